"""train.precision=fp8 trains: the single process differs from bf16 (FP8 really ran) and stays
near it, and dp2 x tp2 x pp2 with sequence parallelism, pp2 x vpp2 under zb1p (deferred W),
cp 2 and ZeRO-3 at dp 2 (its gathers in bf16) reproduce the single-process fp8 curve within a bound built from measured distances.

The bound. A layout's fp8 loss L'_8 at step t must stay within

    bound_t = G16_t + MARGIN * 2 * max_{s <= t} G8_s       (relative to the single-process L_8)

- G16_t = |L'_16 - L_16| / L_16: the same layout in bf16 against the single-process bf16 run,
  measured in the same test: what the layout alone does to bf16 numerics (its sums in another
  order, the tensor-parallel partial sums rounded to bf16, the pipeline's bf16 sends);
- G8_s = |L_8 - L_16| / L_16: the single process's own FP8 effect. A layout quantizes other
  tensors with other scales (tensorwise: one scale per TP shard of a weight and, on the
  collective-matmul ring, per sequence chunk; rowwise: rows cut by the shards), i.e. another
  rounding of the same values to the same format, whose effect on the loss is of the size of
  the single process's: |L'_8 - L'_16| ~ G8, so by the triangle inequality
  |L'_8 - L_8| <= |L'_8 - L'_16| + |L'_16 - L_16| + |L_16 - L_8| ~ G8 + G16 + G8;
- MARGIN = 2: another rounding's effect is another draw of the same size, not the same value
  (measured below the bound by the factor docs/fp8.md lists).
A layout that drops a shard's FP8 scale or its reduction moves the loss by far more than FP8
rounding does, and fails it; the first step's loss (the same weights) is held to the bound's
first value. Each rank's blocks are checked to be marked FP8 (probe).
"""
from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("torchao")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from inproc_train import train_layouts  # noqa: E402

SMALL = ["model=gpt_tiny", "model.num_layers=4", "model.hidden_size=32", "model.num_attention_heads=4",
         "model.ffn_hidden_size=64", "model.seq_length=16", "train.global_batch_size=8", "train.micro_batch_size=2",
         "train.log_interval=100", "train.progress=false", "train.lr_decay_steps=6"]
STEPS = 6
MARGIN = 2
LAYOUTS = {
    "3d": (8, ["parallel.dp=2", "parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true"]),
    "zb1p_vpp2": (2, ["parallel.pp=2", "parallel.vpp=2", "parallel.pp_schedule=zb1p"]),
    "cp2": (2, ["parallel.cp=2"]),
    # ZeRO-3: the unit gathers carry bf16 under fp8 (param_gather_dtype=auto), the GEMMs cast to FP8
    "zero3": (2, ["parallel.dp=2", "train.dp_sharding=optim_grads_params"]),
}
SPECS = {"ref_bf16": (1, [*SMALL, "train.precision=bf16"], STEPS),
         "ref_fp8": (1, [*SMALL, "train.precision=fp8"], STEPS),
         # train.compile=true: the blocks' elementwise regions compiled around the eager FP8 GEMMs
         "compiled_fp8": (1, [*SMALL, "train.precision=fp8", "train.compile=true", "train.compile_backend=aot_eager"],
                          STEPS)}
for _name, (_world, _layout) in LAYOUTS.items():
    for _p in ("bf16", "fp8"):
        SPECS[f"{_name}_{_p}"] = (_world, [*SMALL, *_layout, f"train.precision={_p}"], STEPS)
# rowwise on the 3-D layout: the row-parallel GEMMs' rows are cut by the TP shards, so their
# per-row scales differ from the single process's
ROWWISE = ["train.precision=fp8", "train.fp8_recipe=rowwise"]
SPECS["ref_fp8_rowwise"] = (1, [*SMALL, *ROWWISE], STEPS)
SPECS["3d_fp8_rowwise"] = (LAYOUTS["3d"][0], [*SMALL, *LAYOUTS["3d"][1], *ROWWISE], STEPS)


# moe_tiny at dp 2 x ep 2: the experts' grouped GEMMs in FP8 (torchao's rowwise grouped recipe,
# precision/fp8_grouped.py) on each rank's local experts, the dispatch in bf16
MOE = ["model=moe_tiny", "model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=4",
       "model.ffn_hidden_size=64", "model.moe_ffn_hidden_size=32", "model.seq_length=16",
       "train.global_batch_size=8", "train.micro_batch_size=2", "train.log_interval=100", "train.progress=false",
       "train.lr_decay_steps=6"]
