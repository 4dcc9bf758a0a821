"""Mixed precision: `train.precision` and `train.grad_reduce_dtype`, and the small helpers the
custom autograd functions use to follow autocast on CPU and CUDA alike.

train.precision=bf16 runs the forward under `torch.autocast(<device>, torch.bfloat16)`: GEMMs
in bf16, parameters, gradients and optimizer state stay fp32 (master weights), so gradient
accumulation and the update are fp32. The same code path serves CPU (CI) and CUDA (users).

Custom autograd functions are not covered by autocast's casting rules (autocast casts the
inputs of the ops it knows; a Function's forward sees whatever it was handed, and its
backward runs with autocast off). They call `compute_dtype(x)` in forward, cast explicitly,
run their math with autocast disabled (`no_autocast`), and remember the dtype for backward.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Optional

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def autocast_context(precision: str, device: torch.device):
    """The forward's context for `train.precision` on `device` (nullcontext for fp32)."""
    if precision == "fp32":
        return nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[precision])


def step_cast_cache(precision: str, device: torch.device, params_sharded: bool):
    """Around one step's microbatches: autocast's cast of each fp32 weight to bf16 is made once
    per step instead of once per microbatch (and per pipeline chunk pass).

    Autocast caches the casts of leaf tensors that require grad (the parameters) until the
    outermost autocast region exits; each microbatch's forward is its own region, so each
    re-cast every weight (on a GPU one copy kernel per weight per microbatch). This context is
    an outer region with autocast OFF: nothing between the forwards (the loss, backward, the
    pipeline's sends) is autocast, but the cache lives until it exits, before the optimizer
    changes the weights. The values are the same casts, so results are bitwise those of
    per-microbatch casts. Costs the bf16 copies' memory between microbatches (2 bytes a
    parameter, which each microbatch's backward holds anyway); not used when the parameters
    live sharded between uses (ZeRO-3: holding full bf16 copies would undo that), nor in fp32."""
    if precision == "fp32" or params_sharded:
        return nullcontext()
    return torch.autocast(device.type, enabled=False)


def _autocast_on(device_type: str) -> bool:
    try:
        return torch.is_autocast_enabled(device_type)
    except RuntimeError:  # a device type autocast does not know (meta): never autocast
        return False


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a GEMM on floating `x` runs in right now: autocast's dtype for x's device
    when autocast is on there and x is fp32 (autocast leaves fp64 alone), else x's own."""
    if x.dtype == torch.float32 and _autocast_on(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def no_autocast(x: torch.Tensor):
    """Autocast off for x's device: explicit dtypes inside a custom Function (or fp32 block
    math) must not be recast behind the code's back."""
    if not _autocast_on(x.device.type):
        return nullcontext()
    return torch.autocast(x.device.type, enabled=False)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where sums over many bf16 terms accumulate: fp32 (fp64 stays fp64)."""
    return torch.promote_types(dtype, torch.float32)


def cast(x: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    return None if x is None else x.to(dtype)
