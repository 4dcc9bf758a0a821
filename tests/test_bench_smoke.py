"""bench.scaling / bench.memory / bench.timelines without running anything: every configuration
they would launch validates, and their results.md sections render from results.json's shape."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/ is not an installed package

from bench import long_context, memory, scaling, timelines  # noqa: E402
from mpoverlap.config import compose  # noqa: E402
from mpoverlap.overlap.rules import validate  # noqa: E402

MACHINE = {"cores": 2}


def _configs():
    for world in (1, 2, 4, 8):
        yield scaling.world_overrides(world, 12, 0.5)
    for layout in memory.LAYOUTS.values():
        overrides = layout + ["train.steps=3"]
        yield overrides
        yield overrides + memory.baseline_overrides(compose(overrides))
    for scenario in timelines.SCENARIOS.values():
        yield scenario + timelines.PROFILED
    for seq in (64, 16384, 32768, 65536):
        for backend in long_context.BACKENDS:
            yield long_context.overrides(seq, backend, 3)


def test_every_launched_configuration_validates():
    for overrides in _configs():
        assert validate(compose(overrides), None) == [], overrides


def test_scaling_render_names_oversubscription():
    step = {"n": 3, "median_s": 0.2, "min_s": 0.2, "q1_s": 0.2, "q3_s": 0.2}
    rows = [{"world": w, "overrides": scaling.world_overrides(w, 4, 0.5), "step": dict(step, median_s=0.2 * w),
             "dp_time_s_median": None if w == 1 else 0.05, "dp_exposed_s_median": None if w == 1 else 0.01,
             "tokens_per_step": 2048 * w, "others_cores": 0.0, "wall_s": 5.0} for w in (1, 2, 4)]
    text = scaling.render({"machine": MACHINE, "scaling": {"link": "x", "steps": 4, "skipped_steps": 1,
                                                            "per_rank_batch": 16, "rows": rows}})
    assert "| 4 | 800.0 |" in text and "| 0.25 |" in text
    assert "At 4 ranks the ranks oversubscribe the CPU (2 ranks per core" in text


def test_memory_and_timelines_render():
    est = {"params": 2**20, "grads": 2**20, "optimizer": 2**21, "activations": 2**22}
    small = dict.fromkeys(est, 0)
    mem = {"steps": 3, "world": 2, "layouts": {"dp2": {
        "overrides": ["parallel.dp=2", "train.steps=3"], "baseline_overrides": [], "rss_bytes": [300 * 2**20, 310 * 2**20],
        "baseline_rss_bytes": [302 * 2**20, 302 * 2**20], "estimate_bytes": est, "baseline_estimate_bytes": small}}}
    text = memory.render({"memory": mem})
    assert "| `parallel.dp=2` | 310.0 | 302.0 | 8.0 | 8.0 | 8.0 | 1.0 / 1.0 / 2.0 / 4.0 / 0.0 | 1.00 |" in text
    # the estimate's other entries (weight casts, the loss's backward, CP's work) in "the rest"
    mem["layouts"]["dp2"]["estimate_bytes"] = {**est, "weight_casts": 2**20, "loss_backward": 2**20}
    assert "| 10.0 | 10.0 | 1.0 / 1.0 / 2.0 / 4.0 / 2.0 | 0.80 |" in memory.render({"memory": mem})
    tl = {"link": "x", "scenarios": {"dp2": {"overrides": ["parallel.dp=2"], "png": "timelines/dp2.png",
                                             "summary": ["rank 0 dp: 1 handles"]}}}
    assert "![dp2](timelines/dp2.png)" in timelines.render({"timelines": tl})
    assert scaling.render({}) == memory.render({}) == timelines.render({}) == ""


def test_zero_bench_configurations_validate_and_render():
    """bench.zero: its mpoverlap sides validate at 2 ranks; summarize + render from the shape
    its workers gather (two ranks' blocks and memory)."""
    from types import SimpleNamespace

    from bench import zero

    args = SimpleNamespace(layers=8, micro_batch=8, global_batch=32, bucket_mb=4.0, data_bytes=2_000_000,
                           gathers=False, hidden=0, heads=0, ffn=0, seq=0)
    for extra in zero.MPO.values():
        assert validate(compose(zero._base(args) + extra), 2) == []
    gathers = SimpleNamespace(**dict(vars(args), gathers=True, hidden=256, heads=8, ffn=1024, seq=128, micro_batch=2,
                                     global_batch=4))
    for extra in zero.GATHERS.values():
        assert validate(compose(zero._base(gathers) + extra), 2) == []
    mem = {"params": 2**20, "grads": 2**19, "optimizer": 2**20}
    ledger = {"dp": {"time_s": 0.02, "exposed_s": 0.005, "bytes": 2**21},
              "ops": {"all_gather": [0.012, 0.004], "reduce_scatter": [0.008, 0.001]}}
    blocks = [{"name": name, "times": [0.1, 0.11], "extras": [ledger, ledger] if name in zero.MPO else [{}, {}]}
              for name in zero.SIDES]
    rank = {"blocks": blocks, "memory": {name: mem for name in zero.SIDES}}
    res = zero.summarize([rank, rank], list(zero.SIDES), {})
    assert abs(res["variants"]["zero3_prefetch"]["dp_comm"]["all_gather_hidden_share"] - 2 / 3) < 1e-9
    assert res["zero3_prefetch_over_fsdp2_step"] == 1.0
    text = zero.render({"zero": dict(res, link="test link")})
    assert "torch_fsdp2" in text and "0.67" in text and "test link" in text
    ledger = dict(ledger, dp=dict(ledger["dp"], link_bytes=2**20))
    sides = [*zero.GATHERS, "local_no_comm"]
    blocks = [{"name": name, "times": [0.1, 0.11] if name != "gathers_bf16" else [0.05, 0.055],
               "extras": [ledger, ledger] if name in zero.GATHERS else [{}, {}]} for name in sides]
    rank = {"blocks": blocks, "memory": {name: mem for name in sides}}
    res = zero.summarize([rank, rank], sides, {})
    assert res["over_fp32_gathers_step"]["gathers_bf16"] == 0.5
    text = zero.render({"zero": dict(res, link="test link")})
    assert "gathers_int8" in text and "| 0.50 |" in text and "2.0 / 1.0" in text


def test_async_ckpt_bench_configuration_validates_and_renders():
    """bench.async_ckpt: its run validates at 2 ranks; summarise + render from the shape its
    workers gather (per step: wall, cpu, write in flight at the start, at the end)."""
    from types import SimpleNamespace

    from bench import async_ckpt

    args = SimpleNamespace(layers=8, hidden=512, ffn=2048, seq=32, global_batch=2)
    assert validate(compose(async_ckpt.overrides(args, "/tmp/x")), 2) == []
    cycle = {"boundary_s": 0.05, "stage_s": 0.03, "write_s": 0.5, "step": 1,
             "steps": [(0.12, 0.1, True, True), (0.12, 0.1, True, True), (0.11, 0.1, True, False),
                       (0.1, 0.1, False, False)]}
    rank = {"no_save": [(0.1, 0.09)] * 4, "sync_s": [0.6, 0.7], "cycles": [cycle, cycle]}
    res = async_ckpt._summarise([rank, rank], 4)
    assert res["whole_step_under_write"]["n"] == 4 and res["under_write"]["n"] == 6
    assert abs(res["ratio_whole_under_write"] - 1.2) < 1e-9 and abs(res["ratio_whole_vs_after_write"] - 1.2) < 1e-9
    text = async_ckpt.render({"async_ckpt": dict(res, setup={"overrides": ["parallel.tp=2"], "parameters": 33e6, "checkpoint_bytes": 2**28,
                                                             "threads_per_rank": 1, "steps_per_cycle": 4},
                                                 loadavg_before=[1.0, 1, 1], loadavg_after=[1.5, 1, 1])})
    assert "| step wholly under an async write | 120 (120-120, n=4) |" in text and "1.20 (goal <= 1.5: met)" in text


def test_tp_scenario_peers_compute_the_same_first_loss(tmp_path):
    """bench.modes' tp scenario, tiny and without the rate-limited namespace: the DTensor
    peer (which re-splits the fused qkv by heads and K/V groups itself) starts from the loss
    mpoverlap's tp layouts compute."""
    import json
    import os
    import subprocess

    out = tmp_path / "tp.json"
    cmd = [sys.executable, "-m", "bench.modes", "--scenario", "tp", "--layers", "1", "--hidden", "64", "--ffn", "128",
           "--seq", "64", "--repeats", "1", "--max-repeats", "1", "--time-budget", "5", "--warmup", "1", "--block", "2",
           "--min-quiet", "0", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=dict(os.environ, OMP_NUM_THREADS="1"),
                          cwd=Path(__file__).resolve().parent.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    mpo = ("mpo_tp_overlap", "mpo_tp_off", "mpo_tp_nosp_overlap", "mpo_tp_nosp_off")  # with SP and without
    for name in mpo:  # the typical step's figures beside the sums
        tp = result["variants"][name]["comm"]["tp"]
        assert 0 < tp["exposed_ms_median"] <= tp["in_flight_ms_median"]
    first = result["first_loss"]
    ref = first["mpo_tp_off"][0]
    for name in (*mpo, "dtensor_tp"):
        assert abs(first[name][0] - ref) <= 1e-5 * abs(ref), (name, first)
    # The simulator's model rate, timed in the rounds: one probe for the mpoverlap variants of one
    # layout (with SP, without: bench/rate_probe.py machine_of), none for the peer; the rate
    # counts the model's FLOPs per microbatch.
    from mpoverlap.config import compose
    from mpoverlap.models.flops import flops_per_token

    probe = result["model_rate_probe"]
    assert set(probe) == set(mpo) and probe["mpo_tp_overlap"] == probe["mpo_tp_off"]
    assert probe["mpo_tp_nosp_overlap"] == probe["mpo_tp_nosp_off"]
    cfg = compose(result["base_overrides"] + result["variant_overrides"]["mpo_tp_off"])
    flops = flops_per_token(cfg.model) * cfg.train.micro_batch_size * cfg.model.seq_length
    row = probe["mpo_tp_off"]
    assert row["samples"] >= 2 and row["model_flops"] * row["median_thread_s"] == pytest.approx(flops)


def test_predict_judges_shares_on_the_median_step_and_shows_the_sums():
    from bench.predict import _measured_share, render

    # DP: 9 buckets, median step 87.7 ms in flight of which 6.8 ms exposed; summed over all
    # steps 23% (a few steps with a descheduled peer)
    dp = {"dp_comm": {"time_s_median": 0.0877, "exposed_s_median": 0.0068, "exposed_share": 0.23}}
    assert _measured_share("dp", dp) == pytest.approx((0.0068 / 0.0877, 0.23))
    tp = {"comm": {"tp": {"in_flight_ms_median": 200.0, "exposed_ms_median": 50.0, "exposed_share": 0.3}}}
    assert _measured_share("tp", tp) == pytest.approx((0.25, 0.3))
    assert _measured_share("tp", {"comm": {"tp": {"exposed_share": 0.3}}}) == (None, 0.3)  # older results
    row = {"scenario": "dp", "variant": "v", "overlap": True, "measured_step_s": 1.0, "predicted_step_s": 0.8,
           "measured_share": 0.0775, "measured_share_all_steps": 0.30, "predicted_share": 0.08,
           "peak_gflops": 50.0, "efficiency": 0.5, "link_mb_s": 100.0}
    text = render([row, dict(row, predicted_step_s=0.7, measured_share=None)])
    assert "| -20% | 0.08 | 0.30 | 0.08 | +0.00 | -0.22 |" in text
    assert "| -30% | - | 0.30 | 0.08 | - | -0.22 |" in text
    assert "Step within 25%: 1/2; exposed share within 0.15: 1/2 (median step), 0/2 (all steps)." in text


def test_long_context_ring_overhead_and_render():
    """The ring-overhead part at a small sequence (really run: both ranks' ring compute and the
    same blocks through SDPA), and the section renders a skipped side."""
    ov = long_context.ring_overhead(256, repeats=1)
    assert ov["ring_compute_s"] > 0 and ov["sdpa_s"] > 0
    side = {"step_time_s": 2.0, "tokens_per_s": 100.0, "peak_rss_bytes": [2**30, 2**30]}
    res = {"seqs": [256], "steps": 3, "loadavg_before_after": [["1", "1", "1"], ["2", "2", "2"]],
           "sides": {"fused_256": side, "explicit_256": {"skipped": "estimate 9 GiB per rank x 2 ranks > 4 GiB"}},
           "memory": {"seq": 256, "measured_bytes": [2**30, 2**30], "estimate_bytes": 2**30, "ratios": [1.0, 1.0]},
           "ring_overhead": ov}
    text = long_context.render({"long_context": res})
    assert "| 256 | 2.0 | not run | - |" in text and "explicit_256: not run: estimate 9 GiB" in text
    assert "Ring overhead at seq 256" in text


def test_zero_bubble_bench_plumbing(tmp_path):
    """bench.zero_bubble, tiny and on the bare loopback: every mpoverlap schedule of
    SCHEDULE_KINDS that pp 2 can run and torch's 1F1B / ZB1P / ZBV start from the same loss (the
    same weights and batch), each of our sides reports F / B (/ W) costs, its bubble per stage
    and the formulas at those costs, and the section renders; the tp_wgrad and memory
    configurations validate."""
    import json
    import os
    import subprocess
    from types import SimpleNamespace

    from bench import memory, zero_bubble, zero_bubble_report
    from mpoverlap.pipeline.schedules import SCHEDULE_KINDS, defers_weight_grads

    out = tmp_path / "zb.json"
    cmd = [sys.executable, "-m", "bench.zero_bubble", "--scenario", "schedules", "--layers", "4", "--hidden", "64",
           "--ffn", "128", "--seq", "32", "--heads", "4", "--microbatches", "4", "--repeats", "1", "--max-repeats", "1",
           "--time-budget", "5", "--warmup", "1", "--block", "2", "--min-quiet", "0", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=dict(os.environ, OMP_NUM_THREADS="1"),
                          cwd=Path(__file__).resolve().parent.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    ours = {n for n in res["variants"] if n.startswith("mpo_")}
    assert {"mpo_1f1b_m4", "mpo_interleaved_m4", "mpo_zb1p_m4"} <= ours
    assert len(ours) == sum(zero_bubble.schedule_vpp(k, 2, 4, 4) is not None for k in SCHEDULE_KINDS)
    losses = {n: max(v, key=abs) for n, v in res["first_loss"].items()}
    ref = losses["mpo_1f1b_m4"]
    for name in ("torch_1f1b_m4", "torch_zb1p_m4", "torch_zbv_m4", *ours):
        assert abs(losses[name] - ref) <= 1e-5 * abs(ref), (name, losses)
    for name in ours:
        row = res["variants"][name]
        assert len(row["stages"]) == 2 and all(s["busy_ms"] > 0 for s in row["stages"])
        assert row["costs_ms"]["F"] > 0 and row["costs_ms"]["B"] > 0
        assert (row["costs_ms"]["W"] > 0) == defers_weight_grads(row["kind"])
        assert len(row["timed_table_ms"]["in_window_s"]) == 2
        assert len(row["timed_chunk_ms"]["in_window_s"]) == 2  # per-chunk costs + p2p latency
        # once per step with that step's costs and the stages' start offsets
        assert len(row["timed_step_ms"]["in_window_s"]) == 2 and row["timed_step_ms"]["steps"] > 0
        assert len(row["start_offset_ms"]) == 2 and len(row["per_step_pipe"]) == row["timed_step_ms"]["steps"]
        assert row["p2p_latency_ms"]["n"] > 0 and all(s["chunk_action_ms"] for s in row["stages"])
        # the closed form (pipeline/bubble.py) at the pooled and at each stage's measured costs
        assert row["closed_form_ms"] > 0 and len(row["closed_form_stage_ms"]) == 2 and row["closed_form"]
    text = zero_bubble_report.render({"zero_bubble": {"schedules": res}})
    assert "ZB-H1 (zb1p)" in text and "torch ScheduleZBVZeroBubble" in text and "zb1p/1f1b" in text
    if "mpo_zbv_m4" in ours:
        assert "zbv/interleaved" in text and "ours/torch zbv" in text
    args = SimpleNamespace(scenario="tp_wgrad", hidden=64, ffn=128, seq=32, layers=4, heads=4, micro_batch=2,
                           microbatches=[4], torch=[])
    spec = zero_bubble.scenario_overrides(args)
    for extra in spec["variants"].values():
        assert validate(compose(zero_bubble.COMMON + spec["base"] + extra), 4) == []
    args = SimpleNamespace(layers=4, hidden=64, ffn=128, seq=32, heads=4, micro_batch=2)
    layouts = zero_bubble_report.memory_layouts(args, 4)
    assert {"zb_1f1b_m4", "zb_zb1p_m4"} <= set(layouts)
    for overrides in layouts.values():
        overrides = overrides + ["train.steps=3"]
        assert validate(compose(overrides), 2) == []
        assert validate(compose(overrides + memory.baseline_overrides(compose(overrides))), 2) == []
    rows = {}
    for kind in ("1f1b", "zb1p"):
        acts = [{"rank": r, "stage": r, "measured": (3 + r) * 2**20, "estimate": 2**21, "ratio": 1.0} for r in (0, 1)]
        rows[f"zb_{kind}_m4"] = {"activations": acts}
    assert "zb1p 1.00 (goal <= 1.10: met)" in zero_bubble_report.peak_line(rows, 4)
    assert memory.render({}) == ""


def test_ep_pairing_bench_plans_renders_and_names_a_build_without_pairing():
    """bench.ep_pairing: the variants it runs validate at 2 ranks; without the
    `overlap.ep_pairing` key the pairing columns are reported as not available instead of
    failing (with the key, all four run, none and chunks with pairing off); the table renders
    from the shape its workers write, with the prediction beside each measurement."""
    from types import SimpleNamespace

    from bench import ep_pairing

    args = SimpleNamespace(**ep_pairing.DEFAULTS)
    base, run, skipped = ep_pairing.planned(args)
    have, why = ep_pairing.pairing_available()
    for extra in run.values():
        assert validate(compose(base + extra), 2) == []
    if have:
        assert set(run) == set(ep_pairing.VARIANTS) and "overlap.ep_pairing=false" in run["chunks"]
    else:
        assert set(run) == {"none", "chunks"} and skipped == {"pairing": why, "both": why}
        assert why == "pairing: not available in this build (no overlap.ep_pairing key)"
    step = {"n": 6, "median_s": 0.8, "min_s": 0.7, "q1_s": 0.75, "q3_s": 0.85}
    rows = {"none": {"blocks": 4, "step": dict(step, median_s=1.0),
                     "comm": {"ep": {"in_flight_ms_median": 250.0, "exposed_ms_median": 245.0}}},
            "chunks": {"blocks": 4, "step": step, "comm": {"ep": {"in_flight_ms_median": 260.0,
                                                                  "exposed_ms_median": 130.0}}}}
    res = {"setup": dict(ep_pairing.DEFAULTS, block=3, block_warmup=1), "link": "test link", "variants": rows,
           "variants_quiet": rows, "quiet_threshold_cores": 0.1, "base_overrides": base,
           "variant_overrides": {n: run[n] for n in ("none", "chunks")},
           "skipped": {"pairing": ep_pairing.UNAVAILABLE, "both": ep_pairing.UNAVAILABLE},
           "predicted": {"none": {"step_s": 0.9, "share": 1.0, "exchanges_over_experts": 1.02, "pairing": "off"},
                         "chunks": {"step_s": 0.84, "share": 0.45, "pairing": "off"}}}
    text = ep_pairing.render({"ep_pairing": res})
    assert "| none | `overlap.ep=false overlap.ep_chunks=1" in text and "| 1000.0 | 750.0-850.0 | 1.250 |" in text
    assert "| 0.98 | 900.0 | -10% | 1.00 | +0.02 |" in text  # share 245 / 250; predicted 0.9 s of 1.0
    assert "| 0.50 | 840.0 | +5% | 0.45 | -0.05 |" in text
    assert "simulated 1.02" in text and f"Not run: pairing, both ({ep_pairing.UNAVAILABLE})." in text
    assert ep_pairing.render({}) == ""


def test_ep_pairing_bench_dispatch_fp8_variants_validate_and_render():
    """bench.ep_pairing --dispatch-fp8: every variant with a bf16 dispatch wire over fp32 compute,
    none and chunks again with fp8 dispatch (valid at 2 ranks); the table gives their rows and the
    step and ep bytes against bf16's."""
    from types import SimpleNamespace

    from bench import ep_pairing

    base, run, _ = ep_pairing.planned(SimpleNamespace(**ep_pairing.DEFAULTS, dispatch_fp8=True))
    assert "train.ep_dispatch_dtype=bf16" in base and not any(o.startswith("train.precision=") for o in base)
    for name in ("none", "chunks"):
        assert run[f"{name}_fp8"] == run[name] + ["train.ep_dispatch_dtype=fp8"]
        assert validate(compose(base + run[f"{name}_fp8"]), 2) == []
    step = {"n": 6, "median_s": 1.0, "min_s": 0.9, "q1_s": 0.95, "q3_s": 1.05}
    ep = {"in_flight_ms_median": 250.0, "exposed_ms_median": 245.0, "mib_per_step": 8.0}
    rows = {"none": {"blocks": 4, "step": step, "comm": {"ep": ep}},
            "none_fp8": {"blocks": 4, "step": dict(step, median_s=0.9), "comm": {"ep": dict(ep, mib_per_step=7.0)}}}
    res = {"setup": dict(ep_pairing.DEFAULTS, block=3, block_warmup=1), "link": "test link", "variants": rows,
           "variants_quiet": rows, "quiet_threshold_cores": 0.1, "base_overrides": base,
           "variant_overrides": {n: run[n] for n in rows}, "skipped": {}, "predicted": {}}
    text = ep_pairing.render({"ep_pairing": res})
    assert "| none_fp8 | `overlap.ep=false" in text and "| 900.0 |" in text
    assert "fp8 dispatch, none: step 0.900x bf16's, ep 7.00 MiB a step and rank against 8.00" in text


def test_ep_pairing_pp_bench_variants_validate_and_render():
    """bench.ep_pairing_pp: its four pp 2 variants validate at 4 ranks (the two
    paired ones resolve pairing on); the table renders each variant with its prediction and the
    goal line (zbv + pairing against the better of zbv and interleaved + pairing)."""
    from types import SimpleNamespace

    from bench import ep_pairing_pp
    from mpoverlap.overlap.config import CommOverlapConfig

    base = ep_pairing_pp.base_overrides(SimpleNamespace(**ep_pairing_pp.DEFAULTS))
    variants = ep_pairing_pp.variant_overrides()
    for name, extra in variants.items():
        cfg = compose(base + extra)
        assert validate(cfg, 4) == []
        assert CommOverlapConfig.from_config(cfg, 4).ep_pairing.enabled == name.endswith("pairing")
    step = {"n": 4, "median_s": 2.0, "min_s": 1.9, "q1_s": 1.95, "q3_s": 2.05}
    rows = {n: {"blocks": 3, "step": dict(step, median_s=m), "ep_in_flight_ms": 400.0, "ep_exposed_ms": 100.0,
                "exposed_share": 0.25, "bubble_ms": 50.0, "rank_cores": 0.45, "foreign_cores": [0.0]}
            for n, m in (("zbv", 2.0), ("zbv_pairing", 1.8), ("interleaved_pairing", 1.9), ("interleaved", 2.1))}
    pred = {n: {"step_s": 2.2, "share": 0.3, "rank_cores": 0.48, "pairing": "on: the paired table",
                "step_s_core_per_rank": c} for n, c in (("zbv", 1.6), ("zbv_pairing", 1.2),
                                                        ("interleaved_pairing", 1.5), ("interleaved", 1.7))}
    text = ep_pairing_pp.render({"ep_pairing_pp": {"variants": rows, "predicted": pred}})
    assert ("with a core per rank: zbv 1600, zbv_pairing 1200, interleaved_pairing 1500, interleaved 1700 ms, "
            "ratio 0.800") in text
    assert "| zbv_pairing | 1800 | 1950-2050 | 400 | 100 | 0.25 | 50 | 0.45 | 2200 | +22% | 0.30 | 0.48 |" in text
    assert "zbv + pairing / the better of zbv and interleaved + pairing: 0.947 (goal <= 0.95)." in text
    assert ep_pairing_pp.render({}) == ""


def test_launch_bound_overhead_line_validates_and_renders():
    """The launch-bound overhead line: its configuration validates at 1 rank, and the
    section renders the measured ratio (no goal on CPU) beside the plain loop's optimizer."""
    import argparse

    from bench import overhead
    from bench.run import render

    p = argparse.ArgumentParser()
    overhead.add_args(p)
    args = p.parse_args(overhead.launch_bound_args())
    ov = overhead._overrides(args)
    assert validate(compose(ov), 1) == []
    assert "model.num_layers=32" in ov and "train.grad_clip=1.0" in ov and args.plain_optimizer == "fused"
    step = {"n": 8, "median_s": 0.2, "min_s": 0.19, "q1_s": 0.195, "q3_s": 0.21}
    side = {"wall": step, "inner": step, "cpu": step, "blocks": 4}
    res = {"framework": side, "plain": {"wall": dict(step, median_s=0.16), "inner": dict(step, median_s=0.16),
                                        "cpu": dict(step, median_s=0.16), "blocks": 4},
           "ratio": 1.25, "ratio_inner": 1.25, "ratio_cpu": 1.125}
    setup = {"model": "gpt_tiny", "num_layers": 32, "hidden_size": 32, "seq_length": 16, "micro_batch_size": 2,
             "microbatches": 4, "grad_clip": 1.0, "plain_optimizer": "fused", "threads": 1, "block": 5, "repeats": 4,
             "warmup": 3, "block_warmup": 1}
    result = {"setup": setup, "all": res, "quiet": res, "quiet_threshold_cores": 0.1,
              "block_foreign_cores": [{"side": "framework", "foreign_cores": 0.0}] * 8,
              "max_loss_diff_first5": 0.0, "max_loss_diff": 1e-3, "steps_compared": 40}
    text = render({"timestamp": "t", "machine": {"cores": 2, "cpu": "x", "torch": "2", "python": "3", "git": "abc"},
                   "others_cpu_s": 0.0, "wall_s": 1.0, "command": "c", "overhead_launch": result})
    assert "## Framework overhead, launch-bound (many thin layers)" in text
    assert "| plain PyTorch loop (fused AdamW) | 160.0 |" in text and "**framework / plain = 1.250**;" in text
    assert "on this process's CPU time (least moved by other jobs): 1.125;" in text


def test_sigterm_stop_bench_layout_validates_at_4_ranks():
    """bench.sigterm_stop: the dp 2 x tp 2 run it signals validates at 4 ranks with
    train.log_interval=50 and a save every step (the step before the signal is known from its
    checkpoint); the launch itself is the benchmark's (about 2 minutes), not the suite's."""
    from bench import sigterm_stop

    overrides = sigterm_stop.overrides(40)
    assert {"train.log_interval=50", "checkpoint.interval=1", "parallel.tp=2"} <= set(overrides)
    assert validate(compose(overrides), 4) == []


def test_dp_overlap_formats_plan_valid_variants():
    """bench.dp_overlap --formats: every mpoverlap wire-format variant validates at 2 ranks on the
    layout whose reduction outlasts backward, the torch peers (None) are the DDP sides and their
    hooks, and the default set is unchanged."""
    from bench import dp_overlap

    argv = ["--formats", "--layers", "8", "--hidden", "256", "--heads", "8", "--ffn", "1024", "--seq", "128",
            "--micro-batch", "2", "--global-batch", "4"]
    base, variants = dp_overlap.planned(argv)
    assert list(variants) == list(dp_overlap.FORMAT_VARIANTS)
    assert "model.hidden_size=256" in base and "model.seq_length=128" in base
    for name, extra in variants.items():
        if extra is None:
            assert name in dp_overlap.TORCH_SIDES
        else:
            assert validate(compose(base + extra), 2) == [], name
    assert list(dp_overlap.planned([])[1]) == list(dp_overlap.DEFAULT_VARIANTS)


def test_dp_overlap_delay_plan_valid_variants():
    """bench.dp_overlap --delay: overlap.dp_delay 0 and 1 validate at 2 ranks on the same layout,
    beside the no-communication floor."""
    from bench import dp_overlap

    argv = ["--delay", "--layers", "8", "--hidden", "256", "--heads", "8", "--ffn", "1024", "--seq", "128",
            "--micro-batch", "2", "--global-batch", "4"]
    base, variants = dp_overlap.planned(argv)
    assert list(variants) == list(dp_overlap.DELAY_VARIANTS)
    assert "overlap.dp_delay=1" in variants["mpo_delay1"] and variants["local_no_comm"] is None
    for name, extra in variants.items():
        if extra is not None:
            assert validate(compose(base + extra), 2) == [], name


def test_dp_overlap_buckets_variants_validate_and_compare():
    """bench.dp_overlap --buckets (bench/dp_buckets.py): the fixed sizes and auto's chosen size
    validate at 2 ranks, and auto is judged against the fastest fixed size of the same run."""
    from bench import dp_buckets, dp_overlap

    base = dp_overlap.planned(["--layers", "8", "--hidden", "384", "--heads", "6", "--ffn", "1536"])[0]
    variants = dp_buckets.bucket_variants(12.0)
    assert list(variants) == ["mpo_b1", "mpo_b4", "mpo_b16", "mpo_b64", "mpo_auto"]
    assert "overlap.dp_bucket_mb=12" in variants["mpo_auto"]
    for name, extra in variants.items():
        assert validate(compose(base + extra), 2) == [], name

    def row(median):
        return {"step": {"median_s": median}}

    res = {"variants": {f"mpo_b{mb}": row(s) for mb, s in ((1, 1.3), (4, 1.1), (16, 1.0), (64, 1.2))},
           "variants_quiet": {"mpo_auto": row(1.04)}, "auto_mb": 12.0, "auto_reason": "r"}
    res["variants"]["mpo_auto"] = row(2.0)  # all blocks; the quiet ones are what is compared
    verdict = dp_buckets.compare(res)
    assert verdict["best_mb"] == 16 and abs(verdict["auto_over_best"] - 1.04) < 1e-12 and verdict["within_5pct"]
    res["variants_quiet"]["mpo_auto"] = row(1.06)
    assert not dp_buckets.compare(res)["within_5pct"]


def _powersgd_worker(rank, port, args, tmp):
    """bench.dp_overlap's worker shape (init_bench_worker, spawned by spawn_ranks): DDP +
    powerSGD_hook (rank 2, error feedback, compressing from iteration 2) on six layers, one
    bucket each, `args.steps` steps; rank 0 writes whether both ranks hold the same parameters."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel

    from bench.common import init_bench_worker
    from bench.dp_overlap import bucket_ordered

    init_bench_worker(rank, port)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)])
    group = dist.new_group([0, 1])  # as in the bench: the hooked DDP on a group of its own
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.01, process_group=group)
    state = powerSGD_hook.PowerSGDState(process_group=group, matrix_approximation_rank=2, start_powerSGD_iter=2,
                                        use_error_feedback=True, warm_start=True)
    hook = powerSGD_hook.powerSGD_hook
    ddp.register_comm_hook(state, bucket_ordered(hook) if args.ordered else hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(args.steps):
        opt.zero_grad()
        ddp(torch.randn(8, 64, generator=gen)).square().mean().backward()
        opt.step()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    both = [torch.empty_like(flat) for _ in range(2)]
    dist.all_gather(both, flat)
    if rank == 0:
        Path(args.json_tmp).write_text(json.dumps({"same": bool(torch.equal(*both)), "n": flat.numel()}))
    dist.destroy_process_group()


def test_powersgd_beside_gloo_runs_in_bucket_order():
    """bench.dp_overlap's PowerSGD side: with several buckets on gloo, powerSGD_hook's chained
    all-reduces (issued from completion callbacks) interleave across buckets differently on the
    two ranks (a gloo size mismatch or a hang); bucket_ordered issues them bucket by bucket, so
    the run completes and both ranks hold the same parameters (PowerSGD's all-reduced update)."""
    import argparse

    from bench.common import spawn_ranks

    res, _ = spawn_ranks(_powersgd_worker, argparse.Namespace(ordered=True, steps=6), prefix="mpo-test-psgd-")
    assert res == {"same": True, "n": 6 * (64 * 64 + 64)}


def test_ep_auto_bench_picks_what_the_simulator_predicts_on_the_benchmarks_hardware():
    """bench.ep_auto: from a saved bench.ep_pairing result (its rates and link probe), auto's pick
    is on exactly where the simulator, on the hardware the benchmark's prediction builds,
    predicts a faster step with chunked EP overlap than without, and its reason gives both."""
    from types import SimpleNamespace

    from bench import ep_auto, ep_pairing
    from bench.predict import _compose
    from bench.rate_probe import machine_of
    from mpoverlap.simulate.core import simulate
    from mpoverlap.simulate.ep_choice import CANDIDATE_CHUNKS, pinned

    base, run, _ = ep_pairing.planned(SimpleNamespace(**ep_pairing.DEFAULTS))
    rates = {"peak_flops": 9e10, "model_flops": 4e10, "update_s_per_param": 1.5e-9, "expert_flops": 6e10,
             "comm_cpu_s_per_byte": 1.2e-9, "cores": 2, "link_bytes_s": 0.0, "link_latency": 0.0,
             "link_efficiency": {}}
    res = {"base_overrides": base, "variant_overrides": {n: run[n] for n in ("none", "chunks")},
           "machine_rates": {machine_of(_compose(base, run["none"], [])): [rates]},
           "link_probe": {"bytes_s": 2.27e8, "latency": 1.2e-4, "efficiency": {
               "all_reduce": 1.0, "all_gather": 0.93, "reduce_scatter": 0.46, "all_to_all": 0.89, "send_recv": 1.0}},
           "model_rate_probe": {"none": {"model_flops": 4e10, "expert_flops": 6e10},
                                "chunks": {"model_flops": 4e10, "expert_flops": 5e10}}}
    got = ep_auto.picks(res, "2gbit")
    for name in ("none", "chunks"):
        hw, more = ep_auto._hardware(res, name, "2gbit")
        cfg = _compose(base, ep_auto.AUTO, more)
        off = simulate(pinned(cfg, False, 1), hw, 2).step_s
        on = {k: simulate(pinned(cfg, True, k), hw, 2).step_s for k in CANDIDATE_CHUNKS}
        best = min(on, key=lambda k: (on[k], k))
        assert got[name]["enabled"] == (on[best] < off)
        assert got[name]["chunks"] == (best if on[best] < off else 1)
        assert f"{off * 1e3:,.1f} ms" in got[name]["reason"] and f"{on[best] * 1e3:,.1f} ms" in got[name]["reason"]
        assert got[name]["at_bench_chunks"]["chunks"] == ep_pairing.DEFAULTS["chunks"]


def test_ep_auto_in_make_bench_picks_on_the_ep_pairing_run_and_renders(tmp_path):
    """bench/run.py's EP auto section: the picks are made on the run's own bench.ep_pairing
    result (nothing measured again, the same picks as `bench.ep_auto --from` on it), and
    results.md shows that run's none and chunks steps beside them."""
    from types import SimpleNamespace

    from bench import ep_auto, ep_pairing
    from bench.predict import _compose
    from bench.rate_probe import machine_of

    base, run, _ = ep_pairing.planned(SimpleNamespace(**ep_pairing.DEFAULTS))
    rates = {"peak_flops": 9e10, "model_flops": 4e10, "update_s_per_param": 1.5e-9, "expert_flops": 6e10,
             "comm_cpu_s_per_byte": 1.2e-9, "cores": 2, "link_bytes_s": 0.0, "link_latency": 0.0,
             "link_efficiency": {}}

    def row(median):
        return {"blocks": 4, "step": {"median_s": median, "q1_s": median - 0.01, "q3_s": median + 0.01}}

    measured = {"base_overrides": base, "variant_overrides": {n: run[n] for n in ("none", "chunks")},
                "machine_rates": {machine_of(_compose(base, run["none"], [])): [rates]}, "link_probe": None,
                "variants": {"none": row(0.6), "chunks": row(0.5)}, "block_foreign_cores": [0.0, 0.05],
                "loadavg_before_after": ["1.0", "1.1"]}
    got = ep_auto.run_in_bench(measured, "2gbit", tmp_path, 1.0, no_netns=True)
    assert got == {"measured_in": "ep_pairing", "auto": ep_auto.picks(measured, "2gbit")}
    assert list(tmp_path.iterdir()) == []  # nothing measured
    text = ep_auto.render_in_bench({"ep_pairing": measured, "ep_auto": got})
    assert text.startswith("## EP auto against measured on and off")
    assert "none: median 600.0 ms, IQR 590.0-610.0" in text and "chunks: median 500.0 ms" in text
    assert f"auto on none's rates: ep {'on' if got['auto']['none']['enabled'] else 'off'}" in text
    assert ep_auto.render_in_bench({}) == ""


def test_data_ahead_renders_in_make_bench():
    """bench/run.py's data-ahead section from the shape bench.data_ahead writes."""
    from bench import data_ahead

    def side(step, wait):
        return {"n": 8, "median_ms": step, "min_ms": step - 1, "q1_ms": step - 0.5, "q3_ms": step + 0.5,
                "batch_wait_ms": {"median_ms": wait, "min_ms": wait, "q1_ms": wait, "q3_ms": wait + 0.1}}

    res = {"overrides": ["model=gpt_tiny", "run.dir=/somewhere"], "build_ms": 2.4, "inline": side(216.0, 13.2),
           "ahead": side(209.0, 0.08), "saved_ms_per_step": 7.0, "batch_wait_saved_ms": 13.12}
    text = data_ahead.render({"data_ahead": res})
    assert "Overrides: `model=gpt_tiny`; one batch built alone: 2.4 ms." in text
    assert "| inline | 216.0 | 215.5-216.5 | 8 | 13.20 | 13.20-13.30 |" in text
    assert "| ahead | 209.0 | 208.5-209.5 | 8 | 0.08 | 0.08-0.18 |" in text
    assert "inline - ahead: 7.0 ms a step, 13.12 ms of batch wait." in text
    assert data_ahead.render({}) == ""
