"""The forward's autocast context for `train.precision` and the dtype helpers custom autograd
Functions use to follow autocast on CPU and CUDA alike (see the package docstring)."""
from __future__ import annotations

from contextlib import nullcontext
from typing import Optional

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def compute_precision(precision: str) -> str:
    """The precision everything but the FP8 GEMMs runs in: train.precision=fp8 is bf16 autocast
    plus the marked GEMMs in fp8 (precision/fp8_select.py), so it reads as bf16 wherever a
    dtype is chosen (autocast, activations on the wire, the ZeRO-3 gathers' auto dtype)."""
    return "bf16" if precision == "fp8" else precision


def autocast_context(precision: str, device: torch.device):
    """The forward's context for `train.precision` on `device` (nullcontext for fp32; bf16
    autocast for bf16 and fp8)."""
    precision = compute_precision(precision)
    if precision == "fp32":
        return nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[precision])


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


def compute_cast_weights(module: torch.nn.Module) -> set:
    """The parameters the forward reads only through a cast to the compute dtype: the weights of
    the linears (plain, deferrable and tensor-parallel; the output head's) and the grouped experts'
    stacks, whose GEMMs run in bf16 under train.precision=bf16. Everything else is read as it is
    (norm weights, biases, embedding tables, also a tied one, the router): the ZeRO-3 gathers
    carry those exactly (data_parallel/unit_gather.py)."""
    from mpoverlap.moe.experts import GroupedExperts
    from mpoverlap.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from mpoverlap.wgrad.functions import Linear

    out = set()
    for sub in module.modules():
        if isinstance(sub, (Linear, ColumnParallelLinear, RowParallelLinear)):
            out.add(sub.weight)
        elif isinstance(sub, GroupedExperts):
            out.update((sub.w_in, sub.w_out))
    return out
