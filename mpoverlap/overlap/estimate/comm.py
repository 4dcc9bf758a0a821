"""Communication per step and rank, in two views, from the same list of operations.

- buffer bytes: what the ledger counts (metrics.jsonl `comm.<mode>.bytes`): an all-reduce's
  buffer once, an all-gather's output, a reduce-scatter's input, an all-to-all's send buffer,
  a send/receive pair's two buffers.
- link bytes: what each rank puts on the wire for the algorithm NCCL and gloo use: ring
  all-reduce 2(n-1)/n of the buffer, ring all-gather and reduce-scatter (n-1)/n, all-to-all
  (n-1)/n (its own slot stays home), point-to-point the sent half of the pair.
  ZeRO's reduce-scatter + all-gather then moves what one all-reduce moves, and SP's 10
  gathers/scatters per layer move 1.25x what the 4 all-reduces without SP move.

The figures are per rank, averaged over the ranks (as metrics.jsonl reports them).
"""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

from mpoverlap.models.init import head_dim_of, padded_vocab_size, query_groups
from mpoverlap.overlap.estimate import latent
from mpoverlap.overlap.estimate.latent import core_widths, is_latent
from mpoverlap.overlap.estimate.params import (chunk_layers, etp_size, is_moe_layer,
                                               moe_dense_unsplit, mtp_own_chunk, norm_params, stage_layers)
from mpoverlap.overlap.estimate.sharding import dp_ops, expert_group_size
from mpoverlap.overlap.config import ep_chunks
from mpoverlap.overlap.layout import Layout

PARAM_BYTES = 4  # gradients are reduced in fp32

# (mode, op, buffer bytes, group size)
Op = Tuple[str, str, float, int]


def link_factor(op: str, n: int) -> float:
    """Bytes each rank sends per buffer byte (as the ledger counts the buffer)."""
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if op == "send_recv":
        return 0.5  # the ledger counts the send and the receive buffer; only the send leaves
    raise ValueError(f"unknown collective {op!r}")


def grad_wire_bytes(reduce_dtype: str) -> float:
    """Bytes one gradient element takes on the wire per hop in train.grad_reduce_dtype."""
    from mpoverlap.data_parallel.grad_wire import is_wire, wire_bytes_per_element

    if is_wire(reduce_dtype):
        return wire_bytes_per_element()
    return 2 if reduce_dtype == "bf16" else PARAM_BYTES


def fp8_sp_gathers(cfg: Any, lo: Layout) -> bool:
    """Whether the blocks' column-parallel forward all-gathers carry FP8 (1 byte an element,
    tensor_parallel/linear_functions.py), and so do their backward re-gathers (the forward's
    e4m3 chunks, kept for the weight gradient): train.precision=fp8 with the tensorwise recipe
    and SP at tp > 1 without collective matmul (whose ring chunks travel in the compute dtype)."""
    from mpoverlap.overlap.config import CommOverlapConfig

    t = cfg.train
    if str(t.precision) != "fp8" or str(t.fp8_recipe) != "tensorwise":
        return False
    if not (cfg.parallel.sequence_parallel and lo.tp > 1):
        return False
    return not CommOverlapConfig.from_config(cfg, lo.world).tp.enabled


