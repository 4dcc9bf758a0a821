"""Property-based checks of the validator (hypothesis): it never crashes, every rejection
names a key with a fix, every fix leads to an accepted config whose model runs, and accepted
layouts of up to 8 ranks (seeded draws) train two steps without a hang."""
import math
import os
import sys

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from mpoverlap.config import ConfigError, compose
from mpoverlap.overlap.layout import build_layout
from mpoverlap.overlap.rules import validate

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

ANY_VALUE = st.one_of(st.integers(-3, 9), st.sampled_from(["auto", "true", "false", "x", "p2p", "a2a", "0",
                                                             "sigmoid", "topk_score", "1e-3"]),
                      st.booleans())
KEYS = ["parallel.tp", "parallel.pp", "parallel.vpp", "parallel.cp", "parallel.ep", "parallel.dp",
        "parallel.sequence_parallel", "parallel.cp_comm", "overlap.dp", "overlap.tp", "overlap.pp", "overlap.cp",
        "overlap.ep", "overlap.dp_param_gather", "overlap.dp_bucket_mb", "train.distributed_optimizer",
        "train.dp_sharding", "overlap.dp_prefetch", "train.reshard_after_forward",
        "train.global_batch_size", "train.micro_batch_size", "model.num_layers", "model.num_attention_heads",
        "model.seq_length", "model.num_experts", "model.tie_embeddings", "train.on_nonfinite",
        "model.moe_top_k", "model.moe_layer_freq", "model.moe_capacity_factor", "model.moe_dispatcher",
        "model.shared_expert", "overlap.ep_chunks", "train.profile", "train.profile_steps",
        # fine-grained MoE and expert tensor parallelism
        "parallel.etp", "model.moe_shared_expert_ffn_hidden_size", "model.moe_first_dense_layers",
        "model.moe_router_score", "model.moe_router_order", "model.moe_router_norm_topk",
        "model.moe_router_bias_update_rate", "model.moe_router_force_load_balancing",
        # grouped-query attention
        "model.num_query_groups",
        # forward/backward pairing, also in the pipeline
        "overlap.ep_pairing", "parallel.pp_schedule"]


def _fmt(v):
    return str(v).lower() if isinstance(v, bool) else str(v)


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(KEYS), ANY_VALUE, max_size=8), st.sampled_from([None, 1, 2, 4, 8, 16]))
def test_validator_never_crashes_and_names_keys(assignment, world):
    overrides = [f"{k}={_fmt(v)}" for k, v in assignment.items()]
    try:
        cfg = compose(overrides)
    except ConfigError as err:  # a wrong type: Hydra's message names the key
        assert any(k.split(".")[-1] in str(err) for k in assignment), str(err)
        return
    for problem in validate(cfg, world):
        assert problem.keys and problem.reason and problem.fix
        text = problem.render()
        assert any(key in text for key in problem.keys)


LAYOUT_CHOICES = {
    "parallel.tp": [1, 2, 4], "parallel.pp": [1, 2, 4], "parallel.vpp": [1, 2], "parallel.cp": [1, 2],
    "parallel.dp": [1, 2, 4], "parallel.sequence_parallel": [True, False], "parallel.cp_comm": ["p2p", "a2a"],
    "train.distributed_optimizer": [True, False], "overlap.dp": ["auto", "false"], "overlap.tp": ["auto", "false"],
    "overlap.pp": ["auto", "false"], "overlap.cp": ["auto", "false"], "model.tie_embeddings": [True, False],
    "model.num_layers": [2, 4], "train.micro_batch_size": [1, 2], "train.global_batch_size": [8, 16],
    "model.num_experts": [0, 4], "parallel.ep": [1, 2], "overlap.ep": ["auto", "false"],
    "model.num_query_groups": ["null", 1, 2], "train.dp_sharding": ["none", "optim_grads", "optim_grads_params"],
}
TINY = ["model.hidden_size=32", "model.num_attention_heads=4", "model.ffn_hidden_size=64", "model.seq_length=32",
        "data.max_bytes=100000", "train.progress=false", "train.eval_iters=1", "overlap.dp_bucket_mb=0.02"]


