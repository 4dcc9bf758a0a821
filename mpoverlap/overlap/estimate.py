"""Per-rank estimates for the plan: parameters, memory and communication volume per step.

Pure arithmetic on the config (no process group, no model built), so `mpoverlap-check` can
print them for a 4,096-rank layout in a second. Parameters are exact for this GPT; memory
and communication are estimates (fp32 tensors, as on CPU and for the master weights on CUDA).
Communication is counted as the ledger counts it: the bytes of each handle's tensors (an
all-reduce's buffer once, an all-gather's output, a send/receive pair's two buffers).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict

from mpoverlap.models.init import padded_vocab_size
from mpoverlap.overlap.layout import Layout, build_layout

BYTES = 4  # fp32


@dataclass(frozen=True)
class RankEstimate:
    params: int  # on the busiest pipeline stage
    memory_bytes: Dict[str, int]  # params, grads, optimizer, activations
    comm_bytes_per_step: Dict[str, int]  # mode -> bytes per step, per rank averaged over ranks


def _norm_params(cfg_model: Any) -> int:
    return cfg_model.hidden_size * (2 if cfg_model.norm == "layernorm" else 1)


def stage_layers(cfg: Any, lo: Layout, stage: int) -> list:
    """Global indices of the layers on pipeline stage `stage` (model chunk k = v * pp + stage
    holds layers [k L / (pp vpp), (k+1) L / (pp vpp)))."""
    per = cfg.model.num_layers // (lo.pp * lo.vpp)
    return [i for v in range(lo.vpp) for i in range((v * lo.pp + stage) * per, (v * lo.pp + stage + 1) * per)]


def is_moe_layer(m: Any, i: int) -> bool:
    return m.num_experts > 0 and i % m.moe_layer_freq == 0


def layer_params(cfg: Any, lo: Layout, i: int) -> tuple:
    """(dense, expert) parameters of layer i on one rank: attention and dense MLP split over
    tp; an MoE MLP holds the router, num_experts / ep experts and the shared expert, not split
    over tp (experts are the `expert` part)."""
    m = cfg.model
    H, tp = m.hidden_size, lo.tp
    mult = 3 if m.activation == "swiglu" else 2
    dense = 4 * H * H // tp + 2 * _norm_params(m)
    if not is_moe_layer(m, i):
        return dense + mult * H * m.ffn_hidden_size // tp, 0
    f = m.moe_ffn_hidden_size or m.ffn_hidden_size
    return dense + _moe_dense_unsplit(m), m.num_experts // lo.ep * mult * H * f


def _moe_dense_unsplit(m: Any) -> int:
    """Router and shared expert of one MoE layer (replicated over TP)."""
    mult = 3 if m.activation == "swiglu" else 2
    f = m.moe_ffn_hidden_size or m.ffn_hidden_size
    return m.hidden_size * m.num_experts + (mult * m.hidden_size * f if m.shared_expert else 0)


def stage_params(cfg: Any, lo: Layout, stage: int, expert_only: bool = False) -> int:
    """Parameters held by one rank of pipeline stage `stage` (all its vpp chunks); with
    `expert_only`, only its expert weights."""
    m = cfg.model
    H, tp = m.hidden_size, lo.tp
    V = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by)
    parts = [layer_params(cfg, lo, i) for i in stage_layers(cfg, lo, stage)]
    if expert_only:
        return sum(e for _, e in parts)
    total = sum(d + e for d, e in parts)
    first, last = stage == 0, stage == lo.pp - 1
    if first or (last and m.tie_embeddings):
        total += V * H // tp  # the embedding (and, tied, the last stage's copy for the head)
    if last:
        total += _norm_params(m) + (0 if m.tie_embeddings else V * H // tp)
    return total


def estimate(cfg: Any, world_size: int | None = None) -> RankEstimate:
    lo = build_layout(cfg, world_size)
    m, t, p = cfg.model, cfg.train, cfg.parallel
    busiest = max(range(lo.pp), key=lambda s: stage_params(cfg, lo, s))
    params = stage_params(cfg, lo, busiest)
    expert_params = stage_params(cfg, lo, busiest, expert_only=True)
    replicas = lo.dp * lo.cp
    zero = bool(t.distributed_optimizer) and replicas > 1
    micro = lo.num_microbatches or 1
    b, H = t.micro_batch_size, m.hidden_size
    s_cp = m.seq_length // lo.cp
    s_hidden = s_cp // lo.tp if (p.sequence_parallel and lo.tp > 1) else s_cp
    layers_here = m.num_layers // lo.pp
    heads_here = m.num_attention_heads // lo.tp
    # Saved activations per layer and microbatch (rough): the block's inputs and GEMM outputs
    # (~16 H-wide and 4 F-wide tensors per token, split by tp inside TP regions) plus the
    # attention probabilities of the math SDPA path.
    per_layer_act = BYTES * b * (s_hidden * 4 * H + s_cp * (12 * H + 4 * m.ffn_hidden_size) // lo.tp
                                 + heads_here * s_cp * s_cp)
    in_flight = min(micro, lo.pp) if lo.pp > 1 else 1
    memory = {"params": params * BYTES, "grads": params * BYTES,
              # ZeRO-1 shards dense state over dp x cp and expert state over edp = dp x cp / ep.
              "optimizer": 2 * BYTES * ((params - expert_params) // (replicas if zero else 1)
                                        + expert_params // (replicas // lo.ep if zero else 1)),
              "activations": per_layer_act * layers_here * in_flight}
    hidden_bytes = BYTES * b * s_hidden * H
    V = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by)
    # The figures are per rank, averaged over the ranks (as metrics.jsonl reports them); the
    # embedding and head live on the first and last of pp stages.
    end_stages = min(2, lo.pp) / lo.pp
    comm: Dict[str, int] = {}
    if replicas > 1:
        # reduce-scatter + all-gather, or all-reduce; expert weights only over edp = replicas / ep
        reduced = params - (expert_params if replicas == lo.ep else 0)
        # Gradients travel in train.grad_reduce_dtype; ZeRO-1's parameter gather stays fp32.
        grad_bytes = 2 if t.grad_reduce_dtype == "bf16" else BYTES
        comm["dp"] = reduced * (grad_bytes + (BYTES if zero else 0))
    if lo.tp > 1:
        # Full-sequence activation-sized collectives per microbatch. Without SP: each layer's two
        # forward all-reduces and two backward input-gradient all-reduces, plus the embedding's
        # and the head's. With SP: per layer 2 all-gathers + 2 reduce-scatters forward, the
        # re-gathered inputs and scattered gradients of backward (10 in all), plus 5 around the
        # embedding and head. The vocab-parallel loss and SP norm gradients are small and left out.
        # An MoE MLP is not split over TP, so an MoE layer has only its attention's half.
        full_bytes = BYTES * b * s_cp * H
        per_layer, ends = (10, 5) if p.sequence_parallel else (4, 2)
        moe_layers = sum(is_moe_layer(m, i) for i in stage_layers(cfg, lo, busiest))
        tp_layers = layers_here - moe_layers / 2
        comm["tp"] = int(full_bytes * micro * (per_layer * tp_layers + ends / lo.pp))
        if p.sequence_parallel:
            # Parameters not split over TP saw only S/tp positions: their gradients are summed
            # over TP once per step (norms, and the MoE layers' routers and experts).
            unsplit = sum(2 * _norm_params(m) + (layer_params(cfg, lo, i)[1] + _moe_dense_unsplit(m)
                                                 if is_moe_layer(m, i) else 0)
                          for i in stage_layers(cfg, lo, busiest))
            comm["tp"] += unsplit * BYTES
    if lo.pp > 1:
        # pp*vpp - 1 chunk boundaries, each an activation forward and a gradient backward,
        # counted at the sending and the receiving end; plus the tied embedding's gradient sum.
        boundaries = lo.pp * lo.vpp - 1
        tied = V * H // lo.tp * BYTES * end_stages if m.tie_embeddings else 0
        comm["pp"] = int(4 * hidden_bytes * micro * boundaries / lo.pp + tied)
    if lo.cp > 1:
        # Ring, per layer and microbatch: cp-1 K+V exchanges forward; backward cp-1 K+V and cp
        # dK+dV exchanges (each exchange counts its send and its receive).
        kv_block = 2 * BYTES * b * heads_here * s_cp * (H // m.num_attention_heads)
        comm["cp"] = 2 * kv_block * (3 * lo.cp - 2) * layers_here * micro
    moe_here = sum(is_moe_layer(m, i) for i in stage_layers(cfg, lo, busiest))
    if lo.ep > 1 and moe_here:
        tokens = b * s_hidden
        if m.moe_dispatcher == "allgather":
            # Per MoE layer and microbatch, summed over chunks: forward all-gathers of the
            # tokens, router weights (fp32) and expert ids (int64) and the combine's
            # reduce-scatter; backward a reduce-scatter per gathered input that needs a
            # gradient (tokens, weights) and an all-gather for the combine. The ledger counts
            # the gathered size for both (an all-gather's output, a reduce-scatter's input).
            per_layer = lo.ep * tokens * (4 * H * BYTES + 2 * m.moe_top_k * BYTES + m.moe_top_k * 8)
        else:
            # Dropless all-to-all: the dispatch and the combine exchange every routed (token,
            # expert) slot once forward and once backward (the ledger counts the sent buffer;
            # received sizes vary with routing but average the same), plus one all_to_all of
            # every chunk's per-expert counts (int64).
            per_layer = (4 * tokens * m.moe_top_k * H * BYTES
                         + min(cfg.overlap.ep_chunks, tokens) * m.num_experts * 8)
        comm["ep"] = per_layer * moe_here * micro
    return RankEstimate(params=params, memory_bytes=memory, comm_bytes_per_step=comm)


def render_estimate(est: RankEstimate) -> str:
    def mib(n: int) -> str:
        return f"{n / 2**20:,.1f} MiB"

    mem = ", ".join(f"{k} {mib(v)}" for k, v in est.memory_bytes.items())
    comm = ", ".join(f"{k} {mib(v)}" for k, v in est.comm_bytes_per_step.items()) or "none"
    return (f"  per rank (busiest stage): {est.params / 1e6:.2f}M parameters; memory ~{mib(sum(est.memory_bytes.values()))}"
            f" ({mem})\n  communication per step per rank (estimate): {comm}")
