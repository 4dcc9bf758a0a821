"""Top-k router (softmax or sigmoid scores, see TopKRouter) with load-balancing and z-loss,
optional capacity (token dropping) and optional aux-loss-free expert bias.

Shapes: T tokens, H hidden, E experts, k = top_k.
    logits [T, E] = x [T, H] @ W^T in fp32 (autocast off: routing decisions and the losses
                    must not depend on the compute dtype), W [E, H] from `init_tensor`
    probs  [T, E] = softmax(logits), fp32
    expert_ids [T, k] (long), weights [T, k] (fp32 probs of the top-k, renormalised to sum 1)

The losses describe the WHOLE microbatch, whatever the layout. With `shards` (the ranks that
hold parts of the same sequences, see sequence_shards.py) of total token count T_g:
    f_e = (#slots routed to e before drops, summed over shards) / (T_g * k)     (no gradient)
    aux_loss = aux_loss_coeff * E * sum_e f_e * P_e,   P_e = (sum over all T_g tokens of probs[t, e]) / T_g
    z_loss   = z_loss_coeff * (sum over all T_g tokens of logsumexp(logits[t])^2) / T_g
Each rank's RouterOutput.aux_loss / z_loss is its own tokens' share of those sums (times
`shards.grad_mean_size`, see there): the shares add up to the whole loss and each share's
gradient is exactly the whole loss's gradient for this rank's tokens. The reported
`stats["aux_loss"]`/`stats["z_loss"]` are the whole-microbatch values (unscaled).

Capacity (capacity_factor not None): capacity = ceil(capacity_factor * T * k / E) slots per
expert, with T this rank's tokens; slots are kept in token order (token 0 first, then within a
token by rank of choice) and a slot beyond its expert's capacity is dropped: its id becomes -1
and its weight 0 (the surviving weights are not renormalised). Drops are decided per rank:
when SP or CP splits the sequence, which slots are dropped depends on the layout (the plan and
mpoverlap-check say so). capacity_factor None = dropless, exactly layout-invariant.
No host reads: counts are scatter-adds into fixed-size [E] tensors.

force_load_balancing (model.moe_router_force_load_balancing, benchmarks only, as Megatron's
option of that name): the logits are replaced by random ones, N(0, 1) per token and expert,
before anything reads them (choice, weights, losses); their gradient goes straight through to
the router's logits. The draws are a fixed [T, E] tensor per router, shape and `random_stream`
(the ep rank: ranks route differently), made from the model seed on the logits' device once:
every call with the same token count routes alike, so a recomputed forward routes as the
first one did and nothing needs restoring on resume. Every expert then gets about T * k / E
slots, whatever the router learned.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from typing import Dict, Optional

import torch
import torch.nn as nn

from mpoverlap.models.init import init_tensor
from mpoverlap.moe.permute import expert_counts
from mpoverlap.moe.sequence_shards import SequenceShards


@dataclass
class RouterOutput:
    expert_ids: torch.Tensor  # [T, k] long, -1 = dropped
    weights: torch.Tensor  # [T, k] fp32, 0 where dropped
    aux_loss: torch.Tensor  # scalar, already multiplied by its coefficient
    z_loss: torch.Tensor  # scalar, already multiplied by its coefficient
    stats: Dict[str, torch.Tensor] = field(default_factory=dict)  # detached figures
    # With a capacity: each kept slot's place in its expert's queue (token order), [T, k] long,
    # and the capacity (host int); the all-to-all dispatcher pads every expert to it.
    positions: Optional[torch.Tensor] = None
    capacity: Optional[int] = None


def z_loss_terms(logits_TE: torch.Tensor) -> torch.Tensor:
    """[T] logsumexp(logits_t)^2 in fp32."""
    lse = torch.logsumexp(logits_TE.float(), dim=-1)
    return lse * lse


def apply_capacity(expert_ids_Tk: torch.Tensor, weights_Tk: torch.Tensor, num_experts: int,
                   capacity: int):
    """Drop slots beyond `capacity` per expert, in token order. Returns (ids, weights,
    dropped: a 0-d long tensor, so that no host read happens here, position [T, k] long: each
    slot's place in its expert's queue, < capacity for the kept ones).

    A slot's place in its expert's queue comes from one stable sort of the T*k slots and the
    per-expert counts: O(T k log(T k)) work and O(T k + E) memory, never a [T*k, E] one-hot."""
    flat = expert_ids_Tk.reshape(-1)
    n = flat.numel()
    order = torch.sort(flat, stable=True).indices  # slots grouped by expert, token order kept
    counts = expert_counts(expert_ids_Tk, num_experts)
    start = torch.cumsum(counts, 0) - counts  # [E] first sorted position of each expert
    position = torch.empty_like(flat)
    position[order] = torch.arange(n, device=flat.device) - start[flat[order]]
    keep = (position < capacity).view_as(expert_ids_Tk)
    ids = torch.where(keep, expert_ids_Tk, torch.full_like(expert_ids_Tk, -1))
    weights = weights_Tk * keep.to(weights_Tk.dtype)
    return ids, weights, (~keep).sum(), position.view_as(expert_ids_Tk)


class _StraightThrough(torch.autograd.Function):
    """Forward: `replacement` exactly (a copy); backward: the gradient goes to `x` unchanged."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, replacement: torch.Tensor) -> torch.Tensor:
        return replacement.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class TopKRouter(nn.Module):
    """Scores, top-k choice and weights (see the module docstring for the losses).

    score ("softmax" | "sigmoid") and order:
      score_topk: scores = softmax(logits) or sigmoid(logits) over all E; pick the top k of
                  scores (+ expert_bias); weights = the chosen scores, renormalised to sum 1
                  when norm_topk (DeepSeek-MoE 16B: softmax, not renormalised; DeepSeek-V3:
                  sigmoid, renormalised).
      topk_score: pick the top k of logits (+ expert_bias); weights = softmax over those k
                  logits (Mixtral's form; softmax only). With softmax it chooses the same
                  experts as score_topk and its weights equal score_topk's renormalised ones
                  up to rounding.
    Group-limited routing (num_groups G > 1, DeepSeek-V3's n_group / topk_group; score_topk
    only): the E experts form G contiguous groups of E / G; each group's score is the sum of
    its best two selection scores (scores + expert_bias; the best one when a group holds one
    expert), the group_topk best groups are kept and the top k are chosen among their experts
    only. Experts sit contiguously on the ep ranks (rank r holds [r E/ep, (r+1) E/ep)), so with
    groups aligned to ranks a token reaches at most group_topk groups' ranks (device-limited
    routing; the rule engine checks the alignment).
    scaling_factor (DeepSeek-V3's routed_scaling_factor, 2.5): the routed weights are multiplied
    by it after any renormalisation.
    The load-balancing loss's P_e uses softmax(logits) (sigmoid: scores / their sum per token).
    expert_bias (bias_update_rate > 0, DeepSeek-V3's aux-loss-free balancing): a [E] fp32
    buffer added to the selection scores only (never to the weights), moved after each step
    by `update_bias` from the globally summed loads.
    """

    def __init__(self, hidden: int, num_experts: int, top_k: int, *, name: str, cfg, seed: int,
                 aux_loss_coeff: float = 0.0, z_loss_coeff: float = 0.0,
                 capacity_factor: Optional[float] = None,
                 shards: Optional[SequenceShards] = None, score: str = "softmax",
                 order: str = "score_topk", norm_topk: bool = True, bias_update_rate: float = 0.0,
                 force_load_balancing: bool = False, random_stream: int = 0, num_groups: int = 1,
                 group_topk: Optional[int] = None, scaling_factor: float = 1.0) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
        if score not in ("softmax", "sigmoid") or order not in ("score_topk", "topk_score") or \
                (order == "topk_score" and score != "softmax"):
            raise ValueError(f"router score={score!r} order={order!r}: the rule engine refuses this")
        group_topk = num_groups if group_topk is None else group_topk
        if num_groups < 1 or num_experts % num_groups or not 1 <= group_topk <= num_groups or \
                top_k > group_topk * (num_experts // num_groups) or (num_groups > 1 and order != "score_topk"):
            raise ValueError(f"router num_groups={num_groups} group_topk={group_topk} top_k={top_k} "
                             f"num_experts={num_experts} order={order!r}: the rule engine refuses this")
        self.num_experts, self.top_k = num_experts, top_k
        self.num_groups, self.group_topk, self.scaling_factor = int(num_groups), int(group_topk), float(scaling_factor)
        self.aux_loss_coeff, self.z_loss_coeff = aux_loss_coeff, z_loss_coeff
        self.capacity_factor = capacity_factor
        self.score, self.order, self.norm_topk = score, order, bool(norm_topk)
        self.bias_update_rate = float(bias_update_rate)
        self.shards = shards or SequenceShards()
        self.force_load_balancing = bool(force_load_balancing)
        # The random logits' seed: the model seed, this router's name and the stream (ep rank).
        self._random_seed = (int(seed) * 1_000_003 + zlib.crc32(name.encode()) + 7919 * int(random_stream)) % 2 ** 63
        self._random_logits: Dict[tuple, torch.Tensor] = {}
        self.weight = nn.Parameter(init_tensor(f"{name}.weight", (num_experts, hidden), cfg, seed))
        self.expert_bias: Optional[torch.Tensor]
        if self.bias_update_rate > 0:
            self.register_buffer("expert_bias", torch.zeros(num_experts), persistent=True)
        else:
            self.expert_bias = None

    def random_logits(self, logits_TE: torch.Tensor) -> torch.Tensor:
        """The fixed random logits [T, E] fp32 for this shape and device (force_load_balancing)."""
        key = (tuple(logits_TE.shape), logits_TE.device)
        r = self._random_logits.get(key)
        if r is None:
            g = torch.Generator(device=logits_TE.device).manual_seed(self._random_seed)
            r = torch.randn(logits_TE.shape, generator=g, device=logits_TE.device, dtype=torch.float32)
            self._random_logits[key] = r
        return r

    def capacity(self, num_tokens: int) -> Optional[int]:
        if self.capacity_factor is None:
            return None
        return int(math.ceil(self.capacity_factor * num_tokens * self.top_k / self.num_experts))

    def _choose(self, logits_TE: torch.Tensor):
        """-> (expert_ids [T, k], weights [T, k] fp32, probs [T, E] for the balancing loss)."""
        k = self.top_k
        if self.score == "softmax":
            probs = torch.softmax(logits_TE, dim=-1)
            scores = probs
        else:
            scores = torch.sigmoid(logits_TE)
            probs = scores / scores.sum(dim=-1, keepdim=True)
        pick_from = logits_TE if self.order == "topk_score" else scores
        if self.expert_bias is not None:
            pick_from = pick_from + self.expert_bias.to(pick_from.dtype)
        if self.num_groups > 1 and self.group_topk < self.num_groups:
            pick_from = self._limit_to_groups(pick_from)
        _, ids = torch.topk(pick_from, k, dim=-1)  # sorted, ties to the lower index
        if self.order == "topk_score":
            weights = torch.softmax(logits_TE.gather(1, ids), dim=-1)
        else:
            weights = scores.gather(1, ids)
            if self.norm_topk:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.scaling_factor != 1.0:
            weights = weights * self.scaling_factor
        return ids, weights, probs

    def _limit_to_groups(self, pick_TE: torch.Tensor) -> torch.Tensor:
        """The selection scores with every expert outside the token's group_topk best groups
        set to -inf (groups ranked by the sum of their two best scores). [T, E] -> [T, E]."""
        T, G = pick_TE.shape[0], self.num_groups
        per_group = pick_TE.view(T, G, self.num_experts // G)
        group_score = per_group.topk(min(2, per_group.shape[-1]), dim=-1).values.sum(dim=-1)  # [T, G]
        best = group_score.topk(self.group_topk, dim=-1).indices  # [T, group_topk]
        keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, best, True)  # [T, G]
        return per_group.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(pick_TE)

    @torch.no_grad()
    def update_bias(self, load_E: torch.Tensor) -> torch.Tensor:
        """bias_e += rate * sign(mean load - load_e), from the step's GLOBAL routed-slot counts
        per expert (summed over every rank that routed other tokens: the same on every rank,
        whatever the layout). Returns max load / mean load (1.0 = balanced), a 0-d tensor."""
        mean = load_E.sum() / self.num_experts
        self.expert_bias.add_(self.bias_update_rate * torch.sign(mean - load_E))
        return load_E.max() / mean.clamp_min(1e-12)

    def forward(self, x_TH: torch.Tensor) -> RouterOutput:
        with torch.autocast(x_TH.device.type, enabled=False):
            logits = x_TH.float() @ self.weight.float().t()  # [T, E] fp32
        if self.force_load_balancing:
            logits = _StraightThrough.apply(logits, self.random_logits(logits))
        ids, weights, probs = self._choose(logits)
        T, E = x_TH.shape[0], self.num_experts
        z_TE = z_loss_terms(logits)
        probs_sum = probs.sum(dim=0)
        z_sum = z_TE.sum()
        # Whole-microbatch totals: routed slots per expert, summed probabilities, summed z
        # terms and the token count, in one buffer and (when sequences are split) one
        # all-reduce. Evaluation forwards attach no loss: no exchange there.
        routed = expert_counts(ids, E, torch.float32)  # slots per expert before drops
        whole = self.shards.group is None or not torch.is_grad_enabled()
        if whole:  # this rank's tokens are the totals: no buffer to build and slice
            counts_g, probs_sum_g, z_sum_g, tokens_g = routed, probs_sum.detach(), z_sum.detach(), float(max(T, 1))
        else:
            local = torch.cat([routed, probs_sum.detach(), z_sum.detach().view(1), probs_sum.new_full((1,), float(T))])
            totals = self.shards.sum(local)
            counts_g, probs_sum_g = totals[:E], totals[E:2 * E]
            z_sum_g, tokens_g = totals[2 * E], totals[2 * E + 1].clamp_min(1.0)
        f = counts_g / (tokens_g * self.top_k)
        share = float(self.shards.grad_mean_size)
        aux_raw = share * E * (f * probs_sum).sum() / tokens_g
        z_raw = share * z_sum / tokens_g
        dropped = torch.zeros((), dtype=torch.long, device=ids.device)
        cap, positions = self.capacity(T), None
        if cap is not None:
            ids, weights, dropped, positions = apply_capacity(ids, weights, E, cap)
        # after drops: without a capacity the routed counts themselves (one cast, not a recount)
        kept = routed.long() if cap is None else expert_counts(ids, E, torch.long)
        if whole and share == 1.0:  # the whole-microbatch figures are the losses' own values
            aux_stat, z_stat = aux_raw.detach(), z_raw.detach()
        else:
            aux_stat, z_stat = (E * (f * probs_sum_g).sum() / tokens_g).detach(), (z_sum_g / tokens_g).detach()
        stats = {"tokens_per_expert": kept, "dropped": dropped, "aux_loss": aux_stat, "z_loss": z_stat,
                 # Slots routed to each expert before drops, over the ranks sharing these sequences.
                 "load": counts_g.detach()}
        return RouterOutput(ids, weights, self.aux_loss_coeff * aux_raw, self.z_loss_coeff * z_raw, stats,
                            positions=positions, capacity=cap)
