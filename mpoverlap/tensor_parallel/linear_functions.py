"""Column- and row-parallel linear as autograd functions over plain collectives.

Shapes (tp = group size, s = S / tp, o = out / tp for column, i = in / tp for row):

    column:  x_BSH (no SP) or x_BsH (SP)  ->  y_BSo = x_BSH @ W_oH^T (+ b_o)
    row:     x_BSi  ->  y_BSO (no SP, all-reduced) or y_BsO (SP, reduce-scattered) (+ b_O)

Column backward (Megatron's "linear with async grad all-reduce"), one Function, no hooks:

    SP:  issue all-gather of x_BsH (needed by the weight gradient)  -- under -->  dgrad GEMM
         issue reduce-scatter of dgrad                               -- under -->  wgrad GEMM
    no SP: issue all-reduce of dgrad                                 -- under -->  wgrad GEMM

With overlap=False each handle is waited right after it is issued. The arithmetic is the
same either way, so overlap on/off is bitwise identical on this path.

With overlap=True, SP and tp >= 2 the functions in collective_matmul.py are used instead.

Deferred weight gradients (a zero-bubble schedule, `comm.wgrad` inside its deferring region):
the wgrad GEMM is queued for the schedule's W action (with the gathered x under SP, which the
closure keeps alive until then), so the dgrad reduction has no GEMM left to run under in this
backward: it is waited at the end of B, hidden only as far as the pipeline's other work on
the other ranks hides it. The row-parallel GEMM (a plain op) goes through
`mpoverlap.wgrad.linear` when a deferral is attached.

Mixed precision: autocast does not reach inside a custom Function, so forward casts x, W and b
to the compute dtype (`mpoverlap.precision.compute_dtype`: bf16 under autocast) itself, before
the SP all-gather (activations travel in the compute dtype), and backward casts the incoming
gradient to the same dtype and uses W's cast again (made once a step inside step_cast_cache,
`mpoverlap.precision.step_cast`; else recast). The weight gradient comes out of a bf16 GEMM; autograd
casts it to the fp32 parameter's dtype and accumulates it in fp32 (the master gradient).

FP8 (`fp8`, precision.fp8.Fp8Gemms): the same Functions with their three GEMMs through it; the
column GEMMs quantize the gathered x (SP: one scale over the whole sequence, as the single
process's), the weight being this rank's shard with its own scale. Under SP and the tensorwise
recipe the forward's all-gather carries x in FP8 (`_fp8_cast_local`: one all-reduce MAX of the
chunks' amax, each chunk cast with the shared scale; `_fp8_all_gather`: 1 byte an element, the GEMM on it
uncast). Backward keeps this rank's e4m3 chunk and its scale (S H / tp bytes a linear, half
the compute-dtype chunk) and re-gathers it in e4m3 under the dgrad GEMM (1 byte an element on
the wire): the same values the forward gathered, the weight gradient's operand as they are
(the same tensorwise cast of the same x). The rowwise recipe's wgrad scales x along the
sequence (the other axis than its forward), so it keeps the compute-dtype gather and re-gather.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mpoverlap.precision import acc_dtype, cast, compute_dtype, no_autocast, step_cast
from mpoverlap.precision.fp8_select import dgrad_or_fp8, linear_or_fp8
from mpoverlap.tensor_parallel.comm_spec import TPComm
from mpoverlap.wgrad.deferral import WeightGradGemm
from mpoverlap.tensor_parallel.mappings import (
    Pending, all_reduce_async, reduce_from_tensor_parallel_region, reduce_scatter_to_sequence_parallel,
    seq_all_gather_async, seq_reduce_scatter_async)


def linear_backward(backward, ctx, grad_y):
    """The backward of a TP linear Function that saved (input, weight) and set `ctx.dtype` and
    `ctx.param`: `backward(ctx, x, weight, grad_y, param)` with autocast off, the weight cast as
    the forward cast it (step_cast) and the incoming gradient in the forward's compute dtype."""
    x, weight = ctx.saved_tensors
    with no_autocast(x):
        return backward(ctx, x, step_cast(weight, ctx.dtype), grad_y.to(ctx.dtype), ctx.param)


class ColumnParallelLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight_oH, bias_o, comm: TPComm, fp8=None):
        ctx.comm, ctx.has_bias, ctx.fp8 = comm, bias_o is not None, fp8
        ctx.param = weight_oH  # W accumulates into the parameter (checkpointing unpacks an alias)
        ctx.dtype = dtype = compute_dtype(x)
        x = x.to(dtype)  # before the all-gather: bf16 under autocast moves half the bytes
        ctx.fp8_gathered = comm.sequence_parallel and comm.size > 1 and fp8 is not None and fp8.gathers_input()
        if ctx.fp8_gathered:
            # This rank's e4m3 chunk and the shared scale are kept for backward (1 byte an
            # element of S/tp positions), which re-gathers them in e4m3 for the weight gradient.
            with no_autocast(x):
                q_BsH, scale = _fp8_cast_local(x, comm, fp8)
                ctx.save_for_backward(q_BsH, scale, weight_oH)
                q_BSH = _fp8_all_gather(q_BsH, comm).wait()
                return fp8.forward_quantized(q_BSH, scale, step_cast(weight_oH, dtype), cast(bias_o, dtype), dtype)
        # SP: the local chunk only, re-gathered in backward; W's cast is the step's (step_cast)
        # or made again there (not saved per microbatch: one more weight-sized tensor in flight).
        ctx.save_for_backward(x, weight_oH)
        total_x_BSH = seq_all_gather_async(x, comm).wait() if comm.sequence_parallel else x
        with no_autocast(x):
            return linear_or_fp8(fp8, total_x_BSH, step_cast(weight_oH, dtype), cast(bias_o, dtype))

    @staticmethod
    def backward(ctx, grad_y_BSo):
        *x, weight_oH = ctx.saved_tensors
        x = tuple(x) if ctx.fp8_gathered else x[0]  # (this rank's e4m3 chunk, its scale), or x
        with no_autocast(weight_oH):
            return ColumnParallelLinearFn._backward(ctx, x, step_cast(weight_oH, ctx.dtype),
                                                    grad_y_BSo.to(ctx.dtype), ctx.param)

    @staticmethod
    def _backward(ctx, x, weight_oH, grad_y_BSo, param):
        """`x`: the saved input (this rank's chunk under SP, gathered here), or this rank's
        e4m3 chunk and the forward's scale (a pair, SP: gathered here in e4m3)."""
        comm = ctx.comm
        need_dgrad = ctx.needs_input_grad[0]
        grad_y_BSo = grad_y_BSo.contiguous()
        # trace steps: 0 = all-gather of x (SP), 1 = dgrad all-reduce / reduce-scatter
        gather = scale = None
        if isinstance(x, tuple):  # SP, FP8 gathers: the kept e4m3 chunk, re-gathered in e4m3
            x, scale = x
            gather = _fp8_all_gather(x, comm)
        elif comm.sequence_parallel:
            gather = seq_all_gather_async(x, comm)
        if gather is not None:
            comm.mark(_BWD, 0, "issue")
            if not comm.overlap:
                _wait(gather, comm, 0)
        reduce = None
        if need_dgrad:
            comm.mark(_BWD, 0, "gemm_start")
            grad_x_BSH = dgrad_or_fp8(ctx.fp8, grad_y_BSo, weight_oH)  # runs under the all-gather
            comm.mark(_BWD, 0, "gemm_end")
        if gather is not None and comm.overlap:
            _wait(gather, comm, 0)
        if need_dgrad:
            reduce = (seq_reduce_scatter_async(grad_x_BSH, comm) if comm.sequence_parallel
                      else all_reduce_async(grad_x_BSH, comm))
            comm.mark(_BWD, 1, "issue")
            if not comm.overlap:
                _wait(reduce, comm, 1)
        total_x_BSH = gather.wait() if gather is not None else x
        if scale is not None:
            total_x_BSH = (total_x_BSH, scale)  # the forward's e4m3 x: the wgrad GEMM takes it uncast
        grad_w_oH = None
        wgrad = (WeightGradGemm(grad_y_BSo, total_x_BSH) if ctx.fp8 is None
                 else ctx.fp8.deferred_wgrad(grad_y_BSo, total_x_BSH))
        if not comm.defer_wgrad(param, wgrad):
            comm.mark(_BWD, 1, "gemm_start")
            grad_w_oH = wgrad()  # runs under the dgrad reduction
            comm.mark(_BWD, 1, "gemm_end")
        grad_b_o = (grad_y_BSo.reshape(-1, grad_y_BSo.shape[-1]).sum(0, dtype=acc_dtype(ctx.dtype))
                    if ctx.has_bias else None)
        grad_x = None
        if reduce is not None:
            if comm.overlap:
                _wait(reduce, comm, 1)
            grad_x = reduce.wait()
        return grad_x, grad_w_oH, grad_b_o, None, None


