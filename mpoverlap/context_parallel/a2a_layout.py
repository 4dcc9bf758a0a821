"""Pure layout moves of the all-to-all (Ulysses) variant: no communication here.

A "group" g of G head groups: each cp rank owns Nh = N / cp heads (rank j: heads
j*Nh .. (j+1)*Nh - 1); within them, group g is the Ng = Nh / G heads starting at j*Nh + g*Ng.
Tensors carry a leading T (how many tensors travel together: 3 for q, k, v; 1 for out).

sequence-sharded   x_TBNSD   [T, B, N, S_local, D]   chunks (r, 2cp-1-r) of the sequence
head-sharded       y_TBnSD   [T, B, Ng, S, D]        one head group, natural sequence order
a2a buffers        [cp, T, B, Ng, S_local, D]        dim 0 = destination (send) / source (recv)
"""
from __future__ import annotations

from typing import Dict, Tuple

import torch

from mpoverlap.context_parallel.split import cp_chunk_order


# (cp_size, device) -> (order, inverse). Built once per layout and device: torch.tensor(list)
# on a GPU is a host-to-device copy that waits for the stream, and the layout moves run
# for every head group of every attention layer.
_ORDERS: Dict[Tuple[int, torch.device], Tuple[torch.Tensor, torch.Tensor]] = {}


def _orders(cp_size: int, device) -> tuple:
    """(order, inverse) index tensors: order[p] = global chunk at position p of the rank-ordered
    concatenation of shards; inverse[t] = position of global chunk t in that concatenation.
    Cached per (cp, device): the indices depend on nothing else (not on the sequence shape)."""
    key = (cp_size, torch.device(device))
    cached = _ORDERS.get(key)
    if cached is None:
        order = cp_chunk_order(cp_size)
        inverse = [0] * len(order)
        for p, chunk in enumerate(order):
            inverse[chunk] = p
        cached = _ORDERS[key] = (torch.tensor(order, device=device), torch.tensor(inverse, device=device))
    return cached


def pack_seq_to_head(x_TBNSD: torch.Tensor, cp_size: int, groups: int, g: int) -> torch.Tensor:
    """[T, B, N, S_local, D] -> send buffer [cp, T, B, Ng, S_local, D]: slot j holds head
    group g of rank j's heads, for this rank's tokens."""
    T, B, N, S_local, D = x_TBNSD.shape
    x = x_TBNSD.reshape(T, B, cp_size, groups, N // (cp_size * groups), S_local, D)[:, :, :, g]
    return x.permute(2, 0, 1, 3, 4, 5).contiguous()


def unpack_seq_to_head(recv_cTBnSD: torch.Tensor, cp_size: int) -> torch.Tensor:
    """recv buffer [cp(source rank), T, B, Ng, S_local, D] -> [T, B, Ng, S, D], natural order."""
    cp, T, B, Ng, S_local, D = recv_cTBnSD.shape
    c = S_local // 2
    _, inverse = _orders(cp_size, recv_cTBnSD.device)
    y = recv_cTBnSD.permute(1, 2, 3, 0, 4, 5).reshape(T, B, Ng, 2 * cp, c, D)
    return y.index_select(3, inverse).reshape(T, B, Ng, 2 * cp * c, D)


def pack_head_to_seq(y_TBnSD: torch.Tensor, cp_size: int) -> torch.Tensor:
    """[T, B, Ng, S, D] natural order -> send buffer [cp(destination), T, B, Ng, S_local, D]:
    slot j holds rank j's tokens (chunks j, 2cp-1-j)."""
    T, B, Ng, S, D = y_TBnSD.shape
    c = S // (2 * cp_size)
    order, _ = _orders(cp_size, y_TBnSD.device)
    y = y_TBnSD.reshape(T, B, Ng, 2 * cp_size, c, D).index_select(3, order)
    return y.reshape(T, B, Ng, cp_size, 2 * c, D).permute(3, 0, 1, 2, 4, 5).contiguous()


def unpack_head_to_seq(recv_cTBnSD: torch.Tensor, out_TBNSD: torch.Tensor, groups: int,
                       g: int) -> None:
    """recv buffer [cp(head owner), T, B, Ng, S_local, D] -> written into head group g of every
    owner's heads in out_TBNSD [T, B, N, S_local, D] (in place)."""
    cp, T, B, Ng, S_local, D = recv_cTBnSD.shape
    view = out_TBNSD.view(T, B, cp, groups, Ng, S_local, D)
    view[:, :, :, g].copy_(recv_cTBnSD.permute(1, 2, 0, 3, 4, 5))
