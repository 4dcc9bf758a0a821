"""train.ep_dispatch_dtype=fp8 trains: moe_tiny (2 layers, seq 32) at dp 2 x ep 2, overlap.ep on,
8 steps, one spawn of 2 ranks.

The bound, from the run's own noise. bf16 autocast rounds every GEMM input to bf16, a relative
error of up to 2^-8 an element (7 stored mantissa bits); the fp8 dispatch rounds one tensor per
MoE layer, the dispatched tokens, to e4m3, up to 2^-4 relative (3 mantissa bits; the per-128
scale puts every block's largest element at e4m3's largest value, so the elements of a block
keep e4m3's relative precision): 2^4 = 16 times the bf16 rounding, on a subset of what bf16
rounds. The noise floor is measured here: `floor` = the largest gap over the steps between the
bf16 run and the fp32 run of the same layout (what rounding every GEMM input by 2^-8 does to this
curve: ~2.5e-3 on this machine). The fp8 run may then differ from the bf16-dispatch run by at
most 16 x floor (measured: ~2e-3, against a bound of ~4e-2), and fp8 dispatch of fp32
activations from the fp32 run likewise (measured ~1.4e-3). Both numbers come from the same
spawn, so the bound follows whatever the CPU's kernels round to; a quantization with wrong
scales or a wrong block layout moves the loss by 1e-1 or more. The fp8 curves must differ from
their reference at all (the format is applied, not silently off).

The bytes: metrics' ep bytes (the ledger, averaged over the ranks) equal mpoverlap-check's
estimate for fp8 with the counted queues, the capacity-padded queues, the all-gather dispatcher,
forward/backward pairing and full recomputation (the replayed dispatch), and for a bf16 dispatch
of fp32 activations; the fp8 saving against bf16 is exactly the dispatched rows times
(2H - (H + 4 H / 128)) bytes (against fp32: 4H - ..., bf16 on the wire: 4H - 2H): the combine and
the backward exchanges are unchanged.
"""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from inproc_train import train_layouts  # noqa: E402

from mpoverlap.config import compose  # noqa: E402
from mpoverlap.overlap.estimate import estimate  # noqa: E402

BASE = ["model=moe_tiny", "model.num_layers=2", "model.seq_length=32", "train.micro_batch_size=2",
        "train.global_batch_size=8", "train.log_interval=1", "data.max_bytes=200000", "train.progress=false",
        "overlap.dp_bucket_mb=0.05", "parallel.dp=2", "parallel.ep=2", "overlap.ep=true", "overlap.ep_chunks=4"]
BF16, FP32, FP8 = ["train.precision=bf16"], ["train.precision=fp32"], ["train.ep_dispatch_dtype=fp8"]
STEPS = 8
E4M3_OVER_BF16 = 2 ** -4 / 2 ** -8  # unit roundoffs: 3 against 7 stored mantissa bits
SPECS = {
    "fp32": (2, [*BASE, *FP32], STEPS),
    "bf16": (2, [*BASE, *BF16], STEPS),
    "fp8": (2, [*BASE, *BF16, *FP8], STEPS),
    "fp8_fp32": (2, [*BASE, *FP32, *FP8], STEPS),
    # the other dispatch paths, one step each: their bytes
    "fp8_padded": (2, [*BASE, *BF16, *FP8, "model.moe_capacity_factor=1.0"], 1),
    "fp8_allgather": (2, [*BASE, *BF16, *FP8, "model.moe_dispatcher=allgather"], 1),
    "fp8_pairing": (2, [*BASE, *BF16, *FP8, "overlap.ep_pairing=true"], 1),
    "fp8_full": (2, [*BASE, *BF16, *FP8, "model.recompute=full"], 1),
    # bf16 on the wire under fp32 activations (the rows cast for the exchange only)
    "bf16wire_fp32": (2, [*BASE, *FP32, "train.ep_dispatch_dtype=bf16"], 1),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return train_layouts(SPECS, tmp_path_factory.mktemp("epfp8"))


def _gap(a, b):
    return max(abs(x["loss"] - y["loss"]) for x, y in zip(a, b))


def test_fp8_dispatch_stays_within_the_bound_from_the_bf16_noise_floor(runs):
    floor = _gap(runs["bf16"], runs["fp32"])
    bound = E4M3_OVER_BF16 * floor
    assert floor > 0, "bf16 and fp32 runs gave the same curve: no noise floor to scale"
    for name, ref in (("fp8", "bf16"), ("fp8_fp32", "fp32")):
        gap = _gap(runs[name], runs[ref])
        assert 0 < gap <= bound, (name, ref, gap, bound, floor)
    assert runs["fp8"][-1]["loss"] < runs["fp8"][0]["loss"] - 0.5  # it learns


@pytest.mark.parametrize("name", [n for n in SPECS if n.startswith(("fp8", "bf16wire"))])
def test_ep_bytes_are_the_estimate(runs, name):
    world, overrides, _ = SPECS[name]
    est = estimate(compose(list(overrides)), world).comm_bytes_per_step["ep"]
    assert [r["comm"]["ep"]["bytes"] for r in runs[name]] == [est] * len(runs[name]), name


def test_fp8_saves_its_bytes_on_the_dispatch_forward_only(runs):
    """bf16 - fp8 = rows dispatched a step x (2H - (H + 4 H / 128)); fp32 activations: 4H - ..."""
    H, k, tokens, layers, micro = 128, 2, 2 * 32, 2, 2
    rows = tokens * k * layers * micro
    packed = H + 4 * H // 128
    for name, ref, c, sent in (("fp8", "bf16", 2, packed), ("fp8_fp32", "fp32", 4, packed),
                               ("bf16wire_fp32", "fp32", 4, 2 * H)):
        saved = runs[ref][0]["comm"]["ep"]["bytes"] - runs[name][0]["comm"]["ep"]["bytes"]
        assert saved == rows * (c * H - sent), (name, saved)
    assert abs(runs["bf16wire_fp32"][0]["loss"] - runs["fp32"][0]["loss"]) < 1e-3
