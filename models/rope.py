"""Rotary position embeddings (rotate-half form), with Llama 3.1/3.2's frequency scaling.

Shape letters: S positions, D head dim.

model.rope_scaling (rope_type null = plain RoPE, inv_freq_i = 1 / base^(2i/D)), rope_type llama3:
  wavelength w_i = 2 pi / inv_freq_i, L = original_max_position_embeddings;
  w_i > L / low_freq_factor   (low frequencies):  inv_freq_i / factor
  w_i < L / high_freq_factor  (high frequencies): inv_freq_i unchanged
  between: (1 - s) inv_freq_i / factor + s inv_freq_i, s = (L / w_i - low) / (high - low)
This is transformers' `_compute_llama3_parameters` step for step (the same fp32 operations in
the same order), so imported Llama 3.1/3.2 weights see exactly the angles they were trained with.
Other rope types (linear, dynamic, yarn, longrope) are refused by the rule `model.rope_scaling`.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch

ROPE_TYPES = ("llama3",)


def rope_scaling_of(cfg) -> Optional[Any]:
    """model.rope_scaling when it scales (rope_type set), else None."""
    rs = getattr(cfg, "rope_scaling", None)
    return rs if rs is not None and getattr(rs, "rope_type", None) is not None else None


def inv_frequencies(head_dim: int, base: float, scaling: Optional[Any], device) -> torch.Tensor:
    """inv_freq_D2 (fp32): the rotation speed of each channel pair."""
    dims_D2 = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device)
    inv_freq_D2 = 1.0 / (base ** (dims_D2 / head_dim))
    if scaling is None:
        return inv_freq_D2
    factor, low, high = float(scaling.factor), float(scaling.low_freq_factor), float(scaling.high_freq_factor)
    old_len = float(scaling.original_max_position_embeddings)
    wavelen_D2 = 2 * math.pi / inv_freq_D2
    scaled_D2 = torch.where(wavelen_D2 > old_len / low, inv_freq_D2 / factor, inv_freq_D2)
    smooth_D2 = (old_len / wavelen_D2 - low) / (high - low)
    smoothed_D2 = (1 - smooth_D2) * scaled_D2 / factor + smooth_D2 * scaled_D2
    medium_D2 = ~(wavelen_D2 < old_len / high) * ~(wavelen_D2 > old_len / low)
    return torch.where(medium_D2, smoothed_D2, scaled_D2)


def rope_cos_sin(position_ids_S: torch.Tensor, head_dim: int, base: float, scaling: Optional[Any] = None):
    """cos_SD, sin_SD (fp32) for rotary embeddings at the given positions (rotate-half form)."""
    # On the positions' device: a device-less arange would sit on the CPU beside CUDA positions.
    inv_freq_D2 = inv_frequencies(head_dim, base, scaling, position_ids_S.device)
    angles_SD2 = position_ids_S.to(torch.float32)[:, None] * inv_freq_D2[None, :]
    angles_SD = torch.cat([angles_SD2, angles_SD2], dim=-1)
    return angles_SD.cos(), angles_SD.sin()


def rope_reference(x_BNSD: torch.Tensor, cos_SD: torch.Tensor, sin_SD: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., i], x[..., i + D/2]) by the position angle: x cos + rotate_half(x) sin
    in the tables' fp32, cast back to x's dtype. What train.compile's `rope` region traces
    (inductor fuses it) and the tests' reference for `apply_rope`."""
    x1, x2 = x_BNSD.chunk(2, dim=-1)
    rotated_BNSD = torch.cat([-x2, x1], dim=-1)
    return (x_BNSD * cos_SD + rotated_BNSD * sin_SD).to(x_BNSD.dtype)


def apply_rope(x_BNSD: torch.Tensor, cos_SD: torch.Tensor, sin_SD: torch.Tensor) -> torch.Tensor:
    """`rope_reference`'s rotation, eager, as one autograd Function over the two halves:
    out1 = x1 c - x2 s, out2 = x2 c + x1 s (c, s: the tables' first half; rope_cos_sin repeats
    the angles over both halves), each one fp32 product and one multiply-add written in x's
    dtype; backward the transposed rotation of the gradient, alike. Eager autograd on
    `rope_reference` writes the negated half, the rotated copy, two fp32 products, their fp32 sum
    and the cast (~36 bytes moved per element of q and k, bf16) and in backward casts each
    product's fp32 gradient back to bf16 before adding them (~46); this moves ~14 each way. The
    same fp32 arithmetic but for the multiply-add's single rounding: within one rounding of x's
    dtype of the reference."""
    return _Rope.apply(x_BNSD, cos_SD, sin_SD)


def _dense_like(x: torch.Tensor) -> torch.Tensor:
    """An empty tensor of x's shape and dtype, dense in x's dimension order (as an elementwise
    operator would lay out its output: q and k, views into the qkv GEMM's [B, S, ...] output,
    keep that order for attention)."""
    order = sorted(range(x.dim()), key=lambda d: (-x.stride(d), d))  # outermost first
    stride, step = [0] * x.dim(), 1
    for d in reversed(order):
        stride[d], step = step, step * x.shape[d]
    return torch.empty_strided(x.shape, stride, dtype=x.dtype, device=x.device)  # one operator


def _rotate(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor, sign: float) -> torch.Tensor:
    """[x1 c - sign x2 s | x2 c + sign x1 s] in x's dtype (sign -1: the transposed rotation)."""
    x1, x2 = x.chunk(2, dim=-1)
    out = _dense_like(x)
    out1, out2 = out.chunk(2, dim=-1)
    torch.addcmul(x1 * c, x2, s, value=-sign, out=out1)
    torch.addcmul(x2 * c, x1, s, value=sign, out=out2)
    return out


def apply_rope_qk(q_BNSD: torch.Tensor, k_BGSD: torch.Tensor, cos_SD: torch.Tensor, sin_SD: torch.Tensor):
    """(apply_rope(q), apply_rope(k)), bit for bit, as one autograd Function: one call, one
    backward node and one slice of the tables for both (host time a layer and microbatch)."""
    return _RopeQK.apply(q_BNSD, k_BGSD, cos_SD, sin_SD)


class _RopeQK(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_BNSD, k_BGSD, cos_SD, sin_SD):
        half = q_BNSD.shape[-1] // 2
        c, s = cos_SD[..., :half], sin_SD[..., :half]
        ctx.save_for_backward(c, s)
        return _rotate(q_BNSD, c, s, 1.0), _rotate(k_BGSD, c, s, 1.0)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_q, grad_k):
        c, s = ctx.saved_tensors
        return _rotate(grad_q, c, s, -1.0), _rotate(grad_k, c, s, -1.0), None, None


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_BNSD, cos_SD, sin_SD):
        half = x_BNSD.shape[-1] // 2
        c, s = cos_SD[..., :half], sin_SD[..., :half]
        ctx.save_for_backward(c, s)
        return _rotate(x_BNSD, c, s, 1.0)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_BNSD):
        c, s = ctx.saved_tensors
        return _rotate(grad_BNSD, c, s, -1.0), None, None
