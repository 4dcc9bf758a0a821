"""Group-limited routing with the routed weights' scale (DeepSeek-V3's router in miniature:
sigmoid scores, aux-loss-free bias, 16 experts in 4 groups with 2 kept, scale 2.5) on
moe_fine_tiny: dp2 x ep2 (each ep rank holds two whole groups) reproduces the SINGLE-PROCESS
loss curve, gradient norm, aux loss and expert loads within 1e-5 relative over STEPS steps;
the groups change the curve (they are not a no-op)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.slow

BASE = ["model=moe_fine_tiny", "model.moe_router_score=sigmoid", "model.moe_router_norm_topk=true",
        "model.moe_router_bias_update_rate=0.01", "model.moe_router_scaling_factor=2.5",
        "train.global_batch_size=8", "train.micro_batch_size=2", "train.log_interval=1", "data.max_bytes=300000",
        "overlap.dp_bucket_mb=0.05", "train.progress=false", "train.eval_iters=1"]
GROUPS = ["model.moe_router_num_groups=4", "model.moe_router_group_topk=2"]
STEPS = 4
LAYOUTS = {
    "ref": (1, [*GROUPS, "parallel.dp=1"]),
    "ungrouped_ref": (1, ["parallel.dp=1"]),
    "dp2_ep2": (2, [*GROUPS, "parallel.dp=2", "parallel.ep=2", "overlap.ep=true"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from inproc_train import train_layouts

    specs = {name: (world, [*BASE, *ov], STEPS) for name, (world, ov) in LAYOUTS.items()}
    return train_layouts(specs, tmp_path_factory.mktemp("router_groups"), timeout_s=900)


def assert_close(got, ref, rel=1e-5):
    assert len(got) == len(ref)
    for i, (a, b) in enumerate(zip(got, ref)):
        assert abs(a - b) <= rel * abs(b), f"step {i + 1}: {a} vs {b} (rel {abs(a - b) / abs(b):.2e})"


def test_dp2_ep2_reproduces_the_single_process_curve(runs):
    ref, got = runs["ref"], runs["dp2_ep2"]
    assert len(ref) == STEPS
    for key in ("loss", "grad_norm"):
        assert_close([r[key] for r in got], [r[key] for r in ref])
    for key in ("aux_loss", "expert_load_max_over_mean"):
        assert_close([r["moe"][key] for r in got], [r["moe"][key] for r in ref])


def test_groups_change_the_curve(runs):
    assert runs["ref"][0]["loss"] != runs["ungrouped_ref"][0]["loss"]
    assert runs["ref"][-1]["loss"] < runs["ref"][0]["loss"]
