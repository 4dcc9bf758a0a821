"""Tensor/sequence-parallel communication: async sequence collectives and autograd mappings.

Sequence-parallel layout: activations are [B, S, ...] with the sequence on dim 1; rank r of
the tp group holds x_BsH = x_BSH[:, r*s:(r+1)*s] with s = S / tp. gloo/NCCL collectives
concatenate along dim 0, so the helpers below move the tp axis to the front and back.

Every collective is a CommHandle of mode "tp" (the ledger sees it); `Pending.wait()` waits
the handle and returns the finished tensor, so callers choose when to block.
"""
from __future__ import annotations

from functools import partial
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from mpoverlap.comm.collectives import all_gather, all_reduce, reduce_scatter
from mpoverlap.comm.handle import CommHandle
from mpoverlap.tensor_parallel.comm_spec import TPComm

MODE = "tp"


class Pending:
    """An in-flight collective and the finishing step that turns its buffer into the result."""

    def __init__(self, handle: CommHandle, finish: Callable[[], torch.Tensor]) -> None:
        self.handle = handle
        self._finish = finish
        self._result: Optional[torch.Tensor] = None

    def wait(self) -> torch.Tensor:
        if self._result is None:
            self.handle.wait()
            self._result = self._finish()
            self._finish = None
        return self._result


def seq_chunk(x_BS_: torch.Tensor, c: int, s: int) -> torch.Tensor:
    """Sequence chunk c (length s) of x [B, S, ...] (a view)."""
    return x_BS_[:, c * s:(c + 1) * s]