for _p in ("bf16", "fp8"):
    SPECS[f"moe_ref_{_p}"] = (1, [*MOE, f"train.precision={_p}"], STEPS)
    SPECS[f"moe_ep2_{_p}"] = (2, [*MOE, "parallel.dp=2", "parallel.ep=2", f"train.precision={_p}"], STEPS)


def marked(trainer):
    """How many of this rank's linears run in FP8, and the ZeRO-3 gathers' dtype (None below it)."""
    gatherer = trainer.ddp.gatherer
    seen = (len(trainer.fp8_gemms), None if gatherer is None else gatherer.gather_dtype)
    return lambda: seen


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return train_layouts(SPECS, tmp_path_factory.mktemp("fp8"), probe=marked)


def _losses(runs, name):
    return [r["loss"] for r in runs[name]]


def bounds(ref16, ref8, lay16):
    out, g8 = [], 0.0
    for a16, a8, b16 in zip(ref16, ref8, lay16):
        g8 = max(g8, abs(a8 - a16) / a16)
        out.append(abs(b16 - a16) / a16 + MARGIN * 2 * g8)
    return out


def test_fp8_single_process_differs_from_bf16(runs):
    ref16, ref8 = _losses(runs, "ref_bf16"), _losses(runs, "ref_fp8")
    assert ref16 != ref8
    assert all(abs(a - b) / b < 0.01 for a, b in zip(ref8, ref16)), (ref8, ref16)
    assert runs["ref_fp8"][0]["probe"] == [(4 * 4, None)] and runs["ref_bf16"][0]["probe"] == [(0, None)]


@pytest.mark.parametrize("name,recipe", [(n, "") for n in sorted(LAYOUTS)] + [("3d", "_rowwise")])
def test_fp8_layout_reproduces_the_single_process_curve(runs, name, recipe):
    ref16, ref8 = _losses(runs, "ref_bf16"), _losses(runs, f"ref_fp8{recipe}")
    got = _losses(runs, f"{name}_fp8{recipe}")
    limit = bounds(ref16, ref8, _losses(runs, f"{name}_bf16"))
    gaps = [abs(a - b) / b for a, b in zip(got, ref8)]
    print(f"{name}{recipe}: gaps {['%.1e' % g for g in gaps]}, bounds {['%.1e' % b for b in limit]}")
    assert all(g <= b for g, b in zip(gaps, limit)), (name, gaps, limit)
    # every rank marks its own blocks' linears: 4 per block it holds
    probe = runs[f"{name}_fp8{recipe}"][0]["probe"]
    assert all(n > 0 and n % 4 == 0 for n, _ in probe), probe
    assert all(gather == ("bf16" if name == "zero3" else None) for _, gather in probe), probe


def test_compiled_fp8_run_matches_the_eager_fp8_run(runs):
    """A compiled fp8 run's losses within 1e-4 of the eager fp8 run's (a fused norm may round its
    bf16 output an ulp apart, which moves an FP8 cast now and then: measured ~1e-6)."""
    eager, compiled = _losses(runs, "ref_fp8"), _losses(runs, "compiled_fp8")
    assert all(abs(a - b) / b < 1e-4 for a, b in zip(compiled, eager)), (compiled, eager)
    assert runs["compiled_fp8"][0]["probe"] == [(4 * 4, None)]


def test_fp8_moe_at_ep2_reproduces_the_single_process_curve(runs):
    """moe_tiny in fp8 (the grouped experts' GEMMs in FP8 beside the blocks' linears) differs from
    bf16 and at dp 2 x ep 2 stays within the same bound of the single-process fp8 curve."""
    ref16, ref8 = _losses(runs, "moe_ref_bf16"), _losses(runs, "moe_ref_fp8")
    assert ref16 != ref8
    got, limit = _losses(runs, "moe_ep2_fp8"), bounds(ref16, ref8, _losses(runs, "moe_ep2_bf16"))
    gaps = [abs(a - b) / b for a, b in zip(got, ref8)]
    print(f"moe ep2: gaps {['%.1e' % g for g in gaps]}, bounds {['%.1e' % b for b in limit]}")
    assert all(g <= b for g, b in zip(gaps, limit)), (gaps, limit)
    # per block: q/k/v, the attention output and the grouped experts (one module)
    assert runs["moe_ref_fp8"][0]["probe"] == [(2 * 3, None)], runs["moe_ref_fp8"][0]["probe"]
    assert all(n == 2 * 3 for n, _ in runs["moe_ep2_fp8"][0]["probe"]), runs["moe_ep2_fp8"][0]["probe"]