def _accepted_layouts(count: int, seed: int = 0) -> list:
    """`count` distinct layouts drawn (seeded) from LAYOUT_CHOICES that the validator accepts
    and that fit in 8 ranks, as override lists."""
    import random

    rng, found = random.Random(seed), {}
    while len(found) < count:
        layout = {k: rng.choice(v) for k, v in LAYOUT_CHOICES.items()}
        if math.prod(layout[f"parallel.{d}"] for d in ("tp", "pp", "cp", "dp")) > 8:
            continue  # lo.world (all four degrees are given) is over 8: not composed (0.1 s each)
        overrides = TINY + [f"{k}={_fmt(v)}" for k, v in layout.items()]
        cfg = compose(overrides)
        lo = build_layout(cfg)
        if lo.world is not None and lo.world <= 8 and not validate(cfg):
            found[tuple(overrides)] = lo.world
    return [(list(ov), world) for ov, world in found.items()]


def _reference_overrides(overrides: list) -> list:
    """The single-process run of the same model and global batch."""
    return [o for o in overrides if not o.startswith(("parallel.", "overlap.", "train.distributed_optimizer", "train.dp_sharding"))]


@pytest.mark.slow
def test_accepted_layouts_train_two_steps(tmp_path_factory):
    """8 accepted layouts of up to 8 ranks (seeded draws) each train two steps inside one spawn per
    world size, without a hang (the harness times out), and reproduce the single-process losses
    of their model (dropless MoE included)."""
    from inproc_train import train_layouts

    layouts = _accepted_layouts(8)
    assert len({world for _, world in layouts}) >= 2  # the draws cover several world sizes
    specs = {f"layout{i}": (world, ov, 2) for i, (ov, world) in enumerate(layouts)}
    refs = {}
    for i, (ov, _) in enumerate(layouts):
        refs.setdefault(tuple(_reference_overrides(ov)), []).append(f"layout{i}")
    for j, ref in enumerate(refs):
        specs[f"ref{j}"] = (1, list(ref), 2)
    got = train_layouts(specs, tmp_path_factory.mktemp("prop"), timeout_s=600)
    for i, (ov, world) in enumerate(layouts):
        losses = [r["loss"] for r in got[f"layout{i}"]]
        assert len(losses) == 2 and all(math.isfinite(x) for x in losses), (world, ov, losses)
    for j, names in enumerate(refs.values()):
        ref = [r["loss"] for r in got[f"ref{j}"]]
        for name in names:
            losses = [r["loss"] for r in got[name]]
            assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses, ref)), (specs[name], losses, ref)


FIXABLE = {
    "model.hidden_size": st.integers(1, 48), "model.num_attention_heads": st.integers(1, 8),
    "model.ffn_hidden_size": st.integers(1, 48), "model.seq_length": st.integers(2, 24),
    "model.num_layers": st.integers(1, 4), "model.num_experts": st.sampled_from([0, 2, 3, 4]),
    "model.moe_top_k": st.integers(0, 5), "model.activation": st.sampled_from(["gelu", "swiglu"]),
    "parallel.tp": st.integers(1, 4), "parallel.pp": st.integers(1, 3), "parallel.vpp": st.integers(1, 2),
    "parallel.cp": st.integers(1, 3), "parallel.ep": st.integers(1, 2), "parallel.sequence_parallel": st.booleans(),
    "parallel.cp_comm": st.sampled_from(["p2p", "a2a"]), "train.global_batch_size": st.integers(1, 12),
    "train.micro_batch_size": st.integers(1, 4), "overlap.tp": st.sampled_from(["auto", "true"]),
    "parallel.etp": st.integers(1, 4), "model.shared_expert": st.booleans(),
    "model.moe_shared_expert_ffn_hidden_size": st.sampled_from(["null", 0, 12]),
    "model.moe_first_dense_layers": st.integers(-1, 4), "model.moe_router_score": st.sampled_from(["softmax", "sigmoid"]),
    "model.moe_router_order": st.sampled_from(["score_topk", "topk_score"]),
    "model.moe_router_bias_update_rate": st.sampled_from([0, 0.01, -0.01]),
    "model.moe_router_force_load_balancing": st.booleans(),
    "model.num_query_groups": st.sampled_from(["null", 0, 1, 2, 3, 4, 6]),
}


