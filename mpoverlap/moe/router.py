"""Softmax top-k router with load-balancing and z-loss, optional capacity (token dropping).

Shapes: T tokens, H hidden, E experts, k = top_k.
    logits [T, E] = x [T, H] @ W^T, W [E, H] initialised by `init_tensor(f"{name}.weight")`
    probs  [T, E] = softmax(logits) in fp32
    expert_ids [T, k] (long), weights [T, k] (fp32 probs of the top-k, renormalised to sum 1)

aux_loss = aux_loss_coeff * E * sum_e f_e * P_e      (Switch / Megatron load balancing)
    f_e = (#slots routed to e before drops) / (T * k), P_e = mean_t probs[t, e]
z_loss   = z_loss_coeff * mean_t logsumexp(logits[t])^2

Capacity (capacity_factor not None): capacity = ceil(capacity_factor * T * k / E) slots per
expert; slots are kept in token order (token 0 first, then within a token by rank of choice)
and a slot beyond its expert's capacity is dropped: its id becomes -1 and its weight 0 (the
surviving weights are not renormalised). capacity_factor None = dropless.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, Optional

import torch
import torch.nn as nn

from mpoverlap.models.init import init_tensor


@dataclass
class RouterOutput:
    expert_ids: torch.Tensor  # [T, k] long, -1 = dropped
    weights: torch.Tensor  # [T, k] fp32, 0 where dropped
    aux_loss: torch.Tensor  # scalar, already multiplied by its coefficient
    z_loss: torch.Tensor  # scalar, already multiplied by its coefficient
    stats: Dict[str, torch.Tensor] = field(default_factory=dict)  # detached figures


def load_balancing_loss(probs_TE: torch.Tensor, expert_ids_Tk: torch.Tensor, num_experts: int) -> torch.Tensor:
    """E * sum_e f_e * P_e (unscaled); f from the routing choice (no gradient), P from probs."""
    T, k = expert_ids_Tk.shape
    counts = torch.bincount(expert_ids_Tk.reshape(-1), minlength=num_experts).to(probs_TE.dtype)
    f = counts / max(T * k, 1)
    P = probs_TE.mean(dim=0) if T else probs_TE.sum(dim=0)
    return num_experts * (f * P).sum()


def z_loss_of(logits_TE: torch.Tensor) -> torch.Tensor:
    """mean_t logsumexp(logits_t)^2 (unscaled), fp32."""
    lse = torch.logsumexp(logits_TE.float(), dim=-1)
    return (lse * lse).mean() if lse.numel() else lse.sum()


def apply_capacity(expert_ids_Tk: torch.Tensor, weights_Tk: torch.Tensor, num_experts: int,
                   capacity: int):
    """Drop slots beyond `capacity` per expert, in token order. Returns (ids, weights, dropped)."""
    flat = expert_ids_Tk.reshape(-1)
    onehot = torch.nn.functional.one_hot(flat, num_experts)  # [T*k, E]
    position = (onehot.cumsum(dim=0) * onehot).sum(dim=1) - 1  # slot's place in its expert's queue
    keep = (position < capacity).view_as(expert_ids_Tk)
    ids = torch.where(keep, expert_ids_Tk, torch.full_like(expert_ids_Tk, -1))
    weights = weights_Tk * keep.to(weights_Tk.dtype)
    return ids, weights, int((~keep).sum())


class TopKRouter(nn.Module):
    def __init__(self, hidden: int, num_experts: int, top_k: int, *, name: str, cfg, seed: int,
                 aux_loss_coeff: float = 0.0, z_loss_coeff: float = 0.0,
                 capacity_factor: Optional[float] = None) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
        self.num_experts, self.top_k = num_experts, top_k
        self.aux_loss_coeff, self.z_loss_coeff = aux_loss_coeff, z_loss_coeff
        self.capacity_factor = capacity_factor
        self.weight = nn.Parameter(init_tensor(f"{name}.weight", (num_experts, hidden), cfg, seed))

    def capacity(self, num_tokens: int) -> Optional[int]:
        if self.capacity_factor is None:
            return None
        return int(math.ceil(self.capacity_factor * num_tokens * self.top_k / self.num_experts))

    def forward(self, x_TH: torch.Tensor) -> RouterOutput:
        logits = x_TH @ self.weight.t()  # [T, E]
        probs = torch.softmax(logits.float(), dim=-1)
        top_p, ids = torch.topk(probs, self.top_k, dim=-1)  # sorted, ties to the lower index
        weights = top_p / top_p.sum(dim=-1, keepdim=True)
        aux_raw = load_balancing_loss(probs, ids, self.num_experts)
        z_raw = z_loss_of(logits)
        dropped = 0
        cap = self.capacity(x_TH.shape[0])
        if cap is not None:
            ids, weights, dropped = apply_capacity(ids, weights, self.num_experts, cap)
        valid = ids[ids >= 0]
        stats = {"tokens_per_expert": torch.bincount(valid, minlength=self.num_experts),
                 "dropped": torch.tensor(dropped), "aux_loss": aux_raw.detach(),
                 "z_loss": z_raw.detach()}
        return RouterOutput(ids, weights, self.aux_loss_coeff * aux_raw, self.z_loss_coeff * z_raw, stats)
