"""deepseek_v3_tiny (multi-head latent attention, a dense layer then MoE layers with a sigmoid
router, aux-loss-free bias and a shared expert) trained by the Trainer at tp 2 + SP (collective
matmul), cp 2 ring (selective recompute) and all-to-all (full recompute), pp 2 x vpp 2 with the
zero-bubble zb1p table (weight gradients of the latent projections deferred to W actions) and
ZeRO-3 (dp 2, train.dp_sharding=optim_grads_params): each reproduces the single-process loss and
gradient-norm curves within 1e-5 relative over STEPS = 4 fp32 steps (step 1's gradient norm is
the gradient of every weight; later losses follow from the updated weights). All layouts of a
world size train inside one spawn (tests/inproc_train.py)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_train_cli import assert_close  # noqa: E402

BASE = ["model=deepseek_v3_tiny", "train.global_batch_size=8", "train.micro_batch_size=2", "train.log_interval=1",
        "data.max_bytes=300000", "overlap.dp_bucket_mb=0.05", "train.progress=false", "train.eval_iters=1"]
STEPS = 4
LAYOUTS = {  # name: (world, overrides)
    "ref": (1, ["parallel.dp=1"]),
    "tp2_sp": (2, ["parallel.tp=2", "parallel.dp=1", "parallel.sequence_parallel=true", "overlap.tp=true"]),
    "cp2_p2p_selective": (2, ["parallel.cp=2", "parallel.dp=1", "parallel.cp_comm=p2p", "overlap.cp=true",
                              "model.recompute=selective"]),
    "cp2_a2a_full": (2, ["parallel.cp=2", "parallel.dp=1", "parallel.cp_comm=a2a", "model.recompute=full"]),
    "pp2_vpp2_zb1p": (2, ["parallel.pp=2", "parallel.vpp=2", "parallel.dp=1", "parallel.pp_schedule=zb1p"]),
    "dp2_zero3": (2, ["parallel.dp=2", "train.dp_sharding=optim_grads_params", "overlap.dp=true"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from inproc_train import train_layouts

    specs = {name: (world, [*BASE, *ov], STEPS) for name, (world, ov) in LAYOUTS.items()}
    return train_layouts(specs, tmp_path_factory.mktemp("mla"), timeout_s=900)


@pytest.mark.parametrize("name", [n for n in LAYOUTS if n != "ref"])
def test_layout_reproduces_the_single_process_curve(runs, name):
    ref, got = runs["ref"], runs[name]
    assert len(ref) == len(got) == STEPS
    assert_close([r["loss"] for r in got], [r["loss"] for r in ref])
    assert_close([r["grad_norm"] for r in got], [r["grad_norm"] for r in ref])
    assert_close([r["moe"]["expert_load_max_over_mean"] for r in got],
                 [r["moe"]["expert_load_max_over_mean"] for r in ref])


def test_reference_learns(runs):
    losses = [r["loss"] for r in runs["ref"]]
    assert losses[-1] < losses[0]
