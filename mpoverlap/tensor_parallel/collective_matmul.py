"""Collective matmul: SP all-gather + GEMM and GEMM + reduce-scatter as tp ring steps of p2p.

Rank r of a ring of tp ranks sends to r+1 and receives from r-1 (global peers from
comm.ranks, so it works on gloo and NCCL). Sequence chunks are [B, s, ...], s = S / tp.

ring_all_gather_apply (all-gather GEMM): at step k rank r holds chunk (r - k) mod tp; it
    issues the send of that chunk to r+1 (and the receive of the next one from r-1), then
    runs the GEMM on the held chunk while the transfer is in flight.
ring_reduce_scatter (GEMM reduce-scatter): at step k rank r computes its partial for chunk
    (r - 1 - k) mod tp, adds the partial sum received from r-1, and sends the sum on to r+1;
    that send is in flight under the next step's GEMM. After tp steps the sum that arrives
    is the full sum for chunk r.

Numerics vs the plain collectives: per-chunk GEMMs and ring-order sums give the same values
up to fp32 rounding (not bitwise): the weight gradient sums chunk GEMMs, and the reduction
order differs from the backend's reduce-scatter.

Mixed precision (see mpoverlap/precision/): autocast does not reach into these Functions, so
forward casts to the compute dtype itself (the chunks that travel the ring and the gathered
output are bf16 under autocast) and backward recasts W and the incoming gradient. Weight
gradient terms of the chunks are bf16 GEMMs summed in an fp32 accumulator (an in-place
`addmm_` would need every operand in one dtype).

FP8 (`fp8`, precision.fp8.Fp8Gemms): each ring chunk's GEMM is its own FP8 GEMM, its operands
scaled per chunk (the chunk is all a step holds: a scale over the gathered tensor would wait
for the whole ring); the emulation runs the same chunks with the same scales.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import torch

from mpoverlap.comm.collectives import send_recv
from mpoverlap.comm.handle import CommHandle
from mpoverlap.precision import acc_dtype, cast, compute_dtype, no_autocast, step_cast
from mpoverlap.precision.fp8_select import dgrad_or_fp8, linear_or_fp8
from mpoverlap.tensor_parallel.comm_spec import TPComm
from mpoverlap.tensor_parallel.linear_functions import linear_backward
from mpoverlap.tensor_parallel.mappings import MODE, seq_chunk


def ring_pass(sends: Sequence[torch.Tensor], comm: TPComm, label: str, step: int
              ) -> Tuple[List[torch.Tensor], CommHandle]:
    """Send each tensor to the next rank and receive same-shaped tensors from the previous
    one, as one batch of p2p ops (same order on every rank, so messages match in order)."""
    recvs = [torch.empty_like(t) for t in sends]
    handle = send_recv([(t, comm.next_peer) for t in sends], [(t, comm.prev_peer) for t in recvs],
                       comm.group, mode=MODE, ledger=comm.ledger)
    comm.mark(label, step, "issue")
    return recvs, handle


def _wait(handle: CommHandle, comm: TPComm, label: str, step: int) -> None:
    handle.wait()
    comm.mark(label, step, "wait")


def ring_all_gather_apply(x_Bs_: torch.Tensor, comm: TPComm, fn: Callable[[int, torch.Tensor], None],
                          label: str) -> None:
    """Call fn(c, x_c) for every rank's chunk c (own first) while the next chunk travels."""
    held = x_Bs_.contiguous()
    for k in range(comm.size):
        handle = None
        if k < comm.size - 1:
            (incoming,), handle = ring_pass([held], comm, label, k)
        comm.mark(label, k, "gemm_start")
        fn((comm.rank - k) % comm.size, held)
        comm.mark(label, k, "gemm_end")
        if handle is not None:
            _wait(handle, comm, label, k)
            held = incoming


def ring_reduce_scatter(partial_fn: Callable[[int], torch.Tensor], comm: TPComm,
                        label: str) -> torch.Tensor:
    """Sum over the group of partial_fn(r) for this rank's chunk r; partial_fn(c) is this
    rank's contribution [B, s, ...] to chunk c."""
    handle, incoming, part = None, None, None
    for k in range(comm.size):
        comm.mark(label, k, "gemm_start")
        part = partial_fn((comm.rank - 1 - k) % comm.size)
        comm.mark(label, k, "gemm_end")
        if handle is not None:
            _wait(handle, comm, label, k - 1)
            part = part + incoming[0]
        if k < comm.size - 1:
            incoming, handle = ring_pass([part], comm, label, k)
    return part


