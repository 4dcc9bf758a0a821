"""The start-up plan: the layout, each overlap mode on or off and why, in plain text."""
from __future__ import annotations

from typing import Any, List, Optional

from mpoverlap.models.rope import rope_scaling_of
from mpoverlap.overlap.config import CommOverlapConfig, ep_chunks
from mpoverlap.overlap.estimate import estimate, render_estimate
from mpoverlap.overlap.estimate.comm import padded_queue_rows
from mpoverlap.overlap.estimate.params import etp_size, expert_ffn, model_params, mtp_params, shared_expert_ffn
from mpoverlap.overlap.layout import build_layout
from mpoverlap.overlap.placement import placement_lines
from mpoverlap.overlap.priority import priority_line
from mpoverlap.overlap.rules import Problem
from mpoverlap.parallel.grid import RankGrid
from mpoverlap.pipeline.actions import ScheduleError
from mpoverlap.precision.autocast import compute_precision

_PLAN_KINDS = ("tp", "cp", "dp", "pp", "ep", "edp", "etp")


def _abbrev(groups: List[List[int]], limit: int = 4) -> str:
    def one(g: List[int]) -> str:
        if len(g) > 8:
            return f"[{g[0]}, {g[1]}, ..., {g[-1]}] ({len(g)} ranks)"
        return "[" + ", ".join(map(str, g)) + "]"

    shown = ", ".join(one(g) for g in groups[:limit])
    more = f", ... ({len(groups)} groups)" if len(groups) > limit else ""
    return shown + more


def _schedule(cfg: Any, lo) -> str:
    """`, pp schedule zb1p` (parallel.pp_schedule resolved) for a pipelined layout."""
    from mpoverlap.pipeline import SCHEDULE_CHOICES, resolve_schedule

    choice = getattr(cfg.parallel, "pp_schedule", "auto")
    if lo.pp in (None, 1) or lo.vpp is None or choice not in SCHEDULE_CHOICES:
        return ""
    return f", pp schedule {resolve_schedule(choice, lo.vpp)}"


def _bucket_line(cfg: Any, world_size: Optional[int], bucket) -> str:
    """overlap.dp_bucket_mb: the size the buckets close at and why (auto: the simulator's
    prediction for each candidate size, simulate/bucket_size.py)."""
    if bucket is None:
        from mpoverlap.simulate.bucket_size import resolve_bucket_mb

        bucket = resolve_bucket_mb(cfg, world_size=world_size)
    return f"    overlap.{'dp_bucket_mb':<16} {bucket.requested:>5} -> {bucket.mb:g} MiB  {bucket.reason}"


