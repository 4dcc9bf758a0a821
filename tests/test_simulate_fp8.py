"""train.precision=fp8 in the simulator and the estimate: the presets' FP8 rates, the covered
GEMMs at that rate (the rest at bf16's), the bytes of the bf16 run, the refusal on a preset
without FP8 GEMMs, and `mpoverlap-check --simulate`'s fp8 step beside bf16."""
import pytest

from mpoverlap.config import ConfigError, compose
from mpoverlap.overlap.estimate.core import compute_bytes, estimate
from mpoverlap.overlap.layout import build_layout
from mpoverlap.simulate.core import simulate
from mpoverlap.simulate.costs import chunk_costs, layer_flops
from mpoverlap.simulate.hardware import fp8_speedup, from_config
from mpoverlap.simulate.memory import cast_bytes, fp8_cast_bytes

LLAMA_64 = ["model=llama3_8b", "hardware=h100_sxm", "parallel.world_size=64", "parallel.tp=8",
            "parallel.sequence_parallel=true", "train.global_batch_size=64", "train.micro_batch_size=1"]


def _cfg(precision, *extra):
    return compose([*LLAMA_64, f"train.precision={precision}", *extra])


@pytest.mark.parametrize("preset,rate", [("h100_sxm", 1979e12), ("h200_sxm", 1979e12), ("a100_80gb", 0.0),
                                         ("measured", 0.0)])
def test_presets_carry_the_dense_fp8_rate(preset, rate):
    cfg = compose([f"hardware={preset}"])
    assert float(cfg.hardware.fp8_peak_flops) == rate


def test_covered_gemms_run_at_the_fp8_rate_and_the_rest_at_bf16():
    """Per chunk, fp8 compute = bf16 compute less the covered GEMMs' seconds (attention GEMMs and
    MLP, forward + backward: 3x the forward) times (1 - bf16 peak / fp8 peak), plus the FP8
    casts' memory-bound seconds."""
    bf16, fp8 = _cfg("bf16", "parallel.pp=2", "parallel.tp=4"), _cfg("fp8", "parallel.pp=2", "parallel.tp=4")
    hw = from_config(bf16)
    lo = build_layout(bf16)
    links = {k: hw.intra for k in ("tp", "cp", "ep", "dp", "pp")}
    enabled = {k: False for k in ("tp", "cp", "ep", "dp", "pp")}
    a = chunk_costs(bf16, lo, hw, links, enabled, 2)
    b = chunk_costs(fp8, build_layout(fp8), hw, links, enabled, 2)
    speed = fp8_speedup(fp8, hw)
    assert speed == pytest.approx(2.0, rel=1e-3)
    for chunk, (x, y) in enumerate(zip(a, b)):
        layers = range(chunk * 16, (chunk + 1) * 16)
        covered = sum(layer_flops(bf16, lo, i)["attn_gemm"] + layer_flops(bf16, lo, i)["mlp"] for i in layers)
        saved = covered / hw.flops * (1 - 1 / speed)
        casts = {k: sum(hw.memory_seconds(fp8_cast_bytes(fp8, lo, i, 2)[k]) for i in layers) for k in "FB"}
        assert casts["F"] > 0 and casts["B"] > casts["F"]
        assert x.compute["F"] - y.compute["F"] == pytest.approx(saved - casts["F"], rel=1e-9)
        assert x.compute["B"] - y.compute["B"] == pytest.approx(2 * saved - casts["B"], rel=1e-9)
        for k in "FB":  # the other elementwise bytes: the bf16 run's
            assert y.memory[k] - x.memory[k] == pytest.approx(casts[k], rel=1e-9)


