"""`make gpu-check` (bench/gpu_check.py) on a machine without a GPU: the one-line exit, and the
parts that need no GPU: the report writer on made-up results, the simulator's prediction, the
plain-loop side of the throughput part on a tiny model, and the CUDA tier's helpers on CPU."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # bench/ is not an installed package
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
TINY = ["model.num_layers=1", "model.hidden_size=64", "model.num_attention_heads=4", "model.num_query_groups=2",
        "model.ffn_hidden_size=128",
        "model.vocab_size=256", "model.seq_length=32", "train.global_batch_size=4", "train.micro_batch_size=2",
        "data.max_bytes=100000"]


def test_make_gpu_check_without_a_gpu_prints_one_line_and_exits_0():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    done = subprocess.run(["make", "-s", "--no-print-directory", "gpu-check"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["gpu-check: no CUDA GPU is visible here (torch.cuda.is_available() is "
                                        "False); nothing to check"], done.stdout
    assert "Traceback" not in done.stderr


def test_the_tier_covers_the_cuda_test_files():
    from bench.gpu_check import cuda_test_files

    names = {Path(p).name for p in cuda_test_files(REPO)}
    assert {"test_block_kernels.py", "test_cuda_tier.py"} <= names and "test_gpu_check.py" not in names


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="0" failures="1"
skipped="2" tests="10" time="3.0"><testcase classname="tests.test_cuda_tier" name="test_cuda_matches_cpu[gpt_tiny-bf16]"
time="1"><failure message="AssertionError: gpt_tiny-bf16: cuda [5.3] cpu [5.1]">trace</failure></testcase>
<testcase classname="tests.test_block_kernels" name="test_ok" time="0.1"/></testsuite></testsuites>"""