def comm_ops(cfg: Any, lo: Layout, busiest: int, params: int, expert_params: int, c: int,
             f: int = 4) -> List[Op]:
    """Every mode's operations per step on a rank of stage `busiest`; `c` bytes of the compute
    dtype (attention's q, k, v, expert tokens, TP activations: the GEMMs' inputs and partial
    sums), `f` of the residual stream (fp32 in every layout, bf16 autocast included: what
    pipeline stages send and what the TP embedding reduces)."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    replicas = lo.dp * lo.cp
    micro = lo.num_microbatches or 1
    b, H = t.micro_batch_size, m.hidden_size
    s_cp = m.seq_length // lo.cp
    s_hidden = s_cp // lo.tp if (p.sequence_parallel and lo.tp > 1) else s_cp
    layers_here = m.num_layers // lo.pp
    here = stage_layers(cfg, lo, busiest)
    moe_here = sum(is_moe_layer(m, i) for i in here)
    ops: List[Op] = []
    if replicas > 1 or expert_group_size(cfg, lo) > 1:
        # All-reduce, or (train.dp_sharding) reduce-scatter the gradients and all-gather the
        # parameters (sharding.py). Dense weights over dp x cp; expert weights over
        # edp = dp x cp / ep, or tp x edp when replicated over tp under SP (none when 1).
        # Gradients travel in train.grad_reduce_dtype (fp8|int8: 1 byte an element and 4 a block
        # of 512, per hop); the parameter gathers in their own format (sharding.py).
        grad_bytes = grad_wire_bytes(str(getattr(t, "grad_reduce_dtype", "fp32")))
        ops += dp_ops(cfg, lo, params, expert_params, grad_bytes, busiest)
    if lo.tp > 1:
        # Full-sequence activation-sized collectives per microbatch. Without SP: each layer's two
        # forward all-reduces and two backward input-gradient all-reduces, plus the embedding's
        # and the head's. With SP: per layer 2 all-gathers + 2 reduce-scatters forward, the
        # re-gathered inputs and scattered gradients of backward (10 in all, half of each kind),
        # plus 5 around the embedding and head (the embedding's reduce-scatter and its gradient's
        # all-gather in the residual dtype f; the head's gather, re-gather and dgrad
        # reduce-scatter in c). Without SP the embedding's all-reduce (f) and the head's dgrad
        # all-reduce (c). The embedding and head ops are averaged over the pp stages (one stage
        # each). The vocab-parallel loss and SP norm gradients are small and left out. Experts
        # are not split over TP: an MoE layer without a shared expert has only its attention's
        # half (a shared expert is split like a dense MLP).
        tokens = b * s_cp * H * micro
        tp_layers = layers_here - (0 if m.shared_expert else moe_here / 2)
        # Latent attention gathers its latents and the RoPE key instead of the hidden state
        # (models/mla.py): per layer `latent_in` channels a token for the attention's input
        # (forward gather, backward reduce-scatter; the latents also re-gathered in backward).
        latent_in, latent_regather = tp_latent_widths(m)
        per_width = tokens / H * c * layers_here
        if p.sequence_parallel:
            gather = tokens * (c * (5 * tp_layers + 2 / lo.pp) + f / lo.pp)
            if fp8_sp_gathers(cfg, lo):
                # the blocks' two forward gathers a layer and their two backward re-gathers in
                # FP8 (1 byte), one all-reduce of an fp32 amax each forward gather (backward
                # re-gathers the forward's e4m3 chunk with its scale)
                gather -= tokens * (c - 1) * 4 * tp_layers
                ops.append(("tp", "all_reduce", 4 * 2 * tp_layers * micro, lo.tp))
            scatter = tokens * (c * (5 * tp_layers + 1 / lo.pp) + f / lo.pp)
            if is_latent(m):
                gather += per_width * (latent_in + latent_regather - 2 * H)
                scatter += per_width * (latent_in - H)
            ops += [("tp", "all_gather", gather, lo.tp), ("tp", "reduce_scatter", scatter, lo.tp)]
            # Parameters not split over TP saw only S/tp positions: their gradients are summed
            # over TP once per step (norms, the MoE layers' routers, latent attention's
            # down-projections and their norms). Experts are not among them: split over etp,
            # or reduced over tp x edp in the dp buckets (dp_ops).
            unsplit = sum(2 * norm_params(m) + (moe_dense_unsplit(m) if is_moe_layer(m, i) else 0)
                          + latent_unsplit(m) for i in here)
            ops.append(("tp", "all_reduce", unsplit * PARAM_BYTES, lo.tp))
        else:
            reduced = tokens * (c * (4 * tp_layers + 1 / lo.pp) + f / lo.pp)
            ops.append(("tp", "all_reduce", reduced + (per_width * (latent_in - H) if is_latent(m) else 0), lo.tp))
    if lo.pp > 1:
        # pp*vpp - 1 chunk boundaries, each an activation forward and a gradient backward,
        # counted at the sending and the receiving end; plus the tied embedding's gradient sum
        # over the first and last stage (2 of pp ranks). zbv's V: 2pp - 1 boundaries, the turn
        # (chunk pp-1 -> pp, on stage pp-1) handed over in memory, so 2(pp-1): twice 1F1B's
        # bytes; its tied head shares the embedding on stage 0, nothing to sum.
        from mpoverlap.pipeline import chunk_layout, resolve_schedule

        v_layout = chunk_layout(resolve_schedule(getattr(p, "pp_schedule", "auto"), lo.vpp)) == "v"
        hidden_bytes = f * b * s_hidden * H
        # the loop_mtp layout: one more, the head's chunk to the MTP chunk on stage 0
        boundaries = lo.pp * lo.vpp - 1 - (1 if v_layout else 0) + (1 if mtp_own_chunk(cfg, lo) else 0)
        ops.append(("pp", "send_recv", 4 * hidden_bytes * micro * boundaries / lo.pp, 2))
        if m.tie_embeddings and not v_layout:
            V = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by)
            ops.append(("pp", "all_reduce", V * H // lo.tp * PARAM_BYTES * min(2, lo.pp) / lo.pp, 2))
    if lo.cp > 1:
        local_q, local_k, local_v, local_out = cp_local_qkv_bytes(cfg, lo, c)
        if p.cp_comm == "a2a":
            # a2a_attention.py, per layer and microbatch: forward q, k, v go to head-sharded
            # and the output comes back; backward d(out) goes and dq, dk, dv come back. Head
            # groups split these, never add.
            ops.append(("cp", "all_to_all", 2 * (local_q + local_k + local_v + local_out) * layers_here * micro,
                        lo.cp))
        else:
            # Ring, per layer and microbatch: cp-1 K+V exchanges forward; backward cp-1 K+V and
            # cp dK+dV exchanges (each exchange counts its send and its receive). Only the G
            # K/V groups travel: N / G times less than multi-head attention.
            ops.append(("cp", "send_recv", 2 * (local_k + local_v) * (3 * lo.cp - 2) * layers_here * micro, 2))
    sp_split = lo.tp > 1 and bool(p.sequence_parallel)
    if moe_here and (sp_split or lo.cp > 1):
        # The router's whole-sequence statistics (moe/sequence_shards.py): counts, summed
        # probabilities, the z sum and the token count, fp32, one all-reduce per MoE layer and
        # microbatch over the ranks sharing the sequences; counted under cp when cp > 1.
        ops.append(("cp" if lo.cp > 1 else "tp", "all_reduce", (2 * m.num_experts + 2) * 4 * moe_here * micro,
                    (lo.tp if sp_split else 1) * lo.cp))
    if replicas > 1 and moe_here and getattr(m, "moe_router_bias_update_rate", 0.0) > 0:
        # The aux-loss-free bias: every MoE layer's per-expert loads (fp32), one all-reduce per step.
        ops.append(("dp", "all_reduce", moe_here * m.num_experts * 4, replicas))
    etp = etp_size(cfg)
    if etp > 1 and moe_here:
        # Expert tensor parallelism (moe/expert_tp.py), per MoE layer and microbatch over the
        # tp group's T = b * s_cp tokens. SP: forward all-gathers of tokens, weights (fp32)
        # and ids (int64) and a reduce-scatter of the outputs; backward reduce-scatters of the
        # token and weight gradients and an all-gather of the output gradient. No SP: the
        # outputs' all-reduce forward, the token and weight gradients' backward.
        group_tokens, k = b * s_cp, m.moe_top_k
        if p.sequence_parallel:
            ops += [("tp", "all_gather", group_tokens * (2 * H * c + 12 * k) * moe_here * micro, etp),
                    ("tp", "reduce_scatter", group_tokens * (2 * H * c + 4 * k) * moe_here * micro, etp)]
        else:
            ops.append(("tp", "all_reduce", group_tokens * (2 * H * c + 4 * k) * moe_here * micro, etp))
    if lo.ep > 1 and moe_here:
        # Each rank dispatches the tokens it runs its experts on: with etp, the tp group's.
        tokens = b * (s_cp if etp > 1 else s_hidden)
        # A token row of the dispatch's forward exchange on the wire (train.ep_dispatch_dtype);
        # the combine and the backward exchanges carry H * c.
        d = dispatch_row_bytes(cfg, c)
        if m.moe_dispatcher == "allgather":
            # Per MoE layer and microbatch, summed over chunks: forward all-gathers of the
            # tokens, router weights (fp32) and expert ids (int64) and the combine's
            # reduce-scatter; backward a reduce-scatter per gathered input that needs a
            # gradient (tokens, weights) and an all-gather for the combine. The ledger counts
            # the gathered size for both (an all-gather's output, a reduce-scatter's input).
            # Plus one all_gather of every chunk's per-expert counts (int64), before the tokens.
            gathered = (lo.ep * tokens * (d + H * c + m.moe_top_k * 4 + m.moe_top_k * 8)
                        + lo.ep * min(ep_chunks(cfg, lo.world), tokens) * m.num_experts * 8) * moe_here * micro
            scattered = lo.ep * tokens * (2 * H * c + m.moe_top_k * 4) * moe_here * micro
            ops += [("ep", "all_gather", gathered, lo.ep), ("ep", "reduce_scatter", scattered, lo.ep)]
        elif padded_queue_rows(cfg, lo, tokens):
            # A capacity (all-to-all, etp 1, no pairing): every expert's queue padded to the
            # capacity, its rows exchanged forward and backward, no counts (moe/dispatcher.py).
            per_layer = padded_queue_rows(cfg, lo, tokens) * (d + 3 * H * c)
            ops.append(("ep", "all_to_all", per_layer * moe_here * micro, lo.ep))
        else:
            # Dropless all-to-all: the dispatch and the combine exchange every routed (token,
            # expert) slot once forward and once backward (the ledger counts the sent buffer;
            # received sizes vary with routing but average the same), plus one all_to_all of
            # every chunk's per-expert counts (int64).
            per_layer = tokens * m.moe_top_k * (d + 3 * H * c) + min(ep_chunks(cfg, lo.world), tokens) * m.num_experts * 8
            ops.append(("ep", "all_to_all", per_layer * moe_here * micro, lo.ep))
    return ops + replayed_ops(cfg, lo, busiest, c)


def replayed_ops(cfg: Any, lo: Layout, busiest: int, c: int) -> List[Op]:
    """The forward communication that recomputation issues again in backward (see
    mpoverlap/recompute): `full` replays whole blocks (TP, CP, the router statistics, EP),
    `selective` the attention core (CP's exchanges only; SDPA on one rank communicates nothing).
    torch stops a replay once the region's last saved tensor is recomputed, so a collective
    after it is not issued again: the MLP's row all-reduce without SP, its reduce-scatter with
    SP unless collective matmul fuses it with the GEMM (which saves after communicating), and
    the all-gather dispatcher's combine reduce-scatter of the LAST chunk (its unpermute, the
    last save, comes before it). The combines of the chunks before are issued and, in a replay,
    waited at once (moe/layer.py), so they count; the all-to-all combine is followed by the
    unpermute, which saves, and is reissued whole. Checked against the ledger of real runs."""
    from mpoverlap.overlap.estimate.activations import recomputed_in_chunk

    m, t, p = cfg.model, cfg.train, cfg.parallel
    mode = getattr(m, "recompute", "none")
    if mode == "none":
        return []
    chunks = [v * lo.pp + busiest for v in range(lo.vpp)]
    full_ids = [i for k in chunks for i in recomputed_in_chunk(cfg, lo, k)]
    core_ids = full_ids if mode == "full" else [i for k in chunks for i in chunk_layers(cfg, lo, k)]
    n_moe = sum(is_moe_layer(m, i) for i in full_ids)
    micro, b, H = lo.num_microbatches or 1, t.micro_batch_size, m.hidden_size
    s_cp = m.seq_length // lo.cp
    sp = bool(p.sequence_parallel) and lo.tp > 1
    ops: List[Op] = []
    if lo.tp > 1 and full_ids:
        from mpoverlap.overlap.config import CommOverlapConfig

        full, n_dense = c * b * s_cp * H * micro, len(full_ids) - n_moe
        if sp:
            # Attention: all-gather + reduce-scatter; a dense MLP: all-gather, and its
            # reduce-scatter only when collective matmul fuses it into the GEMM's function.
            fused = CommOverlapConfig.from_config(cfg, lo.world).tp.enabled
            gathers = len(full_ids) + n_dense
            scatters = len(full_ids) + (n_dense if fused else 0)
            per = 1 if fp8_sp_gathers(cfg, lo) else c  # the replayed forward gathers (FP8: 1 byte)
            if per != c:
                ops.append(("tp", "all_reduce", 4 * gathers * micro, lo.tp))
            ops += [("tp", "all_gather", full // c * per * gathers, lo.tp), ("tp", "reduce_scatter", full * scatters, lo.tp)]
        else:
            ops.append(("tp", "all_reduce", full * len(full_ids), lo.tp))  # the attention's row all-reduce
    if lo.cp > 1 and core_ids:
        local_q, local_k, local_v, local_out = cp_local_qkv_bytes(cfg, lo, c)
        if p.cp_comm == "a2a":
            ops.append(("cp", "all_to_all", (local_q + local_k + local_v + local_out) * len(core_ids) * micro, lo.cp))
        else:
            ops.append(("cp", "send_recv", 2 * (local_k + local_v) * (lo.cp - 1) * len(core_ids) * micro, 2))
    if n_moe and (sp or lo.cp > 1):
        ops.append(("cp" if lo.cp > 1 else "tp", "all_reduce", (2 * m.num_experts + 2) * 4 * n_moe * micro,
                    (lo.tp if sp else 1) * lo.cp))
    if lo.ep > 1 and n_moe:
        tokens = b * (s_cp // lo.tp if sp else s_cp)
        counts = min(ep_chunks(cfg, lo.world), tokens) * m.num_experts * 8
        d = dispatch_row_bytes(cfg, c)  # the replayed dispatch's rows; its combine's H * c
        if m.moe_dispatcher == "allgather":
            k = m.moe_top_k
            ops.append(("ep", "all_gather", (lo.ep * tokens * (d + 12 * k) + lo.ep * counts) * n_moe * micro,
                        lo.ep))
            n = min(ep_chunks(cfg, lo.world), tokens)  # the layer's chunks: bounds i * T // n
            before_last = (n - 1) * tokens // n
            if before_last:
                ops.append(("ep", "reduce_scatter", lo.ep * before_last * H * c * n_moe * micro, lo.ep))
        elif padded_queue_rows(cfg, lo, tokens):
            ops.append(("ep", "all_to_all", padded_queue_rows(cfg, lo, tokens) * (d + H * c) * n_moe * micro, lo.ep))
        else:
            ops.append(("ep", "all_to_all", (tokens * m.moe_top_k * (d + H * c) + counts) * n_moe * micro, lo.ep))
    return ops


def dispatch_row_bytes(cfg: Any, c: int) -> int:
    """Bytes of one token row the dispatch's forward exchange carries: H * c (the activation
    dtype), 2H (bf16 on the wire) or fp8's H + 4 per block of 128 (moe/dispatch_wire.py)."""
    from mpoverlap.moe.dispatch_wire import dispatch_row_bytes as row_bytes
    from mpoverlap.overlap.estimate.core import activation_precision

    t = cfg.train
    return row_bytes(str(getattr(t, "ep_dispatch_dtype", "auto")), activation_precision(cfg), cfg.model.hidden_size, c)


