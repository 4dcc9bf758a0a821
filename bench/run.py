"""`make bench`: framework overhead (dp=1), DP overlap on a rate-limited link (dp=2), weak scaling
of pure DP, peak memory against the estimate, and a drawn timeline per parallel mode.

Each benchmark runs in its own subprocess; the DP one inside `bench/netns.sh` (a network
namespace whose loopback is capped with tc tbf). When the namespace cannot be made (no root,
no iproute2), the DP benchmark runs on the bare loopback and the output says so.

Writes bench/results/<timestamp>/results.json and results.md and prints the table.

    python -m bench.run [--overhead-repeats 8] [--dp-repeats 6] [--block 5] [--rate 2gbit]
                        [--skip-overhead] [--skip-overhead-launch] [--skip-moe] [--skip-dp] [--no-netns]
                        [--modes tp,cp,pp,ep,bubble] [--modes-repeats 5] [--modes-block 4] [--modes-budget 150]
                        [--skip-scaling] [--scaling-worlds 1,2,4,8] [--scaling-steps 12]
                        [--skip-memory] [--memory-layouts dp2,...] [--memory-steps 3]
                        [--skip-timelines] [--timelines dp2,tp2,pp2,cp2,ep2] [--skip-zero]
                        [--skip-zero-bubble] [--zero-bubble schedules,tp_wgrad]
                        [--skip-async-ckpt] [--skip-long-context] [--long-context-seqs 16384,32768,65536]
                        [--skip-data-ahead] [--data-ahead-steps 10] [--data-ahead-blocks 3]
                        [--skip-ep-pairing] [--skip-ep-auto]

--modes runs bench/modes.py (TP/CP/PP overlap against DTensor and torch.distributed.pipelining,
and the pipeline bubble), one scenario per subprocess, each in bench/netns.sh.

Scaling (bench/scaling.py), memory (bench/memory.py) and timelines (bench/timelines.py) run
`mpoverlap-train` itself, one run per world size / layout / scenario; scaling and timelines
inside bench/netns.sh (probed once; the bare loopback otherwise, and the output says so).

bench/long_context.py: cp 2 ring attention at 16K, 32K and 64K tokens on a 2-layer
tiny model, the fused block kernels against the explicit math (step time, tokens/s, peak RSS),
peak memory against mpoverlap-check's estimate, and the ring's compute against the same blocks
through SDPA alone. The longest part of `make bench` (tens of minutes on two cores).

bench/zero_bubble.py: pp 2 schedules (ours from SCHEDULE_KINDS, torch's 1F1B, ZB1P and
ZBV) side by side at m = 4 and 8 with the bubble against its formula and each schedule's
activation memory; and the exposed tp of tp 2 + SP + collective matmul at pp 2 with and
without W deferral (world 4). Inside bench/netns.sh (probed once, as scaling's).

bench/data_ahead.py: on one process, the host time the batch built ahead (training/prefetch.py)
takes off the step against the same batches built inline.

bench/ep_auto.py: what `overlap.ep=auto overlap.ep_chunks=auto` picks on the hardware the EP 1:1
benchmark's (bench/ep_pairing.py) prediction uses, beside that run's measured none (off) and
chunks (on); measured on its own only when the run skips bench/ep_pairing.py.

bench/async_ckpt.py (checkpoint.async_save: step time while a checkpoint is written in the
background, against steps without saves and a synchronous save) runs on the bare loopback: it
measures the disk and the cores, not the link.

At the end, bench/predict.py puts the step-time simulator's prediction (`hardware=measured`)
beside every DP and modes measurement of the run (step time and exposed share). The machine's
rates for each benchmark are timed right before and right after it runs (its `machine_rates`),
and the prediction uses their mean: this machine's speed drifts by tens of percent in minutes.
The modes benchmarks also time the model rate in their own rounds (bench/rate_probe.py), and the
prediction takes that one.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from bench import async_ckpt, data_ahead, dp_overlap, ep_auto, long_context, memory, modes, moe_step, overhead, predict
from bench import scaling, timelines, zero, zero_bubble
from bench import zero_bubble_report
from bench.common import MIN_QUIET_BLOCKS, NETNS_UNAVAILABLE, ROOT, machine_busy_s, netns_prefix, own_children_cpu_s, \
    quiet_or_all


def machine_info() -> Dict[str, Any]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import torch
        torch_version = torch.__version__
    except ImportError:
        torch_version = "not installed"
    commit = _quiet(["git", "rev-parse", "--short", "HEAD"])
    dirty = _quiet(["git", "status", "--porcelain", "--untracked-files=no"])
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch_version, "python": platform.python_version(),
            "kernel": platform.release(),
            "git": f"{commit}{' + uncommitted changes' if dirty else ''}" if commit else "unknown"}


def _quiet(cmd: List[str]) -> Optional[str]:
    try:
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def _run(cmd: List[str], env: Optional[dict] = None) -> subprocess.CompletedProcess:
    print("$ " + " ".join(cmd), flush=True)
    # stderr passes through (warnings, the netns explanation); stdout (the JSON) is captured.
    return subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)


def _json_of(cmd: List[str], path: Path, what: str) -> Dict[str, Any]:
    """Runs a benchmark's command (`_run`) and reads the JSON it wrote to `path`; a failure
    stops the run naming `what`."""
    proc = _run(cmd)
    if proc.returncode != 0:
        raise SystemExit(f"{what} failed with exit status {proc.returncode}")
    return json.loads(path.read_text())


def run_overhead(args, out: Path) -> Dict[str, Any]:
    path = out / "overhead.json"
    cmd = [sys.executable, "-m", "bench.overhead", "--json", str(path), "--block", str(args.block),
           "--repeats", str(args.overhead_repeats), "--warmup", str(args.warmup),
           "--time-budget", str(args.overhead_budget), "--min-quiet", str(args.min_quiet), "--threads", str(args.threads),
           "--quiet-cores", str(args.quiet_cores)]
    return _json_of(cmd, path, "bench.overhead")


def run_overhead_launch(args, out: Path) -> Dict[str, Any]:
    """bench.overhead on its launch-bound configuration (many thin layers, the plain loop on
    torch's fused AdamW): the framework's per-operator host work against the plain loop's."""
    path = out / "overhead_launch.json"
    cmd = [sys.executable, "-m", "bench.overhead", "--json", str(path), "--block", str(args.block),
           "--repeats", str(args.overhead_repeats), "--warmup", str(args.warmup),
           "--time-budget", str(args.overhead_budget), "--min-quiet", str(args.min_quiet), "--threads", str(args.threads),
           "--quiet-cores", str(args.quiet_cores), *overhead.launch_bound_args()]
    return _json_of(cmd, path, "bench.overhead (launch-bound)")


def run_moe_step(args, out: Path) -> Dict[str, Any]:
    """bench.moe_step: an MoE model's step on one process, grouped experts against the
    per-expert loop (tokens/s, GEMM share)."""
    path = out / "moe_step.json"
    return _json_of([sys.executable, "-m", "bench.moe_step", "--json", str(path), "--threads", str(args.threads)],
                    path, "bench.moe_step")


def run_data_ahead(args, out: Path) -> Dict[str, Any]:
    """bench.data_ahead: on one process, the host time the batch built ahead takes off the step
    against the same batches built inline."""
    path = out / "data_ahead.json"
    return _json_of([sys.executable, "-m", "bench.data_ahead", "--json", str(path), "--steps", str(args.data_ahead_steps),
                     "--blocks", str(args.data_ahead_blocks)], path, "bench.data_ahead")


def _time_machine(planned) -> Dict[str, Any]:
    """This machine's rates for a benchmark's variants, timed now (bench.predict.time_machine)."""
    base, variants = planned
    return predict.time_machine(base, variants)


def _with_rates(res: Dict[str, Any], before: Dict[str, Any], planned) -> Dict[str, Any]:
    """`res` with the machine's rates timed right before and right after it was measured
    (`machine_rates`: {machine key: [before, after]}), which bench/predict.py averages."""
    after = _time_machine(planned)
    res["machine_rates"] = {k: [before[k], after[k]] for k in before}
    return res


def run_dp(args, out: Path) -> Dict[str, Any]:
    path = out / "dp_overlap.json"
    bench = [sys.executable, "-m", "bench.dp_overlap", "--json", str(path), "--block", str(args.block),
             "--repeats", str(args.dp_repeats), "--warmup", str(args.warmup), "--layers", str(args.layers),
             "--time-budget", str(args.dp_budget), "--min-quiet", str(args.min_quiet),
             "--bucket-mb", str(args.bucket_mb), "--quiet-cores", str(args.quiet_cores)]
    note = None
    if not args.no_netns:
        env = dict(os.environ, RATE=args.rate)
        planned = dp_overlap.planned(bench[3:])
        before = _time_machine(planned)
        proc = _run(["bash", str(ROOT / "bench" / "netns.sh")] + bench, env=env)
        if proc.returncode == 0:
            return _with_rates(json.loads(path.read_text()), before, planned)
        if proc.returncode != NETNS_UNAVAILABLE:
            raise SystemExit(f"bench.dp_overlap (in bench/netns.sh) failed with exit status {proc.returncode}")
        note = ("bench/netns.sh could not create the rate-limited namespace (see its message above): "
                "ran on the bare loopback instead")
    else:
        note = "--no-netns: ran on the bare loopback"
    print(f"NOTE: {note}. Communication is then nearly free on the wire and costs CPU instead; "
          "the overlap figures below do NOT show a rate-limited link.", flush=True)
    proc = _run(bench + ["--link", f"loopback, NOT rate-limited ({note})"])
    if proc.returncode != 0:
        raise SystemExit(f"bench.dp_overlap failed with exit status {proc.returncode}")
    return json.loads(path.read_text())


def run_modes(args, out: Path, scenario: str) -> Dict[str, Any]:
    """bench.modes for one scenario, inside bench/netns.sh when possible (as run_dp)."""
    path = out / f"modes_{scenario}.json"
    bench = [sys.executable, "-m", "bench.modes", "--scenario", scenario, "--json", str(path),
             "--block", str(args.modes_block), "--repeats", str(args.modes_repeats), "--warmup", str(args.warmup),
             "--time-budget", str(args.modes_budget), "--min-quiet", str(args.min_quiet),
             "--quiet-cores", str(args.quiet_cores)]
    if not args.no_netns:
        # bench/predict.py predicts every scenario but the bubble's
        planned = modes.planned(bench[3:]) if scenario != "bubble" else None
        before = _time_machine(planned) if planned else {}
        proc = _run(["bash", str(ROOT / "bench" / "netns.sh")] + bench, env=dict(os.environ, RATE=args.rate))
        if proc.returncode == 0:
            res = json.loads(path.read_text())
            return _with_rates(res, before, planned) if planned else res
        if proc.returncode != NETNS_UNAVAILABLE:
            raise SystemExit(f"bench.modes --scenario {scenario} (in bench/netns.sh) failed with exit status "
                             f"{proc.returncode}")
        note = "bench/netns.sh could not create the rate-limited namespace: ran on the bare loopback instead"
    else:
        note = "--no-netns: ran on the bare loopback"
    print(f"NOTE: {note}; the overlap figures below do NOT show a rate-limited link.", flush=True)
    proc = _run(bench + ["--link", f"loopback, NOT rate-limited ({note})"])
    if proc.returncode != 0:
        raise SystemExit(f"bench.modes --scenario {scenario} failed with exit status {proc.returncode}")
    return json.loads(path.read_text())


def _names(csv: str) -> List[str]:
    return [x.strip() for x in csv.split(",") if x.strip()]


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def _render_overhead(ov: Dict[str, Any], title: str, goal: Optional[float]) -> List[str]:
    """The lines of one bench.overhead result: the two sides' medians and their ratio (against
    `goal` when one is set; the launch-bound line states its measured figure instead)."""
    s = ov["setup"]
    res, quiet = quiet_or_all({k: ov["all"][k] for k in ("framework", "plain")}, ov.get("quiet"),
                              ["framework", "plain"])
    ratio = (ov["quiet"] if quiet else ov["all"])["ratio"]
    ratio_inner = (ov["quiet"] if quiet else ov["all"])["ratio_inner"]
    ov_ratio_cpu = (ov["quiet"] if quiet else ov["all"]).get("ratio_cpu")  # older results.json lack it
    f, p = res["framework"]["wall"], res["plain"]["wall"]
    n_blocks = len(ov["block_foreign_cores"]) // 2
    verdict = f" (goal <= {goal}: {'met' if ratio <= goal else 'NOT met'})" if goal is not None else ""
    plain = f"plain PyTorch loop ({s.get('plain_optimizer', 'foreach')} AdamW)"
    return [f"## {title}", "",
            f"{s['model']} ({s['num_layers']} layers, hidden {s['hidden_size']}, seq {s['seq_length']}), "
            f"micro batch {s['micro_batch_size']} x {s['microbatches']} microbatches, clip {s.get('grad_clip', 1.0)}, "
            f"{s['threads']} thread(s); {s['repeats']} alternating blocks of {s['block']} steps per side, "
            f"first {s['block_warmup']} of each block and {s['warmup']} warmup steps discarded. "
            + (f"Quiet blocks used: {res['framework']['blocks']} + {res['plain']['blocks']} of {n_blocks} + {n_blocks}."
               if quiet else f"WARNING: too few quiet blocks (other processes used > {ov['quiet_threshold_cores']} "
               "cores); all blocks used, expect noise."), "",
            "| side | median step (ms) | IQR (ms) | steps |", "|---|---:|---:|---:|",
            f"| mpoverlap Trainer.train_step | {_ms(f['median_s'])} | {_ms(f['q1_s'])}-{_ms(f['q3_s'])} | {f['n']} |",
            f"| {plain} | {_ms(p['median_s'])} | {_ms(p['q1_s'])}-{_ms(p['q3_s'])} | {p['n']} |",
            "",
            f"**framework / plain = {ratio:.3f}**{verdict}; "
            f"on the loops' own timers (batch assembly excluded): {ratio_inner:.3f}; "
            + (f"on this process's CPU time (least moved by other jobs): {ov_ratio_cpu:.3f}; " if ov_ratio_cpu else "")
            + f"over all blocks: "
            f"{ov['all']['ratio']:.3f}. Loss difference framework vs plain: {ov['max_loss_diff_first5']:.1e} "
            f"over the first 5 steps, {ov['max_loss_diff']:.1e} over {ov['steps_compared']} steps.", ""]


def render(results: Dict[str, Any]) -> str:
    m = results["machine"]
    lines = [f"# mpoverlap benchmarks, {results['timestamp']}", "",
             f"Machine: {m['cores']} cores, {m['cpu']}; torch {m['torch']}, Python {m['python']}; "
             f"commit {m['git']}.",
             f"CPU used by other processes while the benchmarks ran: {results['others_cpu_s']:.0f} core-s over "
             f"{results['wall_s']:.0f} s wall ({results['others_cpu_s'] / max(results['wall_s'], 1e-9):.2f} cores "
             "on average). Blocks during which other processes used more than the quiet threshold are left "
             f"out of the tables when at least {MIN_QUIET_BLOCKS} quiet blocks per side remain.",
             f"Command: `{results['command']}`", ""]
    if results.get("overhead"):
        lines += _render_overhead(results["overhead"], "Framework overhead at dp=1", goal=1.05)
    if results.get("overhead_launch"):
        lines += _render_overhead(results["overhead_launch"], "Framework overhead, launch-bound (many thin layers)",
                                  goal=None)
    dp = results.get("dp")
    if dp:
        s = dp["setup"]
        names = list(dp["variants"])
        v, quiet = quiet_or_all(dp["variants"], dp.get("variants_quiet"), names)
        ddp = v.get("torch_ddp", {}).get("step", {}).get("median_s")
        lines += ["## DP overlap, 2 ranks", "",
                  f"Link: {dp['link']}.",
                  f"Overrides: `{' '.join(s['base_overrides'])}`; 1 thread per rank; {s['repeats']} rotating "
                  f"blocks of {s['block']} steps per variant (first {s['block_warmup']} of each block and "
                  f"{s['warmup']} warmup steps discarded); step time = slowest rank. "
                  + ("Quiet blocks used: " + ", ".join(f"{n} {v[n]['blocks']}/{dp['variants'][n]['blocks']}" for n in names) + "."
                     if quiet else f"WARNING: too few quiet blocks (other processes used > {dp['quiet_threshold_cores']} "
                     "cores); all blocks used, expect noise."), "",
                  "| variant | median step (ms) | IQR (ms) | vs DDP | over floor (ms) | CPU ms/step (2 ranks + irq) | wire MiB/step | dp ops/step | ledger MiB/step | dp in flight (ms/step) | exposed (ms/step) | exposed share |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        labels = {"mpo_overlap": "mpoverlap overlap.dp=true", "mpo_no_overlap": "mpoverlap overlap.dp=false",
                  "torch_ddp": "torch DDP (bucket_cap_mb same)", "mpo_zero1": "mpoverlap dist-opt + param-gather overlap",
                  "local_no_comm": "floor: bare model, no communication"}
        floor = v.get("local_no_comm", {}).get("step", {}).get("median_s")
        for name in names:
            st = v[name]["step"]
            rel = f"{st['median_s'] / ddp:.3f}" if ddp else "-"
            c = v[name].get("dp_comm")
            comm = (f"{c['ops_per_step']:.0f} | {c['mib_per_step']:.2f} | {_ms(c['time_s_median'])} | "
                    f"{_ms(c['exposed_s_median'])} | {c['exposed_share'] * 100:.0f}%") if c else "- | - | - | - | -"
            over = _ms(st["median_s"] - floor) if floor else "-"
            lines.append(f"| {labels.get(name, name)} | {_ms(st['median_s'])} | {_ms(st['q1_s'])}-{_ms(st['q3_s'])} "
                         f"| {rel} | {over} | {v[name]['cpu_ms_per_step']:.0f} + {v[name]['irq_ms_per_step']:.0f} "
                         f"| {v[name].get('wire_mib_per_step', float('nan')):.2f} | {comm} |")
        lines.append("")
        mc = (v.get("local_no_comm", {}).get("microbatch_compute")
              or v.get("torch_ddp", {}).get("microbatch_compute"))
        off = v.get("mpo_no_overlap", {}).get("dp_comm")
        if mc:
            txt = (f"One microbatch without communication: forward "
                   f"{_ms(mc['forward_s'])} ms, backward {_ms(mc['backward_s'])} ms")
            if off:
                txt += (f"; the gradient all-reduce done serially (overlap off) takes {_ms(off['time_s_median'])} ms "
                        f"per step, so backward is {'longer' if mc['backward_s'] > off['time_s_median'] else 'SHORTER'} "
                        "than the all-reduce")
            lines += [txt + ".", ""]
        buckets = dp["variants"].get("mpo_overlap", {}).get("buckets_mib")
        if buckets:
            lines += [f"Buckets (MiB, issue order): mpoverlap {buckets}; torch DDP "
                      f"{dp['variants'].get('torch_ddp', {}).get('buckets_mib') or 'n/a'}.", ""]
        if "overlap_vs_off_max_loss_diff" in dp:
            lines += [f"Loss difference overlap on vs off: {dp['overlap_vs_off_max_loss_diff']:.1e}.", ""]
        goals = []
        o = v.get("mpo_overlap", {}).get("dp_comm")
        if o:
            goals.append(f"exposed share with overlap {o['exposed_share'] * 100:.0f}% "
                         f"(goal < 30%: {'met' if o['exposed_share'] < 0.30 else 'NOT met'})")
        if ddp and "mpo_overlap" in v:
            mo, dd = v["mpo_overlap"]["step"], v["torch_ddp"]["step"]
            r = mo["median_s"] / ddp
            verdict = ("met" if r <= 1.0 else "not met, but within the noise: the interquartile ranges overlap"
                       if mo["q1_s"] <= dd["q3_s"] else "NOT met")
            goals.append(f"overlap step / DDP step {r:.3f} (goal <= 1: {verdict})")
        if floor and "mpo_no_overlap" in v:
            cost_off = v["mpo_no_overlap"]["step"]["median_s"] - floor
            parts = []
            for name in ("mpo_overlap", "mpo_zero1", "torch_ddp"):
                if name in v and cost_off > 0:
                    hidden = 1 - (v[name]["step"]["median_s"] - floor) / cost_off
                    parts.append(f"{labels[name]} {hidden * 100:.0f}%")
            if parts:
                lines += [f"Share of the no-overlap communication cost ({_ms(cost_off)} ms over the floor) "
                          "that disappears from the step: " + ", ".join(parts) + ". This counts what the "
                          "ledger cannot see: background communication slowing compute down on shared cores.", ""]
        if goals:
            lines += ["Goals: " + "; ".join(goals) + ".", ""]
    return "\n".join(lines)


MODE_LABELS = {"mpo_tp_overlap": "mpoverlap overlap.tp=true (collective matmul)",
               "mpo_tp_off": "mpoverlap overlap.tp=false", "dtensor_tp": "torch DTensor Colwise/Rowwise",
               "mpo_tp_nosp_overlap": "mpoverlap without SP, overlap.tp=true (input-gradient all-reduce under wgrad)",
               "mpo_tp_nosp_off": "mpoverlap without SP, overlap.tp=false",
               "mpo_cp_overlap": "mpoverlap overlap.cp=true", "mpo_cp_off": "mpoverlap overlap.cp=false",
               "mpo_pp_overlap": "mpoverlap overlap.pp=true", "mpo_pp_off": "mpoverlap overlap.pp=false",
               "mpo_ep_overlap": "mpoverlap overlap.ep=true", "mpo_ep_off": "mpoverlap overlap.ep=false",
               "mpo_ep_overlap_shared": "overlap.ep=true + shared expert",
               "mpo_ep_off_shared": "overlap.ep=false + shared expert",
               "torch_interleaved_1f1b": "torch ScheduleInterleaved1F1B"}
MODE_PEER = {"tp": "dtensor_tp", "pp": "torch_interleaved_1f1b"}
MODE_TITLE = {"tp": "TP, tp=2: with SP, and without (the mpo_tp_nosp_* variants)", "cp": "CP ring attention, cp=2",
              "pp": "PP interleaved 1F1B, pp=2 vpp=2",
              "bubble": "Pipeline bubble, pp=2, overlap.pp=true",
              "ep": "EP token dispatch, ep=2 (dp 2), 8 experts top-2, with and without a shared expert"}


def render_modes(results: Dict[str, Any]) -> str:
    lines: List[str] = []
    for scenario, res in results.get("modes", {}).items():
        s = res["setup"]
        names = list(res["variants"])
        v, quiet = quiet_or_all(res["variants"], res.get("variants_quiet"), names)
        lines += [f"## {MODE_TITLE.get(scenario, scenario)}", "", f"Link: {res['link']}.",
                  f"Overrides: `{' '.join(res['base_overrides'])}`; model hidden {s['hidden']}, ffn {s['ffn']}, "
                  f"seq {s['seq']}, {s['layers']} layers, {s['heads']} heads, micro batch {s['micro_batch']}; "
                  f"blocks of {s['block']} steps (first {s['block_warmup']} discarded), step time = slowest rank. "
                  + ("Quiet blocks used: " + ", ".join(f"{n} {v[n]['blocks']}/{res['variants'][n]['blocks']}"
                                                       for n in names) + "."
                     if quiet else f"WARNING: too few quiet blocks (other processes used > "
                     f"{res['quiet_threshold_cores']} cores); all blocks used, expect noise."), ""]
        if scenario == "bubble":
            lines += ["| vpp | microbatches m | step (ms) | stage | busy (ms) | pipeline window (ms) | idle fraction | "
                      "idle / busy | theory (p-1)/(m v) | theory idle fraction (p-1)/(m v + p-1) |",
                      "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
            for name in names:
                vpp, m = (int(x[1:] if x.startswith("m") else x[3:]) for x in name.split("_"))
                for b in v[name].get("bubble", []):
                    th = (2 - 1) / (m * vpp)
                    idle = b["idle_fraction"]
                    lines.append(f"| {vpp} | {m} | {_ms(v[name]['step']['median_s'])} | {b['stage']} | "
                                 f"{b['busy_ms']:.1f} | {b['window_ms']:.1f} | {idle * 100:.0f}% | "
                                 f"{idle / max(1 - idle, 1e-9):.2f} | {th:.2f} | {th / (1 + th) * 100:.0f}% |")
            lines.append("")
            continue
        mode = {"tp": "tp", "cp": "cp", "pp": "pp", "ep": "ep"}[scenario]
        peer = MODE_PEER.get(scenario)
        ref = v.get(peer, {}).get("step", {}).get("median_s") if peer else None
        lines += [f"| variant | median step (ms) | IQR (ms) | vs {MODE_LABELS.get(peer, '-') if peer else 'overlap off'} "
                  f"| CPU ms/step (2 ranks) | wire MiB/step | {mode} ops/step | {mode} in flight (ms/step/rank) | "
                  f"exposed (ms/step/rank) | exposed share |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        off = v.get(f"mpo_{mode}_off", {}).get("step", {}).get("median_s")
        for name in names:
            st = v[name]["step"]
            # Against the peer, else against overlap off of the same model (ep: with its shared expert).
            base = ref or v.get(name.replace("_overlap", "_off"), {}).get("step", {}).get("median_s") or off
            c = v[name]["comm"].get(mode)
            comm = (f"{c['ops_per_step']:.0f} | {c['in_flight_ms']:.1f} | {c['exposed_ms']:.1f} | "
                    f"{c['exposed_share'] * 100:.0f}%") if c else "- | - | - | -"
            lines.append(f"| {MODE_LABELS.get(name, name)} | {_ms(st['median_s'])} | {_ms(st['q1_s'])}-{_ms(st['q3_s'])} | "
                         f"{st['median_s'] / base:.3f} | {v[name]['cpu_ms_per_step']:.0f} | "
                         f"{v[name]['wire_mib_per_step']:.2f} | {comm} |")
        lines.append("")
        fl = res.get("first_loss", {})
        if fl:
            lines += ["First-step loss (rank 0, rank 1): " + "; ".join(f"{k} {a:.6f}, {b:.6f}" for k, (a, b) in fl.items())
                      + ".", ""]
        bub = [(n, v[n]["bubble"]) for n in names if v[n].get("bubble")]
        if bub:
            lines += ["Idle fraction of the pipeline window per stage (stage 0, stage 1): " + "; ".join(
                f"{n} " + ", ".join(f"{b['idle_fraction'] * 100:.0f}%" for b in bs) for n, bs in bub) + ".", ""]
        on, offv = v.get(f"mpo_{mode}_overlap"), v.get(f"mpo_{mode}_off")
        goals = []
        if on and offv and offv["comm"].get(mode):
            hidden = 1 - on["comm"][mode]["exposed_ms"] / max(offv["comm"][mode]["exposed_ms"], 1e-9)
            goals.append(f"exposed {mode} time cut by {hidden * 100:.0f}% vs overlap off "
                         f"({offv['comm'][mode]['exposed_ms']:.1f} -> {on['comm'][mode]['exposed_ms']:.1f} ms); "
                         f"step overlap/off {on['step']['median_s'] / offv['step']['median_s']:.3f}")
        if ref and on:
            goals.append(f"overlap / {MODE_LABELS[peer]} = {on['step']['median_s'] / ref:.3f} "
                         f"(goal < 1: {'met' if on['step']['median_s'] < ref else 'NOT met'})")
        if goals:
            lines += ["Reading: " + "; ".join(goals) + ".", ""]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--block", type=int, default=5, help="steps per block, both benchmarks (default 5)")
    p.add_argument("--warmup", type=int, default=3, help="discarded warmup steps per side/variant (default 3)")
    p.add_argument("--overhead-repeats", type=int, default=8, help="at least this many blocks per side (default 8)")
    p.add_argument("--dp-repeats", type=int, default=6, help="at least this many blocks per DP variant (default 6)")
    p.add_argument("--min-quiet", type=int, default=5,
                   help="add blocks until every side has this many quiet ones (within the budgets; default 5)")
    p.add_argument("--overhead-budget", type=float, default=60.0, help="seconds of overhead measuring at most (default 60)")
    p.add_argument("--dp-budget", type=float, default=180.0, help="seconds of DP measuring at most (default 180)")
    p.add_argument("--threads", type=int, default=1, help="torch threads in the overhead benchmark (default 1)")
    p.add_argument("--layers", type=int, default=8, help="model.num_layers in the DP benchmark (default 8)")
    p.add_argument("--bucket-mb", type=float, default=0.5, help="overlap.dp_bucket_mb = DDP bucket_cap_mb")
    p.add_argument("--rate", default="2gbit", help="tc tbf rate of the namespace's loopback (default 2gbit)")
    p.add_argument("--quiet-cores", type=float, default=0.1,
                   help="blocks during which other processes used more cores than this are left out (default 0.1)")
    p.add_argument("--no-netns", action="store_true", help="run the DP, modes, scaling and timeline runs on the bare loopback")
    p.add_argument("--skip-overhead", action="store_true")
    p.add_argument("--skip-moe", action="store_true",
                   help="skip bench/moe_step.py (an MoE step on one process: grouped experts vs the per-expert loop)")
    p.add_argument("--skip-overhead-launch", action="store_true",
                   help="skip the launch-bound overhead line (32 thin layers against a plain loop with fused AdamW)")
    p.add_argument("--skip-dp", action="store_true")
    p.add_argument("--skip-data-ahead", action="store_true",
                   help="skip bench/data_ahead.py (world 1: the batch built ahead against built inline)")
    p.add_argument("--data-ahead-steps", type=int, default=10, help="steps per bench.data_ahead block (default 10)")
    p.add_argument("--data-ahead-blocks", type=int, default=3, help="bench.data_ahead blocks per side (default 3)")
    p.add_argument("--modes", default="tp,cp,pp,ep,bubble",
                   help="comma-separated bench.modes scenarios to run (default: tp,cp,pp,ep,bubble; "
                        "'none' runs none)")
    p.add_argument("--modes-repeats", type=int, default=5, help="at least this many blocks per variant (default 5)")
    p.add_argument("--modes-block", type=int, default=4, help="steps per block in bench.modes (default 4)")
    p.add_argument("--modes-budget", type=float, default=150.0, help="seconds of measuring per scenario (default 150)")
    p.add_argument("--skip-zero", action="store_true", help="skip bench/zero.py (ZeRO-3 prefetch vs torch FSDP2)")
    p.add_argument("--skip-ep-pairing", action="store_true", help="skip bench/ep_pairing.py (EP at 1:1)")
    p.add_argument("--skip-ep-auto", action="store_true",
                   help="skip bench/ep_auto.py (EP auto's pick on the EP 1:1 run's none and chunks; measured "
                        "on its own under --skip-ep-pairing)")
    p.add_argument("--zero-budget", type=float, default=150.0, help="seconds of ZeRO-3 measuring at most (default 150)")
    p.add_argument("--skip-zero-bubble", action="store_true", help="skip bench/zero_bubble.py (zero-bubble schedules)")
    p.add_argument("--zero-bubble", default="schedules,tp_wgrad",
                   help="bench/zero_bubble.py scenarios (default schedules,tp_wgrad)")
    p.add_argument("--zero-bubble-budget", type=float, default=150.0,
                   help="seconds of measuring per zero-bubble scenario at most (default 150)")
    p.add_argument("--skip-scaling", action="store_true")
    p.add_argument("--scaling-worlds", default="1,2,4,8", help="world sizes of the DP scaling runs (default 1,2,4,8)")
    p.add_argument("--scaling-steps", type=int, default=12, help="steps per scaling run (default 12)")
    p.add_argument("--skip-memory", action="store_true")
    p.add_argument("--memory-layouts", default=",".join(memory.LAYOUTS),
                   help=f"layouts whose peak memory is compared with the estimate (default {','.join(memory.LAYOUTS)})")
    p.add_argument("--memory-steps", type=int, default=3, help="steps per memory run (default 3)")
    p.add_argument("--skip-timelines", action="store_true")
    p.add_argument("--skip-async-ckpt", action="store_true", help="skip bench/async_ckpt.py (checkpoint.async_save)")
    p.add_argument("--timelines", default=",".join(timelines.SCENARIOS),
                   help=f"scenarios to profile and draw (default {','.join(timelines.SCENARIOS)})")
    p.add_argument("--skip-long-context", action="store_true", help="skip bench/long_context.py (cp 2 at 16K-64K tokens)")
    p.add_argument("--long-context-seqs", default="16384,32768,65536",
                   help="sequence lengths of bench/long_context.py (default 16384,32768,65536)")
    p.add_argument("--out", help="output directory (default bench/results/<timestamp>)")
    args = p.parse_args()
    worlds = [int(x) for x in _names(args.scaling_worlds)]
    layouts, scenarios = _names(args.memory_layouts), _names(args.timelines)
    for given, known, flag in ((layouts, memory.LAYOUTS, "--memory-layouts"),
                               (scenarios, timelines.SCENARIOS, "--timelines")):
        if set(given) - set(known):
            p.error(f"{flag}: unknown {', '.join(sorted(set(given) - set(known)))}; known: {', '.join(known)}")

    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / stamp
    out.mkdir(parents=True, exist_ok=True)
    results: Dict[str, Any] = {"timestamp": stamp, "machine": machine_info(), 
                               "command": "python -m bench.run " + " ".join(sys.argv[1:]), "args": vars(args)}
    t0, busy0, own0, me0 = time.perf_counter(), machine_busy_s(), own_children_cpu_s(), time.process_time()
    if not args.skip_overhead:
        results["overhead"] = run_overhead(args, out)
    if not args.skip_overhead_launch:
        results["overhead_launch"] = run_overhead_launch(args, out)
    if not args.skip_moe:
        results["moe_step"] = run_moe_step(args, out)
    if not args.skip_data_ahead:
        results["data_ahead"] = run_data_ahead(args, out)
    if not args.skip_dp:
        results["dp"] = run_dp(args, out)
    for scenario in [x.strip() for x in args.modes.split(",") if x.strip() and x.strip() != "none"]:
        results.setdefault("modes", {})[scenario] = run_modes(args, out, scenario)
    if not args.skip_ep_pairing:  # EP at 1:1, none / chunks / pairing / both, with the simulator
        from bench import ep_pairing
        results["ep_pairing"] = ep_pairing.run_in_bench(args.rate, out, args.modes_budget, args.no_netns,
                                                        probe_link=not args.skip_ep_auto)
    if not args.skip_ep_auto:  # EP auto's pick against that run's none and chunks
        results["ep_auto"] = ep_auto.run_in_bench(results.get("ep_pairing"), args.rate, out, args.modes_budget,
                                                  args.no_netns)
    # One namespace probe for the scaling and timeline runs.
    prefix, link = (([], "") if args.skip_scaling and args.skip_timelines and args.skip_zero and args.skip_zero_bubble
                    else netns_prefix(args.rate, args.no_netns))
    if not args.skip_zero:
        results["zero"] = zero.run_in_bench(prefix, link, out, args.zero_budget)
    if not args.skip_zero_bubble:
        results["zero_bubble"] = zero_bubble.run_in_bench(prefix, link, out, args.zero_bubble_budget,
                                                          _names(args.zero_bubble))
    if not args.skip_scaling:
        results["scaling"] = scaling.run(worlds, args.scaling_steps, args.bucket_mb, out, prefix, link)
    if not args.skip_memory:
        results["memory"] = memory.run(layouts, args.memory_steps, out)
    if not args.skip_timelines:
        results["timelines"] = timelines.run(scenarios, args.bucket_mb, out, prefix, link)
    if not args.skip_async_ckpt:
        results["async_ckpt"] = async_ckpt.run_in_bench(out)
    if not args.skip_long_context:
        results["long_context"] = long_context.run_in_bench(out, args.long_context_seqs)
    if not args.no_netns and (results.get("dp") or results.get("modes")):
        # The simulator beside the measurements, with this machine's rates measured first.
        results["predicted"] = predict.predict(results, args.rate)
    results["wall_s"] = time.perf_counter() - t0
    # Machine-wide busy time minus our subprocesses' (and this process's small share).
    results["others_cpu_s"] = max(0.0, (machine_busy_s() - busy0) - (own_children_cpu_s() - own0)
                                  - (time.process_time() - me0))
    (out / "results.json").write_text(json.dumps(results, indent=2))
    table = render(results)
    if results.get("modes"):
        table += "\n" + render_modes(results)
    if results.get("ep_pairing"):
        from bench import ep_pairing
        table += "\n" + ep_pairing.render(results)
    for section in (moe_step.render(results), data_ahead.render(results), ep_auto.render_in_bench(results),
                    zero.render(results), zero_bubble_report.render(results), scaling.render(results), memory.render(results), timelines.render(results),
                    async_ckpt.render(results), long_context.render(results), predict.render(results.get("predicted") or [])):
        if section:
            table += "\n" + section
    (out / "results.md").write_text(table + "\n")
    print()
    print(table)
    print(f"(written to {out}/results.json and results.md; {results['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
