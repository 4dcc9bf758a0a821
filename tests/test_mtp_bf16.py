"""Multi-token prediction under train.precision=bf16: deepseek_v3_tiny (latent attention, MoE,
untied head) with one MTP depth at tp 2 + SP (the depth's shift across the sequence-parallel
shards, its vocabulary-parallel loss on bf16 logits) and at pp 2 (the depth beside the head on
stage 1 with its copy of the embedding) tracks the single-process bf16 curve in the
LM loss, the MTP loss and the gradient norm within a multiple of the noise floor measured in the
same run, as tests/test_mla_train.py bounds its bf16 layouts: the floor is the larger gap of the
single process against its micro-batch-4 and micro-batch-1 twins (the same math summed in other
orders), 6 floors for an MoE model (tests/test_train_cli.py's factor); and autocast really ran:
each bf16 curve is off the fp32 one by more than fp32 reordering moves it (1e-6), by at most 2%.
bf16 matmuls are slow on CPU: 2 layers, STEPS steps."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_mla_train import AUTOCAST_RAN, MOE_FLOORS, rel_gap  # noqa: E402

pytestmark = pytest.mark.slow

BF16 = ["train.precision=bf16"]
BASE = ["model=deepseek_v3_tiny", "model.num_layers=2", "model.mtp_num_layers=1", "model.mtp_loss_scale=0.3",
        "train.global_batch_size=8", "train.micro_batch_size=2", "train.log_interval=1", "data.max_bytes=300000",
        "overlap.dp_bucket_mb=0.05", "train.progress=false", "train.eval_iters=1"]
STEPS = 3
KEYS = ("loss", "mtp_loss", "grad_norm")
LAYOUTS = {
    "fp32": (1, ["parallel.dp=1"]),
    "bf16": (1, ["parallel.dp=1", *BF16]),
    "bf16_mb4": (1, ["parallel.dp=1", *BF16, "train.micro_batch_size=4"]),
    "bf16_mb1": (1, ["parallel.dp=1", *BF16, "train.micro_batch_size=1"]),
    "bf16_tp2_sp": (2, ["parallel.tp=2", "parallel.dp=1", "parallel.sequence_parallel=true", *BF16]),
    "bf16_pp2": (2, ["parallel.pp=2", "parallel.dp=1", *BF16]),  # the depth and an embedding copy on stage 1
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from inproc_train import train_layouts

    specs = {name: (world, [*BASE, *ov], STEPS) for name, (world, ov) in LAYOUTS.items()}
    return train_layouts(specs, tmp_path_factory.mktemp("mtp_bf16"), timeout_s=900)


@pytest.mark.parametrize("name", ["bf16_tp2_sp", "bf16_pp2"])
def test_bf16_mtp_tracks_the_single_process_bf16_curve(runs, name):
    ref = runs["bf16"]
    assert len(ref) == len(runs[name]) == STEPS
    floor = {key: max(rel_gap(runs[twin], ref, key) for twin in ("bf16_mb4", "bf16_mb1")) for key in KEYS}
    for curve in (ref, runs[name]):
        for key in ("loss", "mtp_loss"):
            assert AUTOCAST_RAN < rel_gap(curve, runs["fp32"], key) <= 2e-2, key
    gaps = {key: rel_gap(runs[name], ref, key) for key in KEYS}
    print(f"\n{name}: gaps {gaps}, floor {floor}")
    for key in KEYS:
        assert floor[key] > 0, (key, floor)
        assert gaps[key] <= MOE_FLOORS * floor[key], (key, gaps, floor)