def seq_split(x_BS_: torch.Tensor, comm: TPComm) -> torch.Tensor:
    """This rank's chunk x [B, S/tp, ...] (contiguous copy), no communication."""
    S = x_BS_.shape[1]
    if S % comm.size:
        raise ValueError(f"sequence length {S} is not divisible by tp_size={comm.size}")
    return seq_chunk(x_BS_, comm.rank, S // comm.size).contiguous()


def seq_all_gather_async(x_Bs_: torch.Tensor, comm: TPComm) -> Pending:
    """x [B, s, ...] on every rank -> x [B, tp*s, ...] (rank order along the sequence)."""
    x_Bs_ = x_Bs_.contiguous()
    B, s, rest = x_Bs_.shape[0], x_Bs_.shape[1], tuple(x_Bs_.shape[2:])
    buf_TBs_ = x_Bs_.new_empty((comm.size * B, s) + rest)
    handle = all_gather(buf_TBs_, x_Bs_, comm.group, mode=MODE, ledger=comm.ledger)
    if comm.size == 1:
        return Pending(handle, lambda: buf_TBs_)
    return Pending(handle, lambda: buf_TBs_.view((comm.size, B, s) + rest).transpose(0, 1)
                   .reshape((B, comm.size * s) + rest))


def seq_reduce_scatter_async(x_BS_: torch.Tensor, comm: TPComm) -> Pending:
    """Partial sums x [B, S, ...] on every rank -> summed chunk [B, S/tp, ...] of this rank."""
    B, S, rest = x_BS_.shape[0], x_BS_.shape[1], tuple(x_BS_.shape[2:])
    if S % comm.size:
        raise ValueError(f"sequence length {S} is not divisible by tp_size={comm.size}")
    s = S // comm.size
    in_TBs_ = x_BS_.reshape((B, comm.size, s) + rest).transpose(0, 1).contiguous()
    out_Bs_ = x_BS_.new_empty((B, s) + rest)
    handle = reduce_scatter(out_Bs_, in_TBs_.view((comm.size * B, s) + rest), comm.group,
                            mode=MODE, ledger=comm.ledger)
    return Pending(handle, lambda: out_Bs_)


def all_reduce_async(x: torch.Tensor, comm: TPComm, op=dist.ReduceOp.SUM) -> Pending:
    """Sum (or `op`) of x over the tp group, in place on a contiguous x."""
    x = x.contiguous()
    handle = all_reduce(x, comm.group, mode=MODE, ledger=comm.ledger, op=op)
    return Pending(handle, lambda: x)


# ---- autograd mappings (every collective waited at once: nothing to hide it under) ---------

class CopyToTensorParallelRegion(torch.autograd.Function):
    """Forward identity; backward all-reduce of the gradient (replicated input, split weights)."""

    @staticmethod
    def forward(ctx, x, comm: TPComm):
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce_async(grad.clone(), ctx.comm).wait(), None


class ReduceFromTensorParallelRegion(torch.autograd.Function):
    """Forward all-reduce of partial sums; backward identity."""

    @staticmethod
    def forward(ctx, x, comm: TPComm):
        return all_reduce_async(x.clone(), comm).wait()

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ScatterToSequenceParallel(torch.autograd.Function):
    """[B, S, H] replicated -> own chunk [B, S/tp, H]; backward all-gather."""

    @staticmethod
    def forward(ctx, x, comm: TPComm):
        ctx.comm = comm
        return seq_split(x, comm)

    @staticmethod
    def backward(ctx, grad):
        return seq_all_gather_async(grad, ctx.comm).wait(), None


class GatherFromSequenceParallel(torch.autograd.Function):
    """[B, S/tp, H] -> [B, S, H]. Backward: reduce-scatter when the consumer is a TP region
    whose gradient is a partial sum (grad_is_partial=True), else keep the own chunk."""

    @staticmethod
    def forward(ctx, x, comm: TPComm, grad_is_partial: bool):
        ctx.comm, ctx.grad_is_partial = comm, grad_is_partial
        return seq_all_gather_async(x, comm).wait()

    @staticmethod
    def backward(ctx, grad):
        if ctx.grad_is_partial:
            return seq_reduce_scatter_async(grad, ctx.comm).wait(), None, None
        return seq_split(grad, ctx.comm), None, None


class ReduceScatterToSequenceParallel(torch.autograd.Function):
    """Partial sums [B, S, H] -> summed own chunk [B, S/tp, H]; backward all-gather."""

    @staticmethod
    def forward(ctx, x, comm: TPComm):
        ctx.comm = comm
        return seq_reduce_scatter_async(x, comm).wait()

    @staticmethod
    def backward(ctx, grad):
        return seq_all_gather_async(grad, ctx.comm).wait(), None


def copy_to_tensor_parallel_region(x, comm: TPComm):
    return CopyToTensorParallelRegion.apply(x, comm)


# The mappings below move a tensor in the dtype they are handed (and its gradient in the
# gradient's dtype): the producer chooses. Under bf16 autocast a row-parallel GEMM's partial
# sums are bf16 (the single process rounds that GEMM's output to bf16 too) and travel in bf16;
# the vocab-parallel embedding's output is fp32, the residual stream's dtype in every layout
# (docs/invariants.md, "The bf16 residual stream"), and is reduced in fp32 (exact: one rank
# holds each row, the others zeros), as the single process never rounds it.

def reduce_from_tensor_parallel_region(x, comm: TPComm):
    return ReduceFromTensorParallelRegion.apply(x, comm)


def scatter_to_sequence_parallel(x_BSH, comm: TPComm):
    """x_BSH (replicated) -> x_BsH, s = S / tp."""
    return ScatterToSequenceParallel.apply(x_BSH, comm)


def gather_from_sequence_parallel(x_BsH, comm: TPComm, grad_is_partial: bool = True):
    """x_BsH -> x_BSH."""
    return GatherFromSequenceParallel.apply(x_BsH, comm, grad_is_partial)


def reduce_scatter_to_sequence_parallel(x_BSH, comm: TPComm):
    """partial x_BSH -> summed x_BsH."""
    return ReduceScatterToSequenceParallel.apply(x_BSH, comm)


def allreduce_sequence_parallel_grads(params, tp_group, ledger=None, overlap: bool = False,
                                      grads: Optional[List[torch.Tensor]] = None) -> List[CommHandle]:
    """Sum over the tp group the gradients of parameters replicated across it but fed
    sequence-sharded activations (norm weights, row-parallel biases under SP): each rank
    holds the gradient of its sequence chunk only. In place on `p.grad`, with one all-reduce
    of one flat buffer for all of them (a norm weight is a few KB: one collective per
    parameter would pay the latency 2 x layers times). overlap=False: waited before
    returning; True: the caller waits the returned handles (before the optimizer and before
    DP reduces these grads); the gradients hold the sums once the handle is waited.
    `grads`: the tensors to sum instead of the `.grad`s (ZeRO-2/3 pass their shards' parts;
    empty parts are skipped, alike on every TP peer)."""
    if tp_group is None:
        return []
    grads = ([p.grad for p in params if p.grad is not None] if grads is None
             else [g for g in grads if g.numel() > 0])
    if not grads:
        return []
    for g in grads:
        if not g.is_contiguous():
            raise ValueError("allreduce_sequence_parallel_grads needs contiguous gradients")
    by_dtype = {}
    for g in grads:  # one buffer per dtype (a flat buffer has one)
        by_dtype.setdefault(g.dtype, []).append(g)
    handles: List[CommHandle] = []
    for group_grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in group_grads])
        h = all_reduce(flat, tp_group, mode=MODE, ledger=ledger,
                       on_done=partial(_copy_back, flat, group_grads))
        if not overlap:
            h.wait()
        handles.append(h)
    return handles


def _copy_back(flat: torch.Tensor, grads: List[torch.Tensor]) -> None:
    torch._foreach_copy_(grads, [v.view_as(g) for v, g in zip(flat.split([g.numel() for g in grads]), grads)])
