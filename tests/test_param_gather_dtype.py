"""train.param_gather_dtype: ZeRO-3's unit gathers in the compute dtype (auto) or int8.

gpt_tiny (4 layers, width 32, untied head) at dp 2 under train.precision=bf16, 6 steps, each
gather format, against the same layout with fp32 gathers and the single-process runs:
- values: auto (bf16) sends the GEMM weights in bf16 and what the forward reads as it is (norms,
  the embedding) in fp32 (data_parallel/unit_gather.py), so every value the model computes with
  is the one the fp32 gathers give: the losses are bitwise those of the fp32 gathers. int8
  rounds each GEMM weight to within 1/254 of its block's largest magnitude, ~7x the error of a
  bf16 rounding of a Gaussian block's typical element (2^-9 |x| against amax / 254, amax ~3.5
  rms at 2,048 elements): its loss stays within one bf16 rounding (2^-8 relative) of the fp32
  gathers' (measured: ~1e-4 over 6 steps; a wrong scale or block layout moves it by 1e-1).
- bytes: the probe sums the first step's handles per op: the GEMM weights' share of the
  gathers halves (bf16) or quarters plus scales (int8), the fp32 part and the reduce-scatters
  unchanged; metrics' dp bytes equal the estimate (3%; int8's block padding comes on top).
- the masters: what checkpoints see (full_params) after a step is the fp32 shards, not
  bf16-representable values (the exact gather), and the gathers never round the shards.
"""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from inproc_train import train_layouts  # noqa: E402

from mpoverlap.config import compose  # noqa: E402
from mpoverlap.overlap.estimate import estimate  # noqa: E402

SMALL = ["model=gpt_tiny", "model.tie_embeddings=false", "model.num_layers=4", "model.hidden_size=32", "model.num_attention_heads=4",
         "model.ffn_hidden_size=64", "model.seq_length=16", "train.global_batch_size=8", "train.micro_batch_size=2",
         "train.log_interval=100", "train.progress=false", "train.lr_decay_steps=6", "overlap.dp_bucket_mb=0.01"]
ZERO3 = ["parallel.dp=2", "train.dp_sharding=optim_grads_params", "train.precision=bf16"]
STEPS = 6
SPECS = {
    "ref_fp32": (1, SMALL, STEPS),
    "ref_bf16": (1, [*SMALL, "train.precision=bf16"], STEPS),
    "fp32": (2, [*SMALL, *ZERO3, "train.param_gather_dtype=fp32"], STEPS),
    "auto": (2, [*SMALL, *ZERO3], STEPS),
    "int8": (2, [*SMALL, *ZERO3, "train.param_gather_dtype=int8"], STEPS),
}


def gathers_and_masters(trainer):
    """Probe: the first step's dp handles' bytes per op, and after it whether every GEMM weight
    as a checkpoint gathers it (full_params) is a bf16 value, and whether the shards are."""
    if trainer.ddp.gatherer is None:
        return None
    import torch

    from mpoverlap.precision import compute_cast_weights

    ledger, by_op, counts = trainer.ledger, {}, {}

    def record(handle):
        if handle.mode == "dp":
            by_op[handle.op] = by_op.get(handle.op, 0) + handle.nbytes
            counts[handle.op] = counts.get(handle.op, 0) + 1
    ledger.recorder = record
    cast = compute_cast_weights(trainer.model)
    cast_numel = sum(p.numel() for p in cast)
    exact_numel = sum(p.numel() for p in trainer.model.parameters() if p not in cast)

    def seen():
        ledger.recorder = None
        with trainer.ddp.full_params():
            full = [p.detach().clone() for p in trainer.model.parameters() if p in cast]
        shards = trainer.ddp._param_shards
        return {"by_op": by_op, "counts": counts, "gather_dtype": trainer.ddp.gatherer.gather_dtype,
                "cast_numel": cast_numel, "exact_numel": exact_numel,
                "full_all_bf16": all(torch.equal(p, p.bfloat16().float()) for p in full),
                "shards_all_bf16": bool(torch.equal(shards, shards.bfloat16().float()))}
    return seen


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return train_layouts(SPECS, tmp_path_factory.mktemp("gather"), probe=gathers_and_masters)