def test_report_writer_on_made_up_results(tmp_path):
    from bench.gpu_report import junit_summary, render, write

    (tmp_path / "t.xml").write_text(JUNIT)
    tests = dict(junit_summary(tmp_path / "t.xml"), returncode=1, elapsed_s=42.0)
    assert tests["counts"] == {"tests": 10, "failures": 1, "errors": 0, "skipped": 2, "passed": 7}
    kernel = {"kernel": "nvjet_sm90_tst_128x256", "ms": 12.5, "calls": 48}
    results = {
        "started": "2026-11-27T18:00:00+00:00", "budget_s": 360, "elapsed_s": 301.0,
        "env": {"gpu": "NVIDIA H100 80GB HBM3", "capability": "sm90", "gpu_memory_gib": 79.1, "driver": "570.1",
                "torch": "2.11.0+cu130", "cuda": "13.0", "nccl": "2.27.3", "python": "3.12.3", "commit": "abc123"},
        "tests": tests,
        "attention_kernels": [{"preset": "llama3_1b", "heads": 32, "groups": 8, "head_dim": 64, "seq": 8192,
                               "sdpa_kernels": ["cudnn_generated_fort_native_sdpa_sm90_flash_fprop"],
                               "cp_block_backend": "flash_cuda", "cp_block_kernels": ["flash_fwd_kernel"]}],
        "throughput": {
            "llama3_1b": {"simulated": {"hardware": "h100_sxm", "step_s": 0.5},
                          "sides": {"mpoverlap": {"step_s": 0.75, "tokens_per_s": 43690.7, "model_tflops_per_s": 250.0,
                                                  "mfu": 0.2528, "peak_memory_gib": 30.2, "top_kernels": [kernel],
                                                  "estimated_peak_gib": 29.0,
                                                  "gpu_ms": {"total": 600.0, "gemm": 400.0, "attention": 80.0,
                                                             "other": 120.0}},
                                    "hf": {"error": "RuntimeError: CUDA out of memory"},
                                    "compiled": {"step_s": 0.6, "tokens_per_s": 54613.3, "model_tflops_per_s": 312.5,
                                                 "mfu": 0.316, "peak_memory_gib": 28.0}}},
            "moe_350m": {"status": "timeout", "reason": "ran past its 70 s"},
        },
        "skipped": ["throughput gpt_125m: 12 s of the budget left, under 25 s"],
        "cuda_vs_cpu": [{"case": "llama_tiny_gqa-bf16", "floor": 8e-5, "bound": 3.2e-4, "max_rel": 4.3e-4,
                         "per_step": [1e-5, 4.3e-4]},
                        {"case": "gpt_tiny-fp32", "bound": 1e-5, "max_rel": 1e-7, "per_step": [0.0, 1e-7]}],
        "host_syncs": [{"model": "moe_tiny", "cuda_syncs": 9, "cpu_reads": 9,
                        "cpu_sites": {"float at data_parallel/optimizer.py:232": 1, "tolist at moe/dispatcher.py:231": 8}}],
    }
    md = render(results)
    for text in ("NVIDIA H100 80GB HBM3 (sm90, 79.1 GiB), driver 570.1", "torch 2.11.0+cu130, CUDA 13.0, NCCL 2.27.3",
                 "commit: abc123", "7 passed, 1 failed, 0 errors, 2 skipped in 42 s (exit code 1)",
                 "FAILED tests.test_cuda_tier::test_cuda_matches_cpu[gpt_tiny-bf16]: AssertionError",
                 "| llama3_1b | 32 / 8 / 64 | cudnn_generated_fort_native_sdpa_sm90_flash_fprop | flash_cuda |",
                 "| llama3_1b | mpoverlap Trainer | 0.750 | 43,691 | 250.0 | 25.3% | 30.2 | 0.500 (h100_sxm) | 1.50 |",
                 "| llama3_1b | transformers Llama loop | error: RuntimeError: CUDA out of memory",
                 "| llama3_1b | mpoverlap Trainer, train.compile=true | 0.600 | 54,613 | 312.5 | 31.6% | 28.0 | 0.500 "
                 "(h100_sxm) | 1.20 |",
                 "| moe_350m | timeout: ran past its 70 s", "| `nvjet_sm90_tst_128x256` | 12.50 | 48 |",
                 "| llama3_1b | mpoverlap Trainer | 750.0 | 600.0 | 400.0 | 80.0 | 120.0 | 150.0 |",
                 "- throughput gpt_125m: 12 s of the budget left",
                 "| llama_tiny_gqa-bf16 | 8.00e-05 | 3.20e-04 | 4.30e-04 | 1.0e-05, 4.3e-04 |",
                 "| gpt_tiny-fp32 | - | 1.00e-05 | 1.00e-07 | 0.0e+00, 1.0e-07 |",
                 "| moe_tiny | 9 | 9 | float at data_parallel/optimizer.py:232 x1, tolist at moe/dispatcher.py:231 x8 |",
                 # the figures read off the table (a side that errored or never ran gives none)
                 "| llama3_1b | Trainer step eager / with train.compile=true | 1.250 |",
                 "(abs(simulated - measured) / measured) | 33.3% |",
                 "| llama3_1b | mpoverlap Trainer | 30.2 | 29.0 | 1.04 |"):
        assert text in md, text
    assert "not run" in render({"env": {}}) and "none recorded" in render({"env": {}})
    write(tmp_path / "out", results)
    assert json.loads((tmp_path / "out" / "gpu-report.json").read_text()) == results
    assert (tmp_path / "out" / "gpu-report.md").read_text() == md


def test_estimated_peak_is_the_estimates_heaviest_stage():
    """The report's memory table reads the estimate `mpoverlap-check` prints, at world 1."""
    from bench.gpu_throughput import estimated_peak_gib
    from mpoverlap.config import compose
    from mpoverlap.overlap.estimate import estimate

    cfg = compose(["model=llama_tiny", *TINY, "train.precision=bf16"])
    mem = estimate(cfg, 1).memory_bytes
    assert mem["weight_casts"] > 0 and mem["loss_backward"] > 0
    assert estimated_peak_gib(cfg) == sum(mem.values()) / 2**30


def test_gpu_time_by_kind():
    """The profiled kernels of a step summed by kind (names as the H200 report printed them)."""
    from bench.gpu_throughput import gpu_time_by_kind

    kernels = [{"kernel": "nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NTN", "ms": 90.0},
               {"kernel": "_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel_for_sm9xINS_4gemm6kernel1",
                "ms": 7.0},
               {"kernel": "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26", "ms": 60.0},
               {"kernel": "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kerne", "ms": 5.0},
               {"kernel": "void at::native::vectorized_elementwise_kernel<8, at::native::bfloat16_copy_kernel_cuda",
                "ms": 25.0},
               {"kernel": "void at::native::(anonymous namespace)::cunn_SoftMaxBackward<4, float, float, float", "ms": 7.0}]
    assert gpu_time_by_kind(kernels) == {"total": 194.0, "gemm": 97.0, "attention": 65.0, "other": 32.0}


