"""ZeRO-3 / FSDP: parameters live sharded between uses; each unit is gathered around its use.

A unit is a piece of the model run as a whole: a transformer block, the embedding, the head
(final norm + output layer, plus the tied embedding weight it reuses). Its parameters sit in
buckets of their own (`build_buffer(unit_of=...)`), and each rank keeps only its shard of every
bucket (`DataParallel.param_shard`). Around a unit's use:

    forward pre-hook   gather its buckets (all-gather shard -> full bucket), wait them, and
                       issue the gathers of the next `prefetch` units of its chunk (in flight
                       while this unit computes; overlap.dp=false: waited at once)
    forward post-hook  free the full buckets (reshard_after_forward=True), and hook the
                       output's gradient: that hook runs right before the unit's backward
    backward pre-hook  gather again (if freed) + prefetch the `prefetch` previous units
    gradients ready    DataParallel reduce-scatters the bucket and frees it (`after_reduce`)
    input's gradient   (zero-bubble B, weight gradients deferred to W) free the unit's buckets:
                       W reads no parameter (its GEMMs take the saved input and output
                       gradient), and the reduce-scatter that would free them waits for W

Under a zero-bubble schedule a unit's buckets are complete only when its W ran, so without the
input-gradient hook every unit a B ran through stayed gathered until its W: the whole stage's
parameters between B and W. With it, what a B leaves gathered is only what has no input
gradient to hook (the embedding unit, and the tied head's share of it), kept until the W that
reduce-scatters it (tests/test_invariants.py checks this bound after every pipeline action).

reshard_after_forward=True (FSDP2's default): parameters are gathered twice per microbatch
(forward and backward); peak parameter memory is the shards plus the few units in flight.
False: the forward's gather is kept until the unit's backward, one gather per microbatch but
every unit's full parameters stay alive between the forward and the backward (ZeRO-2's
parameter memory at the peak of a step).

A full bucket is a tensor with storage of its own: freeing resizes that storage to 0 and the
parameters (views of it, also the ones autograd saved for backward) see the memory again once
it is re-allocated and re-gathered.

What a gather carries (`gather_dtype`, train.param_gather_dtype): its result is a compute copy,
so the weights the GEMMs cast may travel in bf16 or int8 (data_parallel/unit_gather.py, bucket by
bucket; everything else in fp32). The shards themselves (the fp32 master weights the optimizer
updates) are never rounded, and `gather_all` (checkpoints, loads) always gathers them exactly.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Dict, List, Sequence

import torch
import torch.nn as nn

from mpoverlap.comm.collectives import all_gather
from mpoverlap.comm.handle import CommHandle
from mpoverlap.data_parallel.buffer import alloc_storage, free_storage, is_allocated
from mpoverlap.data_parallel.unit_gather import FORMATS, BucketGather, exact_ranges


@dataclass
class UnitSpec:
    """`owned`: the parameters that live in this unit's buckets; `shared`: parameters of other
    units it also uses (a tied head's embedding weight). The unit starts with `start`'s forward
    and ends with `end`'s (often the same module). Units of one `chunk` are in forward order."""

    name: str
    start: nn.Module
    end: nn.Module
    owned: List[nn.Parameter]
    shared: List[nn.Parameter] = field(default_factory=list)
    chunk: int = 0


def in_backward() -> bool:
    """True while autograd runs a backward pass (a recomputed forward runs inside one)."""
    return torch._C._current_graph_task_id() != -1


class UnitGatherer:
    """The ZeRO-3 gathers of `ddp`'s buckets around the use of each unit (see module doc)."""

    def __init__(self, ddp: Any, units: Sequence[UnitSpec], *, prefetch: int,
                 reshard_after_forward: bool, overlap: bool, gather_dtype: str = "fp32") -> None:
        if prefetch < 0:
            raise ValueError(f"prefetch must be >= 0, got {prefetch}")
        if gather_dtype not in FORMATS:
            raise ValueError(f"gather_dtype must be one of {FORMATS}, got {gather_dtype!r}")
        self.gather_dtype = gather_dtype
        self.ddp, self.units = ddp, list(units)
        self.prefetch = prefetch if overlap else 0  # no overlap: each gather waited at once
        self.reshard_after_forward = bool(reshard_after_forward)
        buf = ddp.buffer
        self.sharded = [ddp.bucket_group(b.index).group is not None for b in buf.buckets]
        # Each sharded bucket's gather in gather_dtype (None: fp32 into the bucket itself).
        self._formats = [None] * len(buf.buckets)
        self.fp8_scales = None  # fp8: the step's per-weight scales (data_parallel/fp8_gather.py)
        if gather_dtype != "fp32":
            self._plan_formats(gather_dtype)
        self.buckets_of: List[List[int]] = []
        for u in self.units:
            ids = sorted({buf.index[p][2] for p in list(u.owned) + list(u.shared) if p in buf.index})
            self.buckets_of.append([b for b in ids if self.sharded[b]])
        self._pending: Dict[int, CommHandle] = {}
        readers: Dict[int, int] = {}
        for ids in self.buckets_of:
            for b in ids:
                readers[b] = readers.get(b, 0) + 1
        self._shared = {b for b, n in readers.items() if n > 1}  # buckets two units read
        # Deferred weight gradients: the unit whose input is unit k's output (k -> that unit),
        # and the last unit output seen in this forward (weak reference, unit).
        self._free_first: Dict[int, int] = {}
        self._last_output = None
        # Forward/backward pairing (mpoverlap/pairing) uses two units at once: the uses holding
        # each bucket, and the buckets whose free waits for their last use to end.
        self._pins: Dict[int, int] = {}
        self._free_later: set = set()
        # Bytes of full buckets allocated now and at most since the last reset (the working set),
        # with the e4m3 copy an FP8 gather holds beside each (`_fp8_held`: bucket -> its bytes).
        self._fp8_held: Dict[int, int] = {}
        # Bytes the gathers received per wire dtype since the last take_wire_bytes (the ledger's
        # dp gather bytes split: metrics.jsonl's dp_gather_bytes_<dtype>).
        self._wire_bytes: Dict[str, int] = {}
        self.held_bytes = 0
        self.peak_held_bytes = 0
        self._hooks = []
        for i, u in enumerate(self.units):
            self._hooks.append(u.start.register_forward_pre_hook(partial(self._pre_forward, i)))
            self._hooks.append(u.end.register_forward_hook(partial(self._post_forward, i)))
        self.reshard_all()  # the full buckets build_buffer filled: from now on only shards persist
        self.held_bytes = self.peak_held_bytes = 0

    def _plan_formats(self, gather_dtype: str) -> None:
        """Each sharded fp32 bucket's BucketGather. fp8: the buckets holding FP8 GEMM weights
        carry them in e4m3 (the rest of such a bucket in fp32), the other buckets bf16."""
        from mpoverlap.data_parallel.fp8_gather import Fp8Scales, Fp8Shards, attach, fp8_weights
        from mpoverlap.precision import compute_cast_weights

        ddp, buf = self.ddp, self.ddp.buffer
        cast = compute_cast_weights(ddp.module)
        fp8 = fp8_weights(ddp.module) if gather_dtype == "fp8" else {}
        if gather_dtype == "fp8" and not fp8:
            raise ValueError("train.param_gather_dtype=fp8 gathers the weights of FP8 GEMMs, and this model has "
                             "none: set train.precision=fp8 (train.fp8_recipe=tensorwise), or "
                             "train.param_gather_dtype=bf16")
        for b in buf.buckets:
            if not (self.sharded[b.index] and b.param_data.dtype == torch.float32):
                continue
            group = ddp.bucket_group(b.index)
            mine = sorted((p for p, (_, _, i) in buf.index.items() if i == b.index and p in fp8),
                          key=lambda p: buf.index[p][0])
            kw = dict(size=group.size, rank=group.rank, device=b.param_data.device)
            if mine:
                if self.fp8_scales is None:
                    self.fp8_scales = Fp8Scales(group.group, ddp.ledger)
                elif self.fp8_scales.group is not group.group:
                    raise ValueError("train.param_gather_dtype=fp8: the FP8 weights' buckets are sharded over "
                                     "different groups, and their amaxes are reduced over one")
                spans = [(buf.index[p][0] - b.offset, buf.index[p][1] - b.offset, p.shape) for p in mine]
                part = Fp8Shards(b.numel, spans, scales=self.fp8_scales, bucket=b.index, **kw)
                attach(part, mine)
                plan = BucketGather("fp8", b.numel, exact_ranges(b, buf.index, set(mine)), fp8=part, **kw)
            else:
                plan = BucketGather("bf16" if gather_dtype == "fp8" else gather_dtype, b.numel,
                                    exact_ranges(b, buf.index, cast), **kw)
            self._formats[b.index] = plan if plan.fmt != "fp32" else None

    # ---- per bucket ----------------------------------------------------------------------
    def _gather(self, b: int, exact: bool = False) -> None:
        if b in self._pending:
            return
        bucket = self.ddp.buffer.buckets[b]
        if not alloc_storage(bucket.param_data):
            return  # already gathered
        plan = self._formats[b] if not exact else None
        if plan is not None and plan.fp8 is not None:
            self._fp8_held[b] = plan.fp8.held_bytes()
        self.held_bytes += bucket.param_data.untyped_storage().nbytes() + self._fp8_held.get(b, 0)
        self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)
        full, shard, group = bucket.param_data, self.ddp.param_shard(b), self.ddp.bucket_group(b).group
        plain = {str(full.dtype).replace("torch.float32", "fp32").replace("torch.", ""): full.numel() * full.element_size()}
        for dtype, nbytes in (plan.wire_bytes() if plan is not None else plain).items():
            self._wire_bytes[dtype] = self._wire_bytes.get(dtype, 0) + nbytes
        if plan is None:
            self._pending[b] = all_gather(full, shard, group, mode="dp", ledger=self.ddp.ledger)
        else:
            if plan.fp8 is not None:
                self.fp8_scales.ensure(self.ddp.param_shard)
            self._pending[b] = plan.issue(full, shard, group, mode="dp", ledger=self.ddp.ledger)

    def _wait(self, b: int) -> None:
        handle = self._pending.pop(b, None)
        if handle is not None:
            handle.wait()

    def free(self, b: int) -> None:
        if not self.sharded[b]:
            return
        if b in self._pins:  # in use by a paired sub-step program: freed when released
            self._free_later.add(b)
            return
        self._wait(b)  # a gather in flight writes the storage
        plan = self._formats[b]
        if plan is not None and plan.fp8 is not None:
            plan.fp8.release()
        data = self.ddp.buffer.buckets[b].param_data
        self.held_bytes -= data.untyped_storage().nbytes() + self._fp8_held.pop(b, 0)
        free_storage(data)

    def after_reduce(self, b: int) -> None:
        """Every gradient of bucket `b` arrived in this backward: its parameters are done."""
        self.free(b)

    # ---- per unit ------------------------------------------------------------------------
    def _neighbours(self, i: int, step: int) -> List[int]:
        out, j = [], i + step
        while len(out) < self.prefetch and 0 <= j < len(self.units) and self.units[j].chunk == self.units[i].chunk:
            out.append(j)
            j += step
        return out

    def ensure(self, i: int, step: int = 1) -> None:
        """Unit `i` gathered (waited); the next units in direction `step` issued, not waited."""
        for b in self.buckets_of[i]:
            self._gather(b)
        for j in self._neighbours(i, step):
            for b in self.buckets_of[j]:
                self._gather(b)
        for b in self.buckets_of[i]:
            self._wait(b)

    def pin(self, i: int, step: int) -> None:
        """Unit `i` gathered and held until `unpin` (prefetching in direction `step`)."""
        self.ensure(i, step)
        for b in self.buckets_of[i]:
            self._pins[b] = self._pins.get(b, 0) + 1

    def unpin(self, i: int, free: bool) -> None:
        """End one use of unit `i`; its buckets are freed once unused if `free` or a free was
        asked for while they were held."""
        for b in self.buckets_of[i]:
            self._pins[b] -= 1
            if self._pins[b] == 0:
                del self._pins[b]
                if free or b in self._free_later:
                    self._free_later.discard(b)
                    self.free(b)

    def _pre_forward(self, i: int, _module, args) -> None:
        # A recomputed forward runs inside the unit's backward: the units after it finished
        # their backward and were freed, so prefetching "the next" units would gather them
        # again for nobody. Look backwards, as the backward pre-hook does (already issued).
        self.ensure(i, -1 if in_backward() else +1)
        deferral = getattr(self.ddp, "weight_grads", None)
        if deferral is not None and not in_backward() and torch.is_grad_enabled():
            x = next((a for a in args if isinstance(a, torch.Tensor) and a.requires_grad), None)
            last = self._last_output
            if x is not None and last is not None and last[0]() is x:
                # x is the previous unit's output: its backward pre-hook (registered first on
                # x, so it would run first and gather that unit and prefetch more before this
                # one is freed) frees this unit before it gathers.
                self._free_first[last[1]] = i
            elif x is not None:
                x.register_hook(partial(self._after_backward, i))

    def _after_backward(self, i: int, _grad=None) -> None:
        """Unit `i`'s input gradient is complete, so is its backward. Inside a deferring B its
        buckets wait for W to be reduce-scattered (and freed): free them now, but the ones
        another unit also reads (the tied embedding: the embedding unit's backward follows)."""
        if self.ddp.weight_grads.active:
            for b in self.buckets_of[i]:
                if b not in self._shared:
                    self.free(b)
        return None

    def _post_forward(self, i: int, _module, _args, output) -> None:
        if in_backward():
            return  # a recomputed forward: its backward follows at once and needs the unit
        if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
            output = output[0]  # a head returning (logits, hidden) (GPT with_hidden): the logits
        if torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(partial(self._pre_backward, i))
            self._last_output = (weakref.ref(output), i)
        if self.reshard_after_forward or not torch.is_grad_enabled():
            for b in self.buckets_of[i]:
                self.free(b)

    def _pre_backward(self, i: int, _grad) -> None:
        if i in self._free_first:
            self._after_backward(self._free_first[i])
        self.ensure(i, -1)
        return None

    # ---- whole model ---------------------------------------------------------------------
    def reshard_all(self) -> None:
        """Free every gathered bucket (after the optimizer step: their content is stale, and so
        are the FP8 gathers' scales)."""
        for b, sharded in enumerate(self.sharded):
            if sharded:
                self.free(b)
        if self.fp8_scales is not None:
            self.fp8_scales.invalidate()

    def take_wire_bytes(self) -> Dict[str, int]:
        """{wire dtype: bytes} the gathers received since the last call (fp32, bf16, int8, fp8)."""
        out, self._wire_bytes = self._wire_bytes, {}
        return out

    def reset_peak(self) -> None:
        self.peak_held_bytes = self.held_bytes

    def gather_all(self) -> None:
        """Every bucket gathered exactly (fp32, whatever gather_dtype is): for checkpoints and
        loads. A rounded compute copy still held is dropped first."""
        if self.gather_dtype != "fp32":
            self.reshard_all()
        for b, sharded in enumerate(self.sharded):
            if sharded:
                self._gather(b, exact=True)
        self.wait_pending()

    @torch.no_grad()
    def write_back(self) -> None:
        """Copy this rank's part of every gathered bucket into its shard (after a load)."""
        for b, sharded in enumerate(self.sharded):
            bucket = self.ddp.buffer.buckets[b]
            if sharded and is_allocated(bucket.param_data):
                lo, hi = self.ddp.shard_range(b)
                self.ddp.param_shard(b).copy_(bucket.param_data[lo - bucket.offset:hi - bucket.offset])

    def wait_pending(self) -> None:
        """Wait every gather still in flight (prefetched units nobody used yet)."""
        for b in list(self._pending):
            self._wait(b)

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


