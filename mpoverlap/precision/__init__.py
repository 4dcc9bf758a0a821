"""Mixed precision: `train.precision` and `train.grad_reduce_dtype`, and the small helpers the
custom autograd functions use to follow autocast on CPU and CUDA alike.

train.precision=bf16 runs the forward under `torch.autocast(<device>, torch.bfloat16)`: GEMMs
in bf16, parameters, gradients and optimizer state stay fp32 (master weights), so gradient
accumulation and the update are fp32. The same code path serves CPU (CI) and CUDA (users).

Custom autograd functions are not covered by autocast's casting rules (autocast casts the
inputs of the ops it knows; a Function's forward sees whatever it was handed, and its
backward runs with autocast off). They call `compute_dtype(x)` in forward, cast explicitly,
run their math with autocast disabled (`no_autocast`), and remember the dtype for backward.

The package splits by idea: `autocast` (the forward's context and the dtype helpers the
Functions use), `step_cast` (the step's cache of weight casts and the in-place gradient adds), `fp8` (the FP8
GEMMs over torchao, the optional `fp8` extra: imported only where fp8 is used), `fp8_grouped`
(the grouped expert GEMMs in FP8, torch._scaled_grouped_mm on CUDA), `fp8_select` (which
modules' GEMMs run in FP8, and the torchao check; no torchao import).
"""
from mpoverlap.precision.autocast import (DTYPES, _autocast_on, acc_dtype, autocast_context, cast,
                                          compute_cast_weights, compute_dtype, compute_precision, no_autocast)
from mpoverlap.precision.step_cast import (_FoldedCast, added_into_grad, grad_buffer, step_cast,
                                           step_cast_cache, step_weight)

__all__ = ["DTYPES", "acc_dtype", "added_into_grad", "autocast_context", "cast", "compute_cast_weights",
           "compute_dtype", "compute_precision", "grad_buffer", "no_autocast", "step_cast", "step_cast_cache",
           "step_weight"]