def _accumulate(acc_oH: Optional[torch.Tensor], g_2d: torch.Tensor, x_2d: torch.Tensor, fp8=None) -> torch.Tensor:
    """acc + g^T x, one chunk's weight-gradient term. fp32 operands: the in-place addmm_ as
    before (bitwise unchanged). bf16: the term is a bf16 GEMM, added into an fp32 accumulator
    (the chunks' sum, like the gradient buffer it ends in, is fp32). FP8: the chunk's own FP8
    GEMM (its operands scaled per chunk), fp32 out, added the same way."""
    if fp8 is not None:
        term = fp8.wgrad(g_2d, x_2d)
        return term if acc_oH is None else acc_oH.add_(term)
    if g_2d.dtype == acc_dtype(g_2d.dtype):
        return g_2d.t().matmul(x_2d) if acc_oH is None else acc_oH.addmm_(g_2d.t(), x_2d)
    term = g_2d.t().matmul(x_2d)
    if acc_oH is None:
        return term.to(acc_dtype(term.dtype))
    return acc_oH.add_(term)


def _accumulate_all(pairs, fp8=None) -> torch.Tensor:
    """The sum of g^T x over the (g_2d, x_2d) chunk pairs, in ring order (as the ring would)."""
    acc = None
    for g_2d, x_2d in pairs:
        acc = _accumulate(acc, g_2d, x_2d, fp8)
    return acc


class ColumnParallelRingFn(torch.autograd.Function):
    """x_BsH -> y_BSo. Backward: one ring that passes the x chunks (for the weight gradient)
    and the dgrad partial sums (reduce-scatter) together; each step's transfer runs under the
    step's weight-gradient GEMM and the next step's dgrad GEMM."""

    @staticmethod
    def forward(ctx, x_BsH, weight_oH, bias_o, comm: TPComm, fp8=None):
        ctx.comm, ctx.has_bias, ctx.fp8 = comm, bias_o is not None, fp8
        ctx.param = weight_oH  # W accumulates into the parameter (checkpointing unpacks an alias)
        ctx.dtype = dtype = compute_dtype(x_BsH)
        x_BsH = x_BsH.to(dtype)  # the chunks travel the ring in the compute dtype
        ctx.save_for_backward(x_BsH, weight_oH)
        B, s = x_BsH.shape[0], x_BsH.shape[1]
        y_BSo = x_BsH.new_empty(B, s * comm.size, weight_oH.shape[0])
        w_oH, b_o = step_cast(weight_oH, dtype), cast(bias_o, dtype)

        def gemm(c, x_c):
            seq_chunk(y_BSo, c, s).copy_(linear_or_fp8(fp8, x_c, w_oH, b_o))

        with no_autocast(x_BsH):
            ring_all_gather_apply(x_BsH, comm, gemm, "column.fwd")
        return y_BSo

    @staticmethod
    def backward(ctx, grad_y_BSo):
        return linear_backward(ColumnParallelRingFn._backward, ctx, grad_y_BSo)

    @staticmethod
    def _backward(ctx, x_BsH, weight_oH, grad_y_BSo, param):
        comm, s, fp8 = ctx.comm, x_BsH.shape[1], ctx.fp8
        need_dgrad = ctx.needs_input_grad[0]
        held, handle, incoming = x_BsH.contiguous(), None, None
        part: Optional[torch.Tensor] = None
        grad_w_oH: Optional[torch.Tensor] = None
        label = "column.bwd"
        # Deferred (zero-bubble W): the ring still brings every x chunk (the dgrad partial sums
        # travel with them); the (grad chunk, x chunk) pairs wait for the W action.
        deferred = [] if comm.wgrad is not None and comm.wgrad.active else None
        for k in range(comm.size):
            if need_dgrad:
                comm.mark(label, k, "gemm_start")
                part = dgrad_or_fp8(fp8, seq_chunk(grad_y_BSo, (comm.rank - 1 - k) % comm.size, s), weight_oH)
                comm.mark(label, k, "gemm_end")
            if handle is not None:
                _wait(handle, comm, label, k - 1)
                held = incoming[0]
                if need_dgrad:
                    part = part + incoming[1]
            if k < comm.size - 1:
                incoming, handle = ring_pass([held, part] if need_dgrad else [held], comm, label, k)
            else:
                handle = None
            g_c = seq_chunk(grad_y_BSo, (comm.rank - k) % comm.size, s)
            g_2d, x_2d = g_c.reshape(-1, g_c.shape[-1]), held.reshape(-1, held.shape[-1])
            if deferred is not None:
                deferred.append((g_2d, x_2d))
                continue
            comm.mark(label, k, "gemm_start")
            grad_w_oH = _accumulate(grad_w_oH, g_2d, x_2d, fp8)
            comm.mark(label, k, "gemm_end")
        if deferred is not None and not comm.defer_wgrad(param, lambda: _accumulate_all(deferred, fp8)):
            grad_w_oH = _accumulate_all(deferred, fp8)
        grad_b_o = (grad_y_BSo.reshape(-1, grad_y_BSo.shape[-1]).sum(0, dtype=acc_dtype(ctx.dtype))
                    if ctx.has_bias else None)
        return part if need_dgrad else None, grad_w_oH, grad_b_o, None, None


