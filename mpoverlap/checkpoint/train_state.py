"""A training run's parameters and AdamW moments as ShardedEntry objects: what each rank
writes and what it reads back.

Every value is keyed by its layout-free parameter name (pipeline stages keep their blocks'
global names, experts their global index) and placed in the FULL tensor by offsets, so the
checkpoint does not depend on the layout that wrote it. A stacked expert parameter (the
grouped experts' [L, ...] weights, moe/experts.py) is written as its experts' tensors, under
the per-expert names it lists in `expert_names`, as the per-expert modules write them:

    model.<name>                  the parameter
    optimizer.exp_avg.<name>      AdamW's moments, same shape
    optimizer.exp_avg_sq.<name>
    optimizer.step                the step count (an int)

Who writes what (each element once, by the rank that holds it; nothing is gathered):
- each bucket is split over its reduction group (dp x cp, or edp for experts, tp x edp for
  experts replicated over tp under SP): under ZeRO-1/2/3 a rank writes its optimizer shard,
  without sharding an even split of the bucket;
- a parameter replicated over tensor parallelism (norms, biases of row-parallel layers,
  experts with etp = 1) is written by tp rank 0 alone, unless its bucket's group spans the tp
  ranks (then each writes its own split); a tensor-parallel one by every tp rank (its slice,
  placed by `Partition`);
- the tied embedding's second copy on the last pipeline stage is not written (the first
  stage's copy is the same tensor).

What each rank reads: the parameters it holds (under ZeRO-3 its shard, otherwise its whole
tensor-parallel slice, second copies included) and its AdamW pieces' moments.

With gradient error feedback (train.grad_error_feedback) the state also holds each rank's
residuals, `grad_residual.*` (residuals.py). With overlap.dp_delay=1 it holds the reduced
gradient the next step applies, `dp_delay_grad.<name>` (data_parallel/delayed.py), written and
placed like the parameter; a checkpoint without it (written undelayed) makes the first resumed
step apply nothing, as a run's first step does.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from mpoverlap.checkpoint import residuals
from mpoverlap.checkpoint.boxes import Partition, box_flat_start, flat_range_boxes
from mpoverlap.checkpoint.sharded import ShardedEntry

MOMENT_KEYS = ("exp_avg", "exp_avg_sq")
PENDING = "dp_delay_grad"
Chunks = List[Tuple[Tuple[int, ...], torch.Tensor]]


def partition_of(p: nn.Parameter, tp_rank: int, tp_size: int) -> Partition:
    """Where a parameter's local tensor sits in its full tensor (see tensor_parallel/layers.py:
    `tensor_model_parallel`, `partition_dim`, `partition_blocks`; expert weights split over
    etp = tp carry the same attributes)."""
    if not getattr(p, "tensor_model_parallel", False):
        return Partition()
    return Partition.of(p.shape, p.partition_dim, tp_rank, tp_size, p.partition_blocks)


def range_chunks(flat: torch.Tensor, shape, part: Partition, a: int, b: int) -> Chunks:
    """`flat` [b - a] holds elements [a, b) of a local tensor of `shape` (row-major) ->
    [(offsets in the full tensor, view of `flat` with that box's elements)]."""
    chunks: Chunks = []
    for box in flat_range_boxes(shape, a, b):
        start = box_flat_start(shape, box) - a
        block = flat[start:start + math.prod(box[1])].view(box[1])
        for (g_offsets, _), (l_offsets, l_sizes) in part.to_global(box):
            view = block
            if part.dim is not None:
                d = part.dim
                view = block.narrow(d, l_offsets[d] - box[0][d], l_sizes[d])
            chunks.append((g_offsets, view))
    return chunks


def _write_range(ddp, b: int) -> Tuple[int, int]:
    """The part of bucket `b` this rank writes: its optimizer shard under ZeRO, else its even
    share of the bucket over the bucket's reduction group."""
    bucket, group = ddp.buffer.buckets[b], ddp.bucket_group(b)
    if ddp.distributed_optimizer and group.group is not None:
        return ddp.shard_range(b)
    per = -(-bucket.numel // group.size)
    lo = bucket.offset + min(bucket.numel, group.rank * per)
    return lo, min(bucket.offset + bucket.numel, lo + per)


def _writes(p: nn.Parameter, tp_rank: int, group_spans_tp: bool) -> bool:
    if getattr(p, "pipeline_duplicate", False):
        return False
    return tp_rank == 0 or group_spans_tp or bool(getattr(p, "tensor_model_parallel", False))


class TrainStateChunks:
    """Builds the `model` and `optimizer` parts of a checkpoint state dict for one rank.

    ddp: the DataParallel wrapper (buffers, buckets, shards); optimizer: its DataParallelAdamW;
    dp_names: {name in the wrapper: layout-free name}.
    """

    def __init__(self, ddp, optimizer, dp_names: Dict[str, str], tp_rank: int, tp_size: int) -> None:
        self.ddp, self.optimizer, self.dp_names = ddp, optimizer, dp_names
        self.tp_rank, self.tp_size = tp_rank, tp_size

    def _add(self, out: Dict[str, Chunks], shapes: Dict[str, tuple], p: nn.Parameter, chunks: Chunks) -> None:
        """Add p's chunks (boxes of its full tensor) to `out` under p's layout-free name, or a
        stacked expert parameter's under each expert's name (box dim 0 = the local expert)."""
        full = partition_of(p, self.tp_rank, self.tp_size).global_shape(p.shape)
        names = getattr(p, "expert_names", None)
        if names is None:
            name = self.dp_names[self.ddp.buffer.name_of[p]]
            out.setdefault(name, []).extend(chunks)
            shapes[name] = full
            return
        for offsets, view in chunks:
            for i in range(view.shape[0]):  # checkpoint time only: a loop over the experts is fine
                name = names[offsets[0] + i]
                out.setdefault(name, []).append((offsets[1:], view[i]))
                shapes[name] = full[1:]

    def _chunks_of(self, p: nn.Parameter, flat: torch.Tensor, a: int, b: int) -> Dict[str, tuple]:
        """{name: (full shape, chunks)} of elements [a, b) of p held in `flat`, placed as p is."""
        out: Dict[str, Chunks] = {}
        shapes: Dict[str, tuple] = {}
        self._add(out, shapes, p, range_chunks(flat, p.shape, partition_of(p, self.tp_rank, self.tp_size), a, b))
        return {name: (shapes[name], chunks) for name, chunks in out.items()}

    def _residual_views(self) -> list:
        return residuals.residual_views(self.ddp, self.tp_rank, self.tp_size)

    @staticmethod
    def _entries(pieces: Dict[str, Chunks], shapes: Dict[str, tuple]) -> Dict[str, ShardedEntry]:
        return {name: ShardedEntry(shapes[name], chunks) for name, chunks in pieces.items() if chunks}

    def for_save(self) -> Dict[str, dict]:
        """{"model": {name: entry}, "optimizer": {"step", "exp_avg": {...}, "exp_avg_sq": {...}}}
        holding views of this rank's own storage (the moments of a rank that has not stepped
        yet are zeros of its pieces' sizes)."""
        buf = self.ddp.buffer
        moments: Dict[str, list] = {}
        for pc, m in self.optimizer.piece_moments():
            moments.setdefault(pc.name, []).append((pc, m))
        model: Dict[str, Chunks] = {}
        optim: Dict[str, Dict[str, Chunks]] = {k: {} for k in MOMENT_KEYS}
        shapes: Dict[str, tuple] = {}
        for bucket in buf.buckets:
            w_lo, w_hi = _write_range(self.ddp, bucket.index)
            for p in bucket.params:
                start, end, _ = buf.index[p]
                lo, hi = max(start, w_lo), min(end, w_hi)
                if lo >= hi or not _writes(p, self.tp_rank, self.ddp.bucket_group(bucket.index).spans_tp):
                    continue
                part = partition_of(p, self.tp_rank, self.tp_size)
                self._add(model, shapes, p, range_chunks(
                    self.ddp.held_params(bucket.index, lo, hi), p.shape, part, lo - start, hi - start))
                pc, m = next((pc, m) for pc, m in moments[buf.name_of[p]] if pc.lo <= lo and hi <= pc.hi)
                for k in MOMENT_KEYS:
                    flat = (m[k][lo - pc.lo:hi - pc.lo] if m is not None
                            else torch.zeros(hi - lo, dtype=pc.main.dtype, device=pc.main.device))
                    self._add(optim[k], shapes, p, range_chunks(flat, p.shape, part, lo - start, hi - start))
        out = {"model": self._entries(model, shapes),
               "optimizer": {"step": self.optimizer.step_count,
                             **{k: self._entries(optim[k], shapes) for k in MOMENT_KEYS}}}
        views = self._residual_views()
        if views:
            out[residuals.PREFIX] = residuals.for_save(self._chunks_of, views)
        if self.ddp.delay and self.ddp.has_delayed_grad:
            self.ddp.wait_delayed()
            out[PENDING] = self._pending_entries(save=True)
        return out

    def _pending_entries(self, save: bool) -> Dict[str, ShardedEntry]:
        """The delayed gradient (`ddp.delayed_result(b)` holds elements [r_lo, r_hi) of bucket
        b) as entries: to save, each element once (the parameters' write ranges); to load, all
        this rank holds."""
        buf = self.ddp.buffer
        out: Dict[str, Chunks] = {}
        shapes: Dict[str, tuple] = {}
        for bucket in buf.buckets:
            result, r_lo = self.ddp.delayed_result(bucket.index)
            lo_b, hi_b = r_lo, r_lo + result.numel()
            if save:
                w_lo, w_hi = _write_range(self.ddp, bucket.index)
                lo_b, hi_b = max(lo_b, w_lo), min(hi_b, w_hi)
            for p in bucket.params:
                start, end, _ = buf.index[p]
                lo, hi = max(start, lo_b), min(end, hi_b)
                if lo >= hi or (save and not _writes(p, self.tp_rank, self.ddp.bucket_group(bucket.index).spans_tp)):
                    continue
                self._add(out, shapes, p, range_chunks(result[lo - r_lo:hi - r_lo], p.shape,
                                                       partition_of(p, self.tp_rank, self.tp_size),
                                                       lo - start, hi - start))
        return self._entries(out, shapes)

    def for_load(self, step: int, saved: Optional[dict] = None) -> Dict[str, dict]:
        """The same keys as views to fill in place: the parameters this rank holds and fresh
        AdamW moments at `step` (the checkpoint's; none at step 0); with error feedback the
        residuals the checkpoint holds (`saved`: its metadata, {fqn: metadata}). Run
        `after_load()` once the load filled them."""
        buf = self.ddp.buffer
        model: Dict[str, Chunks] = {}
        shapes: Dict[str, tuple] = {}
        for bucket in buf.buckets:
            h_lo, h_hi = self.ddp.held_range(bucket.index)
            for p in bucket.params:
                start, end, _ = buf.index[p]
                lo, hi = max(start, h_lo), min(end, h_hi)
                if lo >= hi:
                    continue
                self._add(model, shapes, p, range_chunks(
                    self.ddp.held_params(bucket.index, lo, hi), p.shape,
                    partition_of(p, self.tp_rank, self.tp_size), lo - start, hi - start))
        by_buf_name = {buf.name_of[p]: p for p in buf.params}
        optim: Dict[str, Dict[str, Chunks]] = {k: {} for k in MOMENT_KEYS}
        for pc, m in self.optimizer.reset_moments(step):
            p = by_buf_name[pc.name]
            for k in MOMENT_KEYS:
                self._add(optim[k], shapes, p, range_chunks(
                    m[k], p.shape, partition_of(p, self.tp_rank, self.tp_size), pc.a, pc.b))
        out = {"model": self._entries(model, shapes),
               "optimizer": {"step": step, **{k: self._entries(optim[k], shapes) for k in MOMENT_KEYS}}}
        self._after: list = []
        if self.ddp.delay and any(k.startswith(f"{PENDING}.") for k in (saved or {})):
            out[PENDING] = self._pending_entries(save=False)
            self._after.append(self.ddp.loaded_delayed_grad)
        views = self._residual_views()
        if views:
            for view in views:
                view[4].zero_()  # what the checkpoint does not hold starts at zero
            entries, self._after = residuals.for_load(self._chunks_of, views, saved or {})
            if entries:
                out[residuals.PREFIX] = entries
        return out

    def after_load(self) -> None:
        for fix in getattr(self, "_after", []):
            fix()
        self._after = []