def gpt_units(chunks: Sequence[nn.Module]) -> List[UnitSpec]:
    """The units of GPT chunks (`models/gpt.py`): embedding (on the chunk that embeds), each
    block, the MTP depths (`mtp_units`), and the head = final norm + output layer (+ the tied embedding weight), which starts
    at the final norm and ends with the chunk's forward."""
    units: List[UnitSpec] = []
    for c, chunk in enumerate(chunks):
        if chunk.pre_process and chunk.embedding is not None:
            units.append(UnitSpec("embedding", chunk.embedding, chunk.embedding,
                                  list(chunk.embedding.parameters()), chunk=c))
        for name, block in chunk.layers.items():
            units.append(UnitSpec(f"layers.{name}", block, block, list(block.parameters()), chunk=c))
        if getattr(chunk, "mtp", None) is not None:
            units += mtp_units(chunk, units, c)
        if chunk.post_process:
            owned = list(chunk.final_norm.parameters())
            shared = []
            if chunk.output is not None:
                owned += list(chunk.output.parameters())
            elif chunk.embedding is not None:
                # The embedding's own unit (this chunk's, or another chunk's on this stage: the
                # zbv V) owns it; only a copy of it on a later stage belongs to the head.
                if chunk.pre_process or any(u.start is chunk.embedding for u in units):
                    shared = list(chunk.embedding.parameters())
                else:  # the last stage's copy of a tied embedding: only the head uses it
                    owned += list(chunk.embedding.parameters())
            units.append(UnitSpec("head", chunk.final_norm, chunk, owned, shared, chunk=c))
    return units