def render_plan(cfg: Any, world_size: Optional[int] = None, num_params: Optional[int] = None,
                device: Optional[str] = None, conventions=None, hosts: Optional[List[str]] = None,
                bucket=None) -> str:
    """`conventions`: how activations are counted (`estimate.Conventions`; default: as this
    code saves them, in the compute dtype). `hosts`: each rank's hostname (index = global rank),
    gathered at start-up; the plan then says where each rank runs and which groups cross hosts.
    `bucket`: the run's overlap.dp_bucket_mb (a BucketChoice); default: resolved here."""
    lo = build_layout(cfg, world_size)
    ov = CommOverlapConfig.from_config(cfg, world_size)
    t, m = cfg.train, cfg.model
    lines = [
        f"mpoverlap plan: world {lo.world} = tp {lo.tp} x cp {lo.cp} x dp {lo.dp} x pp {lo.pp}"
        f" (ep {lo.ep}, vpp {lo.vpp})" + _schedule(cfg, lo) + (f" on {device}" if device else ""),
        f"  model {m.name}: {m.num_layers} layers, hidden {m.hidden_size}, heads {m.num_attention_heads}"
        + (f" ({m.num_query_groups} K/V groups)" if m.num_query_groups not in (None, m.num_attention_heads) else "")
        + f", seq {m.seq_length}" + (f", {num_params / 1e6:.2f}M parameters" if num_params else ""),
        _attention_shape_line(m),
        _param_line(cfg),
        f"  batch: global {t.global_batch_size} = {lo.num_microbatches} microbatch(es) x "
        f"{t.micro_batch_size} x dp {lo.dp}; {t.steps} steps; dp sharding {_sharding(cfg, lo)}",
        f"  precision {t.precision} (master weights, gradients and optimizer state fp32); "
        f"dp gradients reduced in {_grad_wire(cfg)}",
    ]
    if t.precision == "fp8":
        lines.append(fp8_line(cfg))
    if m.num_experts > 0:
        lines.append(_ep_wire_line(cfg, lo))
    device_type = _device_type(cfg, lo.world, device)
    lines.append(_attention_line(cfg, lo, device_type))
    if cfg.model.num_experts > 0:
        lines.append(grouped_gemm_line(cfg, lo, device_type))
    try:
        lines.append(render_estimate(estimate(cfg, world_size, conventions=conventions), lo.world))
    except (ZeroDivisionError, TypeError, AttributeError, ValueError, ScheduleError):
        pass  # an invalid layout: its problems are reported instead of a plan
    lines.append("  overlap:")
    for name, state in ov.modes().items():
        flag = "ON " if state.enabled else "off"
        lines.append(f"    overlap.{name:<16} {state.requested:>5} -> {flag}  {state.reason}")
    if ov.dp.enabled or ov.dp.requested == "false":
        lines.append(_bucket_line(cfg, world_size, bucket))
    lines.append(priority_line(cfg, world_size, device_type))
    if cfg.model.num_experts > 0:
        n, asked = ep_chunks(cfg, world_size), str(cfg.overlap.ep_chunks)
        padded = padded_queue_rows(cfg, lo, _routed_tokens(cfg, lo)) if lo.ep > 1 else 0
        why = (f"a capacity: every expert's queue padded to {padded // cfg.model.num_experts} rows, sent in "
               f"{min(n, padded // cfg.model.num_experts)} chunk(s) of its positions; no host read to size them"
               if padded else
               f"each MoE layer's tokens dispatched in {n} chunk(s); one host read per MoE layer and microbatch "
               "(the split sizes)" if lo.ep > 1 else
               "ep 1: no token exchange to hide, one chunk" if n == 1 else
               f"ep 1: {n} chunks hide nothing here and repeat the MoE layer's operators {n}x")
        if asked.strip().lower() == "auto" and lo.ep > 1:
            from mpoverlap.overlap.config import ep_chunks_choice

            why += f"; {ep_chunks_choice(cfg, world_size).chunks_reason}"
        lines.append(f"    overlap.{'ep_chunks':<16} {asked:>5} -> {n:<3}  {why}")
    lines.extend(f"  note: {n}" for n in layout_notes(cfg, lo))
    grid = RankGrid(tp=lo.tp, cp=lo.cp, dp=lo.dp, pp=lo.pp, ep=lo.ep, etp=etp_size(cfg))
    lines.append("  rank groups:")
    for kind in _PLAN_KINDS:
        lines.append(f"    {kind:<4} {_abbrev(grid.groups(kind))}")
    if hosts:
        lines.extend(placement_lines(grid, hosts))
    return "\n".join(lines)


def fp8_line(cfg: Any) -> str:
    """Which GEMMs run in FP8 under train.precision=fp8 (precision/fp8_select.py) and which stay bf16."""
    m = cfg.model
    fc = "gate_up (fc1), down (fc2)" if m.activation == "swiglu" else "up (fc1), down (fc2)"
    attn = "attn.qkv (q/k/v), attn.proj (out)"
    if getattr(m, "attention", "mha") == "mla":
        attn = ("attn." + ("q_a_proj, attn.q_b_proj" if m.q_lora_rank else "q_proj")
                + ", attn.kv_a_proj_with_mqa, attn.kv_b_proj, attn.proj (out)")
    mlp = f"mlp {fc}"
    if m.num_experts > 0:
        mlp += (" (dense layers and the shared expert), the routed experts' grouped GEMMs (torchao's rowwise "
                "grouped recipe whichever recipe: precision/fp8_grouped.py)")
    return (f"  fp8 GEMMs ({cfg.train.fp8_recipe} recipe, torchao's casts and scales): per block {attn}, "
            f"{mlp}, in forward, input gradient and weight gradient; bf16: embedding, "
            "output head, router, norms, attention's softmax")