def test_comparisons_of_the_h200_report():
    """The figures read off the throughput table of the H200 report at f45a626: the Trainer 1.6% over
    its plain loop, 1.076x the transformers loop, the simulator 5% off the llama step; a shape
    without a compiled side has no compiled figure, and the report names no verdict."""
    from bench.gpu_report import comparisons, render

    report = json.loads((REPO / "docs" / "gpu-reports" / "2026-11-27-h200-f45a626.json").read_text())
    got = [(c["shape"], c["figure"].split(" (")[0], c["shown"]) for c in comparisons(report["throughput"])]
    assert got == [("llama3_1b", "Trainer step / its module's plain loop", "1.016"),
                   ("llama3_1b", "transformers loop / Trainer step", "1.076"),
                   ("llama3_1b", "Trainer step eager / with train.compile=true", "1.152"),
                   ("llama3_1b", "simulator's error on the Trainer step", "5.0%"),
                   ("moe_350m", "Trainer step / its module's plain loop", "0.944"),
                   ("moe_350m", "simulator's error on the Trainer step", "75.1%"),
                   ("gpt_125m", "Trainer step / its module's plain loop", "0.935"),
                   ("gpt_125m", "simulator's error on the Trainer step", "38.2%")], got
    md = render(report).lower()
    assert not any(word in md for word in ("issue", "criteri", "verdict", "missed")), md


def test_simulator_prediction_helper():
    """The prediction is what `mpoverlap-check --simulate` computes for the shape's overrides on
    the preset, and it changes with the preset's figures."""
    from bench.gpu_throughput import hardware_preset, overrides_of, sim_prediction
    from mpoverlap.config import compose
    from mpoverlap.simulate.core import simulate
    from mpoverlap.simulate.hardware import from_config

    ov = overrides_of("llama3_1b")
    got = sim_prediction(ov, "h100_sxm")
    cfg = compose(ov + ["hardware=h100_sxm"])
    want = simulate(cfg, from_config(cfg))
    assert got["step_s"] == want.step_s > 0 and got["mfu"] == want.mfu
    assert got["tokens_per_s"] * got["step_s"] == pytest.approx(8 * 4096)  # global batch 8 at seq 4096
    assert sim_prediction(ov, "a100_80gb")["step_s"] > 2 * got["step_s"]  # 312 vs 989 TFLOP/s peak
    assert hardware_preset("NVIDIA H200") == "h200_sxm" and hardware_preset("NVIDIA H100 80GB HBM3") == "h100_sxm"


def test_plain_loop_side_runs_on_cpu(tmp_path):
    """The throughput part's plain loop (bench/overhead.py PlainLoop, the same module, fused
    AdamW on CUDA) on a tiny model on CPU: it trains (the loss falls over the same batches the
    Trainer takes), and `measure` writes its figures and the simulator's prediction."""
    from bench.gpu_throughput import measure
    from bench.overhead import PlainLoop
    from mpoverlap.config import compose
    from mpoverlap.training.data import build_datasets

    cfg = compose(["model=llama_tiny", *TINY, "train.lr=0.01", "train.lr_warmup_steps=0"])
    data, _ = build_datasets(cfg.data, cfg.model.seq_length, cfg.model.vocab_size)
    loop = PlainLoop(cfg, data)
    losses = [float(loop.train_step()["loss_local"]) for _ in range(4)]
    assert losses[-1] < losses[0], losses
    r = measure("llama3_1b", tmp_path / "t.json", "cpu", warmup=1, steps=2, sides=("plain",), hardware="h100_sxm",
                extra=TINY)
    assert json.loads((tmp_path / "t.json").read_text()) == json.loads(json.dumps(r))
    row = r["sides"]["plain"]
    assert "error" not in row, row
    assert len(row["steps_s"]) == 2 and row["tokens_per_s"] == pytest.approx(4 * 32 / row["step_s"])
    assert r["simulated"]["hardware"] == "h100_sxm" and r["simulated"]["step_s"] > 0
    assert "mfu" not in row  # no peak known for a CPU: no made-up MFU
    assert row["launches"] > 100 and row["foreach_tensors"] > 0, row  # the operators of one more step
    assert "host" not in row and "estimated_peak_gib" not in row  # the Trainer's side's (not run here)
    # where a step's host time went (bench/host_profile.py, the Trainer's eager side in the check),
    # on the plain loop here: autograd's backward among the Python-called functions with most self
    # time, the GEMMs among the aten operators, no CUDA runtime call on a CPU
    import torch

    from bench.host_profile import host_profile

    host = host_profile(loop.train_step, torch.device("cpu"), lambda: None)
    assert any("run_backward" in f["function"] for f in host["python_top"]), host["python_top"]
    assert any(a["name"] in ("aten::mm", "aten::addmm") for a in host["aten_top"]), host["aten_top"]
    assert host["runtime"] == []
    from bench.gpu_report import _host_rows

    md = "\n".join(_host_rows("llama3_1b", "plain", host))
    assert "host time of one step" in md and "Python function (cProfile)" in md and "CUDA runtime" not in md


