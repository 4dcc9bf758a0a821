"""Per-rank parameter, gradient and optimizer memory, and dp traffic, at each sharding level
(`train.dp_sharding`, see mpoverlap/data_parallel/levels.py). Pure arithmetic on the config.

A rank of a stage holding n parameters (n_e of them expert weights) shards dense state over
g = dp x cp ranks and expert state over g_e = g / ep, times tp when the experts are replicated
over tp under sequence parallelism (`expert_group_size`) (fp32 everywhere, B = 4 bytes):

    level               params                grads                 optimizer (AdamW: 2 moments)
    none                B n                   B n                   2 B n
    optim               B n                   B n                   2 B (n_d / g + n_e / g_e)
    optim_grads         B n                   B (n_d/g + n_e/g_e)   2 B (n_d / g + n_e / g_e)
    optim_grads_params  B (n_d/g + n_e/g_e)   B (n_d/g + n_e/g_e)   2 B (n_d / g + n_e / g_e)
                        + U

U, the gathered units' working set under ZeRO-3: with reshard_after_forward the unit in use
plus the `overlap.dp_prefetch` units gathered ahead of it (prefetch only under overlap.dp),
at the size of the stage's largest unit, plus (stage 0) the embedding when a tied head on the
same chunk keeps it gathered through the backward, or when a zero-bubble schedule keeps it
gathered from its B to its W; with two or more MTP depths under a zero-bubble schedule at least
a depth's unit, the next depth's own buckets (freed only once the depth's backward completes its
input's gradient) and the units prefetched behind it (`mtp_backward_held`); without resharding every unit of the stage stays
gathered from its forward to its backward (U = B n).

Traffic per step (the ledger's buffer bytes; m microbatches of the rank): ZeRO-2/3
reduce-scatter each bucket in every microbatch (m times the gradient bytes); ZeRO-1/2 gather
the parameters once after the step; ZeRO-3 gathers each unit before its forward and again
before its backward (2 m times the parameter bytes; m without resharding), and a tied head on
the embedding's chunk (or, in zbv's V, on the embedding's stage 0) gathers the embedding once
more per microbatch. `estimate` reports these per stage averaged over the stages, as the
ledger averages the ranks (core.py).
"""
from __future__ import annotations

from typing import Any, Dict, List

from mpoverlap.models.init import padded_vocab_size
from mpoverlap.overlap.estimate.params import (chunk_layers, chunk_layout_of, etp_size, head_stage, layer_params,
                                               mtp_depth_extra, mtp_stage, norm_params, read_as_is_params,
                                               stage_layers)
from mpoverlap.overlap.layout import Layout

BYTES = 4


def level_of(cfg: Any, lo: Layout) -> str:
    """The sharding level in effect: `none` with a single replica (nothing to shard over),
    unless expert weights are reduced over tp x edp (`expert_group_size`)."""
    from mpoverlap.overlap.dp_rules import sharding_level

    experts_shard = cfg.model.num_experts > 0 and expert_group_size(cfg, lo) > 1
    return sharding_level(cfg) if lo.dp * lo.cp > 1 or experts_shard else "none"


def embedding_params(cfg: Any, lo: Layout) -> int:
    m = cfg.model
    return padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by) * m.hidden_size // lo.tp


def tied_on_one_chunk(cfg: Any, lo: Layout) -> bool:
    """The head reuses the embedding of its own chunk (it keeps it gathered through backward),
    or of its own stage (zbv's V: the embedding chunk and the head chunk both on stage 0)."""
    if not cfg.model.tie_embeddings:
        return False
    return (lo.pp == 1 and lo.vpp == 1) or chunk_layout_of(cfg, lo) == "v"


def mtp_depths_on(cfg: Any, lo: Layout, stage: int) -> int:
    """The MTP depths (models/mtp.py) on `stage`: all of them on their stage (params.mtp_stage:
    the head's, or 0 as a chunk of their own), else 0."""
    return getattr(cfg.model, "mtp_num_layers", 0) if stage == mtp_stage(cfg, lo) else 0