def test_fp8_cast_bytes_of_one_dense_layer():
    """llama3_8b's layer 0 at tp 8 + SP, micro batch 1: t = 8,192 rows; qkv [t, 4096] x 6,144/8,
    projection [t, 512] x 4,096, gate+up [t, 4096] x 2 x 14,336/8, down [t, 1,792] x 4,096; 33 bytes
    an element cast eagerly (abs 4, amax 2, upcast 6, scale 8, clamp 8, fp8 cast 5), the weights
    once forward and once backward."""
    from mpoverlap.overlap.estimate.params import layer_params

    cfg = _cfg("fp8")
    lo = build_layout(cfg)
    t, per = 8192, 33
    assert cast_bytes(2) == cast_bytes(4) == 33
    gemms = [(4096, 768), (512, 4096), (4096, 3584), (1792, 4096)]
    weights = layer_params(cfg, lo, 0)[0] * per
    got = fp8_cast_bytes(cfg, lo, 0, 2)
    assert got["F"] == pytest.approx(t * sum(k for k, _ in gemms) * per + weights)
    assert got["B"] == pytest.approx(t * sum(2 * n + k for k, n in gemms) * per + weights)


def test_fp8_step_has_faster_gemms_the_casts_the_bf16_bytes_and_the_same_flops():
    """Compute-bound seconds shrink (the GEMMs at the FP8 rate), the memory-bound ones grow by the
    eager casts (which at this shape outweigh the GEMMs' saving: the step is slower)."""
    bf16, fp8 = _cfg("bf16"), _cfg("fp8")
    hw = from_config(fp8)
    a, b = simulate(bf16, hw), simulate(fp8, hw)
    assert b.compute_s - b.memory_s < 0.75 * (a.compute_s - a.memory_s) and b.memory_s > a.memory_s
    assert b.step_s > a.step_s
    # the FLOPs run are counted at the rate each GEMM ran at: the same model, the same FLOPs
    assert b.useful_share == pytest.approx(a.useful_share, rel=1e-9)
    # the report's MFU decomposition still multiplies out, with the FP8 gain as a factor
    assert a.fp8_gain == 1.0 and 1.0 < b.fp8_gain < 2.0
    parts = hw.gemm_efficiency * b.fp8_gain * b.useful_share * b.compute_bound_share * b.avg_compute_s / b.step_s
    assert b.mfu == pytest.approx(parts, rel=1e-6)
    assert compute_bytes(fp8) == compute_bytes(bf16) == 2
    ea, eb = estimate(bf16), estimate(fp8)
    # saved activations (bf16 inputs), gathers, state: the bf16 run's
    assert eb.memory_bytes == ea.memory_bytes and eb.comm_bytes_per_step == ea.comm_bytes_per_step


def test_a_preset_without_fp8_gemms_refuses_fp8():
    cfg = _cfg("fp8", "hardware=a100_80gb")
    with pytest.raises(ConfigError, match=r"train.precision=fp8 with hardware=a100_80gb.*fix: hardware=h100_sxm"):
        simulate(cfg, from_config(cfg))
    assert fp8_speedup(_cfg("bf16", "hardware=a100_80gb"), from_config(cfg)) == 1.0


def test_format_lines_print_the_fp8_step_beside_bf16():
    from mpoverlap.simulate.formats import format_lines

    cfg = _cfg("fp8")
    hw = from_config(cfg)
    result = simulate(cfg, hw)
    lines = format_lines(cfg, hw, [*LLAMA_64, "train.precision=fp8"], result)
    ref = simulate(_cfg("bf16"), hw)
    assert len(lines) == 1 and lines[0].startswith("  GEMM precision (train.precision): fp8 step")
    assert f"bf16 step {1e3 * ref.step_s:,.2f} ms" in lines[0]
    assert f"{result.tokens_per_s / ref.tokens_per_s:.2f}x bf16's tokens/s" in lines[0]


def test_check_simulate_prints_the_fp8_step_beside_bf16(capsys):
    from mpoverlap.check import main

    assert main(["--simulate", *LLAMA_64, "train.precision=fp8"]) == 0
    out = capsys.readouterr().out
    assert "GEMM precision (train.precision): fp8 step" in out and "x bf16's tokens/s" in out


def test_check_simulate_refuses_fp8_on_a100(capsys):
    from mpoverlap.check import main

    assert main(["--simulate", *LLAMA_64, "hardware=a100_80gb", "train.precision=fp8"]) == 2
    err = capsys.readouterr().err
    assert "train.precision=fp8 with hardware=a100_80gb" in err and "fix: hardware=h100_sxm" in err