def _ep_wire_line(cfg: Any, lo) -> str:
    """What the MoE dispatch's forward exchange carries (train.ep_dispatch_dtype) against the
    combine and the backward exchanges, which stay in the activation dtype."""
    from mpoverlap.moe.dispatch_wire import DISPATCH_DTYPES, resolve_dispatch_wire

    t, H = cfg.train, cfg.model.hidden_size
    precision = compute_precision(str(t.precision))
    asked, act = str(t.ep_dispatch_dtype), "bf16" if precision == "bf16" else "fp32"
    if asked not in DISPATCH_DTYPES:
        return f"  ep wire: train.ep_dispatch_dtype={asked} (invalid: see the problems)"
    wire = resolve_dispatch_wire(asked, precision)
    row = H * (2 if act == "bf16" else 4)
    fmt = (f"{act} (the activation dtype{', auto' if asked == 'auto' else ''})" if wire is None
           else f"{wire.describe()}, {wire.row_bytes(H)} bytes a token against {row}")
    where = "" if lo.ep > 1 else " (ep 1: no token leaves its rank)"
    return (f"  ep wire: dispatch forward in {fmt}; the combine and every backward exchange in {act} "
            f"(straight-through gradient){where}")


def _attention_shape_line(m: Any) -> str:
    """RoPE (and its scaling) and the attention options that imported checkpoints carry."""
    rs = rope_scaling_of(m)
    rope = f"RoPE base {m.rope_base:.12g}" + (
        f", scaled {rs.rope_type} (factor {rs.factor:g}, low_freq_factor {rs.low_freq_factor:g}, high_freq_factor "
        f"{rs.high_freq_factor:g}, original_max_position_embeddings {rs.original_max_position_embeddings})"
        if rs is not None else ", not scaled")
    extra = [f"head_dim {m.head_dim}" if m.head_dim is not None else "",
             "q/k/v bias" if m.qkv_bias else "", "per-head q/k RMSNorm" if m.qk_norm else ""]
    return "  attention shape: " + "; ".join([rope] + [e for e in extra if e])


def _device_type(cfg: Any, world_size: Optional[int], device: Optional[str]) -> str:
    """"cuda" | "cpu": the running device ("cuda/nccl" from the trainer), else the one
    train.device picks on this machine (overlap/cuda_env.py device_choice)."""
    if device:
        return device.split("/")[0]
    from mpoverlap.overlap.cuda_env import device_choice

    return device_choice(str(cfg.train.device), world_size)[0]


def _attention_line(cfg: Any, lo, device_type: str) -> str:
    """The attention kernel in use: the CP block kernel (parallel.cp_attention_backend) with
    cp > 1, else what F.scaled_dot_product_attention picks."""
    import torch

    from mpoverlap.context_parallel.block_kernels import describe_block_backend, describe_sdpa_backend
    from mpoverlap.models.init import head_dim_of, query_groups

    m = cfg.model
    dtype = torch.bfloat16 if compute_precision(str(cfg.train.precision)) == "bf16" else torch.float32
    heads, head_dim, v_head_dim, groups = m.num_attention_heads, head_dim_of(m), None, query_groups(m)
    if m.attention == "mla":  # latent attention: q/k heads n + p wide, v heads v_head_dim, one per query head
        head_dim, v_head_dim, groups = m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim, heads
    if lo.cp > 1:
        kernel = describe_block_backend(cfg.parallel.cp_attention_backend, device_type, dtype, head_dim)
        padded = (f"; the flash kernels pad v from {v_head_dim} to {head_dim} channels and trim it back"
                  if v_head_dim is not None and "flash" in kernel else "")
        return (f"  attention: context-parallel {cfg.parallel.cp_comm} blocks on {kernel}"
                + f" (parallel.cp_attention_backend={cfg.parallel.cp_attention_backend}{padded})")
    return f"  attention: {describe_sdpa_backend(device_type, dtype, heads, groups, head_dim, v_head_dim)}"


def _routed_tokens(cfg: Any, lo) -> int:
    """The tokens one rank routes per MoE layer and microbatch: its S/cp positions, S/(cp tp)
    with sequence parallelism."""
    sp = lo.tp > 1 and bool(cfg.parallel.sequence_parallel)
    return cfg.train.micro_batch_size * cfg.model.seq_length // lo.cp // (lo.tp if sp else 1)