def test_cuda_tier_helpers_run_on_cpu(monkeypatch):
    """The CUDA tier's trainer helper on the CPU side, in a 1-rank gloo world of this process:
    keeps the tier in step with the Trainer's API although CI never runs it on a GPU."""
    import socket

    import torch.distributed as dist

    import test_cuda_tier as tier
    from mpoverlap.training.setup import shutdown_distributed

    assert not dist.is_initialized()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(port)).items():
        monkeypatch.setenv(k, v)
    try:
        losses = tier._losses(tier.BASE + ["model=llama_tiny", "model.num_layers=1", "train.precision=bf16"], "cpu",
                              steps=2)
    finally:
        shutdown_distributed()
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses) and losses[1] < losses[0]


def test_exit_code_says_whether_everything_ran_and_passed():
    from bench.gpu_check import passed

    ok = {"tests": {"returncode": 0}, "skipped": [], "throughput": {"gpt_125m": {"sides": {"plain": {"step_s": 1.0}}}}}
    assert passed(ok)
    assert not passed(dict(ok, tests={"returncode": 1}))
    assert not passed(dict(ok, skipped=["throughput moe_350m: 10 s of the budget left"]))
    assert not passed(dict(ok, throughput={"gpt_125m": {"status": "timeout", "sides": {"plain": {"step_s": 1.0}}}}))
    assert not passed(dict(ok, throughput={"gpt_125m": {"sides": {"plain": {"error": "OOM"}}}}))


@pytest.mark.skipif(not list((REPO / ".gpu" / "whl").glob("*.whl")), reason="no wheels in .gpu/whl (make gpu-wheels)")
def test_bare_machine_install_from_carried_wheels(tmp_path, monkeypatch):
    """Where hydra / omegaconf / the package do not import (a bare GPU machine; faked here for
    the first look), the wheels in .gpu/whl and the package go into folders of their own with
    pip, no index, and the parts' PYTHONPATH imports them from there."""
    import bench.gpu_check as gc

    real, seen = gc._package_importable, []

    def first_look_fails(env, cwd):
        seen.append(env.get("PYTHONPATH"))
        return len(seen) > 1 and real(env, cwd)

    monkeypatch.setattr(gc, "_package_importable", first_look_fails)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    env = gc.prepare_env(tmp_path, root=tmp_path / "install")
    assert env["PYTHONPATH"].split(os.pathsep) == [str(tmp_path / "install" / "mp"), str(tmp_path / "install" / "site")]
    assert seen == [None, env["PYTHONPATH"]]
    assert (tmp_path / "install" / "mp" / "mpoverlap" / "models" / "gpt.py").exists()
    assert (tmp_path / "install" / "site" / "hydra").is_dir()


def test_bare_machine_without_wheels_says_what_to_carry(tmp_path, monkeypatch):
    import bench.gpu_check as gc

    monkeypatch.setattr(gc, "_package_importable", lambda env, cwd: False)
    with pytest.raises(gc.SetupError, match="make gpu-wheels"):
        gc.prepare_env(tmp_path, repo=tmp_path)


