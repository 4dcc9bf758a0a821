"""Where the elements a rank holds sit in a parameter's full, layout-free tensor.

A rank holds, of each parameter, a flat range [a, b) of its local tensor (its data-parallel
shard of a bucket; the whole local tensor without sharding), and the local tensor is its
tensor-parallel slice of the full one. A checkpoint describes each element by its position in
the full tensor, so both have to be turned into boxes (an offset and a size per dimension), the
form torch.distributed.checkpoint stores and reshards:

    flat_range_boxes(shape, a, b)   the row-major range [a, b) as boxes, each contiguous in memory
    Partition.to_global(box)        a local box as boxes of the full tensor (split where the
                                    partition dimension's fused blocks, e.g. [q | k | v], break)

Pure integer arithmetic: nothing here touches a tensor.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

# (offsets, sizes), one entry per dimension.
Box = Tuple[Tuple[int, ...], Tuple[int, ...]]


def flat_range_boxes(shape: Sequence[int], start: int, end: int) -> List[Box]:
    """The row-major flat range [start, end) of a tensor of `shape` as at most 2 * ndim - 1
    boxes, in memory order; each box is contiguous (leading dims of size 1, one partial dim,
    full trailing dims), so its data is `flat[box_start:box_start + volume].view(sizes)`."""
    shape = tuple(int(s) for s in shape)
    if not 0 <= start <= end <= math.prod(shape):
        raise ValueError(f"flat range [{start}, {end}) outside a tensor of shape {shape}")
    if start == end:
        return []
    if len(shape) <= 1:
        return [((start,), (end - start,))] if shape else [((), ())]
    inner = math.prod(shape[1:])
    row, row_end = divmod(start, inner), divmod(end, inner)
    first_row, first_col = row
    last_row, last_col = row_end
    boxes: List[Box] = []

    def prefixed(r: int, a: int, b: int) -> List[Box]:
        return [((r, *o), (1, *s)) for o, s in flat_range_boxes(shape[1:], a, b)]

    if first_row == last_row:  # inside one row
        return prefixed(first_row, first_col, last_col)
    if first_col:  # the partial first row
        boxes += prefixed(first_row, first_col, inner)
        first_row += 1
    if last_row > first_row:  # whole rows
        boxes.append(((first_row, *(0,) * (len(shape) - 1)), (last_row - first_row, *shape[1:])))
    if last_col:  # the partial last row
        boxes += prefixed(last_row, 0, last_col)
    return boxes


def box_flat_start(shape: Sequence[int], box: Box) -> int:
    """Row-major flat index of a box's first element in a tensor of `shape`."""
    offsets, _ = box
    index = 0
    for o, n in zip(offsets, shape):
        index = index * n + o
    return index


@dataclass(frozen=True)
class Partition:
    """How a local tensor sits in the full one: split along `dim` into `size` ranks (this one
    `rank`), the dimension made of fused blocks of the FULL sizes `blocks`, each split alike
    (rank r holds [block0_r | block1_r | ...]); `dim=None`: the local tensor is the full one."""

    dim: Optional[int] = None
    rank: int = 0
    size: int = 1
    blocks: Tuple[int, ...] = ()

    @classmethod
    def of(cls, local_shape: Sequence[int], dim: Optional[int], rank: int, size: int, blocks=1) -> "Partition":
        """From a parameter's attributes (`partition_dim`, `partition_blocks`: a count of equal
        blocks or their full sizes, as tensor_parallel/layers.py sets them)."""
        if dim is None or size == 1:
            return cls()
        full = int(local_shape[dim]) * size
        if isinstance(blocks, int):
            if full % blocks:
                raise ValueError(f"dimension of size {full} does not split into {blocks} equal blocks")
            sizes = (full // blocks,) * blocks
        else:
            sizes = tuple(int(b) for b in blocks)
        if sum(sizes) != full or any(b % size for b in sizes):
            raise ValueError(f"blocks {sizes} do not tile a dimension of {full} split {size} ways")
        return cls(dim, rank, size, sizes)

    def global_shape(self, local_shape: Sequence[int]) -> Tuple[int, ...]:
        shape = list(local_shape)
        if self.dim is not None:
            shape[self.dim] *= self.size
        return tuple(shape)

    def to_global(self, box: Box) -> List[Tuple[Box, Box]]:
        """A box of the local tensor -> [(box in the full tensor, the same elements' box in the
        local tensor)]: one pair, or one per fused block the box crosses."""
        if self.dim is None:
            return [(box, box)]
        offsets, sizes = box
        d = self.dim
        lo, hi = offsets[d], offsets[d] + sizes[d]
        pairs = []
        local_start = global_start = 0
        for full in self.blocks:
            part = full // self.size
            a, b = max(lo, local_start), min(hi, local_start + part)
            if a < b:
                g = global_start + self.rank * part + (a - local_start)
                local_box = (offsets[:d] + (a,) + offsets[d + 1:], sizes[:d] + (b - a,) + sizes[d + 1:])
                global_box = (offsets[:d] + (g,) + offsets[d + 1:], local_box[1])
                pairs.append((global_box, local_box))
            local_start += part
            global_start += full
        return pairs
