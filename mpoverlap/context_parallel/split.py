"""Load-balanced sequence split for context parallelism (pure tensor code, one collective helper).

The global sequence of S tokens is cut into 2*cp equal chunks of c = S / (2 cp) tokens. Rank r
holds chunks r and 2cp-1-r, concatenated in that order:

    cp=2, chunks 0..3:   rank 0 -> [0, 3]   rank 1 -> [1, 2]
    cp=4, chunks 0..7:   rank 0 -> [0, 7]   rank 1 -> [1, 6]   rank 2 -> [2, 5]   rank 3 -> [3, 4]

Under a causal mask, chunk a attends to a+1 chunks, so every rank attends to
(r + 1) + (2cp - r) = 2cp + 1 chunk pairs: the work is equal on every rank.

Shape letters: S global sequence, S_local = S / cp, c = S / (2 cp) chunk length.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch


def _check(seq_len: int, cp_rank: int, cp_size: int) -> int:
    """Chunk length c; raises on a sequence not divisible by 2*cp (the engine rejects such
    configs first, with the fix; this guards direct callers)."""
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank} must be in [0, cp_size={cp_size})")
    if seq_len % (2 * cp_size):
        raise ValueError(f"sequence length {seq_len} must be divisible by 2 * cp = {2 * cp_size}")
    return seq_len // (2 * cp_size)


def cp_chunks_of_rank(cp_rank: int, cp_size: int) -> tuple:
    """The two global chunk indices held by `cp_rank`, in local order: (r, 2cp-1-r)."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def cp_chunk_order(cp_size: int) -> List[int]:
    """Global chunk index of each chunk of the rank-ordered concatenation of all local shards:
    [0, 2cp-1, 1, 2cp-2, ..., cp-1, cp]. Length 2cp."""
    return [c for r in range(cp_size) for c in cp_chunks_of_rank(r, cp_size)]


def split_for_cp(x: torch.Tensor, cp_rank: int, cp_size: int, seq_dim: int) -> torch.Tensor:
    """x[..., S, ...] -> x_local[..., S_local, ...]: chunks r and 2cp-1-r of the sequence
    dimension `seq_dim`, concatenated (a new contiguous tensor; a view of x when cp == 1)."""
    if cp_size == 1:
        return x
    c = _check(x.shape[seq_dim], cp_rank, cp_size)
    first, second = cp_chunks_of_rank(cp_rank, cp_size)
    return torch.cat([x.narrow(seq_dim, first * c, c), x.narrow(seq_dim, second * c, c)],
                     dim=seq_dim)


def positions_for_cp(seq_len: int, cp_rank: int, cp_size: int,
                     device: Optional[torch.device] = None) -> torch.Tensor:
    """LongTensor[S_local]: the global positions of this rank's tokens (feed them to RoPE).
    Equal to split_for_cp(arange(seq_len), cp_rank, cp_size, 0)."""
    c = _check(seq_len, cp_rank, cp_size)
    first, second = cp_chunks_of_rank(cp_rank, cp_size)
    return torch.cat([torch.arange(first * c, (first + 1) * c, device=device),
                      torch.arange(second * c, (second + 1) * c, device=device)])


def unsplit_from_cp(shards: Sequence[torch.Tensor], seq_dim: int) -> torch.Tensor:
    """Inverse of split_for_cp given every rank's shard in cp-rank order: list of cp tensors
    [..., S_local, ...] -> [..., S, ...] in natural sequence order."""
    cp_size = len(shards)
    if cp_size == 1:
        return shards[0]
    chunks = [None] * (2 * cp_size)
    for r, shard in enumerate(shards):
        lo, hi = shard.chunk(2, dim=seq_dim)
        first, second = cp_chunks_of_rank(r, cp_size)
        chunks[first], chunks[second] = lo, hi
    return torch.cat(chunks, dim=seq_dim)


def gather_from_cp(x_local: torch.Tensor, *, cp_group, cp_size: int, seq_dim: int,
                   ledger=None) -> torch.Tensor:
    """Collective over the cp group (every member calls it): all ranks' shards
    x_local[..., S_local, ...] -> the full x[..., S, ...] in natural order, on every rank.
    Blocking; for tests, evaluation and debugging, not for the training hot path."""
    if cp_size == 1:
        return x_local
    from mpoverlap.comm.collectives import all_gather

    moved = x_local.movedim(seq_dim, 0).contiguous()
    out = torch.empty((cp_size * moved.shape[0],) + tuple(moved.shape[1:]),
                      dtype=moved.dtype, device=moved.device)
    all_gather(out, moved, cp_group, mode="cp", ledger=ledger).wait()
    shards = [s.movedim(0, seq_dim) for s in out.chunk(cp_size, dim=0)]
    return unsplit_from_cp(shards, seq_dim)
