"""Deferrable linear and embedding: the plain (non-tensor-parallel) projections of the model,
the tied output head, the row-parallel GEMM and the experts run through these once a
deferral is attached (`attach_deferral`); the tensor-parallel Functions defer in their own
backward (linear_functions.py, collective_matmul.py) through `TPComm.wgrad`.

    linear(x [..., in], weight [out, in], bias [out] | None, deferral) -> [..., out]
    embedding(ids [...], weight [V, H], deferral) -> [..., H]

With `deferral=None` these are F.linear / F.embedding (autograd's own backward, unchanged).
With a deferral, backward computes the input gradient (and the bias gradient, a cheap sum
that stays in B) and hands the weight gradient to `deferral.defer`; outside a deferring
region it computes it at once.

Mixed precision: autocast does not reach into a custom Function, so forward casts x, W and b
to the compute dtype itself (as autocast would cast F.linear) and backward casts the incoming
gradient and uses W's cast again: made once a step inside step_cast_cache (precision.step_cast),
else at each use (see mpoverlap/precision/step_cast.py).

FP8 (`fp8`: precision.fp8.Fp8Gemms, for the linears mark_fp8_gemms marked): the same Function,
with or without a deferral, its three GEMMs through Fp8Gemms on the compute-dtype x and W
cast; a deferred weight gradient keeps the bf16 operands and quantizes them in W (see
precision.fp8.Fp8WeightGrad), so it equals the immediate one.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from mpoverlap.precision import acc_dtype, cast, compute_dtype, no_autocast, step_cast, step_weight
from mpoverlap.precision.fp8_select import fp8_gemms
from mpoverlap.wgrad.deferral import WeightGradGemm


class DeferrableLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, deferral, fp8=None):
        ctx.deferral, ctx.has_bias, ctx.fp8 = deferral, bias is not None, fp8
        # The parameter itself: under activation checkpointing the saved weight unpacks as a
        # detached alias, which is not what the W action must accumulate into.
        ctx.param = weight
        ctx.dtype = dtype = compute_dtype(x)
        x = x.to(dtype)
        ctx.save_for_backward(x, weight)
        with no_autocast(x):
            if fp8 is not None:
                return fp8.forward(x, step_cast(weight, dtype), cast(bias, dtype))
            return F.linear(x, step_cast(weight, dtype), cast(bias, dtype))

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        fp8 = ctx.fp8
        with no_autocast(x):
            grad_y = grad_y.to(ctx.dtype)
            grad_x = None
            if ctx.needs_input_grad[0]:
                w = step_cast(weight, ctx.dtype)
                grad_x = grad_y.matmul(w) if fp8 is None else fp8.dgrad(grad_y, w)
            grad_w = None
            deferred = WeightGradGemm(grad_y, x) if fp8 is None else fp8.deferred_wgrad(grad_y, x)
            if ctx.deferral is None or not ctx.deferral.defer(ctx.param, deferred):
                grad_w = deferred()
            grad_b = (grad_y.reshape(-1, grad_y.shape[-1]).sum(0, dtype=acc_dtype(ctx.dtype))
                      if ctx.has_bias else None)
        return grad_x, grad_w, grad_b, None, None


class DeferrableEmbeddingFn(torch.autograd.Function):
    """The whole gradient of an embedding is its weight gradient: B does nothing, W scatters."""

    @staticmethod
    def forward(ctx, ids, weight, deferral):
        ctx.deferral, ctx.num_rows, ctx.param = deferral, weight.shape[0], weight
        ctx.save_for_backward(ids, weight)
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad_y):
        ids, _ = ctx.saved_tensors

        def compute():  # autograd's own embedding backward (same summation order)
            return torch.ops.aten.embedding_dense_backward(grad_y, ids, ctx.num_rows, -1, False)

        return None, (None if ctx.deferral.defer(ctx.param, compute) else compute()), None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
           deferral=None, fp8=None) -> torch.Tensor:
    """x W^T (+ b); `deferral`: the zero-bubble W switch; `fp8`: the FP8 GEMMs (Fp8Gemms) or None."""
    if deferral is None and fp8 is None:
        return F.linear(x, step_weight(weight), bias)
    return DeferrableLinearFn.apply(x, weight, bias, deferral, fp8)


def embedding(ids: torch.Tensor, weight: torch.Tensor, deferral=None) -> torch.Tensor:
    if deferral is None:
        return F.embedding(ids, weight)
    return DeferrableEmbeddingFn.apply(ids, weight, deferral)


class Linear(nn.Linear):
    """nn.Linear whose weight gradient can be deferred (`wgrad`, set by attach_deferral) and whose
    GEMMs can run in FP8 (`fp8_recipe`, set by precision.fp8_select.mark_fp8_gemms)."""

    wgrad = None
    fp8_recipe = None
    fp8_emulate = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.wgrad, fp8_gemms(self))


class Embedding(nn.Embedding):
    """nn.Embedding (no padding_idx, max_norm, sparse) whose weight gradient can be deferred."""

    wgrad = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.wgrad is None:
            return super().forward(ids)
        return embedding(ids, self.weight, self.wgrad)


def attach_deferral(module: nn.Module, deferral) -> int:
    """Hand `deferral` to every deferrable layer under `module` (Linear, Embedding, modules
    marked `defers_weight_grad` such as the grouped experts, and the tensor-parallel layers
    through their TPComm); returns how many got it. Layers that keep
    their weight gradient in B: norms, the MoE router, biases."""
    from mpoverlap.tensor_parallel.comm_spec import TPComm

    count = 0
    for sub in module.modules():
        if isinstance(sub, (Linear, Embedding)) or getattr(sub, "defers_weight_grad", False):
            sub.wgrad = deferral
            count += 1
        elif isinstance(getattr(sub, "comm", None), TPComm):
            sub.comm.wgrad = deferral
            count += 1
    return count
