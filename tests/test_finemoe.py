"""Fine-grained MoE: router options, the aux-loss-free expert bias, shared
experts of their own width, dense leading layers, expert tensor parallelism (parallel.etp),
exact parameter counts, and parity of every parallel layout with the single-process curve."""
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mpoverlap.config import compose

BIN = Path(sys.executable).parent


# ---- router ------------------------------------------------------------------------------

def _router(**kw):
    from mpoverlap.moe.router import TopKRouter

    cfg = compose(["model=moe_fine_tiny"]).model
    opts = dict(score="softmax", order="score_topk", norm_topk=True)
    opts.update(kw)
    return TopKRouter(64, 64, 8, name="r", cfg=cfg, seed=3, **opts)


def test_topk_then_softmax_equals_renormalised_softmax_then_topk():
    x = torch.randn(40, 64)
    a, b = _router(), _router(order="topk_score")
    ra, rb = a(x), b(x)
    assert torch.equal(ra.expert_ids, rb.expert_ids)
    torch.testing.assert_close(ra.weights, rb.weights, rtol=1e-6, atol=1e-7)
    assert torch.allclose(rb.weights.sum(-1), torch.ones(40))


def test_score_functions_and_normalisation():
    x = torch.randn(40, 64)
    r = _router(norm_topk=False)
    out = r(x)
    probs = torch.softmax(x @ r.weight.t(), -1)
    torch.testing.assert_close(out.weights, probs.gather(1, out.expert_ids))  # DeepSeek-MoE: not renormalised
    s = _router(score="sigmoid")
    out = s(x)
    scores = torch.sigmoid(x @ s.weight.t())
    assert torch.equal(out.expert_ids, torch.topk(scores, 8, -1).indices)
    torch.testing.assert_close(out.weights.sum(-1), torch.ones(40))
    with pytest.raises(ValueError):
        _router(score="sigmoid", order="topk_score")


def test_expert_bias_steers_selection_only_and_follows_the_sign_rule():
    x = torch.randn(40, 64)
    r = _router(norm_topk=False, bias_update_rate=0.5)
    before = r(x)
    load = torch.zeros(64)
    load[:8] = 10.0  # mean 1.25: experts 0..7 overloaded, the rest underloaded
    ratio = r.update_bias(load)
    assert float(ratio) == pytest.approx(8.0)
    assert torch.equal(r.expert_bias[:8], torch.full((8,), -0.5)) and torch.equal(r.expert_bias[8:], torch.full((56,), 0.5))
    after = r(x)
    assert not bool((after.expert_ids < 8).any())  # a 0.5 bias outweighs any softmax gap here
    probs = torch.softmax(x @ r.weight.t(), -1)
    torch.testing.assert_close(after.weights, probs.gather(1, after.expert_ids))  # weights carry no bias
    assert not torch.equal(before.expert_ids, after.expert_ids)


