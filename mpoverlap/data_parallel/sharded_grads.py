"""ZeRO-2/3 side of DataParallel: persistent gradient (and parameter) shards, full gradient
buckets that exist only while backward fills them, the per-bucket reduce-scatter of every
microbatch, and the views the optimizer and the training loop read.

A mixin of `DataParallel` (ddp.py): it uses the wrapper's buffer, groups, handles and ledger.
At levels none and optim the shard views are slices of the flat buffers (`shard_range`), so
the optimizer reads the same way at every level.
"""
from __future__ import annotations

import contextlib
from typing import List, Optional

import torch

from mpoverlap.comm.collectives import reduce_scatter
from mpoverlap.data_parallel.buffer import alloc_storage, free_storage, is_allocated


class ShardedGrads:
    """The ZeRO-2/3 methods of DataParallel (see ddp.py's module docstring)."""

    def _init_shards(self) -> None:
        """ZeRO-2/3: the persistent shards (one flat buffer each, bucket b's shard at
        `_shard_at[b]`) and the full gradient buckets freed until their first gradient; a
        bucket reduced over a group of one is its own shard."""
        buckets = self.buffer.buckets
        self._shard_at: List[Optional[int]] = [None] * len(buckets)
        self._grad_shards = self._param_shards = None
        if not self.shard_grads:
            return
        total = 0
        for b in buckets:
            if self._communicates[b.index]:
                self._shard_at[b.index] = total
                total += b.numel // self.bucket_group(b.index).size
        ref = buckets[0].grad_data
        self._grad_shards = torch.zeros(total, dtype=ref.dtype, device=ref.device)
        if self.shard_params:
            self._param_shards = torch.empty(total, dtype=ref.dtype, device=ref.device)
        for b in buckets:
            if self._shard_at[b.index] is None:
                continue
            free_storage(b.grad_data)
            if self.shard_params:
                lo, hi = self.shard_range(b.index)
                self.param_shard(b.index).copy_(b.param_data[lo - b.offset:hi - b.offset])

    def param_shard(self, b: int) -> torch.Tensor:
        """The 1-D parameters of this rank's range of bucket `b` (its shard when sharded, else
        the whole bucket): what the optimizer updates. Persistent at every level."""
        bucket = self.buffer.buckets[b]
        at = self._shard_at[b]
        if self.shard_params and at is not None:
            return self._param_shards[at:at + bucket.numel // self.bucket_group(b).size]
        lo, hi = self.shard_range(b)
        return bucket.param_data[lo - bucket.offset:hi - bucket.offset]

    def held_range(self, b: int) -> tuple:
        """[lo, hi) in buffer elements of bucket `b` whose parameters this rank holds between
        uses: its shard under ZeRO-3, else the whole bucket."""
        bucket = self.buffer.buckets[b]
        if self.shard_params and self._shard_at[b] is not None:
            return self.shard_range(b)
        return bucket.offset, bucket.offset + bucket.numel

    def held_params(self, b: int, lo: int, hi: int) -> torch.Tensor:
        """The 1-D parameters of buffer elements [lo, hi) of bucket `b` (inside `held_range`),
        a view of the storage that persists (a checkpoint reads and fills it)."""
        h_lo, h_hi = self.held_range(b)
        if not h_lo <= lo <= hi <= h_hi:
            raise ValueError(f"bucket {b}: [{lo}, {hi}) is not inside the held range [{h_lo}, {h_hi})")
        bucket = self.buffer.buckets[b]
        if self.shard_params and self._shard_at[b] is not None:
            return self.param_shard(b)[lo - h_lo:hi - h_lo]
        return bucket.param_data[lo - bucket.offset:hi - bucket.offset]

    def grad_shard(self, b: int) -> torch.Tensor:
        """The 1-D reduced gradient of this rank's range of bucket `b` (valid after
        `finish_grad_sync`); the optimizer's `.grad`. Persistent at every level."""
        bucket = self.buffer.buckets[b]
        at = self._shard_at[b]
        if at is not None:
            return self._grad_shards[at:at + bucket.numel // self.bucket_group(b).size]
        lo, hi = self.shard_range(b)
        return bucket.grad_data[lo - bucket.offset:hi - bucket.offset]

    def reduced_grads(self, params) -> List[torch.Tensor]:
        """After `finish_grad_sync`: the reduced gradient this rank keeps of each of `params`:
        the whole `.grad`, or under ZeRO-2/3 the flattened part of it inside this rank's shard
        (possibly empty). Ranks with the same bucket layout and shard rank get the same parts."""
        if not self.shard_grads:
            return [p.grad for p in params]
        out = []
        for p in params:
            start, end, b = self.buffer.index[p]
            lo, hi = self.shard_range(b)
            a, z = max(start, lo), min(end, hi)
            out.append(self.grad_shard(b)[a - lo:max(a, z) - lo])
        return out

    @contextlib.contextmanager
    def full_params(self, write_back: bool = False):
        """Every parameter gathered inside (ZeRO-3; a no-op otherwise): for checkpoints and
        loads. `write_back=True`: what was written into the parameters becomes the shards."""
        if self.gatherer is None:
            yield
            return
        self.gatherer.gather_all()
        try:
            yield
            if write_back:
                self.gatherer.write_back()
        finally:
            self.gatherer.reshard_all()

    def reshard(self) -> None:
        """Free every gathered unit (after the optimizer step, after evaluation)."""
        if self.gatherer is not None:
            self.gatherer.reshard_all()

    def _before_accumulate(self, b: int, _grad: torch.Tensor) -> None:
        """Tensor hook of a parameter of bucket `b`, before its gradient accumulates: the
        bucket's previous reduce-scatter (still reading it) is finished and its storage is
        (re-)allocated and zeroed."""
        if getattr(self, "weight_grads", None) is not None and _grad is None:
            return None  # B deferred this gradient to a W action (mpoverlap/wgrad)
        if b in self._handles:
            self._complete(b)
        bucket = self.buffer.buckets[b]
        if alloc_storage(bucket.grad_data):
            bucket.grad_data.zero_()
            self._grad_bucket_bytes += bucket.grad_data.untyped_storage().nbytes()
            self.peak_grad_bucket_bytes = max(self.peak_grad_bucket_bytes, self._grad_bucket_bytes)
        return None

    def _free_grad_bucket(self, b: int) -> None:
        data = self.buffer.buckets[b].grad_data
        self._grad_bucket_bytes -= data.untyped_storage().nbytes()
        free_storage(data)

    # ZeRO-2/3 keep at most this many reduce-scatters in flight: issuing one more first waits
    # the oldest (it had a bucket's worth of backward to hide under), so the full gradient
    # buckets alive at once stay a few, not the whole model (FSDP2 keeps one).
    MAX_SHARDED_INFLIGHT = 2

    def _issue_sharded(self, b: int) -> None:
        bucket = self.buffer.buckets[b]
        self._ready[b].clear()
        while len(self._handles) >= self.MAX_SHARDED_INFLIGHT:
            self._complete(next(iter(self._handles)))  # the oldest (dicts keep issue order)
        if self.group_size > 1:
            bucket.grad_data.div_(self.group_size)
        send = bucket.grad_data if self.reduce_dtype == bucket.grad_data.dtype else bucket.grad_data.to(self.reduce_dtype)
        rg = self.bucket_group(b)
        out = torch.empty(bucket.numel // rg.size, dtype=self.reduce_dtype, device=send.device)
        self._rs_pending[b] = out
        if self.wire is not None:  # quantized (grad_wire.py); its residual carries to the next microbatch
            self._handles[b] = self.wire.reduce_scatter(b, out, send, rg.group, ledger=self.ledger)
        else:
            self._handles[b] = reduce_scatter(out, send, rg.group, mode="dp", ledger=self.ledger)
        if self.gatherer is not None:
            self.gatherer.after_reduce(b)
        if not self.overlap:
            self._complete(b)

    def _mark_ready_sharded(self, param, b: int) -> None:
        """Bucket `b` is issued once every parameter of it is ready: as it fills, or, after
        `mark_unused` (unused.py) marked this microbatch's unused parameters, in bucket order."""
        if not self._communicates[b]:
            return
        self._ready[b].add(param)
        if self._sharded_next is None:
            if len(self._ready[b]) == len(self.buffer.buckets[b].params):
                self._issue_sharded(b)
            return
        self._advance_sharded()

    def _advance_sharded(self) -> None:
        """Issue, in bucket order, every bucket from `_sharded_next` on that is ready."""
        buckets = self.buffer.buckets
        while self._sharded_next < len(buckets):
            n = self._sharded_next
            if self._communicates[n]:
                if len(self._ready[n]) < len(buckets[n].params):
                    return
                self._issue_sharded(n)
            self._sharded_next = n + 1

    def _finish_sharded(self) -> None:
        """Reduce what is left: buckets whose gradients are partly in (a parameter got none),
        in bucket order (the same on every rank); then wait everything. A bucket reduced over
        a group of one is averaged in place."""
        for bucket in self.buffer.buckets:
            b = bucket.index
            if not self._communicates[b]:
                if self.group_size > 1:
                    bucket.grad_data.div_(self.group_size)
            elif is_allocated(bucket.grad_data) and b not in self._handles:
                self._issue_sharded(b)
        self._wait_all()
