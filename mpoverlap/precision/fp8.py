"""FP8 GEMMs for `train.precision=fp8`: y = x W^T and its two backward GEMMs with torchao's
float8 casts and scales (torchao.float8.float8_utils) and `torch._scaled_mm`, outputs bf16.

The recipes follow torchao's Float8LinearConfig recipes (float8_linear.py,
matmul_with_hp_or_float8_args):
- tensorwise: one scale per tensor; forward x and W in e4m3; the output gradient in e5m2 for
  dgrad (grad @ W) and wgrad (grad^T @ x), its wider range being what gradients need.
- rowwise: one scale per row of each GEMM operand along its contraction dimension, every
  operand in e4m3, scales rounded to powers of two (torchao's rowwise recipe).

The autograd Function is written here rather than taking torchao's Float8Linear module: the
framework's linears are its own Functions (deferrable weight gradient, tensor-parallel
collectives, the step's weight casts), which need the three GEMMs as plain calls.
`emulate=True` runs the same casts and scales dequantized with an fp32 matmul: the reference
the tests compare against.
"""
from __future__ import annotations

import logging
import warnings

import torch

# torchao logs that its CUDA extensions did not load (harmless: only its casts and scales are
# used) and torch's pytree warns about one of its enums: kept out of the user's output.
_QUIET = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
_LEVELS = [log.level for log in _QUIET]
for _log in _QUIET:
    _log.setLevel(logging.ERROR)
try:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchao.float8.config import Float8LinearConfig, ScalingGranularity
        from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated
finally:
    for _log, _level in zip(_QUIET, _LEVELS):
        _log.setLevel(_level)

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
RECIPES = ("tensorwise", "rowwise")
__all__ = ["E4M3", "E5M2", "Float8LinearConfig", "Fp8Linear", "RECIPES", "fp8_gemm", "fp8_linear", "grad_dtype"]


def _quantize(t: torch.Tensor, dtype: torch.dtype, dim, rowwise: bool):
    """t in `dtype` and its scale (fp8 = t * scale): per tensor, or per slice along `dim`."""
    if rowwise:
        scale = tensor_to_scale(t, dtype, scaling_granularity=ScalingGranularity.AXISWISE, axiswise_dim=dim,
                                round_scales_to_power_of_2=True)
    else:
        scale = tensor_to_scale(t, dtype)
    return to_fp8_saturated(t.float() * scale, dtype), scale


def fp8_gemm(a: torch.Tensor, b: torch.Tensor, dtype_a: torch.dtype, dtype_b: torch.dtype, recipe: str,
             emulate: bool = False) -> torch.Tensor:
    """a (M, K) @ b (K, N) with both cast to fp8 (scaled along K under rowwise); bf16 out, or
    fp32 from the dequantized operands under `emulate`."""
    rowwise = recipe == "rowwise"
    qa, sa = _quantize(a, dtype_a, -1, rowwise)
    qb, sb = _quantize(b, dtype_b, 0, rowwise)
    if emulate:
        return (qa.float() / sa) @ (qb.float() / sb)
    # _scaled_mm wants its second operand column-major.
    return torch._scaled_mm(qa, qb.t().contiguous().t(), scale_a=sa.reciprocal(), scale_b=sb.reciprocal(),
                            out_dtype=torch.bfloat16)


def grad_dtype(recipe: str) -> torch.dtype:
    """The output gradient's fp8 dtype under `recipe`."""
    return E5M2 if recipe == "tensorwise" else E4M3


class Fp8Linear(torch.autograd.Function):
    """y = x W^T in fp8 (forward, dgrad and wgrad GEMMs per `recipe`); x (..., K), W (N, K)."""

    @staticmethod
    def forward(ctx, x, weight, recipe, emulate):
        ctx.save_for_backward(x, weight)
        ctx.recipe, ctx.emulate = recipe, emulate
        x2 = x.reshape(-1, x.shape[-1])
        return fp8_gemm(x2, weight.t(), E4M3, E4M3, recipe, emulate).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        recipe, emulate = ctx.recipe, ctx.emulate
        # The real output is bf16, so its gradient arrives in bf16; the emulation's fp32 output
        # gets the same rounding here, so both quantize the same values.
        g2 = grad.to(torch.bfloat16).reshape(-1, grad.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        gx = gw = None
        if ctx.needs_input_grad[0]:
            gx = fp8_gemm(g2, weight, grad_dtype(recipe), E4M3, recipe, emulate).reshape(x.shape).to(x.dtype)
        if ctx.needs_input_grad[1]:
            gw = fp8_gemm(g2.t(), x2, grad_dtype(recipe), E4M3, recipe, emulate).to(weight.dtype)
        return gx, gw, None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, recipe: str = "tensorwise", emulate: bool = False):
    """x W^T through the fp8 GEMMs (see Fp8Linear); `recipe` one of RECIPES."""
    if recipe not in RECIPES:
        raise ValueError(f"train.fp8_recipe={recipe}: not a recipe; use one of {', '.join(RECIPES)}, "
                         "e.g. train.fp8_recipe=tensorwise")
    return Fp8Linear.apply(x, weight, recipe, emulate)