def test_cuda_tier_bf16_bound_is_a_multiple_of_the_runs_noise_floor():
    """The CUDA tier's bf16 bound (tests/test_cuda_tier.py `bf16_bound`) on made-up CPU curves: the
    CPU reference's bf16 curve 5e-5 from its fp32 curve gives a bound that the H200 reports' CUDA
    gaps (docs/gpu-reports/, at most 1.0e-4) meet and a CUDA path 1e-3 off does not; a reference
    whose bf16 curve is its fp32 curve (autocast did not run) or 1e-2 off it gives no bound."""
    import test_cuda_tier as tier

    fp32 = [5.5, 5.2, 4.9, 4.7, 4.4]
    bf16 = [x * (1 + d) for x, d in zip(fp32, [2e-5, -1e-5, 5e-5, 3e-5, -4e-5])]
    bound, floor = tier.bf16_bound(bf16, fp32)
    off = [x * (1 + 1e-3) for x in bf16]
    assert max(tier.rel_gaps(off, bf16)) > bound, bound
    reported = [row["max_rel"] for path in sorted((REPO / "docs" / "gpu-reports").glob("*.json"))
                for row in json.loads(path.read_text())["cuda_vs_cpu"] if row["case"].endswith("-bf16")]
    assert len(reported) == 12 and max(reported) <= bound, (reported, bound)
    assert floor == pytest.approx(5e-5) and bound == pytest.approx(tier.BF16_FLOORS * 5e-5)
    for wrong in (fp32, [x * (1 + 1e-2) for x in fp32]):
        with pytest.raises(AssertionError, match="from its fp32 curve"):
            tier.bf16_bound(wrong, fp32)


def test_default_budget_holds_every_part_within_a_ten_minute_call():
    """`make gpu-check`'s default budget has room for the CUDA tier's limit, every shape's own
    limit and the setup (so a default run skips nothing by design), fits in 10 minutes, and is
    the figure docs/gpu-check.md gives."""
    import bench.gpu_check as gc

    a = gc.options([])
    shapes = a.shapes.split(",")
    assert shapes == list(gc.SHAPES) and set(shapes) <= set(gc.SHAPE_S) and gc.SETUP_S >= 5 * len(shapes)
    assert a.budget_s >= a.tests_s + sum(gc.SHAPE_S[s] for s in shapes) + gc.SETUP_S, a
    assert a.budget_s <= 570, a  # a 600 s call, with room for the machine's own start of the command
    doc = (REPO / "docs" / "gpu-check.md").read_text()
    assert f"default {a.budget_s:.0f}" in doc and f"at most {a.tests_s:.0f} s" in doc


def test_fp8_check_budget_shapes_and_sides():
    """`make gpu-check-fp8`: llama3_1b and moe_350m, the four Trainer sides each (bf16 and fp8,
    eager and compiled) within a ten-minute call, the tier's fp8 tests only; the figure is the
    one docs/gpu-check.md gives."""
    import bench.gpu_check as gc
    from bench.gpu_throughput import side_overrides

    a = gc.options(["--fp8"])
    assert a.shapes.split(",") == ["llama3_1b", "moe_350m"] == list(gc.FP8_SHAPE_S)
    assert a.budget_s >= a.tests_s + sum(gc.FP8_SHAPE_S.values()) + gc.SETUP_S and a.budget_s <= 570, a
    assert gc.options(["--fp8", "--budget-s", "300"]).budget_s == 300
    assert set(gc.FP8_SIDES.split(",")) == {"mpoverlap", "compiled", "fp8", "fp8_compiled"}
    base = ["model=llama3_1b", "train.precision=bf16", "parallel.dp=1"]
    assert side_overrides(base, "fp8") == ["model=llama3_1b", "parallel.dp=1", "train.precision=fp8"]
    assert side_overrides(base, "fp8_compiled")[-2:] == ["train.precision=fp8", "train.compile=true"]
    assert side_overrides(base, "compiled") == base + ["train.compile=true"]
    doc = (REPO / "docs" / "gpu-check.md").read_text()
    assert f"default {a.budget_s:.0f}" in doc and "make gpu-check-fp8" in doc