def test_forced_load_balancing_routes_evenly_and_passes_the_gradient_straight_through():
    """model.moe_router_force_load_balancing (benchmarks): a router whose own logits send every
    token to experts 0..7 still spreads the slots evenly; the same draws on every call (a
    recomputed forward routes alike), other draws on another ep rank; the router weight's
    gradient is the one its logits would get if they had been the random ones."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 64, generator=g)
    r = _router(force_load_balancing=True, random_stream=0)
    with torch.no_grad():
        r.weight.zero_()
        r.weight[:8] = 5.0  # unbalanced: its own choice would be experts 0..7 for every token
    out = r(x)
    load = torch.bincount(out.expert_ids.reshape(-1), minlength=64).float()
    mean = 4096 * 8 / 64
    assert float(load.max()) < 1.25 * mean and float(load.min()) > 0.75 * mean, load
    again = r(x)
    assert torch.equal(out.expert_ids, again.expert_ids) and torch.equal(out.weights, again.weights)
    other = _router(force_load_balancing=True, random_stream=1)(x)
    assert not torch.equal(out.expert_ids, other.expert_ids)
    # Straight through: d loss / d logits at the random logits, times x, is the weight's gradient.
    rand = r.random_logits(x @ r.weight.t()).clone().requires_grad_()
    ids, weights, _ = r._choose(rand)
    assert torch.equal(ids, out.expert_ids)
    coeff = torch.randn(4096, 8, generator=g)
    (out.weights * coeff).sum().backward()
    (weights * coeff).sum().backward()
    torch.testing.assert_close(r.weight.grad, rand.grad.t() @ x, rtol=1e-4, atol=2e-5)  # summation order
    off = _router()(x)  # the key off: the router's own logits
    assert not torch.equal(off.expert_ids, out.expert_ids)


def _capacity_one_hot(ids, weights, E, cap):
    """A [T*k, E] one-hot formulation, as the reference."""
    flat = ids.reshape(-1)
    onehot = torch.nn.functional.one_hot(flat, E)
    position = (onehot.cumsum(dim=0) * onehot).sum(dim=1) - 1
    keep = (position < cap).view_as(ids)
    return torch.where(keep, ids, torch.full_like(ids, -1)), weights * keep, (~keep).sum(), position.view_as(ids)


def test_capacity_is_linear_in_slots_and_equals_the_one_hot_reference():
    from mpoverlap.moe.router import apply_capacity

    g = torch.Generator().manual_seed(0)
    T, k, E = 500, 8, 64
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    ids[:100, 0] = 3  # a hot expert
    w = torch.rand(T, k, generator=g)
    for cap in (1, 20, 63, 10_000):
        got, ref = apply_capacity(ids, w, E, cap), _capacity_one_hot(ids, w, E, cap)
        assert len(got) == len(ref) == 4 and all(torch.equal(a, b) for a, b in zip(got, ref))
    # No tensor of T*k x E elements is allocated (the one-hot would be 256,000 here).
    sizes = []

    class Spy(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor):
                sizes.append(out.numel())
            return out

    with Spy():
        apply_capacity(ids, w, E, 20)
    assert max(sizes) <= T * k


# ---- model structure and counts ----------------------------------------------------------

def test_dense_leading_layers_and_shared_expert_width():
    from mpoverlap.models.gpt import GPT, MLP
    from mpoverlap.moe.layer import MoELayer

    cfg = compose(["model=moe_fine_tiny"]).model
    model = GPT(cfg, seed=1)
    kinds = [type(b.mlp) for b in model.layers.values()]
    assert kinds == [MLP, MoELayer, MoELayer, MoELayer]
    shared = model.layers["1"].mlp.shared_expert
    assert shared.gate_up.weight.shape == (2 * 64, 64) and shared.down.weight.shape == (64, 64)
    assert model.layers["1"].mlp.experts.num_local_experts == 16
    # The boolean alone means one shared expert of the expert width.
    old = GPT(compose(["model=moe_tiny", "model.shared_expert=true"]).model, seed=1)
    assert old.layers["0"].mlp.shared_expert.down.weight.shape == (128, 176)


@pytest.mark.parametrize("overrides", [["model=moe_fine_tiny"], ["model=moe_tiny", "model.shared_expert=true"],
                                       ["model=gpt_tiny"], ["model=moe_fine_tiny", "model.moe_layer_freq=2"]])
def test_parameter_count_is_exact(overrides):
    from mpoverlap.models.gpt import GPT, num_parameters
    from mpoverlap.overlap.estimate.params import model_params

    cfg = compose(overrides)
    total, active = model_params(cfg)
    assert total == num_parameters(GPT(cfg.model, seed=1))
    m = cfg.model
    if m.num_experts:
        per_expert = 3 * m.hidden_size * m.moe_ffn_hidden_size
        n_moe = sum(1 for i in range(m.num_layers) if i >= m.moe_first_dense_layers and i % m.moe_layer_freq == 0)
        assert total - active == n_moe * (m.num_experts - m.moe_top_k) * per_expert


def test_check_prints_the_deepseek_count_within_half_a_percent():
    """DeepSeek-MoE 16B: published 16.4B total, ~2.8B active (its preset's comment)."""
    proc = subprocess.run([str(BIN / "mpoverlap-check"), "model=deepseek_moe_16b"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    m = re.search(r"parameters: ([\d,]+) total .*?, ([\d,]+) active per token", proc.stdout)
    total, active = (int(g.replace(",", "")) for g in m.groups())
    assert abs(total - 16.4e9) / 16.4e9 < 0.005
    assert abs(active - 2.8e9) / 2.8e9 < 0.02
    from mpoverlap.config import config_dir

    assert f"{total:,}" in (Path(config_dir()) / "model" / "deepseek_moe_16b.yaml").read_text()  # the comment's figure


def test_etp_slices_the_seed_drawn_expert_weights():
    """etp shards concatenate to the etp=1 weights (layout-independent initialisation)."""
    from mpoverlap.moe.experts import Experts

    cfg = compose(["model=moe_fine_tiny"]).model
    full = Experts(2, 64, 32, first_expert_index=4, name_prefix="layers.1.mlp", cfg=cfg, seed=7)
    parts = [Experts(2, 64, 32, first_expert_index=4, name_prefix="layers.1.mlp", cfg=cfg, seed=7,
                     etp_rank=r, etp_size=2) for r in range(2)]
    for i in range(2):
        f, a, b = full.local[i], parts[0].local[i], parts[1].local[i]
        gate_up = [torch.cat([p.w_in.view(2, 16, 64)[j] for p in (a, b)]) for j in range(2)]
        assert torch.equal(torch.cat(gate_up), f.w_in)
        assert torch.equal(torch.cat([a.w_out, b.w_out], dim=1), f.w_out)
        assert a.w_in.tensor_model_parallel and a.w_in.expert_parallel and a.w_out.partition_dim == 1
        x = torch.randn(5, 64)
        torch.testing.assert_close(a(x) + b(x), f(x), rtol=1e-5, atol=1e-6)



def test_grouped_experts_hold_the_per_expert_weights_and_outputs():
    """The stacked experts' slices are the per-expert modules' weights (same names,
    same etp slices), and the grouped GEMMs' etp partial outputs sum to the per-expert loop's."""
    from mpoverlap.moe.experts import Experts, GroupedExperts
    from mpoverlap.tensor_parallel.layers import shard_tensor

    cfg = compose(["model=moe_fine_tiny"]).model
    kw = dict(first_expert_index=4, name_prefix="layers.1.mlp", cfg=cfg, seed=7)
    loop = Experts(2, 64, 32, **kw)
    ref = loop.global_names()
    parts = [GroupedExperts(2, 64, 32, etp_rank=r, etp_size=2, **kw) for r in range(2)]
    for part, r in zip(parts, range(2)):
        got = part.global_names()
        assert set(got) == set(ref)
        for name, w in got.items():
            dim = 0 if name.endswith("gate_up.weight") else 1
            assert w.partition_dim == dim and torch.equal(w, shard_tensor(ref[name], dim, r, 2, 2 - dim))
    x = torch.randn(7, 64)
    counts = torch.tensor([3, 4])
    torch.testing.assert_close(parts[0](x, counts) + parts[1](x, counts), loop(x, [3, 4]), rtol=1e-5, atol=1e-6)
    assert all(torch.equal(w, ref[n]) for n, w in GroupedExperts(2, 64, 32, **kw).global_names().items())


def test_estimate_splits_experts_over_etp_and_counts_its_traffic():
    from mpoverlap.overlap.estimate import estimate

    base = ["model=moe_fine_tiny", "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.dp=2",
            "parallel.ep=2", "train.global_batch_size=8", "train.micro_batch_size=2"]
    one, two = (estimate(compose(base + [f"parallel.etp={e}"]), 4) for e in (1, 2))
    expert_one = 3 * 64 * 32 * 8 * 3  # 8 local experts, 3 MoE layers
    assert one.params - two.params == expert_one // 2
    assert two.comm_bytes_per_step["tp"] > one.comm_bytes_per_step["tp"]
    assert two.comm_bytes_per_step["ep"] == pytest.approx(
        2 * (one.comm_bytes_per_step["ep"]) - _counts_bytes(compose(base)), rel=1e-9)


def _counts_bytes(cfg):
    """The per-chunk count exchanges of the all-to-all dispatcher (not scaled by the tokens)."""
    from mpoverlap.overlap.config import ep_chunks

    m, micro = cfg.model, 2
    return min(ep_chunks(cfg), 2 * 32) * m.num_experts * 8 * 3 * micro


def test_grid_names_the_expert_tp_groups():
    from mpoverlap.parallel.grid import RankGrid

    g = RankGrid(tp=2, dp=4, ep=2, etp=2)
    assert g.groups("etp") == g.groups("tp")
    assert RankGrid(tp=2, dp=4, ep=2).groups("etp") == [[r] for r in range(8)]
    # ep and edp groups never mix tp ranks: rank (t, e) holds slice t of ep rank e's experts.
    for kind in ("ep", "edp"):
        assert all(len({r % 2 for r in grp}) == 1 for grp in g.groups(kind))
    with pytest.raises(ValueError):
        RankGrid(tp=4, dp=2, etp=2)
