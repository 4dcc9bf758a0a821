"""Readiness and in-order issue of DataParallel's bucket reductions: the BucketIssue methods of
DataParallel (ddp.py; a mixin, like sharded_grads.ShardedGrads), which use the wrapper's
buffer, groups, scratch tensors, handles and ledger.

Gradients accumulate in place into the flat gradient buffer (see `buffer.py`). During the
backward of the LAST microbatch of a step, each parameter's post-accumulate hook marks it
ready; when every parameter of a bucket is ready, the bucket's collective is issued as a
CommHandle of mode "dp":

    all-reduce       grad_data[numel_b]                     (plain data parallel)
    reduce-scatter   grad_data[numel_b] -> shard[numel_b/g]  (distributed optimizer, ZeRO-1)

With `overlap=True` the handle is left in flight under the rest of backward and waited in
`finish_grad_sync()`; with `overlap=False` it is waited the moment it is issued. Both modes
run the same ops on the same data, so their gradients are bitwise identical.

Reduction dtype (`train.grad_reduce_dtype`): gradients always accumulate in the fp32 buffer.
With `reduce_dtype=torch.bfloat16` a bucket is averaged in fp32, copied into a bf16 scratch of
its own, reduced in bf16 (half the bytes on the wire) and copied back into the fp32 buffer
when its handle completes; the optimizer still sees fp32 gradients. With a wire format
(`grad_wire="int8"|"fp8"`, grad_wire.py) a bucket is averaged in fp32 the same way and
quantized when it is ready: a quantized reduce-scatter (all levels; every bucket is then padded
to its group's size), under plain data parallelism followed by a quantized all-gather of the
reduced shard, issued when the next bucket is (the reduce-scatter had that bucket's backward to
hide under) or at the latest in `finish_grad_sync()`; error feedback keeps each rank's residuals.

Averaging: every bucket is divided by the dp x cp size right before the SUM collective
(gloo has no AVG). Buckets are issued strictly in bucket order, so the sequence of
collectives is identical on every rank even if a bucket is held back by a parameter that got
no gradient: `mark_unused(loss)` after each forward marks such parameters ready (unused.py);
without it that bucket, with everything after it, is issued by `finish_grad_sync()`.

Deferred weight gradients (zero-bubble pipelines, mpoverlap/wgrad): `weight_grads` is the
model's WeightGradDeferral. A deferred weight's gradient reaches these hooks from the W action
(which accumulates it through autograd), so a bucket is ready when its last W has run; the
hook calls autograd makes in B for a weight whose gradient was withheld carry nothing and are
skipped.
"""
from __future__ import annotations

import warnings

import torch.nn as nn

from mpoverlap.comm.collectives import all_reduce, reduce_scatter


class BucketIssue:
    """The gradient hooks, the in-order issue and the completion of each bucket's collective
    (see this module's docstring)."""

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if self.weight_grads is not None and self.weight_grads.withheld(param):
            return  # B deferred this gradient to a W action: nothing was accumulated
        view = self._grad_views[param]
        grad = param.grad
        if grad.data_ptr() != view.data_ptr() or grad.shape != view.shape:
            # Autograd replaced .grad (it was set to None, or create_graph=True): the new
            # tensor holds the whole accumulated gradient, so it becomes the buffer's content.
            view.copy_(grad)
            param.grad = view
        if param in self._held_params:  # more of its gradient comes later in this backward
            if param not in self._held:
                self._held.append(param)
            return
        self._mark_ready(param)

    def hold_ready(self, params) -> None:
        """Forward/backward pairing (mpoverlap/pairing) runs one microbatch's backward as several
        autograd calls; a parameter used in two of them (the tied embedding: embedding and head)
        accumulates twice. Its readiness waits for `release_ready`, at the end of that backward."""
        self._held_params = set(params)

    def release_ready(self) -> None:
        held, self._held = self._held, []
        for param in held:
            self._mark_ready(param)

    def _mark_ready(self, param: nn.Parameter) -> None:
        b = self.buffer.index[param][2]
        if self.shard_grads:
            return self._mark_ready_sharded(param, b)
        if self._issued[b]:
            raise self._arrived_after_reduce(param, b)
        if not self._is_last:
            return
        self._ready[b].add(param)
        # In-order issue: same collective sequence on every rank whatever the timing.
        while (self._next < len(self._issued)
               and len(self._ready[self._next]) == len(self.buffer.buckets[self._next].params)):
            self._issue(self._next)

    def _issue(self, b: int) -> None:
        if self.delay:
            return self._issue_delayed(b)
        bucket = self.buffer.buckets[b]
        self._issued[b] = True
        self._next = b + 1
        if self.group_size > 1:  # dense and expert buckets both average over dp x cp
            bucket.grad_data.div_(self.group_size)
        rg = self.bucket_group(b)
        if rg.group is None:
            return  # a group of one: nothing to add up
        if self.wire is not None:
            self._issue_wire(b, rg)
            return
        send = bucket.grad_data
        if self._send[b] is not None:
            send = self._send[b]
            send.copy_(bucket.grad_data)  # averaged in fp32 first, then rounded once
        if self.distributed_optimizer:
            handle = reduce_scatter(self._rs_out[b], send, rg.group, mode="dp", ledger=self.ledger)
        else:
            handle = all_reduce(send, rg.group, mode="dp", ledger=self.ledger)
        self._handles[b] = handle
        if not self.overlap:
            self._complete(b)

    def _complete(self, b: int) -> None:
        if b in self._first_hop:
            self._second_hop(b)
        handle = self._handles[b]
        if self.shard_grads:
            del self._handles[b]
            handle.wait()
            self.grad_shard(b).add_(self._rs_pending.pop(b))
            self._free_grad_bucket(b)
            return
        if handle.waited:
            return
        handle.wait()
        if self.distributed_optimizer:
            lo, hi = self.shard_range(b)
            self.buffer.grad_data[lo:hi].copy_(self._rs_out[b])  # ZeRO-1: one flat buffer
        elif self._send[b] is not None:  # bf16 (a quantized bucket's gather wrote the bucket itself)
            self.buffer.buckets[b].grad_data.copy_(self._send[b])

    def _wait_all(self) -> None:
        for b in sorted(self._handles):
            if b in self._handles:
                self._complete(b)

    def _note_missing_grads(self) -> None:
        """Warn once when overlap was asked for but a bucket could not be issued in backward
        because some parameter got no gradient (it and every later bucket were not hidden)."""
        got_any = any(self._ready)
        if not (self.overlap and got_any and not self._warned_unused):
            return
        missing = [self.buffer.name_of[p] for b in range(self._next, len(self._issued))
                   for p in self.buffer.buckets[b].params if p not in self._ready[b]]
        if missing:
            self._warned_unused = True
            warnings.warn(
                f"DataParallel: {len(missing)} parameter(s) got no gradient in the last "
                f"microbatch ({', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}); "
                f"buckets {self._next}..{len(self._issued) - 1} were reduced at "
                "finish_grad_sync() without overlap", RuntimeWarning, stacklevel=3)