def mtp_units(chunk: nn.Module, units: Sequence[UnitSpec], c: int) -> List[UnitSpec]:
    """The units of a chunk's MTP depths (models/mtp.py), in the order they run (after the last
    block, before the head): each depth's norms, eh_proj, block and final norm, from the depth's
    forward to its logits (`MTPDepth.logits`), with the embedding its input tokens are looked up
    in and the head weights its logits read (the output layer, or the tied embedding). The
    embedding's unit (this stage's) or the tied head owns the embedding; an untied copy of it on
    a later stage is owned by the first depth."""
    emb = list(chunk.embedding.parameters())
    owns_copy = (chunk.output is not None and not chunk.pre_process
                 and not any(u.start is chunk.embedding for u in units))
    head = list(chunk.output.parameters()) if chunk.output is not None else []
    out: List[UnitSpec] = []
    for k, (name, depth) in enumerate(chunk.mtp.items()):
        owned = list(depth.parameters()) + (emb if owns_copy and k == 0 else [])
        shared = head + ([] if owns_copy and k == 0 else emb)
        out.append(UnitSpec(f"mtp.{name}", depth, depth.head_call, owned, shared, chunk=c))
    return out


def unit_index(units: Sequence[UnitSpec]):
    """param -> index of the unit owning it (None for a parameter in no unit)."""
    owner = {}
    for i, u in enumerate(units):
        for p in u.owned:
            owner.setdefault(p, i)
    return lambda p: owner.get(p)