def test_fp8_check_passes_its_selection_and_sides_to_the_parts(tmp_path, monkeypatch):
    import bench.gpu_check as gc

    calls = []

    class Done:
        returncode = 0

    monkeypatch.setattr(gc.subprocess, "run", lambda cmd, **kw: calls.append(cmd) or Done())
    gc.run_tests(tmp_path, {}, 10.0, "fp8")
    assert calls[0][calls[0].index("-k") + 1] == "fp8"
    gc.run_shape("llama3_1b", tmp_path, {}, 10.0, gc.FP8_SIDES)
    assert f"'--sides', '{gc.FP8_SIDES}'" in calls[1][-1]
    gc.run_tests(tmp_path, {}, 10.0)
    gc.run_shape("gpt_125m", tmp_path, {}, 10.0)
    assert "-k" not in calls[2] and "--sides" not in calls[3][-1]


def test_fp8_kernels_are_picked_by_name():
    from bench.gpu_throughput import fp8_kernels

    names = ["sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x128_warpgroupsize1x1x1",
             "void fbgemm_gpu::f8f8bf16_rowwise_grouped_kernel<cutlass::float_e4m3_t>",
             "nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NTN",
             "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26",
             "void at::native::vectorized_elementwise_kernel<4, at::native::float8_copy_kernel_cuda"]
    got = [k["kernel"] for k in fp8_kernels([{"kernel": n, "ms": 1.0, "calls": 1} for n in names])]
    assert got == [names[0], names[1], names[4]]


def test_report_names_the_fp8_kernels_and_the_acceptance_line():
    from bench.gpu_report import render

    gemm = {"kernel": "sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n", "ms": 40.0, "calls": 96}
    side = {"tokens_per_s": 1.0, "model_tflops_per_s": 1.0, "mfu": 0.1, "peak_memory_gib": 1.0}

    def results(fp8_step):
        return {"env": {}, "throughput": {
            "llama3_1b": {"sides": {"mpoverlap": dict(side, step_s=0.75), "compiled": dict(side, step_s=0.6),
                                    "fp8": dict(side, step_s=0.6, fp8_kernels=[gemm]),
                                    "fp8_compiled": dict(side, step_s=fp8_step, fp8_kernels=[])}},
            "moe_350m": {"sides": {"fp8": {"error": "ConfigError: train.precision=fp8"}}}}}

    md = render(results(0.45))
    for text in ("| llama3_1b | mpoverlap Trainer, train.precision=fp8 | `sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n` "
                 "(40.00, 96) |",
                 "| llama3_1b | mpoverlap Trainer, train.precision=fp8, train.compile=true | none: no kernel named",
                 "| moe_350m | mpoverlap Trainer, train.precision=fp8 | error: ConfigError",
                 "| llama3_1b | fp8 tokens/s / bf16 tokens/s, eager Trainer | 1.250 |",
                 "| llama3_1b | fp8 tokens/s / bf16 tokens/s, train.compile=true | 1.333 |",
                 "Acceptance: llama3_1b at seq 4096, train.compile=true: fp8 1.33x bf16's tokens/s, target >= 1.25x: met"):
        assert text in md, text
    assert "fp8 1.20x bf16's tokens/s, target >= 1.25x: missed" in render(results(0.5))
    assert "FP8 GEMMs" not in render({"env": {}, "throughput": {"gpt_125m": {"sides": {"mpoverlap": dict(side, step_s=1.0)}}}})


def test_default_check_measures_fp8_beside_bf16_in_its_one_call(tmp_path, monkeypatch):
    """`make gpu-check` (one call on a GPU machine) runs llama3_1b's compiled bf16 and fp8
    sides first (the 1.25x target), its eager Trainer beside the plain loop and its eager fp8
    side, and moe_350m's eager Trainer (its host profile), plain loop, compiled and fp8 sides."""
    import bench.gpu_check as gc

    assert gc.DEFAULT_SIDES["llama3_1b"].split(",")[:2] == ["compiled", "fp8_compiled"]
    assert {"mpoverlap", "plain", "fp8"} <= set(gc.DEFAULT_SIDES["llama3_1b"].split(","))
    assert gc.DEFAULT_SIDES["moe_350m"].split(",")[0] == "mpoverlap" and "fp8" in gc.DEFAULT_SIDES["moe_350m"]
    calls = []
    monkeypatch.setattr(gc.subprocess, "run", lambda cmd, **kw: calls.append(cmd) or type("R", (), {"returncode": 0})())
    gc.run_shape("llama3_1b", tmp_path, {}, 10.0, gc.DEFAULT_SIDES["llama3_1b"])
    assert f"'--sides', '{gc.DEFAULT_SIDES['llama3_1b']}'" in calls[0][-1]
