"""FP8 grouped expert GEMMs (`train.precision=fp8` on GroupedExperts): the grouped products of
moe/grouped.py with torchao's MoE float8 training recipe (torchao.prototype.moe_training,
fp8_grouped_mm.py) and `torch._scaled_grouped_mm` on CUDA.

torchao has one FP8 recipe for grouped GEMMs (Float8TrainingRecipe.FP8_ROWWISE): every operand in
e4m3, scales per row along the contraction dimension, rounded down to powers of two. The experts
run it under either `train.fp8_recipe` (tensorwise and rowwise name the dense linears' recipes;
`torch._scaled_grouped_mm` takes e4m3 operands with row scales only):

    grouped_mm   a [N, K] @ b[l] [K, M] per row block: a scaled per row, b per (expert, column)
                 (the forward's x W^T and the backward's input gradient g W)
    grouped_wgrad a_l^T g_l -> [L, K, M]: both operands scaled per (expert, column) over that
                 expert's rows (torchao's per-group colwise scales)

The FP8 grouped kernel wants every group's row count a multiple of ALIGN (16) rows (torchao's
`pad_token_groups` alignment): the rows are copied into a zero-padded layout whose groups start at
multiples of 16 (device index arithmetic, no host read; zero rows change no scale and no product),
the products run there, and the rows are read back. Both paths pad, so they run the same layout:

- CUDA: the quantized operands into `torch._scaled_grouped_mm` (bf16 out, as torchao's).
- elsewhere (CPU): the same quantized operands dequantized (fp8 / scale) and multiplied in fp32
  by the project's grouped GEMM (moe/grouped.py), rounded to the output dtype: the numbers the
  CUDA kernel computes up to its accumulation order.
- `emulate=True`: the same casts and scales on the unpadded rows, dequantized, the dense fp32
  product of moe/grouped.py (every row times every expert): the reference the tests compare
  against.

Rows past offs[-1] (slots a capacity dropped) belong to no expert: zeros out, not read.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import torch

from mpoverlap.moe.grouped import grouped_mm, grouped_wgrad, row_groups
from mpoverlap.moe.grouped_path import DENSE
from mpoverlap.precision.fp8 import E4M3, _quantize
from torchao.float8.float8_utils import amax_to_scale, to_fp8_saturated

ALIGN = 16
__all__ = ["ALIGN", "Fp8Grouped"]


def _pad_layout(offs: torch.Tensor, n: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The zero-padded layout of n rows grouped by `offs` [L] int32: (pos [n] long: each row's
    padded row (rows past offs[-1]: the dump row `rows`), valid [n] bool, padded offs [L] int32,
    rows: the padded buffer's row count, an upper bound on the host)."""
    L = offs.shape[0]
    rows = -(-(n + L * ALIGN) // ALIGN) * ALIGN
    sizes = torch.diff(offs, prepend=offs.new_zeros(1))
    padded_sizes = (sizes + ALIGN - 1) // ALIGN * ALIGN
    padded_offs = torch.cumsum(padded_sizes, 0, dtype=torch.int32)
    g = row_groups(offs, n)  # L for rows past offs[-1]
    valid = g < L
    gc = g.clamp_max(L - 1)
    shift = (padded_offs - padded_sizes - offs + sizes).long()[gc]  # padded start - start of its group
    pos = torch.where(valid, torch.arange(n, device=offs.device) + shift, rows)
    return pos, valid, padded_offs, rows


def _pad(t: torch.Tensor, pos: torch.Tensor, rows: int) -> torch.Tensor:
    """t [n, K] into a zero [rows, K] buffer at rows `pos` (the dump row `rows` dropped)."""
    out = t.new_zeros((rows + 1, t.shape[1]))
    out.index_copy_(0, pos, t)
    return out[:rows]


def _unpad(t: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The rows `pos` of t (zeros for rows past offs[-1])."""
    got = t.index_select(0, pos.clamp_max(t.shape[0] - 1))
    return torch.where(valid.unsqueeze(1), got, got.new_zeros(()))


def _quantize_groups(t: torch.Tensor, offs: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """t [n, K] in e4m3 with one scale per (group, column) over the group's rows (torchao's
    per-group colwise scales): (fp8 [n, K], scales [L, K]); rows past offs[-1] are zeros."""
    L = offs.shape[0]
    g = row_groups(offs, t.shape[0]).unsqueeze(1).expand(-1, t.shape[1])
    t = t.float().masked_fill((g == L)[:, :1], 0)  # rows past offs[-1] may hold anything
    amax = t.new_zeros((L + 1, t.shape[1]))
    amax.scatter_reduce_(0, g, t.abs(), "amax")
    scale = amax_to_scale(amax, E4M3, round_scales_to_power_of_2=True)
    return to_fp8_saturated(t * scale.gather(0, g), E4M3), scale[:L]


@dataclass(frozen=True)
class Fp8Grouped:
    """The grouped products of moe/grouped.py in FP8: `mm` and `wgrad` take and return what
    grouped_mm / grouped_wgrad do, outputs in `out_dtype` (bf16 on CUDA, as the kernel's;
    elsewhere the caller's compute dtype); `emulate`: the fp32 reference (module docstring)."""

    out_dtype: torch.dtype = torch.bfloat16
    emulate: bool = False

    def _kernel(self, a: torch.Tensor) -> bool:
        return a.device.type == "cuda" and not self.emulate

    def mm(self, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """a [N, K], b [L, K, M] -> [N, M]: row block l of a times b[l]."""
        if a.shape[0] == 0:
            return a.new_zeros((0, b.shape[2]), dtype=self.out_dtype)
        if self.emulate:
            qa, sa = _quantize(a, E4M3, -1, True)
            qb, sb = _quantize(b, E4M3, 1, True)
            out = grouped_mm(qa.float() / sa, qb.float() / sb, offs, DENSE)
            valid = row_groups(offs, a.shape[0]) < offs.shape[0]
            return torch.where(valid.unsqueeze(1), out, out.new_zeros(())).to(self.out_dtype)
        pos, valid, padded_offs, rows = _pad_layout(offs, a.shape[0])
        qa, sa = _quantize(_pad(a, pos, rows), E4M3, -1, True)  # [rows, K], [rows, 1]
        if self._kernel(a):
            # b column-major per expert (strides (K M, 1, K)), its scales along K: [L, 1, M]
            qb, sb = _quantize(b, E4M3, 1, True)
            qb = qb.transpose(1, 2).contiguous().transpose(1, 2)
            out = torch._scaled_grouped_mm(qa, qb, sa.reciprocal().squeeze(1), sb.reciprocal().squeeze(1),
                                           padded_offs, out_dtype=torch.bfloat16, use_fast_accum=True)
        else:
            qb, sb = _quantize(b, E4M3, 1, True)
            out = grouped_mm(qa.float() / sa, qb.float() / sb, padded_offs)
        return _unpad(out.to(self.out_dtype), pos, valid)

    def wgrad(self, a: torch.Tensor, g: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """a [N, K], g [N, M] -> [L, K, M] = a_l^T g_l (zeros for empty experts)."""
        if a.shape[0] == 0:
            return a.new_zeros((offs.shape[0], a.shape[1], g.shape[1]), dtype=self.out_dtype)
        if self.emulate:
            qa, sa = _quantize_groups(a, offs)
            qg, sg = _quantize_groups(g, offs)
            rows = row_groups(offs, a.shape[0]).clamp_max(offs.shape[0] - 1)
            return grouped_wgrad(qa.float() / sa[rows], qg.float() / sg[rows], offs, DENSE).to(self.out_dtype)
        pos, _, padded_offs, rows = _pad_layout(offs, a.shape[0])
        qa, sa = _quantize_groups(_pad(a, pos, rows), padded_offs)
        qg, sg = _quantize_groups(_pad(g, pos, rows), padded_offs)
        if self._kernel(a):
            # [K, rows] row-major times [rows, M] column-major, scales per (expert, column)
            out = torch._scaled_grouped_mm(qa.t().contiguous(), qg.t().contiguous().t(),
                                           sa.reciprocal().flatten(), sg.reciprocal().flatten(), padded_offs,
                                           out_dtype=torch.bfloat16, use_fast_accum=True)
            return out.to(self.out_dtype)
        groups = row_groups(padded_offs, rows).clamp_max(offs.shape[0] - 1)
        return grouped_wgrad(qa.float() / sa[groups], qg.float() / sg[groups], padded_offs).to(self.out_dtype)
