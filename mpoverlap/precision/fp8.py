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
        from torchao.float8.float8_utils import amax_to_scale, tensor_to_scale, to_fp8_saturated
finally:
    for _log, _level in zip(_QUIET, _LEVELS):
        _log.setLevel(_level)

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
RECIPES = ("tensorwise", "rowwise")
__all__ = ["E4M3", "E5M2", "Float8LinearConfig", "Fp8Gemms", "Fp8Linear", "Fp8WeightGrad", "RECIPES", "fp8_gemm",
           "fp8_linear", "grad_dtype"]


def _quantize(t: torch.Tensor, dtype: torch.dtype, dim, rowwise: bool):
    """t in `dtype` and its scale (fp8 = t * scale): per tensor, or per slice along `dim`."""
    if rowwise:
        scale = tensor_to_scale(t, dtype, scaling_granularity=ScalingGranularity.AXISWISE, axiswise_dim=dim,
                                round_scales_to_power_of_2=True)
    else:
        scale = tensor_to_scale(t, dtype)
    return to_fp8_saturated(t.float() * scale, dtype), scale


def fp8_gemm(a: torch.Tensor, b, dtype_a: torch.dtype, dtype_b: torch.dtype, recipe: str,
             emulate: bool = False, out_dtype=None) -> torch.Tensor:
    """a (M, K) @ b (K, N) with both cast to fp8 (scaled along K under rowwise); `out_dtype`
    out (default bf16), or fp32 from the dequantized operands under `emulate` (cast to
    `out_dtype` when one is given, so both round their fp32 sum to the same dtype). `b` may
    come already quantized: a pair (fp8 values (K, N), scale), used as it is (no second cast);
    so may `a` ((M, K) and its scale)."""
    rowwise = recipe == "rowwise"
    qa, sa = a if isinstance(a, tuple) else _quantize(a, dtype_a, -1, rowwise)
    qb, sb = b if isinstance(b, tuple) else _quantize(b, dtype_b, 0, rowwise)
    if emulate:
        out = (qa.float() / sa) @ (qb.float() / sb)
        return out if out_dtype is None else out.to(out_dtype)
    # _scaled_mm wants its second operand column-major.
    return torch._scaled_mm(qa, qb.t().contiguous().t(), scale_a=sa.reciprocal(), scale_b=sb.reciprocal(),
                            out_dtype=out_dtype or torch.bfloat16)


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