def rel(a, b):
    return abs(a - b) / abs(b)


def test_auto_gathers_in_the_compute_dtype(runs):
    """Half the bytes of the GEMM weights' share, and bitwise the fp32 gathers' curve."""
    fp32, auto, int8 = (runs[n][0]["probe"][0] for n in ("fp32", "auto", "int8"))
    assert (fp32["gather_dtype"], auto["gather_dtype"], int8["gather_dtype"]) == ("fp32", "bf16", "int8")
    cast, exact = auto["cast_numel"], auto["exact_numel"]
    assert cast > 4 * exact > 0  # the GEMM weights are most of the model, norms and embedding the rest
    gathered = fp32["by_op"]["all_gather"]
    passes = gathered / (4 * (cast + exact))  # every parameter gathered this many times in the step
    assert passes == int(passes) and passes >= 2
    per_rank = fp32["counts"]["all_gather"] * 2 * 4  # the exact part's padding: < one element a rank and gather
    assert 2 * cast * passes + 4 * exact * passes <= auto["by_op"]["all_gather"] <= (
        2 * cast * passes + 4 * exact * passes + per_rank * 16)
    assert auto["by_op"]["reduce_scatter"] == fp32["by_op"]["reduce_scatter"]
    # int8: one byte a GEMM weight plus scales and block padding (< one block per rank and gather)
    blocks = int8["counts"]["all_gather"] * 2 * (2048 + 4)
    assert cast * passes + 4 * exact * passes < int8["by_op"]["all_gather"] < (
        cast * passes * (1 + 4 / 2048) + 4 * exact * passes + blocks + per_rank * 16)
    assert [r["loss"] for r in runs["auto"]] == [r["loss"] for r in runs["fp32"]]
    assert [r["grad_norm"] for r in runs["auto"]] == [r["grad_norm"] for r in runs["fp32"]]
    for name in ("fp32", "auto", "int8"):
        world, overrides, _ = SPECS[name]
        est = estimate(compose(list(overrides)), world).comm_bytes_per_step["dp"]
        got = runs[name][-1]["comm"]["dp"]["bytes"]
        assert est <= got * 1.03 and got <= (est + blocks * 16 if name == "int8" else est * 1.03), (name, got, est)
    print(f"gather bytes a step: fp32 {gathered}, auto {auto['by_op']['all_gather']} "
          f"({auto['by_op']['all_gather'] / gathered:.3f}), int8 {int8['by_op']['all_gather']} "
          f"({int8['by_op']['all_gather'] / gathered:.3f}); GEMM weights {cast / (cast + exact):.1%} of the parameters")


def test_the_masters_are_never_rounded(runs):
    for name in ("auto", "int8"):
        for rank in runs[name][0]["probe"]:
            assert not rank["shards_all_bf16"] and not rank["full_all_bf16"], name


def test_int8_gathers_stay_within_a_bf16_rounding(runs):
    floor = max(rel(b["loss"], f["loss"]) for b, f in zip(runs["ref_bf16"], runs["ref_fp32"]))
    assert floor > 1e-7, floor  # bf16 autocast ran
    for row, want in zip(runs["fp32"], runs["ref_bf16"]):  # fp32 gathers: the single-process curve
        assert rel(row["loss"], want["loss"]) < 1e-5
    gap = max(rel(r["loss"], w["loss"]) for r, w in zip(runs["int8"], runs["fp32"]))
    assert 0 < gap <= 2.0 ** -8, gap
    print(f"bf16 autocast's gap to fp32 {floor:.2e}; int8 gathers' gap to the fp32 gathers {gap:.2e}")
