"""deepseek_v3_tiny (multi-head latent attention, a dense layer then MoE layers with a sigmoid
router, aux-loss-free bias and a shared expert) trained by the Trainer at tp 2 + SP (collective
matmul), cp 2 ring (selective recompute) and all-to-all (full recompute), pp 2 x vpp 2 with the
zero-bubble zb1p table (weight gradients of the latent projections deferred to W actions) and
ZeRO-3 (dp 2, train.dp_sharding=optim_grads_params): each reproduces the single-process loss and
gradient-norm curves within 1e-5 relative over STEPS = 4 fp32 steps (step 1's gradient norm is
the gradient of every weight; later losses follow from the updated weights). Under
train.precision=bf16, tp 2 + SP and cp 2 ring track the single-process bf16 curve within a
multiple of its measured noise floor. All layouts of a
world size train inside one spawn (tests/inproc_train.py)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_train_cli import assert_close  # noqa: E402

BF16 = ["train.precision=bf16"]
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
    # bf16 (train.precision=bf16): the single process, its noise floor (the same math at micro-batch 4
    # and 1, summed in other orders) and tp 2 + SP and cp 2 ring (the flash block kernel padded in bf16)
    "bf16": (1, ["parallel.dp=1", *BF16]),
    "bf16_mb4": (1, ["parallel.dp=1", *BF16, "train.micro_batch_size=4"]),
    "bf16_mb1": (1, ["parallel.dp=1", *BF16, "train.micro_batch_size=1"]),
    "bf16_tp2_sp": (2, ["parallel.tp=2", "parallel.dp=1", "parallel.sequence_parallel=true", "overlap.tp=true",
                        *BF16]),
    "bf16_cp2_p2p": (2, ["parallel.cp=2", "parallel.dp=1", "parallel.cp_comm=p2p", "overlap.cp=true", *BF16]),
}
FP32 = [n for n in LAYOUTS if not n.startswith("bf16")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from inproc_train import train_layouts

    specs = {name: (world, [*BASE, *ov], STEPS) for name, (world, ov) in LAYOUTS.items()}
    return train_layouts(specs, tmp_path_factory.mktemp("mla"), timeout_s=900)


@pytest.mark.parametrize("name", [n for n in FP32 if n != "ref"])
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


def rel_gap(got, want, key):
    return max(abs(a[key] - b[key]) / abs(b[key]) for a, b in zip(got, want))


# bf16 bounds as tests/test_train_cli.py derives them: multiples of a noise floor measured in the same
# run (the single process against its micro-batch-4 and micro-batch-1 twins, the larger gap of the two),
# 6 floors for an MoE model there; and autocast really ran, in the reference and in the layout: each
# bf16 curve is off the fp32 one by more than fp32 reordering moves it (1e-6).
MOE_FLOORS = 6.0
AUTOCAST_RAN = 1e-6


@pytest.mark.parametrize("name", ["bf16_tp2_sp", "bf16_cp2_p2p"])
def test_bf16_layout_tracks_the_single_process_bf16_curve(runs, name):
    ref = runs["bf16"]
    floor = {key: max(rel_gap(runs[twin], ref, key) for twin in ("bf16_mb4", "bf16_mb1"))
             for key in ("loss", "grad_norm")}
    for curve in (ref, runs[name]):
        assert AUTOCAST_RAN < rel_gap(curve, runs["ref"], "loss") <= 2e-2
    gaps = {key: rel_gap(runs[name], ref, key) for key in ("loss", "grad_norm")}
    print(f"\n{name}: gaps {gaps}, floor {floor}")
    for key in ("loss", "grad_norm"):
        assert gaps[key] <= MOE_FLOORS * floor[key], (key, gaps, floor)


def test_tp_bytes_follow_the_estimate(runs):
    """Under SP latent attention gathers its latents and the RoPE key instead of the hidden state:
    the ledger's tp bytes are mpoverlap-check's estimate within 1% (measured 0.1% apart; the
    estimate counting the hidden state there instead is 3.5% above)."""
    from mpoverlap.config import compose
    from mpoverlap.overlap.estimate import estimate

    world, ov = LAYOUTS["tp2_sp"]
    est = estimate(compose([*BASE, *ov]), world).comm_bytes_per_step["tp"]
    assert runs["tp2_sp"][-1]["comm"]["tp"]["bytes"] == pytest.approx(est, rel=1e-2)


@pytest.mark.parametrize("name", ["cp2_p2p_selective", "cp2_a2a_full"])
def test_cp_bytes_equal_the_estimate(runs, name):
    """What the ledger counts under cp in a step (q and k N (n + p) wide, v and the output N v,
    the recomputed core's or block's exchanges again, the router statistics) is mpoverlap-check's
    estimate."""
    from mpoverlap.config import compose
    from mpoverlap.overlap.estimate import estimate

    world, ov = LAYOUTS[name]
    est = estimate(compose([*BASE, *ov]), world).comm_bytes_per_step["cp"]
    assert runs[name][-1]["comm"]["cp"]["bytes"] == pytest.approx(est, rel=1e-3)