class RowParallelRingFn(torch.autograd.Function):
    """x_BSi -> y_BsO (GEMM reduce-scatter ring). Backward: the all-gather of grad_y_BsO as a
    ring; each arriving chunk gives its dgrad rows and its weight-gradient term."""

    @staticmethod
    def forward(ctx, x_BSi, weight_Oi, comm: TPComm, fp8=None):
        ctx.comm, ctx.fp8 = comm, fp8
        ctx.param = weight_Oi  # W accumulates into the parameter (checkpointing unpacks an alias)
        ctx.dtype = dtype = compute_dtype(x_BSi)
        x_BSi = x_BSi.to(dtype)  # the partial sums travel the ring in the compute dtype
        ctx.save_for_backward(x_BSi, weight_Oi)
        S = x_BSi.shape[1]
        if S % comm.size:
            raise ValueError(f"sequence length {S} is not divisible by tp_size={comm.size}")
        s = S // comm.size
        w_Oi = step_cast(weight_Oi, dtype)
        with no_autocast(x_BSi):
            return ring_reduce_scatter(lambda c: linear_or_fp8(fp8, seq_chunk(x_BSi, c, s), w_Oi),
                                       comm, "row.fwd")

    @staticmethod
    def backward(ctx, grad_y_BsO):
        return linear_backward(RowParallelRingFn._backward, ctx, grad_y_BsO)

    @staticmethod
    def _backward(ctx, x_BSi, weight_Oi, grad_y_BsO, param):
        comm, s, fp8 = ctx.comm, grad_y_BsO.shape[1], ctx.fp8
        need_dgrad = ctx.needs_input_grad[0]
        grad_x_BSi = x_BSi.new_empty(x_BSi.shape) if need_dgrad else None
        acc: List[Optional[torch.Tensor]] = [None]
        # Deferred (zero-bubble W): the arriving grad chunks are kept for the W action.
        deferred = [] if comm.wgrad is not None and comm.wgrad.active else None

        def gemms(c, g_c):
            if need_dgrad:
                seq_chunk(grad_x_BSi, c, s).copy_(dgrad_or_fp8(fp8, g_c, weight_Oi))
            x_c = seq_chunk(x_BSi, c, s)
            g_2d, x_2d = g_c.reshape(-1, g_c.shape[-1]), x_c.reshape(-1, x_c.shape[-1])
            if deferred is not None:
                deferred.append((g_2d, x_2d))
            else:
                acc[0] = _accumulate(acc[0], g_2d, x_2d, fp8)

        ring_all_gather_apply(grad_y_BsO, comm, gemms, "row.bwd")
        if deferred is not None and not comm.defer_wgrad(param, lambda: _accumulate_all(deferred, fp8)):
            acc[0] = _accumulate_all(deferred, fp8)
        return grad_x_BSi, acc[0], None, None