def unit_params(cfg: Any, lo: Layout, stage: int) -> List[int]:
    """Parameters gathered with each ZeRO-3 unit of the stage: embedding, blocks, MTP depths
    (each with the embedding and the head weights it reads), head (fsdp.gpt_units)."""
    m = cfg.model
    units = [sum(layer_params(cfg, lo, i)) for i in stage_layers(cfg, lo, stage)]
    emb = embedding_params(cfg, lo)
    if stage == 0:
        units.append(emb)
    # an MTP depth's unit gathers the embedding with it, and an untied output layer
    head = emb if not m.tie_embeddings else 0
    units += [sum(layer_params(cfg, lo, m.num_layers + d)) + mtp_depth_extra(m) + emb + head
              for d in range(mtp_depths_on(cfg, lo, stage))]
    if stage == head_stage(cfg, lo):
        units.append(norm_params(m) + (emb if not tied_on_one_chunk(cfg, lo) else 0))
    return units


def expert_group_size(cfg: Any, lo: Layout) -> int:
    """The ranks expert gradients are reduced (and expert state sharded) over: edp = dp x cp / ep,
    or tp x edp when the experts are replicated over tp (etp = 1) under sequence parallelism,
    where each tp rank's gradient is partial (RankGrid.expert_grad_kind)."""
    edp = max(1, lo.dp * lo.cp // lo.ep)
    spans_tp = lo.tp > 1 and etp_size(cfg) == 1 and bool(cfg.parallel.sequence_parallel)
    return edp * (lo.tp if spans_tp else 1)


def gathered_working_set(cfg: Any, lo: Layout, stage: int, n: int) -> int:
    """U in bytes (see the module doc). FP8 gathers (train.param_gather_dtype=fp8) hold each
    gathered bucket's e4m3 copy beside it for the GEMMs: 1 byte more an element (counted for
    every gathered element, an upper bound: the norms and the embedding have none)."""
    per = BYTES + (1 if unit_gather_format(cfg, level_of(cfg, lo)) == "fp8" else 0)
    if not bool(cfg.train.reshard_after_forward):
        return per * n
    ahead = int(cfg.overlap.dp_prefetch) if lo.mode("dp") != "false" else 0
    units = unit_params(cfg, lo, stage)
    held = (1 + ahead) * max(units)
    if stage == 0 and (tied_on_one_chunk(cfg, lo) or defers_weight_grads_of(cfg, lo)):
        held += embedding_params(cfg, lo)
    return per * min(max(held, mtp_backward_held(cfg, lo, stage, ahead)), n)


def mtp_backward_held(cfg: Any, lo: Layout, stage: int, ahead: int) -> int:
    """Parameters gathered at once in a zero-bubble B through the MTP depths of `stage` (0 with
    fewer than two, weight gradients not deferred, or the depths a chunk of their own): depth d + 1's input is depth d's block
    output, whose gradient is complete only inside depth d's backward, so depth d + 1's own
    buckets are still gathered (fsdp.UnitGatherer frees a unit on its input's gradient) when
    depth d's unit (with the embedding and head weights it reads) is gathered and the `ahead`
    units before it in the chunk prefetched (the earlier depths' own buckets, then the chunk's
    blocks from the last)."""
    from mpoverlap.overlap.estimate.mtp import mtp_chunk_of

    D = mtp_depths_on(cfg, lo, stage)
    if D < 2 or not defers_weight_grads_of(cfg, lo) or stage != head_stage(cfg, lo):
        return 0  # (the depths a chunk of their own: its B is a full backward, nothing deferred)
    m = cfg.model
    emb = embedding_params(cfg, lo)
    shared = emb + (emb if not m.tie_embeddings else 0)
    own = [sum(layer_params(cfg, lo, m.num_layers + d)) + mtp_depth_extra(m) for d in range(D)]
    blocks = [sum(layer_params(cfg, lo, i)) for i in chunk_layers(cfg, lo, mtp_chunk_of(cfg, lo, stage))]
    return max(own[d] + shared + own[d + 1] + sum((own[:d][::-1] + blocks[::-1])[:ahead]) for d in range(D - 1))


def defers_weight_grads_of(cfg: Any, lo: Layout) -> bool:
    """A zero-bubble schedule (W actions): the embedding's B gives no input gradient to free
    it on (fsdp.UnitGatherer), so it stays gathered until its W reduce-scatters it."""
    from mpoverlap.pipeline import defers_weight_grads, resolve_schedule

    choice = getattr(cfg.parallel, "pp_schedule", "auto")
    return lo.pp > 1 and defers_weight_grads(resolve_schedule(choice, lo.vpp))


def state_memory(cfg: Any, lo: Layout, stage: int, n: int, n_exp: int) -> Dict[str, int]:
    """params / grads / optimizer bytes of one rank of `stage` at the configured level, and
    `gathered` (U, included in params) under ZeRO-3."""
    level = level_of(cfg, lo)
    g = lo.dp * lo.cp
    g_e = expert_group_size(cfg, lo)
    shard = (n - n_exp) // g + n_exp // g_e
    sharded = lambda on: shard if on else n  # noqa: E731
    gathered = gathered_working_set(cfg, lo, stage, n) if level == "optim_grads_params" else 0
    return {"params": BYTES * sharded(level == "optim_grads_params") + gathered,
            "grads": BYTES * sharded(level in ("optim_grads", "optim_grads_params")),
            "optimizer": 2 * BYTES * sharded(level != "none"),
            "gathered": gathered}


def residual_memory(cfg: Any, lo: Layout, n: int, n_exp: int) -> int:
    """Bytes of gradient error-feedback residuals on a rank holding n parameters (n_exp of them
    expert weights): fp32 of every reduced bucket, plus under plain data parallelism the owner's
    residual of its reduced shard (data_parallel/grad_wire.py); 0 without error feedback."""
    from mpoverlap.data_parallel.grad_wire import error_feedback_on, is_wire

    t = cfg.train
    try:
        if not (is_wire(str(t.grad_reduce_dtype)) and error_feedback_on(t.grad_error_feedback, t.grad_reduce_dtype)):
            return 0
    except ValueError:  # refused by the rule dp.grad_error_feedback
        return 0
    g, g_e = lo.dp * lo.cp, expert_group_size(cfg, lo)
    dense, expert = (n - n_exp if g > 1 else 0), (n_exp if g_e > 1 else 0)
    owned = dense // g + expert // g_e if level_of(cfg, lo) == "none" else 0
    return BYTES * (dense + expert + owned)


def delayed_grad_memory(cfg: Any, lo: Layout, n: int) -> int:
    """Bytes of overlap.dp_delay=1's second gradient buffer on a rank holding n parameters
    (data_parallel/delayed.py): every bucket once more, in the reduction dtype where it is
    reduced (fp32 where nothing is), plus a one-bucket fp32 scratch (buckets close at
    overlap.dp_bucket_mb; a parameter is never split: the embedding's bucket may be larger)."""
    if cfg.overlap.dp_delay != 1:
        return 0
    reduced = lo.dp * lo.cp > 1
    per = 2 if reduced and str(cfg.train.grad_reduce_dtype) == "bf16" else BYTES
    from mpoverlap.simulate.bucket_size import bucket_mb_or_provisional

    bucket = max(int(bucket_mb_or_provisional(cfg) * 1024 * 1024) // BYTES, embedding_params(cfg, lo))
    scratch = BYTES * min(n, bucket)  # an unresolved auto counts the provisional size (bucket_size.py)
    return per * n + scratch


def unit_gather_format(cfg: Any, level: str) -> str:
    """train.param_gather_dtype as the trainer resolves it (data_parallel/levels.py, from the
    compute precision: bf16 under train.precision=fp8 too)."""
    from mpoverlap.data_parallel.levels import param_gather_dtype
    from mpoverlap.precision.autocast import compute_precision

    return param_gather_dtype(str(cfg.train.param_gather_dtype), compute_precision(str(cfg.train.precision)), level)


def unit_gather_pass_bytes(cfg: Any, lo: Layout, stage: int, count: int, exact: int) -> float:
    """Bytes one gather of a rank's `count` dense parameters carries, `exact` of them read as
    they are (fp32): the GEMM weights in the unit gathers' format; under fp8 the blocks' GEMM
    weights at 1 byte and an untied head's weight, no FP8 GEMM, in bf16 (data_parallel/fp8_gather.py)."""
    from mpoverlap.data_parallel.unit_gather import gather_bytes

    fmt = unit_gather_format(cfg, level_of(cfg, lo))
    if fmt != "fp8":
        return gather_bytes(fmt, count - exact, exact)
    head = embedding_params(cfg, lo) if stage == head_stage(cfg, lo) and not cfg.model.tie_embeddings else 0
    return gather_bytes("fp8", count - exact - head, 0) + gather_bytes("bf16", head, exact)


def dp_ops(cfg: Any, lo: Layout, params: int, expert_params: int, grad_bytes: float, stage: int = 0) -> list:
    """The dp collectives per step of a rank of `stage` holding `params` ((mode, op, buffer
    bytes, group size) tuples, as comm.comm_ops lists them). Quantized gradients
    (train.grad_reduce_dtype=fp8|int8, data_parallel/grad_wire.py): each reduce-scatter is an
    all-to-all of the packed shards, and plain data parallelism's all-reduce that all-to-all plus
    an all-gather of the reduced shard, `grad_bytes` an element each (block padding left out)."""
    from mpoverlap.data_parallel.grad_wire import is_wire

    level = level_of(cfg, lo)
    replicas = lo.dp * lo.cp
    n_e = expert_group_size(cfg, lo)
    micro = lo.num_microbatches or 1
    wire = is_wire(str(cfg.train.grad_reduce_dtype))
    ops = []
    for n, count, dense in ((replicas, params - expert_params if replicas > 1 else 0, True),
                            (n_e, expert_params if n_e > 1 else 0, False)):
        if not count:
            continue
        if level == "none":
            if wire:
                hop = int(count * grad_bytes)
                ops += [("dp", "all_to_all", hop, n), ("dp", "all_gather", hop, n)]
            else:
                ops.append(("dp", "all_reduce", count * grad_bytes, n))
            continue
        rounds = micro if level in ("optim_grads", "optim_grads_params") else 1
        ops.append(("dp", "all_to_all" if wire else "reduce_scatter", int(rounds * count * grad_bytes), n))
        if level != "optim_grads_params":
            ops.append(("dp", "all_gather", count * BYTES, n))
            continue
        # Per gather of the stage's parameters: the GEMM weights in the unit gathers' format, what
        # the forward reads as it is in fp32 (data_parallel/unit_gather.py; padding left out).
        from mpoverlap.data_parallel.unit_gather import gather_bytes

        resharded = bool(cfg.train.reshard_after_forward)
        exact = min(count, read_as_is_params(cfg, lo, stage)) if dense else 0
        fmt = unit_gather_format(cfg, level)
        per_pass = unit_gather_pass_bytes(cfg, lo, stage, count, exact) if dense else gather_bytes(fmt, count, 0)
        gathered = micro * (2 if resharded else 1) * per_pass
        if resharded and dense and tied_on_one_chunk(cfg, lo) and stage == 0:
            gathered += micro * gather_bytes(fmt, 0, embedding_params(cfg, lo))
        D = mtp_depths_on(cfg, lo, stage)
        if resharded and dense and D and stage != head_stage(cfg, lo):
            # The depths a chunk of their own (models/mtp_chunk.py): its copies of the embedding
            # and of an untied output layer, counted with the stage's (two gathers), are gathered
            # by each depth's forward and once for the backward (the last depth's gather stays
            # until the first depth's gradient reduces them): D - 1 more each.
            emb = embedding_params(cfg, lo)
            untied = not cfg.model.tie_embeddings
            gathered += micro * (D - 1) * (gather_bytes(fmt, 0, emb) + (gather_bytes(fmt, emb, 0) if untied else 0))
        elif resharded and dense and D:
            # Each depth's forward gathers the embedding again (the tied head's weight too) and an
            # untied output layer's GEMM weight; their backward finds them held (the head's or a
            # later depth's backward gathered them). An untied copy of the embedding on a later
            # stage is the first depth's own: its gathers are counted with the stage's.
            emb = embedding_params(cfg, lo)
            untied = not cfg.model.tie_embeddings
            gathered += micro * ((D - (untied and stage != 0)) * gather_bytes(fmt, 0, emb)
                                 + (D * gather_bytes(fmt, emb, 0) if untied else 0))
        ops.append(("dp", "all_gather", int(gathered), n))
    return ops