def ep_forward_share(cfg: Any, c: int) -> float:
    """The forward's share of a MoE layer pass's token bytes (dispatch + combine forward against
    their two reverse exchanges): 1/2 when every exchange carries H * c bytes a row, less with
    a compressed dispatch (the backward stays in the activation dtype)."""
    H = cfg.model.hidden_size
    d = dispatch_row_bytes(cfg, c)
    return (d + H * c) / (d + 3 * H * c)


def padded_queue_rows(cfg: Any, lo: Layout, tokens: int) -> int:
    """Rows one rank sends per MoE layer pass when the all-to-all dispatcher pads every expert's
    queue to the capacity (a capacity factor, ep > 1, grouped experts, etp 1, no pairing; see
    AllToAllDispatcher.capacity_chunks): E x n x ceil(C / n), C = ceil(factor x tokens x top_k / E),
    n = min(ep_chunks, C). 0 when the exchange is not padded."""
    import math

    from mpoverlap.overlap.config import CommOverlapConfig

    m = cfg.model
    if (m.moe_capacity_factor is None or lo.ep <= 1 or m.moe_dispatcher != "alltoall" or etp_size(cfg) > 1
            or not getattr(m, "moe_grouped_gemm", True) or CommOverlapConfig.from_config(cfg, lo.world).ep_pairing.enabled):
        return 0
    C = math.ceil(float(m.moe_capacity_factor) * tokens * m.moe_top_k / m.num_experts)
    n = max(1, min(ep_chunks(cfg, lo.world), C))
    return m.num_experts * n * -(-C // n)


def tp_latent_widths(m: Any) -> Tuple[int, int]:
    """Latent attention under TP, channels a token: (what its attention input's gather and its
    gradient's reduction carry: the query latent (the hidden state when q_lora_rank is 0), the
    key/value latent and the RoPE key; what backward re-gathers: the latents). (0, 0) otherwise."""
    if not is_latent(m):
        return 0, 0
    q_in = m.q_lora_rank or m.hidden_size
    return q_in + m.kv_lora_rank + m.qk_rope_head_dim, q_in + m.kv_lora_rank


def latent_unsplit(m: Any) -> int:
    """Latent attention's parameters replicated over TP (down-projections and their norms); 0 otherwise."""
    if not is_latent(m):
        return 0
    return latent.gemm_weights(m)[0] + m.q_lora_rank + m.kv_lora_rank


def cp_local_qkv_bytes(cfg: Any, lo: Layout, c: int) -> Tuple[int, int, int, int]:
    """(bytes of q, of k, of v, of the attention output) on one rank per microbatch: [b, N/tp
    or G/tp, S/cp, D] in the compute dtype (G = model.num_query_groups, N without grouped-query
    attention; the output N/tp heads); latent attention: q and k N/tp heads of n + p, v and the
    output N/tp heads of v_head_dim (estimate/latent.py; the shared RoPE key travels expanded,
    in every head)."""
    m, b = cfg.model, cfg.train.micro_batch_size
    s_cp = m.seq_length // lo.cp
    if is_latent(m):
        q, k, v = (c * b * s_cp * w // lo.tp for w in core_widths(m))
        return q, k, v, v
    head_dim = head_dim_of(m)
    q = c * b * m.num_attention_heads // lo.tp * s_cp * head_dim
    kv = c * b * query_groups(m) // lo.tp * s_cp * head_dim
    return q, kv, kv, q


def comm_views(ops: List[Op]) -> Tuple[Dict[str, int], Dict[str, int]]:
    """(buffer bytes, link bytes) per mode."""
    buffer: Dict[str, float] = {}
    link: Dict[str, float] = {}
    for mode, op, nbytes, n in ops:
        buffer[mode] = buffer.get(mode, 0) + nbytes
        link[mode] = link.get(mode, 0) + nbytes * link_factor(op, n)
    return {k: int(v) for k, v in buffer.items()}, {k: int(v) for k, v in link.items()}