def _apply_fixes(assignment: dict, world, rounds: int = 6):
    """Apply every problem's fix (later values win) until the validator accepts; returns the
    config and the overrides, or fails naming the fixes that went round in circles."""
    current = dict(assignment)
    history = []
    for _ in range(rounds):
        cfg = compose([f"{k}={v}" for k, v in current.items()])
        problems = validate(cfg, world)
        if not problems:
            return cfg, current
        history.append([p.render() for p in problems])
        for p in problems:
            for fix in p.fix:
                key, value = fix.split("=", 1)
                current[key] = value
    raise AssertionError(f"fixes did not converge from {assignment}:\n" + "\n---\n".join(map("\n".join, history)))


@settings(max_examples=20, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow,
                                                                                   HealthCheck.filter_too_much])
@given(st.fixed_dictionaries({}, optional=FIXABLE))
# Head dimension 5 (odd), and heads that do not divide the hidden size
# (the fix must not pick a head count with an odd head dimension either).
@example({"model.hidden_size": 10, "model.num_attention_heads": 2, "model.ffn_hidden_size": 32,
          "model.num_layers": 1})
@example({"model.hidden_size": 30, "model.num_attention_heads": 4})
@example({"model.hidden_size": 9, "model.num_attention_heads": 3})
# The fine-grained MoE keys at once: an etp that is not tp, every layer dense, sigmoid with top-k-then-
# softmax, a shared width without a shared expert, a negative bias rate.
@example({"model.num_experts": 4, "model.moe_top_k": 2, "parallel.tp": 2, "parallel.etp": 3, "model.num_layers": 2,
          "model.moe_first_dense_layers": 2, "model.moe_router_score": "sigmoid",
          "model.moe_router_order": "topk_score", "model.moe_shared_expert_ffn_hidden_size": 12,
          "model.shared_expert": False, "model.moe_router_bias_update_rate": -0.01})
@example({"model.num_experts": 0, "parallel.etp": 2, "model.moe_first_dense_layers": 1,
          "model.moe_router_bias_update_rate": 0.01})
# Grouped-query attention: groups that divide neither the heads nor tp, with the all-to-all
# variant (whose head split needs cp x tp | groups too) and its overlap.
@example({"model.num_attention_heads": 8, "model.hidden_size": 32, "model.num_query_groups": 3, "parallel.tp": 4,
          "parallel.cp": 2, "parallel.cp_comm": "a2a", "overlap.tp": "true"})
@example({"model.num_attention_heads": 4, "model.num_query_groups": 1, "parallel.tp": 2, "parallel.cp": 2,
          "parallel.cp_comm": "a2a"})
# Pairing in the pipeline: at vpp 1 (fix: vpp 2) and with a zero-bubble schedule
# (fix: interleaved).
@example({"model.num_experts": 4, "model.moe_top_k": 2, "parallel.ep": 2, "parallel.pp": 2, "model.num_layers": 4,
          "train.global_batch_size": 8, "train.micro_batch_size": 1, "overlap.ep_pairing": "true"})
@example({"model.num_experts": 4, "model.moe_top_k": 2, "parallel.ep": 2, "parallel.pp": 2, "parallel.vpp": 2,
          "model.num_layers": 4, "train.global_batch_size": 8, "train.micro_batch_size": 1,
          "parallel.pp_schedule": "zbv", "overlap.ep_pairing": "true"})
