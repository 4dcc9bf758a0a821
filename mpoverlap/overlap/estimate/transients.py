"""Memory a step holds beside parameters, gradients, optimizer state and saved activations, for
the heaviest-stage estimate (core.py): the step's weight casts and the loss's backward.

  weight_casts    under bf16 autocast every weight a GEMM reads is cast to bf16 once a step and
                  the cast kept until the step ends (precision.step_cast_cache: the linears, the
                  tensor-parallel layers, the experts' stacks, the tied head; autocast's own cache
                  for the rest): c bytes per parameter of the stage, but for what the forward
                  reads as it is (estimate.params.read_as_is_params: the norms, the routers, the
                  biases (cast at each use), an untied input embedding: a lookup). Under
                  train.precision=fp8 the grouped experts hold no cast either: their FP8 products
                  quantize the fp32 stacks at each call (precision/fp8_grouped.py), the e4m3
                  copies living one GEMM long.
                  Under ZeRO-3 the weights are gathered and cast at each use: one unit's cast at a
                  time, inside the gathered working set's order of magnitude: not counted. fp32: 0.
  loss_backward   the last chunk's loss backward runs while every layer of that microbatch still
                  holds its saved tensors (the start of the step's last backward): it writes the
                  logits' gradient (c bytes per local logit) and, eager at tp 1, works through one
                  fp32 row block at a time (models/loss.py: at most CHUNK_BYTES); the
                  vocabulary-parallel loss (tp > 1) rescales its saved fp32 softmax in place; the
                  compiled loss region writes the gradient in one kernel from the bf16 logits.

Both terms follow the code they model; `make gpu-check` puts the estimate beside a GPU's
measured peak (table "Peak memory against the estimate", docs/gpu-check.md), and
docs/benchmarks-history.md keeps the H200 measurement these terms were added for.
"""
from __future__ import annotations

from typing import Any

from mpoverlap.models.init import padded_vocab_size
from mpoverlap.models.loss import CHUNK_BYTES
from mpoverlap.overlap.layout import Layout


def weight_cast_bytes(cfg: Any, lo: Layout, stage: int, params: int, compute_bytes: int) -> int:
    """The bf16 copies of the stage's weights a step keeps (see the module docstring)."""
    from mpoverlap.data_parallel.levels import resolve_level
    from mpoverlap.overlap.estimate.params import read_as_is_params, stage_params
    from mpoverlap.overlap.estimate.sharding import embedding_params

    t = cfg.train
    level = resolve_level(getattr(t, "dp_sharding", "none"), bool(getattr(t, "distributed_optimizer", False)))
    if compute_bytes >= 4 or level == "optim_grads_params":
        return 0
    cast = params - read_as_is_params(cfg, lo, stage)
    if stage == head_stage(cfg, lo) and cfg.model.tie_embeddings:
        cast += embedding_params(cfg, lo)  # the tied head casts the embedding it reads as is
    if str(getattr(t, "precision", "fp32")) == "fp8":
        cast -= stage_params(cfg, lo, stage, expert_only=True)  # the FP8 grouped experts: no cast kept
    return compute_bytes * max(0, cast)


def head_stage(cfg: Any, lo: Layout) -> int:
    """The pipeline stage holding the last model chunk (the head and the loss)."""
    from mpoverlap.overlap.estimate.params import chunk_layout_of
    from mpoverlap.pipeline.actions import stage_of

    return stage_of(lo.pp * lo.vpp - 1, lo.pp, chunk_layout_of(cfg, lo))


def local_logits(cfg: Any, lo: Layout, micro_batch: int) -> int:
    """Logits of one microbatch on one rank: tokens x V/tp."""
    m = cfg.model
    V = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by)
    return micro_batch * (m.seq_length // lo.cp) * (V // lo.tp)


def eager_blocked_loss(cfg: Any, lo: Layout) -> bool:
    """The one-rank eager loss (models/loss.py token_loss) is the step's: tp 1, not compiled."""
    return lo.tp == 1 and not bool(getattr(cfg.train, "compile", False))


def loss_backward_bytes(cfg: Any, lo: Layout, compute_bytes: int, micro_batch: int) -> int:
    """What the loss's backward allocates on the head's stage (see the module docstring)."""
    logits = local_logits(cfg, lo, micro_batch)
    if lo.tp > 1:  # the gradient in the logits' dtype from the fp32 softmax it rescales in place
        return logits * compute_bytes if compute_bytes < 4 else 0
    grad = logits * compute_bytes
    if eager_blocked_loss(cfg, lo):
        return grad + min(CHUNK_BYTES, 4 * logits)
    return grad
