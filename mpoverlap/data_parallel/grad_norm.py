"""Sums of squares of gradient regions in a few kernels each, whatever their size.

A region is a 1-D view of a gradient buffer (a bucket, a ZeRO shard, a run of parameters of
one category). Adjacent regions of one storage are merged first (`coalesce`), so the whole flat
buffer of a model without sharding is one region. Each region of n elements is read as

    rows_RC = region[:R * C].view(R, C)     R = n // C, C = 2^14 (ROW)
    tail_1T = region[R * C:].view(1, T)     T = n - R * C

and one `vector_norm(dim=1)` per view gives fp32 norms of rows of 2^14 elements (an fp32 sum
over a whole 1M-element bucket would drift ~2e-5), squared and summed in fp64: on CPU the same
bits as a `_foreach_norm` over 2^14-element chunks (tests/test_grad_norm.py). The views are built once (`SquareSum`), the step runs
`len(views)` norms plus a constant handful: no list sized by elements or parameters, so the
launches do not grow with the model's width (on a GPU every view of a chunked norm would be
a launch: 75,000 for a 1.2B model). fp32 gradients are read in place; bf16/fp16 ones are
accumulated in fp32 (on CUDA inside the kernel, no copy).
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch

ROW = 1 << 14  # elements per fp32 partial sum


def _adjacent(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when 1-D `b` starts where 1-D `a` ends in the same storage (both contiguous)."""
    return (a.dtype == b.dtype and a.device == b.device and a.stride() == b.stride() == (1,)
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            and a.storage_offset() + a.numel() == b.storage_offset())


def coalesce(regions: Sequence[torch.Tensor], keys: Optional[Sequence[int]] = None) -> tuple:
    """Merge runs of regions (1-D, buffer order) that follow each other in one storage and share
    a key: ([merged views], [their keys]). A region that is not 1-D and contiguous stays alone."""
    keys = list(keys) if keys is not None else [0] * len(regions)
    out: List[torch.Tensor] = []
    out_keys: List[int] = []
    for t, k in zip(regions, keys):
        if t.numel() == 0:
            continue
        if out and out_keys[-1] == k and t.dim() == 1 and out[-1].dim() == 1 and _adjacent(out[-1], t):
            prev = out[-1]
            out[-1] = prev.as_strided((prev.numel() + t.numel(),), (1,), prev.storage_offset())
        else:
            out.append(t)
            out_keys.append(k)
    return out, out_keys


def row_views(t: torch.Tensor) -> List[torch.Tensor]:
    """[rows_RC, tail_1T] of `t` (flattened, see the module docstring); empty ones left out."""
    flat = t.reshape(-1)
    n = flat.numel()
    full = n // ROW * ROW
    views = []
    if full:
        views.append(flat[:full].view(full // ROW, ROW))
    if n > full:
        views.append(flat[full:].view(1, n - full))
    return views


class SquareSum:
    """Sums of squares of `regions`, one per key in 0..num_keys-1, as a float64 [num_keys]
    tensor on `device`: `SquareSum(regions, keys, num_keys)()`. The regions must stay the same
    memory between calls (persistent gradient buffers and their views)."""

    def __init__(self, regions: Sequence[torch.Tensor], device: torch.device, keys: Optional[Sequence[int]] = None,
                 num_keys: int = 1) -> None:
        merged, merged_keys = coalesce(regions, keys)
        order = sorted(range(len(merged)), key=lambda i: merged_keys[i])  # stable: buffer order per key
        self.device = device
        self.num_keys = num_keys
        self.views: List[torch.Tensor] = []
        self.lengths = [0] * num_keys  # partial norms per key, in key order
        for i in order:
            for v in row_views(merged[i]):
                self.views.append(v)
                self.lengths[merged_keys[i]] += v.shape[0]
        dtypes = {v.dtype for v in self.views}
        # fp32 (and fp64) read in place in their own precision; lower precisions accumulated in
        # fp32. One dtype per call: mixed lists are not something the buffers hold.
        if len(dtypes) > 1:
            raise TypeError(f"gradient regions of several dtypes {sorted(map(str, dtypes))}: one SquareSum reads "
                            "one dtype (a data-parallel buffer holds one); build one per dtype")
        self.acc = None if dtypes <= {torch.float32, torch.float64} else torch.float32

    def __call__(self) -> torch.Tensor:
        if not self.views:
            return torch.zeros(self.num_keys, dtype=torch.float64, device=self.device)
        norms = [torch.linalg.vector_norm(v, 2, dim=1, dtype=self.acc) for v in self.views]
        sq = (torch.cat(norms) if len(norms) > 1 else norms[0]).double().pow(2)
        if self.num_keys == 1:
            return sq.sum().reshape(1)
        return torch.stack([part.sum() for part in sq.split(self.lengths)])


def square_sum(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of squares of all elements of `tensors`, a float64 0-dim tensor on `device` (built
    per call: for a one-off; the optimizer keeps its `SquareSum`)."""
    return SquareSum(list(tensors), device)()[0]
