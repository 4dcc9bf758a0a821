"""One-step-delayed data parallelism (`overlap.dp_delay=1`): the DelayedGrads methods of
DataParallel (a mixin, like sharded_grads.ShardedGrads).

Each communicating bucket gets a second gradient buffer of its own, `_send[b]` (in the
reduction dtype), that holds the reduction in flight, so the next step's backward can
accumulate into the ordinary gradient buffer meanwhile. When bucket b is ready in the last
microbatch of step t+1 (as in the undelayed path, per bucket during backward, in bucket order):

    1. the handle of step t's bucket b is waited (it ran under step t+1's forward and backward
       up to here); its result (`_send[b]`, or ZeRO-1's `_rs_out[b]`) is copied to a scratch
    2. step t+1's bucket, averaged in fp32, is copied into `_send[b]` and its collective issued;
       the handle stays in flight across the step boundary (`carry_over`)
    3. step t's reduced bucket is copied from the scratch into the gradient buffer (ZeRO-1: into
       this rank's shard of it), which the optimizer, the clipping and the non-finite check read

So after `finish_grad_sync()` of step t+1 the gradient buffer holds step t's reduced gradient:
step t+1's update applies step t's gradient. The first step has no previous gradient: its
buffer is zero and `has_delayed_grad` is False (the trainer makes no update there). A bucket
reduced over a group of one (dp 1) takes the same path without a collective, which makes dp 1
the single-process reference of the same math. A checkpoint waits the reductions in flight
and saves `delayed_result(b)` (checkpoint/train_state.py); a resumed run applies it next.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch

from mpoverlap.comm.collectives import all_reduce, reduce_scatter
from mpoverlap.comm.handle import CommHandle


class DelayedGrads:
    def _init_delayed(self, delay: int) -> None:
        if delay not in (0, 1):
            raise ValueError(f"delay={delay!r}: 0 (reduce within the step) or 1 (one step delayed)")
        self.delay = int(delay)
        self.has_delayed_grad = False
        self._delayed: Dict[int, CommHandle] = {}
        self._scratch: Optional[torch.Tensor] = None
        if not self.delay:
            return
        if self.shard_grads or self.wire is not None:
            raise ValueError("delay=1 supports sharding none/optim with an fp32 or bf16 reduction only")
        grad_dtype = self.buffer.buckets[0].grad_data.dtype
        # The second buffer: every bucket's own (a group of one keeps the gradient's dtype: it
        # is never rounded there, as without the delay).
        self._send = [s if s is not None else torch.zeros(
            b.numel, dtype=self.reduce_dtype if c else grad_dtype, device=b.grad_data.device)
            for s, b, c in zip(self._send, self.buffer.buckets, self._communicates)]
        self._scratch = torch.empty(max(b.numel for b in self.buffer.buckets), dtype=grad_dtype,
                                    device=self.buffer.buckets[0].grad_data.device)

    def _result_of(self, b: int) -> torch.Tensor:
        """Where bucket b's reduced gradient lands: ZeRO-1's shard output, else the second buffer."""
        return self._rs_out[b] if self._rs_out[b] is not None else self._send[b]

    def _issue_delayed(self, b: int) -> None:
        bucket = self.buffer.buckets[b]
        self._issued[b] = True
        self._next = b + 1
        if self.group_size > 1:
            bucket.grad_data.div_(self.group_size)
        previous = self._delayed.pop(b, None)
        if previous is not None:
            previous.wait()
        result = self._result_of(b)
        scratch = self._scratch[:result.numel()]
        if self.has_delayed_grad:
            scratch.copy_(result)
        self._send[b].copy_(bucket.grad_data)
        rg = self.bucket_group(b)
        if rg.group is not None:
            if self._rs_out[b] is not None:
                handle = reduce_scatter(self._rs_out[b], self._send[b], rg.group, mode="dp", ledger=self.ledger)
            else:
                handle = all_reduce(self._send[b], rg.group, mode="dp", ledger=self.ledger)
            if self.overlap:
                self._delayed[b] = handle.carry_over()  # waited when step t+1's bucket b is ready
            else:
                handle.wait()
        if not self.has_delayed_grad:
            bucket.grad_data.zero_()  # the first step: no previous gradient to apply
        elif self._rs_out[b] is not None:
            lo, hi = self.shard_range(b)
            self.buffer.grad_data[lo:hi].copy_(scratch)
        else:
            bucket.grad_data.copy_(scratch)

    def _finish_delayed(self) -> None:
        """End of step t+1's backward: every bucket not yet issued is; afterwards the buffer
        holds step t's reduced gradient (zero at the first step)."""
        had = self.has_delayed_grad
        while self._next < len(self._issued):
            self._issue_delayed(self._next)
        self.applies_delayed_grad = had
        self.has_delayed_grad = True

    def wait_delayed(self) -> None:
        """Wait every delayed reduction still in flight (a checkpoint, the end of a run)."""
        for b in sorted(self._delayed):
            self._delayed.pop(b).wait()

    def delayed_result(self, b: int):
        """(tensor, its first element's buffer offset): where bucket b's delayed gradient is
        held (ZeRO-1: this rank's shard of it). A checkpoint saves and loads it in place."""
        if self._rs_out[b] is not None:
            return self._rs_out[b], self.shard_range(b)[0]
        return self._send[b], self.buffer.buckets[b].offset

    def loaded_delayed_grad(self) -> None:
        """A checkpoint filled the delayed gradient: the next step applies it."""
        self.has_delayed_grad = True
