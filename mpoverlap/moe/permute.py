"""Permute token copies by expert and back: pure functions, autograd through indexing.

A token routed to k experts has k "slots" (flat slot s = t * k + j). `permute` orders the kept
slots (id >= 0) by expert, stably (token order within an expert); `unpermute` is its exact
inverse, optionally folding the k copies of a token with its router weights.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch


def expert_counts(expert_ids_Tk: torch.Tensor, num_experts: int, dtype=torch.long) -> torch.Tensor:
    """[E] number of slots per expert; ids of -1 (dropped) are not counted. No host read
    (unlike bincount, whose output size depends on the data)."""
    flat = expert_ids_Tk.reshape(-1)
    kept = (flat >= 0).to(dtype)
    return torch.zeros(num_experts, dtype=dtype, device=flat.device).index_add_(0, flat.clamp_min(0), kept)


def sort_slots(expert_ids_Tk: torch.Tensor, num_experts: int,
               num_kept: Optional[int] = None, counts: bool = True) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(order [N] long: flat slot indices sorted by expert, stable; counts [E] long, or None
    when `counts` is False: the dispatchers have theirs already). Dropped slots (id -1) sort
    last and are left out, so N = number of kept slots. `num_kept` (known to callers that read
    the counts once per layer) avoids a host read here."""
    flat = expert_ids_Tk.reshape(-1)
    key = torch.where(flat >= 0, flat, torch.full_like(flat, num_experts))
    _, order = torch.sort(key, stable=True)
    if num_kept is None:
        num_kept = int((flat >= 0).sum())  # host read: single-process callers and tests only
    return order[:num_kept], (expert_counts(expert_ids_Tk, num_experts) if counts else None)


def permute(x_TH: torch.Tensor, expert_ids_Tk: torch.Tensor, num_experts: int,
            num_kept: Optional[int] = None, counts: bool = True):
    """x [T, H] -> (x_perm [N, H] grouped by expert, order [N], counts [E] or None, see sort_slots).
    x_perm[i] = x[order[i] // k]."""
    k = expert_ids_Tk.shape[1]
    order, counts = sort_slots(expert_ids_Tk, num_experts, num_kept, counts)
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
    [local expert l][rank r]. Returns (x regrouped, index used: regrouped = x[index]).
    Built on the device without host reads (N = x_NH.shape[0] is known on the host)."""
    R, L = counts_RL.shape
    device = counts_RL.device
    sizes_RL = counts_RL.reshape(-1)
    src_start_LR = (torch.cumsum(sizes_RL, 0) - sizes_RL).view(R, L).t().reshape(-1)
    sizes_LR = counts_RL.t().reshape(-1)
    dst_start_LR = torch.cumsum(sizes_LR, 0) - sizes_LR
    total = x_NH.shape[0]
    block = torch.repeat_interleave(torch.arange(L * R, device=device), sizes_LR, output_size=total)
    index = src_start_LR[block] + torch.arange(total, device=device) - dst_start_LR[block]
    return x_NH.index_select(0, index), index


def inverse_index(index: torch.Tensor) -> torch.Tensor:
    """inv such that x[index][inv] == x."""
    inv = torch.empty_like(index)
    inv[index] = torch.arange(index.numel(), device=index.device)
    return inv
