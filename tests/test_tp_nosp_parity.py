"""Tensor parallelism without sequence parallelism, overlap.tp on (each column-parallel linear's
input-gradient all-reduce in flight under its wgrad GEMM) and off, end to end against the
single-process run: dense and moe_tiny, fp32 and bf16, with full and selective recompute and
with zb1p (its deferred W). Every fp32 layout reproduces the single-process loss and gradient-
norm curve (tests/test_train_cli.py's tolerance); bf16 layouts track the single-process bf16
curve within the noise floors tests/test_train_cli.py measures and bounds; overlap on and off
are bitwise equal (the same arithmetic, waited later) with the same TP collectives. The
layers' weight and input gradients against one process: tests/test_tensor_parallel.py (fp32)
and tests/test_bf16.py (bf16), SP off, overlap on and off. One spawn per world size
(tests/inproc_train.py)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_train_cli import BF16, LAYOUT_FLOORS, MOE, SMALL, assert_close, floor_gaps, rel_gaps  # noqa: E402

pytestmark = pytest.mark.slow

STEPS = 4  # as tests/test_pairing.py STEPS: the first step already shows a wrong gradient
BASE = [*SMALL, "train.global_batch_size=8"]
TP2 = ["parallel.tp=2"]
ZB1P = ["parallel.pp=2", "parallel.pp_schedule=zb1p", "overlap.pp=true"]
FP32 = {
    "ref": [],
    "tp2_on": [*TP2, "overlap.tp=true"],
    "tp2_off": [*TP2, "overlap.tp=false"],
    "tp2_on_full": [*TP2, "overlap.tp=true", "model.recompute=full"],
    "tp2_on_selective": [*TP2, "overlap.tp=true", "model.recompute=selective"],
    "tp2_zb1p_on": [*TP2, *ZB1P, "overlap.tp=true"],
    "tp2_zb1p_off": [*TP2, *ZB1P, "overlap.tp=false"],
    "moe_ref": [*MOE],
    "moe_tp2_on": [*MOE, *TP2, "overlap.tp=true"],
    "moe_tp2_off": [*MOE, *TP2, "overlap.tp=false"],
    "moe_tp2_on_full": [*MOE, *TP2, "overlap.tp=true", "model.recompute=full"],
    "moe_tp2_zb1p_on": [*MOE, *TP2, *ZB1P, "overlap.tp=true"],
}
# bf16: the references and their micro-batch-2 noise floors as tests/test_train_cli.py trains
# them (20 steps; the MoE floor 10), the layouts their first 10 steps.
BF = ["train.precision=bf16"]
BF16_REFS = {"bf16": [*BF], "bf16_mb2": [*BF, "train.micro_batch_size=2"], "moe_bf16": [*MOE, *BF],
             "moe_bf16_mb2": [*MOE, *BF, "train.micro_batch_size=2"]}
BF16_STEPS = {"bf16": 20, "bf16_mb2": 20, "moe_bf16": 20, "moe_bf16_mb2": 10}
BF16_LAYOUTS = {
    "bf16_tp2_on": [*BF, *TP2, "overlap.tp=true"],
    "bf16_tp2_off": [*BF, *TP2, "overlap.tp=false"],
    "bf16_tp2_zb1p_full_on": [*BF, *TP2, *ZB1P, "model.recompute=full", "overlap.tp=true"],
    "moe_bf16_tp2_on": [*MOE, *BF, *TP2, "overlap.tp=true"],
    "moe_bf16_tp2_off": [*MOE, *BF, *TP2, "overlap.tp=false"],
}
ON_OFF = [("tp2_on", "tp2_off"), ("tp2_zb1p_on", "tp2_zb1p_off"), ("moe_tp2_on", "moe_tp2_off"),
          ("bf16_tp2_on", "bf16_tp2_off"), ("moe_bf16_tp2_on", "moe_bf16_tp2_off")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from inproc_train import train_layouts, world_of

    specs = {name: (world_of([*BASE, *ov]), [*BASE, *ov], STEPS) for name, ov in FP32.items()}
    for name, ov in {**BF16_REFS, **BF16_LAYOUTS}.items():
        specs[name] = (world_of([*SMALL, *BF16, *ov]), [*SMALL, *BF16, *ov], BF16_STEPS.get(name, 10))
    return train_layouts(specs, tmp_path_factory.mktemp("tp_nosp"))


@pytest.mark.parametrize("name", [n for n in FP32 if "ref" not in n])
def test_tp2_without_sp_reproduces_the_single_process_curve(runs, name):
    ref, got = runs["moe_ref" if name.startswith("moe") else "ref"], runs[name]
    assert len(got) == STEPS
    assert_close([r["loss"] for r in got], [r["loss"] for r in ref])
    assert_close([r["grad_norm"] for r in got], [r["grad_norm"] for r in ref])
    tp = got[-1]["comm"]["tp"]
    assert tp["ops"] > 0 and tp["bytes"] > 0 and 0 <= tp["exposed_s"] <= tp["time_s"]


def test_bf16_tp2_without_sp_tracks_the_single_process_bf16_curve(runs):
    for name in BF16_LAYOUTS:
        ref = "moe_bf16" if name.startswith("moe") else "bf16"
        floor, got = floor_gaps(runs, ref), runs[name]
        assert len(got) == 10
        gaps = {key: rel_gaps(got, runs[ref], key) for key in ("loss", "grad_norm")}
        print(f"\n{name}: {gaps}, the floor of {ref}: {floor}")
        for key in ("loss", "grad_norm"):
            assert gaps[key] <= LAYOUT_FLOORS[ref] * floor[key], (name, key, gaps, floor)


@pytest.mark.parametrize("on,off", ON_OFF)
def test_tp_overlap_on_off_bitwise_without_sp(runs, on, off):
    """The same arithmetic waited later: identical losses and gradient norms, and the same TP
    collectives (ops and bytes) in every step."""
    a, b = runs[on], runs[off]
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert [r["grad_norm"] for r in a] == [r["grad_norm"] for r in b]
    assert [(r["comm"]["tp"]["ops"], r["comm"]["tp"]["bytes"]) for r in a] == \
        [(r["comm"]["tp"]["ops"], r["comm"]["tp"]["bytes"]) for r in b]
