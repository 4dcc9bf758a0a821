"""Permute token copies by expert and back: pure functions, autograd through indexing.

A token routed to k experts has k "slots" (flat slot s = t * k + j). `permute` orders the kept
slots (id >= 0) by expert, stably (token order within an expert); `unpermute` is its exact
inverse, optionally folding the k copies of a token with its router weights.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch


def sort_slots(expert_ids_Tk: torch.Tensor, num_experts: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(order [N] long: flat slot indices sorted by expert, stable; counts [E] long).
    Dropped slots (id -1) are left out, so N = number of kept slots."""
    flat = expert_ids_Tk.reshape(-1)
    _, order = torch.sort(flat, stable=True)
    order = order[flat[order] >= 0]
    counts = torch.bincount(flat[order], minlength=num_experts)
    return order, counts


def permute(x_TH: torch.Tensor, expert_ids_Tk: torch.Tensor, num_experts: int):
    """x [T, H] -> (x_perm [N, H] grouped by expert, order [N], counts [E]).
    x_perm[i] = x[order[i] // k]."""
    k = expert_ids_Tk.shape[1]
    order, counts = sort_slots(expert_ids_Tk, num_experts)
    return x_TH.index_select(0, order // k), order, counts


def unpermute(y_NH: torch.Tensor, order: torch.Tensor, num_tokens: int, top_k: int,
              weights_Tk: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Inverse of `permute`. weights None: the slots [T, k, H] (zeros at dropped slots), exact.
    With weights [T, k]: y [T, H] = sum_j weights[t, j] * slot[t, j] (summed in order j)."""
    H = y_NH.shape[-1]
    slots = y_NH.new_zeros(num_tokens * top_k, H).index_copy(0, order, y_NH)
    slots = slots.view(num_tokens, top_k, H)
    if weights_Tk is None:
        return slots
    return (slots * weights_Tk.to(y_NH.dtype).unsqueeze(-1)).sum(dim=1)


def regroup(x_NH: torch.Tensor, counts_RL: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Reorder rows laid out [rank r][local expert l] (block sizes counts_RL [R, L]) into
    [local expert l][rank r]. Returns (x regrouped, index used: regrouped = x[index])."""
    R, L = counts_RL.shape
    starts = torch.cumsum(counts_RL.reshape(-1), 0) - counts_RL.reshape(-1)
    starts = starts.view(R, L)
    pieces = [torch.arange(int(starts[r, l]), int(starts[r, l] + counts_RL[r, l]))
              for l in range(L) for r in range(R)]
    index = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)
    return x_NH.index_select(0, index), index


def inverse_index(index: torch.Tensor) -> torch.Tensor:
    """inv such that x[index][inv] == x."""
    inv = torch.empty_like(index)
    inv[index] = torch.arange(index.numel())
    return inv