def test_every_fix_gives_an_accepted_config_whose_model_runs(assignment):
    """Fixes applied (all of them, round after round) end in a config the validator accepts,
    and its model builds and runs one forward and backward at this tiny size (an accepted
    config, fixed or not, never crashes the model: an odd head dimension must not either)."""
    import torch

    from mpoverlap.models.gpt import GPT

    overrides = {k: _fmt(v) for k, v in assignment.items()}
    overrides.setdefault("model.moe_ffn_hidden_size", "8")
    try:
        cfg = compose([f"{k}={v}" for k, v in overrides.items()])
    except ConfigError:
        return
    cfg, _ = _apply_fixes(overrides, None)  # an accepted config has none: its model must run too
    from mpoverlap.moe.experts import ExpertMLP

    torch.manual_seed(0)
    model = GPT(cfg.model)
    # Tokens each expert computed: only an expert that got none may end without gradients.
    routed = {}
    for module in model.modules():
        if isinstance(module, ExpertMLP):
            routed[module] = 0
            module.register_forward_hook(lambda m, args, out: routed.__setitem__(m, routed[m] + args[0].shape[0]))
    tokens = torch.randint(0, cfg.model.vocab_size, (1, cfg.model.seq_length))
    logits = model(tokens)
    model.loss(logits, tokens).backward()
    idle = {id(p) for m, n in routed.items() if n == 0 for p in m.parameters()}
    missing = [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None and id(p) not in idle]
    assert not missing, missing
    # Fixed configs with model parallelism are trained by test_fixed_layouts_train_like_one_process.


# Problems whose fixes change the layout (tp, etp, cp and its variant, pp, sequence parallelism):
# the fixed configs are trained, not only validated.
LAYOUT_FIX_CASES = [
    {"model.num_experts": 4, "model.moe_top_k": 2, "parallel.tp": 2, "parallel.etp": 3, "model.num_layers": 2,
     "model.moe_ffn_hidden_size": 8},
    {"model.num_attention_heads": 8, "model.hidden_size": 32, "model.num_query_groups": 3, "parallel.tp": 4,
     "parallel.cp": 2, "parallel.cp_comm": "a2a", "overlap.tp": "true"},
    {"model.num_attention_heads": 4, "model.num_query_groups": 1, "parallel.tp": 2, "parallel.cp": 2,
     "parallel.cp_comm": "a2a"},
    {"parallel.pp": 3, "model.num_layers": 4, "parallel.vpp": 2},
    {"parallel.cp": 3, "model.seq_length": 24},
]


@pytest.mark.slow
def test_fixed_layouts_train_like_one_process(tmp_path_factory):
    """Each case's fixes applied until accepted: the fixed layout (more than one rank) trains
    one step inside one spawn per world size, with the single-process loss of its model."""
    from inproc_train import train_layouts

    specs = {}
    for i, case in enumerate(LAYOUT_FIX_CASES):
        _, fixed = _apply_fixes({k: _fmt(v) for k, v in case.items()}, None)
        overrides = [*TINY, *[f"{k}={v}" for k, v in fixed.items()]]
        world = build_layout(compose(overrides)).world
        assert world is not None and 1 < world <= 8, (case, fixed)
        specs[f"fixed{i}"] = (world, overrides, 1)
        specs[f"ref{i}"] = (1, _reference_overrides(overrides), 1)
    got = train_layouts(specs, tmp_path_factory.mktemp("fixed"), timeout_s=600)
    for i, case in enumerate(LAYOUT_FIX_CASES):
        loss, ref = got[f"fixed{i}"][0]["loss"], got[f"ref{i}"][0]["loss"]
        assert math.isfinite(loss) and abs(loss - ref) <= 1e-5 * abs(ref), (specs[f"fixed{i}"], loss, ref)