_BWD = "column.bwd"


def _fp8_cast_local(x_BsH, comm: TPComm, fp8):
    """The SP all-gather's FP8 cast (tensorwise): the amax of the local chunk reduced (MAX) over
    tp is the gathered sequence's, and each rank casts its chunk with that one scale: (e4m3
    x_BsH, scale), this rank's part of the single process's cast of the whole x (the cast the
    GEMMs make of a bf16 gather: the forward takes it, and the weight gradient, which quantizes
    x with the same tensorwise scale)."""
    amax = x_BsH.abs().amax().float().reshape(1)
    all_reduce_async(amax, comm, op=dist.ReduceOp.MAX).wait()
    return fp8.quantize_input(x_BsH, amax[0])


def _fp8_all_gather(q_BsH, comm: TPComm) -> Pending:
    """The SP all-gather of an e4m3 chunk, 1 byte an element (as uint8: the collectives carry
    no float8 dtype): pending e4m3 x_BSH."""
    pending = seq_all_gather_async(q_BsH.view(torch.uint8), comm)
    return Pending(pending, lambda: pending.wait().view(q_BsH.dtype))


def _wait(pending, comm: TPComm, step: int) -> None:
    pending.wait()
    comm.mark(_BWD, step, "wait")


def column_parallel_linear(x, weight_oH: torch.Tensor, bias_o: Optional[torch.Tensor],
                           comm: TPComm, fp8=None) -> torch.Tensor:
    """x_BSH (no SP) / x_BsH (SP) -> y_BSo. Chooses collective matmul when comm.use_ring.
    Also the tied output head: `column_parallel_linear(h, embedding.weight, None, comm)`.
    `fp8`: the FP8 GEMMs (precision.fp8.Fp8Gemms) or None (the compute dtype's)."""
    if comm.use_ring:
        from mpoverlap.tensor_parallel.collective_matmul import ColumnParallelRingFn
        return ColumnParallelRingFn.apply(x, weight_oH, bias_o, comm, fp8)
    return ColumnParallelLinearFn.apply(x, weight_oH, bias_o, comm, fp8)


def row_parallel_linear(x_BSi: torch.Tensor, weight_Oi: torch.Tensor,
                        bias_O: Optional[torch.Tensor], comm: TPComm, fp8=None) -> torch.Tensor:
    """x_BSi -> y_BSO (no SP) / y_BsO (SP). The bias is added once, after the reduction."""
    if comm.use_ring:
        from mpoverlap.tensor_parallel.collective_matmul import RowParallelRingFn
        y = RowParallelRingFn.apply(x_BSi, weight_Oi, comm, fp8)
    else:
        if comm.wgrad is not None or fp8 is not None:
            from mpoverlap.wgrad import linear

            partial = linear(x_BSi, weight_Oi, None, comm.wgrad, fp8)
        else:
            partial = F.linear(x_BSi, weight_Oi)  # a plain op: autocast casts it
        y = (reduce_scatter_to_sequence_parallel(partial, comm) if comm.sequence_parallel
             else reduce_from_tensor_parallel_region(partial, comm))
    return y if bias_O is None else y + bias_O
