"""Group-limited routing and the routed weights' scale (model.moe_router_num_groups,
moe_router_group_topk, moe_router_scaling_factor; moe/router.py says what they do).

With ep > 1 the groups must follow expert placement: experts sit contiguously on the ep ranks
(rank r holds experts [r E/ep, (r+1) E/ep)) and a group is E/G contiguous experts, so group
and rank boundaries line up when G is a multiple of ep (each rank holds G/ep whole groups) or
ep a multiple of G (each group spans ep/G whole ranks, DeepSeek-V3's node-limited routing).
A token then visits at most group_topk * max(1, ep/G) ranks; a group straddling two ranks
would make that bound a lie.
"""
from __future__ import annotations

from mpoverlap.overlap.layout import Layout
from mpoverlap.overlap.rules import Problem, divisors, rule

GROUP_KEYS = ("model.moe_router_num_groups", "model.moe_router_group_topk", "model.moe_router_scaling_factor")


def _nearest(options, value):
    return min(options, key=lambda d: (abs(d - value), d))


@rule("moe.router_groups_values", "ep",
      (*GROUP_KEYS, "model.num_experts", "model.moe_top_k", "model.moe_router_order"),
      "group-limited routing: groups divide the experts, 1 <= group_topk <= groups, the kept groups "
      "hold at least top_k experts, score_topk order; the routed weights' scale is positive")
def _values(lo: Layout):
    m = lo.cfg.model
    G, gk, E, k = m.moe_router_num_groups, m.moe_router_group_topk, m.num_experts, m.moe_top_k
    if not m.moe_router_scaling_factor > 0:
        yield Problem("moe.router_groups_values", {"model.moe_router_scaling_factor": m.moe_router_scaling_factor},
                      "the routed weights are multiplied by it: it must be positive (1.0 = unscaled)",
                      ["model.moe_router_scaling_factor=1.0"])
    if E <= 0:
        return
    if G < 1 or E % G:
        yield Problem("moe.router_groups_values", {"model.moe_router_num_groups": G, "model.num_experts": E},
                      f"the {E} experts split into num_groups groups of equal size; {G} does not divide {E}",
                      [f"model.moe_router_num_groups={_nearest(divisors(E), max(G, 1))}"])
        return
    if gk is not None and not 1 <= gk <= G:
        yield Problem("moe.router_groups_values", {"model.moe_router_group_topk": gk, "model.moe_router_num_groups": G},
                      f"group_topk is how many of the {G} groups a token may use: between 1 and {G}",
                      [f"model.moe_router_group_topk={min(max(gk, 1), G)}"])
        return
    kept = (G if gk is None else gk) * (E // G)
    if 1 <= k <= E and k > kept:
        yield Problem("moe.router_groups_values", {"model.moe_top_k": k, "model.moe_router_group_topk": gk,
                                                   "model.moe_router_num_groups": G},
                      f"the {gk} kept groups of {E // G} experts hold {kept} experts, fewer than the top_k={k} "
                      "a token is routed to", [f"model.moe_router_group_topk={min(G, -(-k // (E // G)))}"])
    if G > 1 and m.moe_router_order != "score_topk":
        yield Problem("moe.router_groups_values", {"model.moe_router_num_groups": G,
                                                   "model.moe_router_order": m.moe_router_order},
                      "groups are ranked by the experts' scores before the top-k choice (score_topk); "
                      "topk_score picks by logits and softmaxes the k", ["model.moe_router_order=score_topk"])


@rule("moe.router_groups_follow_ep", "ep", ("model.moe_router_num_groups", "parallel.ep", "model.num_experts"),
      "with ep > 1 the router's groups line up with the ep ranks' experts (groups a multiple of ep, or ep "
      "a multiple of groups), so a token visits at most group_topk groups' ranks")
def _follow_ep(lo: Layout):
    m = lo.cfg.model
    G, E, ep = m.moe_router_num_groups, m.num_experts, lo.ep
    if ep is None or ep <= 1 or G <= 1 or E <= 0 or E % G or E % ep:
        return
    if G % ep and ep % G:
        aligned = [g for g in divisors(E) if g % ep == 0 or ep % g == 0]
        yield Problem("moe.router_groups_follow_ep", {"model.moe_router_num_groups": G, "parallel.ep": ep,
                                                      "model.num_experts": E},
                      f"each ep rank holds {E // ep} contiguous experts and each group {E // G}: groups would "
                      "straddle two ranks, so limiting the groups would not limit the ranks a token visits",
                      [f"model.moe_router_num_groups={_nearest(aligned, G)}"])


@rule("moe.router_groups_need_experts", "ep", (*GROUP_KEYS, "model.num_experts"),
      "router group and scale keys are set only on a mixture-of-experts model (never silently ignored)")
def _need_experts(lo: Layout):
    m = lo.cfg.model
    if m.num_experts != 0:
        return
    for key, value, default in (("model.moe_router_num_groups", m.moe_router_num_groups, 1),
                                ("model.moe_router_group_topk", m.moe_router_group_topk, None),
                                ("model.moe_router_scaling_factor", m.moe_router_scaling_factor, 1.0)):
        if value != default:
            yield Problem("moe.router_groups_need_experts", {key: value, "model.num_experts": 0},
                          "a dense model has no router for this key to act on",
                          [f"{key}={'null' if default is None else default}"])
