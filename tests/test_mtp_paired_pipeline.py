"""Multi-token prediction with forward/backward pairing in the pipeline (overlap.ep_pairing=true
at pp 2 x vpp 2 x dp 2 x ep 2, the paired interleaved, zb1p and zbv tables): deepseek_v3_tiny
(one layer a chunk, the first dense; latent attention, aux-loss-free MoE, untied head) with one
MoE depth on the head's stage. The head chunk's sub-step program runs the depth in its head
segment; the trained loss is LM + mtp_loss_scale x MTP, and metrics.jsonl reports the LM loss
and the MTP loss apart. Each run (Trainer.run(), STEPS steps, fp32) reproduces the
SINGLE-PROCESS run within 1e-5 relative: loss, mtp_loss and grad norm every step, and every
weight of the final checkpoint (read layout-free, interop/checkpoint_reader.py).

In the loop tables the depth reads an embedding copy on the last stage (summed with stage 0's
over the embedding group). In the paired V (zbv) the head chunk sits on stage 0 beside the
embedding chunk and its depth reads that chunk's embedding: one parameter both chunks' W
actions feed (PipelineExecutor.shared_params), its gradient added in each microbatch's last W,
here with the dp reduction overlapped (overlap.dp=true, the embedding a bucket of its own)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.slow

STEPS = 3
BASE = ["model=deepseek_v3_tiny", "model.mtp_num_layers=1", "model.mtp_loss_scale=0.3", "train.global_batch_size=16",
        "train.micro_batch_size=2", "train.log_interval=1", "data.max_bytes=300000", "overlap.dp_bucket_mb=0.05",
        "train.progress=false", "train.eval_iters=1", f"checkpoint.interval={STEPS}"]
PAIRED_PP2 = ["parallel.pp=2", "parallel.vpp=2", "parallel.dp=2", "parallel.ep=2", "overlap.ep_pairing=true",
              "overlap.ep_chunks=2"]
LAYOUTS = {
    "ref": (1, ["parallel.dp=1"]),
    "interleaved": (4, [*PAIRED_PP2, "parallel.pp_schedule=interleaved"]),
    "zb1p": (4, [*PAIRED_PP2, "parallel.pp_schedule=zb1p"]),
    "zbv": (4, [*PAIRED_PP2, "parallel.pp_schedule=zbv", "overlap.dp=true"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from inproc_train import run_chains

    root = tmp_path_factory.mktemp("mtp_paired")
    run_chains({name: [(world, [*BASE, *ov], STEPS)] for name, (world, ov) in LAYOUTS.items()}, root,
               timeout_s=900)
    return root


def _rows(run_dir):
    from test_train_cli import rows

    return [r for r in rows(run_dir) if "grad_norm" in r]


def _weights(run_dir):
    from mpoverlap.interop.checkpoint_reader import read_checkpoint, resolve_step_dir

    return read_checkpoint(resolve_step_dir(run_dir))[0]


def test_paired_layouts_pass_the_rules():
    from mpoverlap.config import compose
    from mpoverlap.overlap import validate

    for name, (world, ov) in LAYOUTS.items():
        assert [p.render() for p in validate(compose([*BASE, *ov]), world_size=world)] == [], name


@pytest.mark.parametrize("name", ["interleaved", "zb1p", "zbv"])
def test_paired_pipeline_reproduces_the_single_process_losses_and_weights(runs, name):
    ref, got = _rows(runs / "ref"), _rows(runs / name)
    assert len(ref) == len(got) == STEPS
    for key in ("loss", "mtp_loss", "grad_norm"):
        for step, (a, b) in enumerate(zip((r[key] for r in got), (r[key] for r in ref)), 1):
            assert abs(a - b) <= 1e-5 * abs(b), f"{key} at step {step}: {a} vs {b}"
    assert all(r["mtp_loss"] > 0 and r["mtp_loss"] != r["loss"] for r in ref)
    want, have = _weights(runs / "ref"), _weights(runs / name)
    assert sorted(have) == sorted(want) and any(k.startswith("mtp.") for k in want)
    for key, w in want.items():
        gap = float((have[key] - w).abs().max())
        assert gap <= 1e-5 * max(float(w.abs().max()), 1e-12), f"{key}: max gap {gap:.2e}"