def _expert_calls(cfg: Any, lo) -> tuple:
    """(rows of one expert-MLP call, calls per MoE layer and microbatch, whether the rows vary
    with the routing) on one rank, as moe/layer.py cuts the tokens: every slot a row at ep 1,
    every expert's queue padded to the capacity with capacity padding, else about T k rows
    received per chunk at ep > 1."""
    m = cfg.model
    sp = lo.tp > 1 and bool(cfg.parallel.sequence_parallel)
    tokens = _routed_tokens(cfg, lo)
    padded = padded_queue_rows(cfg, lo, tokens) if lo.ep > 1 else 0
    if padded:  # the chunks split the queue positions: E c rows received per chunk
        calls = min(ep_chunks(cfg, lo.world), padded // m.num_experts)
        return padded // calls, calls, False
    if etp_size(cfg) > 1 and sp:  # the experts run on the tp group's tokens
        tokens *= lo.tp
    calls = max(1, min(ep_chunks(cfg, lo.world), tokens))
    return -(-tokens // calls) * m.moe_top_k, calls, lo.ep > 1


def grouped_gemm_line(cfg: Any, lo, device_type: str) -> str:
    """The grouped-GEMM path the experts take on `device_type` (moe/grouped_path.py `choose`,
    as the run calls it) and its host reads per MoE layer and microbatch. On CUDA without a
    visible GPU, the rule for each GPU generation."""
    import torch

    from mpoverlap.moe import grouped_path as gp
    from mpoverlap.precision import DTYPES

    m = cfg.model
    if not getattr(m, "moe_grouped_gemm", True):
        return ("  grouped GEMM: off (model.moe_grouped_gemm=false): one GEMM per expert, the rows split by host "
                "counts (one host read per MoE layer and microbatch, every chunk's counts together)")
    dtype = DTYPES[compute_precision(str(cfg.train.precision))]
    H, F = m.hidden_size, expert_ffn(m) // etp_size(cfg)
    W = 2 * F if m.activation == "swiglu" else F
    rows, calls, varies = _expert_calls(cfg, lo)
    L = m.num_experts // lo.ep

    def describe(capability) -> str:
        path = gp.choose(device_type, capability, dtype, aligned=gp.widths_aligned(dtype, H, W, F),
                         product_bytes=gp.product_bytes(rows, L, H, W, dtype))
        reads = path.host_reads * calls
        if not reads:
            cost = "no host read"
        else:
            cost = (f"{reads} host read(s) per MoE layer and microbatch"
                    + (f" (one a chunk, {calls} chunks)" if calls > 1 else "")
                    + (", again in a recomputed forward" if m.recompute == "full" else ""))
        # the dense/looped choice depends on the rows of a call, which vary at ep > 1
        rows_note = (f"; {rows:,} rows a call expected, the received rows vary with the routing at ep {lo.ep}"
                     if varies and path.name != gp.KERNEL else "")
        return f"{path.name} ({path.why}): {cost}{rows_note}"

    if device_type == "cuda" and not torch.cuda.is_available():  # the rule per GPU generation
        hopper, other = describe((9, 0)), describe((8, 0))
        if hopper == other:
            return f"  grouped GEMM on any GPU: {hopper}"
        return f"  grouped GEMM: on sm90/sm100 {hopper}; on other GPUs (e.g. sm80) {other}"
    if str(cfg.train.precision) == "fp8":  # precision/fp8_grouped.py
        return ("  grouped GEMM: FP8 (rowwise grouped recipe, groups padded to 16 rows): torch._scaled_grouped_mm "
                "on CUDA; elsewhere the same quantized operands dequantized and multiplied in fp32 by the project's "
                "grouped GEMM (precision/fp8_grouped.py): no host read")
    capability = gp.device_capability(torch.device("cuda", 0)) if device_type == "cuda" else None
    return f"  grouped GEMM: {describe(capability)}"


def _param_line(cfg: Any) -> str:
    """The whole model's parameter count (exact, as built), and for MoE the active per token."""
    total, active = model_params(cfg)
    m = cfg.model

    def short(n: int) -> str:
        return f"{n / 1e9:.3f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"

    mtp_total, mtp_active = mtp_params(m)
    mtp = (f"; without the {m.mtp_num_layers} MTP depth(s) ({short(mtp_total)}, sharing the embedding and head): "
           f"{total - mtp_total:,} ({short(total - mtp_total)})" if mtp_total else "")
    if m.num_experts == 0:
        return f"  parameters: {total:,} ({short(total)}){mtp}"
    shared = shared_expert_ffn(m)
    if mtp_total:
        mtp += f" total, {active - mtp_active:,} ({short(active - mtp_active)}) active"
    return (f"  parameters: {total:,} total ({short(total)}), {active:,} active per token "
            f"({short(active)}: top-{m.moe_top_k} of {m.num_experts} experts"
            + (f" + a shared expert of width {shared}" if shared else "") + ")" + mtp)


def layout_notes(cfg: Any, lo) -> List[str]:
    """Behaviour that is allowed but depends on the layout, stated so that nobody is surprised."""
    m, notes = cfg.model, []
    sp_split = lo.tp > 1 and bool(cfg.parallel.sequence_parallel)
    if m.num_experts > 0 and m.moe_capacity_factor is not None and (sp_split or lo.cp > 1):
        split = " x ".join(f"{k} {v}" for k, v in (("tp", lo.tp if sp_split else 1), ("cp", lo.cp)) if v > 1)
        notes.append(
            f"model.moe_capacity_factor={m.moe_capacity_factor} with each sequence split over ranks ({split}): "
            "every rank applies the capacity to its own share of the tokens, so WHICH slots are dropped, and "
            "with them the loss curve, depend on the layout (router losses and dropless routing do not); "
            "model.moe_capacity_factor=null is exactly layout-invariant")
    if cfg.overlap.dp_delay == 1:
        notes.append(
            "warning: overlap.dp_delay=1: every update applies the PREVIOUS step's gradient (one step stale; the "
            "first step updates nothing); the reduction runs under the next step's forward and backward in a second "
            "gradient buffer (counted below). One-step-stale updates can degrade AdamW at scale (docs/dp_delay.md); "
            "overlap.dp_delay=0 is the undelayed math")
    return notes


def render_problems(problems: List[Problem]) -> str:
    head = f"mpoverlap: the configuration cannot run ({len(problems)} problem{'s' if len(problems) != 1 else ''}):"
    return "\n".join([head] + [p.render() for p in problems])


def _grad_wire(cfg: Any) -> str:
    """The dp gradients' wire format (train.grad_reduce_dtype, train.grad_error_feedback)."""
    from mpoverlap.data_parallel.grad_wire import GRAD_BLOCK, error_feedback_on, is_wire
    from mpoverlap.overlap.dp_rules import sharding_level

    t = cfg.train
    dtype = str(t.grad_reduce_dtype)
    if not is_wire(dtype):
        return dtype
    try:
        feedback = "on" if error_feedback_on(t.grad_error_feedback, dtype) else "off"
    except ValueError:
        feedback = "?"
    hops = ("a quantized reduce-scatter, then a quantized all-gather of the reduced shard (two hops)"
            if sharding_level(cfg) == "none" else "a quantized reduce-scatter (one hop)")
    return (f"{dtype} ({'e4m3, ' if dtype == 'fp8' else ''}1 byte an element + one fp32 scale per {GRAD_BLOCK}; "
            f"{hops}, summed in fp32; error feedback {feedback})")


def _gather_pass(cfg: Any, lo: Any) -> str:
    """What one gather of a stage-0 rank's dense parameters carries, against fp32."""
    from mpoverlap.overlap.estimate.params import read_as_is_params, stage_params
    from mpoverlap.overlap.estimate.sharding import level_of, unit_gather_pass_bytes

    if level_of(cfg, lo) != "optim_grads_params":
        return ""  # a single replica: nothing is sharded, nothing gathered
    count = stage_params(cfg, lo, 0) - stage_params(cfg, lo, 0, expert_only=True)
    exact = min(count, read_as_is_params(cfg, lo, 0))
    got = unit_gather_pass_bytes(cfg, lo, 0, count, exact)
    return f"; one pass over stage 0's units gathers {got / 2 ** 20:.2f} MiB a rank ({got / (4 * count):.2f} of fp32)"


def _sharding(cfg: Any, lo: Any) -> str:
    from mpoverlap.overlap.dp_rules import sharding_level

    level = sharding_level(cfg)
    zero = {"none": "off", "optim": "ZeRO-1", "optim_grads": "ZeRO-2", "optim_grads_params": "ZeRO-3"}.get(level, "?")
    extra = ""
    if level == "optim_grads_params":
        from mpoverlap.data_parallel.levels import param_gather_dtype
        from mpoverlap.data_parallel.unit_gather import describe

        asked = str(cfg.train.param_gather_dtype)
        kind = param_gather_dtype(asked, compute_precision(str(cfg.train.precision)), level)
        why = ", auto: the compute dtype" if asked == "auto" else ""
        extra = (f", reshard_after_forward={str(bool(cfg.train.reshard_after_forward)).lower()}, "
                 f"prefetch {cfg.overlap.dp_prefetch} unit(s); unit gathers in {describe(kind)}{why}; the fp32 "
                 "master shards are never rounded" + _gather_pass(cfg, lo))
    elif level in ("optim", "optim_grads"):
        extra = "; the parameter gather after the step fp32 (its result is the weights themselves)"
    return f"{level} ({zero}{extra})"
