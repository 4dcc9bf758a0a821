"""data.blend=[w1, prefix1, w2, prefix2, ...]: several datasets mixed by weight.

The sample order is a function of (train.seed, the blend) alone, never of train.steps or the
layout, so every layout sees the same global batches and a resumed run continues exactly:
  - global samples come in blocks of BLOCK; each block holds exactly c_d samples of dataset d,
    c = the weights' largest-remainder apportionment of BLOCK (the mix is exact per block,
    within 1/BLOCK of the weights), in an order shuffled by default_rng([seed, TAG, block]);
  - the k-th sample of dataset d (k = block * c_d + its rank inside the block) is window
    sample_index(k, len(d), seed_d) of d: d's own epochs, shuffled with seed_d = crc32(seed, d).
Sample g is thus computed in O(BLOCK) from g alone, with no state carried from earlier samples.
"""
from __future__ import annotations

import functools
import zlib
from typing import List, Sequence

import numpy as np
import torch

from mpoverlap.training.data import DataError, sample_index

BLOCK = 1024
_TAG = 0xB1E4D  # separates the blend's generator streams from the datasets' own


def apportion(weights: Sequence[float], total: int) -> np.ndarray:
    """Largest-remainder split of `total` by `weights` (ties to the earlier dataset)."""
    w = np.asarray(weights, dtype=np.float64)
    exact = w / w.sum() * total
    counts = np.floor(exact).astype(np.int64)
    order = sorted(range(len(w)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[: total - int(counts.sum())]:
        counts[i] += 1
    return counts


def parse_blend(blend: Sequence) -> tuple:
    """[w1, p1, w2, p2, ...] -> (weights, prefixes); the rule engine has already checked it."""
    items = list(blend)
    return [float(w) for w in items[0::2]], [str(p) for p in items[1::2]]


class BlendedWindows:
    """Global sample g -> a window of one of `datasets` (each a TokenWindows)."""

    def __init__(self, datasets: Sequence, weights: Sequence[float], prefixes: Sequence[str]):
        self.datasets = list(datasets)
        self.counts = apportion(weights, BLOCK)
        for d, (c, prefix) in enumerate(zip(self.counts, prefixes)):
            if c == 0:
                raise DataError(f"data.blend: weight {weights[d]} of {prefix} is below 1/{BLOCK} of the total "
                                f"and would never be sampled; raise it or drop {prefix} from data.blend")
        self._len = sum(len(ds) for ds in self.datasets)

    def __len__(self) -> int:
        return self._len

    @functools.lru_cache(maxsize=8)
    def _block(self, seed: int, block: int):
        """(dataset id, rank among that dataset's samples in the block) for every position."""
        order = np.random.default_rng([seed, _TAG, block]).permutation(np.repeat(np.arange(len(self.counts)), self.counts))
        rank = np.empty(BLOCK, dtype=np.int64)
        for d in range(len(self.counts)):
            rank[order == d] = np.arange(self.counts[d])
        return order, rank

    def source(self, g: int, seed: int) -> tuple:
        """(dataset id, that dataset's window index) of global sample g."""
        block, pos = divmod(int(g), BLOCK)
        order, rank = self._block(int(seed), block)
        d = int(order[pos])
        k = block * int(self.counts[d]) + int(rank[pos])
        ds = self.datasets[d]
        return d, sample_index(k, len(ds), zlib.crc32(f"{int(seed)}/blend/{d}".encode()))

    def sample(self, g: int, seed: int) -> torch.Tensor:
        d, i = self.source(g, seed)
        return self.datasets[d][i]


class ConcatWindows:
    """The validation windows of every blended dataset, one after the other."""

    def __init__(self, datasets: Sequence):
        self.datasets = list(datasets)
        self.starts: List[int] = list(np.cumsum([0] + [len(d) for d in self.datasets]))

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, i: int) -> torch.Tensor:
        i = int(i) % len(self)
        d = int(np.searchsorted(self.starts, i, side="right")) - 1
        return self.datasets[d][i - self.starts[d]]
