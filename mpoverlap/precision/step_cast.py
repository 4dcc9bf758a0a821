"""The step's weight casts: each fp32 weight cast to the compute dtype once per step, and its
low-precision gradient added into the fp32 gradient buffer in place (step_cast_cache)."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

import torch

from mpoverlap.precision.autocast import _autocast_on

# The step's weight casts (step_cast_cache): id(parameter) -> (parameter, its bf16 copy), and
# ("plain", its memory, dtype) -> the same without autograd history (step_cast); None outside a step.
_STEP_CASTS: Optional[dict] = None


@contextmanager
def step_cast_cache(precision: str, device: torch.device, params_sharded: bool) -> Iterator[None]:
    """Around one step's microbatches: each fp32 weight is cast to bf16 once per step instead of
    once per microbatch (and per pipeline chunk pass), and its bf16 weight gradient is added into
    the fp32 gradient buffer by one promoting add instead of a cast and an add.

    Weights of the model's linears (wgrad/functions.py `linear`) go through `step_weight`: the
    first use in the step makes the cast (`_FoldedCast`), later microbatches reuse it. Custom
    Functions that take the parameter itself (the grouped experts' stacks, the deferrable and
    tensor-parallel linears) get theirs from `step_cast`, in forward and again in backward. Every other
    weight autocast casts: an outer autocast region (itself off, so nothing between the forwards,
    the loss, backward, the pipeline's sends, is autocast) keeps autocast's own cache of weight
    casts until it exits, before the optimizer changes the weights. The same casts, so the same
    values; the gradient sums are the same but for a weight used twice in one backward (the tied
    embedding and head: autograd adds each in turn, not their sum). Costs the bf16 copies' memory
    for the whole step (2 bytes a parameter of every GEMM weight; a plain linear's backward held
    its cast anyway, the Functions' recast theirs; counted by the memory estimate's
    `weight_casts`, overlap/estimate/transients.py); not used when the parameters live sharded
    between uses (ZeRO-3: holding full bf16 copies would undo that), nor in fp32."""
    global _STEP_CASTS
    if precision == "fp32" or params_sharded:
        yield
        return
    with torch.autocast(device.type, enabled=False):
        _STEP_CASTS = {}
        try:
            yield
        finally:
            _STEP_CASTS = None


class _FoldedCast(torch.autograd.Function):
    """weight (fp32 parameter) -> weight.to(dtype); backward adds the incoming low-precision
    gradient into the parameter's existing fp32 gradient in place (the cast folded into the add:
    no fp32 copy of it) and hands autograd None, whose accumulate call still fires the parameter's
    post-accumulate hooks (the data-parallel readiness). Without a gradient buffer there, or with
    a tensor hook that must see the gradient first (ZeRO-2's), it returns the cast gradient as
    autograd's own cast would."""

    @staticmethod
    def forward(ctx, weight, dtype):
        ctx.param = weight
        return weight.to(dtype)

    @staticmethod
    def backward(ctx, grad):
        param = ctx.param
        if added_into_grad(param, grad):
            return None, None
        return grad.to(param.dtype), None


def added_into_grad(param: torch.Tensor, grad: torch.Tensor) -> bool:
    """In a backward (grad mode off), add `grad` into param's gradient buffer in place (one
    promoting add_ for a low-precision gradient) where grad_buffer allows; True if it did: the
    caller then hands autograd None for the parameter, whose accumulate call still fires the
    post-accumulate hooks."""
    buf = grad_buffer(param)
    if buf is None or torch.is_grad_enabled():
        return False
    buf.add_(grad)
    return True


def grad_buffer(param: torch.Tensor) -> Optional[torch.Tensor]:
    """param.grad when a gradient may be added into it in place, bypassing autograd's accumulate:
    an existing gradient of the parameter's dtype and shape (the data-parallel buffer's view) and
    no tensor hook on the parameter that must see the gradient before it accumulates (the sharded
    levels' pre-accumulate hooks allocate or wait for the bucket there). Else None."""
    buf = param.grad
    if buf is None or buf.dtype != param.dtype or buf.shape != param.shape or getattr(param, "_backward_hooks", None):
        return None
    return buf


def step_weight(weight: torch.Tensor) -> torch.Tensor:
    """The weight a linear computes with: inside a step (step_cast_cache) under autocast, an fp32
    parameter's cast made once for the step (see there); anything else unchanged (autocast casts
    it). Not under no_grad: a cast made there would carry no gradient into later uses."""
    casts = _STEP_CASTS
    if (casts is None or weight.dtype != torch.float32 or not weight.requires_grad or not weight.is_leaf
            or not torch.is_grad_enabled() or not _autocast_on(weight.device.type)):
        return weight
    held = casts.get(id(weight))  # (the parameter, its cast): the parameter kept alive with its id
    if held is None:
        held = casts[id(weight)] = (weight, _FoldedCast.apply(weight, torch.get_autocast_dtype(weight.device.type)))
    return held[1]


def step_cast(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`weight.to(dtype)` for a custom Function that takes the parameter itself and hands its
    gradient on itself (the grouped experts, the deferrable linear): inside a step
    (step_cast_cache) made once for the step and reused by every microbatch's forward and
    backward, else cast at each call. No autograd history: the Function's own backward adds
    each of its calls' gradients into the fp32 gradient as before, so the sums are unchanged
    (a cast carrying history would have autograd add a layer's chunks' bf16 gradients together
    first). Keyed by the weight's memory, not its Python object: backward gets the parameter
    back from its saved tensors, under activation checkpointing as a detached alias of it."""
    casts = _STEP_CASTS
    if casts is None or weight.dtype == dtype:
        return weight.to(dtype)
    key = ("plain", weight.data_ptr(), tuple(weight.shape), weight.stride(), dtype)
    held = casts.get(key)  # (the weight, its cast): the weight kept alive, so its memory is not reused
    if held is None:
        with torch.no_grad():
            held = casts[key] = (weight, weight.to(dtype))
    return held[1]