class Fp8Gemms:
    """The three GEMMs of a linear y = x W^T in fp8 under `recipe`, as plain calls for the
    framework's own linear Functions (plain and deferrable, tensor-parallel, the collective
    matmul's ring chunks): each call casts and scales its operands itself (torchao), so a
    caller that splits a GEMM into chunks quantizes each chunk with its own scale, and the
    emulation (`emulate=True`: the same casts and scales, dequantized, fp32 matmul) follows
    the same split. x and the output gradient arrive in the compute dtype (bf16 under
    train.precision=fp8), W as the step's bf16 cast of the fp32 parameter; forward and dgrad
    return that dtype, wgrad fp32 (the master gradient's dtype: _scaled_mm writes it directly).

    `gathered` (tensorwise only): the weight's FP8 ZeRO-3 gather (data_parallel/fp8_gather.py),
    whose `quantized()` is the gathered e4m3 weight and its scale while the weight's unit is
    gathered in FP8: forward and dgrad then use those as they are instead of casting `weight`
    (the same values: the scale is the whole weight's, from the gathered amax). None, or
    `quantized()` None (a unit gathered exactly, for a checkpoint): the weight is cast here."""

    __slots__ = ("recipe", "emulate", "gathered")

    def __init__(self, recipe: str, emulate: bool = False, gathered=None) -> None:
        if recipe not in RECIPES:
            raise ValueError(f"train.fp8_recipe={recipe}: not a recipe; use one of {', '.join(RECIPES)}, "
                             "e.g. train.fp8_recipe=tensorwise")
        if gathered is not None and recipe != "tensorwise":
            raise ValueError(f"train.fp8_recipe={recipe} with train.param_gather_dtype=fp8: a gathered FP8 weight "
                             "has one scale for the whole weight, the rowwise recipe one per row; use "
                             "train.fp8_recipe=tensorwise or train.param_gather_dtype=bf16")
        self.recipe, self.emulate, self.gathered = recipe, emulate, gathered

    def _weight(self, weight: torch.Tensor, transpose: bool):
        """W (N, K) for the GEMM (W^T when `transpose`): the gathered FP8 pair when there is one."""
        pre = self.gathered.quantized() if self.gathered is not None else None
        if pre is None:
            return weight.t() if transpose else weight
        q, scale = pre
        if q.shape != weight.shape:
            raise ValueError(f"the gathered FP8 weight has shape {tuple(q.shape)}, the GEMM's weight "
                             f"{tuple(weight.shape)}")
        return (q.t() if transpose else q), scale

    def forward(self, x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
        """x (..., K) W (N, K)^T (+ bias) -> (..., N) in x's dtype; x and W in e4m3."""
        y = fp8_gemm(x.reshape(-1, x.shape[-1]), self._weight(weight, True), E4M3, E4M3, self.recipe, self.emulate,
                     x.dtype)
        y = y.reshape(*x.shape[:-1], weight.shape[0])
        return y if bias is None else y + bias.to(y.dtype)

    def gathers_input(self) -> bool:
        """Whether a sequence-parallel all-gather of x may carry FP8 (one scale for the gathered
        tensor: the tensorwise recipe; rowwise keeps its gather in the compute dtype)."""
        return self.recipe == "tensorwise"

    @staticmethod
    def quantize_input(x: torch.Tensor, amax: torch.Tensor):
        """x in e4m3 and its scale from `amax` (the gathered tensor's, reduced over the ranks):
        the cast the forward GEMM makes of any tensor whose amax that is (tensor_to_scale)."""
        scale = amax_to_scale(amax, E4M3)
        return to_fp8_saturated(x.float() * scale, E4M3), scale

    def forward_quantized(self, qx: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor, bias=None,
                          out_dtype=torch.bfloat16) -> torch.Tensor:
        """forward with x already in e4m3 (`qx` (..., K), `scale`: quantize_input's), not cast again."""
        y = fp8_gemm((qx.reshape(-1, qx.shape[-1]), scale), self._weight(weight, True), E4M3, E4M3, self.recipe,
                     self.emulate, out_dtype)
        y = y.reshape(*qx.shape[:-1], weight.shape[0])
        return y if bias is None else y + bias.to(y.dtype)

    def dgrad(self, grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """grad (..., N) W (N, K) -> (..., K) in grad's dtype; the gradient in grad_dtype(recipe)."""
        out = fp8_gemm(grad.reshape(-1, grad.shape[-1]), self._weight(weight, False), grad_dtype(self.recipe), E4M3,
                       self.recipe, self.emulate, grad.dtype)
        return out.reshape(*grad.shape[:-1], weight.shape[1])

    def wgrad(self, grad: torch.Tensor, x) -> torch.Tensor:
        """dW (N, K) = grad^T x summed over the leading dims, fp32; `x` may come quantized (the
        pair quantize_input made, tensorwise: used as it is)."""
        x2 = (x[0].reshape(-1, x[0].shape[-1]), x[1]) if isinstance(x, tuple) else x.reshape(-1, x.shape[-1])
        return fp8_gemm(grad.reshape(-1, grad.shape[-1]).t(), x2, grad_dtype(self.recipe), E4M3, self.recipe,
                        self.emulate, torch.float32)

    def deferred_wgrad(self, grad: torch.Tensor, x: torch.Tensor) -> "Fp8WeightGrad":
        return Fp8WeightGrad(self, grad, x)


class Fp8WeightGrad:
    """A deferred fp8 weight gradient (the zero-bubble schedules' W action): keeps the output
    gradient and the input in the compute dtype (or the input as the SP backward's e4m3
    re-gather and the forward's scale) and quantizes them when W runs. The same tensors and the same casts as an
    immediate wgrad, so the same values bit for bit (what the emulation checks); the cost is 2
    bytes an element held until W instead of fp8's 1 (plus its scales), and the quantization
    runs in W rather than in B."""

    __slots__ = ("gemms", "grad", "x")

    def __init__(self, gemms: Fp8Gemms, grad: torch.Tensor, x: torch.Tensor) -> None:
        self.gemms, self.grad, self.x = gemms, grad, x

    def __call__(self) -> torch.Tensor:
        return self.gemms.wgrad(self.grad, self.x)

    def accumulate_into(self, grad: torch.Tensor) -> None:
        grad.add_(self())
