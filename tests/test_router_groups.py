"""Group-limited routing (model.moe_router_num_groups / moe_router_group_topk) and the routed
weights' scale (model.moe_router_scaling_factor): the vectorised router against a per-token
reference written here from the DeepSeek-V3 definition, the device-limited bound under ep
placement, and the validator's refusals (tests/test_rules.py applies their fixes)."""
import pytest
import torch

from mpoverlap.config import compose


def _router(E=16, k=4, **kw):
    from mpoverlap.moe.router import TopKRouter

    cfg = compose(["model=moe_fine_tiny"]).model
    opts = dict(score="sigmoid", order="score_topk", norm_topk=True)
    opts.update(kw)
    return TopKRouter(32, E, k, name="r", cfg=cfg, seed=5, **opts)


def _reference(logits, bias, G, gk, k, norm, scale):
    """Per token, in plain Python: sigmoid scores, selection scores = scores + bias, each
    group's score the sum of its two best selection scores, the gk best groups kept, the k best
    of their experts chosen; weights from the unbiased scores."""
    T, E = logits.shape
    n = E // G
    ids, weights = [], []
    for t in range(T):
        s = [1.0 / (1.0 + torch.exp(-logits[t, e]).item()) for e in range(E)]
        sel = [s[e] + float(bias[e]) for e in range(E)]
        gscore = [sum(sorted(sel[g * n:(g + 1) * n], reverse=True)[:2]) for g in range(G)]
        groups = sorted(range(G), key=lambda g: -gscore[g])[:gk]
        cand = [e for g in groups for e in range(g * n, (g + 1) * n)]
        chosen = sorted(cand, key=lambda e: -sel[e])[:k]
        w = [s[e] for e in chosen]
        if norm:
            w = [x / sum(w) for x in w]
        ids.append(chosen)
        weights.append([x * scale for x in w])
    return torch.tensor(ids), torch.tensor(weights, dtype=torch.float64)


@pytest.mark.parametrize("G,gk,norm,scale,with_bias", [(4, 2, True, 2.5, True), (8, 3, False, 1.0, False),
                                                       (16, 5, True, 1.0, True), (2, 1, True, 0.5, False)])
def test_group_limited_choice_matches_the_per_token_reference(G, gk, norm, scale, with_bias):
    torch.manual_seed(0)
    r = _router(num_groups=G, group_topk=gk, norm_topk=norm, scaling_factor=scale,
                bias_update_rate=0.1 if with_bias else 0.0)
    if with_bias:
        r.expert_bias.copy_(torch.randn(16) * 0.3)
    x = torch.randn(24, 32)
    out = r(x)
    logits = x @ r.weight.detach().t()
    bias = r.expert_bias if with_bias else torch.zeros(16)
    ref_ids, ref_w = _reference(logits, bias, G, gk, 4, norm, scale)
    assert torch.equal(out.expert_ids, ref_ids)
    torch.testing.assert_close(out.weights.double(), ref_w, rtol=1e-6, atol=1e-7)


def test_groups_change_the_choice_and_all_groups_is_plain_top_k():
    torch.manual_seed(1)
    x = torch.randn(64, 32)
    plain, all_groups, limited = _router(), _router(num_groups=4, group_topk=4), _router(num_groups=4, group_topk=1)
    limited.load_state_dict(plain.state_dict())
    all_groups.load_state_dict(plain.state_dict())
    a, b, c = plain(x), all_groups(x), limited(x)
    assert torch.equal(a.expert_ids, b.expert_ids) and torch.equal(a.weights, b.weights)
    assert not torch.equal(a.expert_ids, c.expert_ids)
    assert bool(((c.expert_ids // 4) == (c.expert_ids[:, :1] // 4)).all())  # one group per token


def test_scaling_factor_scales_the_weights_after_renormalisation_and_their_gradient():
    torch.manual_seed(2)
    x = torch.randn(16, 32, requires_grad=True)
    one, scaled = _router(), _router(scaling_factor=2.5)
    scaled.load_state_dict(one.state_dict())
    a, b = one(x), scaled(x)
    assert torch.equal(a.expert_ids, b.expert_ids)
    torch.testing.assert_close(b.weights, 2.5 * a.weights)
    torch.testing.assert_close(b.weights.sum(-1), torch.full((16,), 2.5))
    ga, = torch.autograd.grad(a.weights[:, 0].sum(), x)
    gb, = torch.autograd.grad(b.weights[:, 0].sum(), x)
    torch.testing.assert_close(gb, 2.5 * ga)


@pytest.mark.parametrize("ep,G,gk", [(4, 8, 2), (4, 4, 2), (4, 2, 1), (8, 16, 3)])
def test_groups_aligned_with_ep_ranks_bound_the_ranks_a_token_visits(ep, G, gk):
    """Rank r holds experts [r E/ep, (r+1) E/ep) (the dispatcher's placement): with the rule's
    alignment a token's experts lie on at most group_topk * max(1, ep / G) ranks; without
    groups the same logits reach more ranks."""
    from mpoverlap.moe.dispatcher import AllToAllDispatcher

    E, k = 32, 6
    torch.manual_seed(3)
    x = torch.randn(256, 32)
    limited, plain = _router(E, k, num_groups=G, group_topk=gk), _router(E, k)
    plain.load_state_dict(limited.state_dict())
    firsts = [AllToAllDispatcher(object(), ep, r, E, False, None).first_expert for r in range(ep)]
    per_rank = E // ep
    assert firsts == [r * per_rank for r in range(ep)]

    def ranks_visited(ids):
        onehot = torch.zeros(ids.shape[0], ep, dtype=torch.bool).scatter_(1, ids // per_rank, True)
        return onehot.sum(-1)

    bound = gk * max(1, ep // G)
    assert int(ranks_visited(limited(x).expert_ids).max()) <= bound
    assert int(ranks_visited(plain(x).expert_ids).max()) > bound


@pytest.mark.parametrize("overrides,rule", [
    (["model.moe_router_num_groups=5"], "moe.router_groups_values"),
    (["model.moe_router_num_groups=4", "model.moe_router_group_topk=5"], "moe.router_groups_values"),
    (["model.moe_router_num_groups=8", "model.moe_router_group_topk=1"], "moe.router_groups_values"),
    (["model.moe_router_num_groups=4", "model.moe_router_order=topk_score"], "moe.router_groups_values"),
    (["model.moe_router_scaling_factor=0"], "moe.router_groups_values"),
    (["model.num_experts=24", "model.moe_router_num_groups=6", "parallel.dp=4", "parallel.ep=4"],
     "moe.router_groups_follow_ep"),
])
def test_validator_refuses_bad_group_settings(overrides, rule):
    from mpoverlap.overlap import validate

    problems = [p for p in validate(compose(["model=moe_fine_tiny", *overrides])) if p.rule == rule]
    assert problems and all(p.fix for p in problems), overrides


def test_validator_accepts_deepseek_style_groups():
    from mpoverlap.overlap import validate

    for ov in (["model.moe_router_num_groups=8", "model.moe_router_group_topk=4", "parallel.dp=4", "parallel.ep=4"],
               ["model.moe_router_num_groups=2", "model.moe_router_group_topk=1", "parallel.dp=4", "parallel.ep=4"]):
        assert [p.render() for p in validate(compose(["model=moe_fine_tiny", "model.moe_router_score=sigmoid",
                                                      "model.moe_router_scaling_factor=2.5", *ov]))] == []
