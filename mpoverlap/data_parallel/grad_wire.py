"""Quantized gradient reduction (`train.grad_reduce_dtype=int8|fp8`) and its error feedback.

A bucket in a wire format is reduced through comm/quantized.py, issued from the same hooks at
the same moment as an fp32 or bf16 bucket (bucket_issue.py), after the same averaging (the
bucket is divided by the dp x cp size first, so the math is the fp32 path's up to the
quantization):

    ZeRO-1/2/3, expert buckets   quantized reduce-scatter (one all-to-all): one hop
    plain data parallel          quantized reduce-scatter, then a quantized all-gather of the
                                 reduced fp32 shard (every rank writes the dequantized gather,
                                 its owner too, so the replicas agree): two hops

Every collective sums in fp32 on the receiver; nothing is summed in the wire dtype. A bucket
is padded to a multiple of its group's size (buffer.py's `pad_to`), so it splits into equal
shards.

Block: GRAD_BLOCK = 512 elements a scale. The scales then cost 4/512 = 0.8% of the int8 bytes
(1.008 bytes an element), while a block stays small against a parameter (the smallest GEMM
weight of a real model holds ~10^5 elements), so one large gradient entry (an embedding row of a
frequent token, a norm weight) coarsens at most 511 neighbours' resolution, not a whole
weight's. DeepEP's 128 (for activations, whose rows are that short) costs 3% in scales; ZeRO++'s
~4K-element weight blocks are tuned for weights, whose range varies less than gradients'.

Error feedback (`train.grad_error_feedback`): each rank keeps, per bucket, the fp32 residual of
what its quantized send lost and adds it to the next send of the bucket before quantizing
(comm/quantized.py `residual`): `sent` [numel] for the reduce-scatter (every level; under
ZeRO-2/3 the bucket is sent every microbatch, and each send carries the previous one's
residual), and under plain data parallelism also `owned` [numel / g], the owner's residual of
the reduced shard it quantizes for the gather. What the quantization drops then reaches the
weights a step later instead of never: the accumulated error stays bounded by one step's
instead of growing with the steps. Memory: 4 bytes a parameter per rank (4 (1 + 1/g) under
plain data parallelism). The residuals are training state: checkpointed per rank (see
checkpoint/residuals.py).
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch

from mpoverlap.comm.handle import CommHandle
from mpoverlap.comm.quantized import quantized_all_gather, quantized_reduce_scatter
from mpoverlap.comm.wire import FORMATS, wire_format
from mpoverlap.data_parallel.reduce_groups import ReduceGroup

GRAD_BLOCK = 512
ERROR_FEEDBACK = ("auto", "true", "false")


def is_wire(reduce_dtype: str) -> bool:
    """A gradient reduction dtype that is a quantized wire format (int8, fp8)."""
    return str(reduce_dtype) in FORMATS


def error_feedback_on(requested, reduce_dtype: str) -> bool:
    """train.grad_error_feedback as resolved: auto = on for a wire format, off otherwise. `true`
    with fp32/bf16 has nothing to feed back; the rule dp.grad_error_feedback refuses it (this
    raises if it got here)."""
    asked = str(requested).lower()
    if asked not in ERROR_FEEDBACK:
        raise ValueError(f"train.grad_error_feedback={requested}: expected one of {', '.join(ERROR_FEEDBACK)}")
    if asked == "auto":
        return is_wire(reduce_dtype)
    if asked == "true" and not is_wire(reduce_dtype):
        raise ValueError(f"train.grad_error_feedback=true with train.grad_reduce_dtype={reduce_dtype}: nothing is "
                         "quantized, so there is no residual; set train.grad_error_feedback=auto")
    return asked == "true"


def wire_bytes_per_element(block: int = GRAD_BLOCK) -> float:
    """What one gradient element costs on the wire per hop (1 byte, plus 4 a block)."""
    return 1.0 + 4.0 / block


class GradWire:
    """The quantized reductions of a DataParallel's buckets in format `fmt`; `sizes[b]`: the
    group size of bucket b (None: not communicated), `two_hops`: plain data parallelism."""

    def __init__(self, fmt: str, *, numels: List[int], sizes: List[Optional[int]], two_hops: bool,
                 error_feedback: bool, device: torch.device, block: int = GRAD_BLOCK) -> None:
        self.fmt_name = fmt
        self.fmt = wire_format(fmt)
        self.block = block
        self.two_hops = two_hops
        self.error_feedback = bool(error_feedback)
        self.sent: Dict[int, torch.Tensor] = {}
        self.owned: Dict[int, torch.Tensor] = {}
        if self.error_feedback:
            for b, (n, g) in enumerate(zip(numels, sizes)):
                if g is None:
                    continue
                self.sent[b] = torch.zeros(n, dtype=torch.float32, device=device)
                if two_hops:
                    self.owned[b] = torch.zeros(n // g, dtype=torch.float32, device=device)

    def reduce_scatter(self, b: int, out: torch.Tensor, send: torch.Tensor, group, *, ledger) -> CommHandle:
        return quantized_reduce_scatter(out, send, group, fmt=self.fmt, block=self.block, mode="dp", ledger=ledger,
                                        residual=self.sent.get(b))

    def all_gather(self, b: int, out: torch.Tensor, shard: torch.Tensor, group, *, ledger) -> CommHandle:
        return quantized_all_gather(out, shard, group, fmt=self.fmt, block=self.block, mode="dp", ledger=ledger,
                                    residual=self.owned.get(b))

    def residual_bytes(self) -> int:
        """The residuals' memory on this rank (DataParallelAdamW.memory_bytes reports it)."""
        return sum(t.numel() * 4 for d in (self.sent, self.owned) for t in d.values())


class QuantizedBuckets:
    """The quantized-bucket methods of DataParallel (a mixin, like sharded_grads.ShardedGrads:
    they use the wrapper's buffer, groups, handles and `wire`)."""

    def _issue_wire(self, b: int, rg: ReduceGroup) -> None:
        """A quantized bucket: its reduce-scatter now; under plain data parallelism the gather of
        every earlier bucket's reduced shard first (their reduce-scatters had this bucket's share
        of backward to run under), this bucket's when the next is issued or at the sync."""
        for prev in list(self._first_hop):
            self._second_hop(prev)
        grad = self.buffer.buckets[b].grad_data
        handle = self.wire.reduce_scatter(b, self._rs_out[b], grad, rg.group, ledger=self.ledger)
        if self.distributed_optimizer:
            self._handles[b] = handle
        else:
            self._first_hop[b] = self._handles[b] = handle
        if not self.overlap:
            self._complete(b)

    def _second_hop(self, b: int) -> None:
        """Plain DP, quantized: wait bucket b's reduce-scatter, gather its reduced shard into it."""
        self._first_hop.pop(b).wait()
        rg = self.bucket_group(b)
        self._handles[b] = self.wire.all_gather(b, self.buffer.buckets[b].grad_data, self._rs_out[b], rg.group,
                                                ledger=self.ledger)
