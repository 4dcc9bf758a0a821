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


def stage_params(cfg: Any, lo: Layout, stage: int) -> int:
    """Parameters held by one rank of pipeline stage `stage` (all its vpp chunks)."""
    m = cfg.model
    H, F, tp = m.hidden_size, m.ffn_hidden_size, lo.tp
    V = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by)
    mlp = (3 if m.activation == "swiglu" else 2) * H * F
    per_layer = (4 * H * H + mlp) // tp + 2 * _norm_params(m)
    total = per_layer * (m.num_layers // lo.pp)
    first, last = stage == 0, stage == lo.pp - 1
    if first or (last and m.tie_embeddings):
        total += V * H // tp  # the embedding (and, tied, the last stage's copy for the head)
    if last:
        total += _norm_params(m) + (0 if m.tie_embeddings else V * H // tp)
    return total


def estimate(cfg: Any, world_size: int | None = None) -> RankEstimate:
    lo = build_layout(cfg, world_size)
    m, t, p = cfg.model, cfg.train, cfg.parallel
    params = max(stage_params(cfg, lo, s) for s in range(lo.pp))
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
              "optimizer": 2 * params * BYTES // (replicas if zero else 1),
              "activations": per_layer_act * layers_here * in_flight}
    hidden_bytes = BYTES * b * s_hidden * H
    V = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by)
    # The figures are per rank, averaged over the ranks (as metrics.jsonl reports them); the
    # embedding and head live on the first and last of pp stages.
    end_stages = min(2, lo.pp) / lo.pp
    comm: Dict[str, int] = {}
    if replicas > 1:
        comm["dp"] = params * BYTES * (2 if zero else 1)  # reduce-scatter + all-gather, or all-reduce
    if lo.tp > 1:
        # Full-sequence activation-sized collectives per microbatch. Without SP: each layer's two
        # forward all-reduces and two backward input-gradient all-reduces, plus the embedding's
        # and the head's. With SP: per layer 2 all-gathers + 2 reduce-scatters forward, the
        # re-gathered inputs and scattered gradients of backward (10 in all), plus 5 around the
        # embedding and head. The vocab-parallel loss and SP norm gradients are small and left out.
        full_bytes = BYTES * b * s_cp * H
        per_layer, ends = (10, 5) if p.sequence_parallel else (4, 2)
        comm["tp"] = int(full_bytes * micro * (per_layer * layers_here + ends / lo.pp))
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
    return RankEstimate(params=params, memory_bytes=memory, comm_bytes_per_step=comm)


def render_estimate(est: RankEstimate) -> str:
    def mib(n: int) -> str:
        return f"{n / 2**20:,.1f} MiB"

    mem = ", ".join(f"{k} {mib(v)}" for k, v in est.memory_bytes.items())
    comm = ", ".join(f"{k} {mib(v)}" for k, v in est.comm_bytes_per_step.items()) or "none"
    return (f"  per rank (busiest stage): {est.params / 1e6:.2f}M parameters; memory ~{mib(sum(est.memory_bytes.values()))}"
            f" ({mem})\n  communication per step per rank (estimate): {comm}")
