"""EP at a 1:1 exchange-to-experts ratio on 2 gloo ranks: none / chunks / pairing / both.

One spawn of 2 ranks inside bench/netns.sh (tbf 2 Gbit/s); every variant is built once and
stepped in rotating blocks (`bench.common.rotating_blocks`, the bench.modes method: warmup,
quiet-block filtering, slowest rank per step). Model: moe_tiny reshaped into a fine-grained
MoE (DeepSeek-V3 class: 32 experts, top-8, expert width 320; hidden 512, seq 128, micro batch
2, 2 MoE layers) whose expert all-to-alls take about as long as its experts' forward and
backward on this link (exchanges : experts measured 1.04, docs/benchmarks.md), parallel.ep=2 (dp 2),
16 microbatches per rank (pairing needs two; the first forward and the last backward run
alone, so 1/m of the exchanges cannot pair). Two settings keep the measurement about the
exchanges (docs/benchmarks.md, "EP at 1:1"):
  - model.moe_router_force_load_balancing=true: routing by fixed random logits, every expert
    and rank gets its share of the slots. An untrained router sends most slots of a layer to
    one rank's experts, and the other rank then waits in every exchange for that rank's
    compute, which no overlap can hide (`--real-routing` turns it off);
  - each rank and its threads pinned to its own core (`--no-pin` turns it off): inside a pair
    the layer's counts exchange is the only blocking one, and ranks that move between the
    cores reach it further apart (5.7 ms on average unpinned, 3.5 pinned, at a coarser MoE shape);
    pinned, the in-round CPU probe (bench.rate_probe.CommCpuSide) can also time what a hidden
    exchange takes from compute.

  none     overlap.ep=false overlap.ep_chunks=1    every exchange waited where it is issued
  chunks   overlap.ep=true overlap.ep_chunks=2     the chunked overlap: a chunk's exchange under another's experts
  pairing  overlap.ep=true overlap.ep_chunks=1 overlap.ep_pairing=true
  both     overlap.ep=true overlap.ep_chunks=2 overlap.ep_pairing=true

(none and chunks also get overlap.ep_pairing=false where the key exists, so an `auto` default
cannot pair them.) `--dispatch-fp8`: every variant with train.ep_dispatch_dtype=bf16 (fp32
compute, the dispatch's rows cast to bf16 for the exchange), and none and chunks once more with
train.ep_dispatch_dtype=fp8 (`none_fp8`, `chunks_fp8`): the dispatch's forward all-to-all in fp8
rows (H + 4 H / 128 bytes a token) against bf16 (2H), the combine and the backward in the fp32
activation dtype either way; `none` exposes every exchange. The pairing variants run only where this build has `overlap.ep_pairing`
and its validator accepts them; otherwise the result says "pairing: not available in this
build" (or the validator's message) and the other two run.

Per variant: the step (median, interquartile range), the ledger's ep in flight and exposed per
step and rank (the figures metrics.jsonl's comm.ep.* reports), and with `run_in_bench` the
simulator's prediction beside it (`hardware=measured`, bench.predict's link probe; the model's
and the experts' rates timed in the rounds, per chunk count: bench/rate_probe.py). The ratio
exchanges : experts = the none variant's ep in flight over the experts' seconds per step
(their FLOPs at the experts' rate timed in the rounds).

    bash bench/netns.sh .venv/bin/python -m bench.ep_pairing [--block 3] [--repeats 4] [--dispatch-fp8] [--json F]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from bench.common import add_block_args, close_trainers, init_bench_worker, json_cli, quiet_or_all, rotating_blocks, \
    spawn_ranks

COMMON = ["train.steps=100000", "train.progress=false", "checkpoint.interval=0", "checkpoint.resume=none",
          "data.max_bytes=2000000", "overlap.dp=false", "model=moe_tiny", "parallel.ep=2",
          "model.shared_expert=false", "model.num_attention_heads=8"]
VARIANTS = {"none": (False, 1, False), "chunks": (True, None, False), "pairing": (True, 1, True),
            "both": (True, None, True)}  # name: (overlap.ep, ep_chunks (None: --chunks), pairing)
PAIRED = ("pairing", "both")
FP8_OF = ("none", "chunks")  # --dispatch-fp8: these variants again with fp8 dispatch
UNAVAILABLE = "pairing: not available in this build (no overlap.ep_pairing key)"


def pairing_available() -> Tuple[bool, str]:
    """(whether this build has `overlap.ep_pairing`, why not)."""
    from mpoverlap.config import ConfigError, compose

    try:
        compose(["overlap.ep_pairing=true"])
    except ConfigError:
        return False, UNAVAILABLE
    return True, ""


def base_overrides(args) -> List[str]:
    routing = [] if getattr(args, "real_routing", False) else ["model.moe_router_force_load_balancing=true"]
    # --dispatch-fp8: fp32 compute with the dispatch cast to bf16 for its exchange (the bf16
    # wire fp8 is measured against). train.precision=bf16 would run the experts' GEMMs in bf16,
    # which CPUs without AVX512_BF16/AMX execute ~130x slower than fp32 (0.57 against 76 GFLOP/s
    # at 512 x 512 x 2048 on an AVX2 EPYC): the GEMMs, not the link, would set the step.
    routing += ["train.ep_dispatch_dtype=bf16"] if getattr(args, "dispatch_fp8", False) else []
    return COMMON + routing + [f"model.hidden_size={args.hidden}", f"model.moe_ffn_hidden_size={args.ffn}",
                     f"model.seq_length={args.seq}", f"model.num_layers={args.layers}",
                     f"train.micro_batch_size={args.micro_batch}",
                     f"model.num_experts={args.experts}", f"model.moe_top_k={args.top_k}",
                     f"train.global_batch_size={args.micro_batch * args.microbatches * 2}"]


def planned(args) -> Tuple[List[str], Dict[str, List[str]], Dict[str, str]]:
    """(base overrides, {variant: overrides} of the variants this build runs, {variant: why
    not} of the others): the pairing variants need the key and the validator's yes."""
    from mpoverlap.config import compose
    from mpoverlap.overlap.rules import validate

    have, why = pairing_available()
    base = base_overrides(args)
    run, skipped = {}, {}
    for name, (on, chunks, pair) in VARIANTS.items():
        extra = [f"overlap.ep={'true' if on else 'false'}", f"overlap.ep_chunks={chunks or args.chunks}"]
        if have:
            extra.append(f"overlap.ep_pairing={'true' if pair else 'false'}")
        elif pair:
            skipped[name] = why
            continue
        problems = validate(compose(base + extra), 2)
        if problems:
            skipped[name] = "refused by the validator: " + "; ".join(str(p) for p in problems)[:400]
            continue
        run[name] = extra
    for name in FP8_OF if getattr(args, "dispatch_fp8", False) else ():
        if name in run:
            run[f"{name}_fp8"] = run[name] + ["train.ep_dispatch_dtype=fp8"]
    return base, run, skipped


def _worker(rank: int, port: int, args, tmp: str) -> None:
    init_bench_worker(rank, port, pin=not args.no_pin)
    import torch.distributed as dist

    from bench.modes import MpoSide, summarize
    from bench.rate_probe import CommCpuSide, ModelRateSide, summarize as rate_summary, summarize_comm_cpu
    from mpoverlap.config import compose
    from mpoverlap.training.loop import Trainer
    from mpoverlap.training.setup import init_distributed

    sides: Dict[str, Any] = {}
    try:
        base, variants, skipped = planned(args)
        state = None
        for name, extra in variants.items():
            cfg = compose(base + extra + [f"run.dir={tmp}/{name}"])
            state = state or init_distributed(cfg)
            (Path(tmp) / name).mkdir(parents=True, exist_ok=True)
            sides[name] = MpoSide(Trainer(cfg, state, Path(tmp) / name))
        first_loss = {}
        for name, side in sides.items():
            first_loss[name] = float(side.train_step()["loss_local"])
            side.collect(False)
            side.settle()
        # the model's and the experts' rates in these rounds, one probe per chunk count (the
        # experts' rate depends on the rows of a chunk)
        probes: Dict[str, Tuple[Any, List[str]]] = {}
        for name, side in sides.items():
            key = f"rate_probe_chunks{side.t.cfg.overlap.ep_chunks}"
            if key not in probes:
                probes[key] = (ModelRateSide(side.t.cfg), [])
            probes[key][1].append(name)
        # the CPU a hidden exchange takes from compute, timed in the rounds (needs the ranks
        # pinned: see CommCpuSide)
        comm_cpu = {} if args.no_pin else {
            "comm_cpu_probe": CommCpuSide(next(iter(sides.values())).t.cfg, state.group("ep"), COMM_CPU_PROBE_BYTES)}
        blocks = rotating_blocks({**sides, **{k: p for k, (p, _) in probes.items()}, **comm_cpu}, args,
                                 log_prefix="ep_pairing")
        gathered: List[Any] = [None, None]
        dist.all_gather_object(gathered, {"blocks": blocks, "first_loss": first_loss})
        if rank == 0:
            res = summarize(gathered, list(sides), args)
            res.update(base_overrides=base, variant_overrides=variants, skipped=skipped, model_rate_probe={})
            for key, (side, names) in probes.items():
                row = rate_summary([g["blocks"] for g in gathered], key, side, args.quiet_cores)
                res["model_rate_probe"].update({n: row for n in names})
            if comm_cpu:
                res["comm_cpu_probe"] = summarize_comm_cpu([g["blocks"] for g in gathered], "comm_cpu_probe",
                                                           args.quiet_cores)
            Path(args.json_tmp).write_text(json.dumps(res, indent=2))
    finally:
        close_trainers(side.t for side in sides.values())


# The comm CPU probe's all-to-all: 24 MB per rank, 12 MB on the wire each way, about 0.1 s at
# the 2 Gbit/s link, inside one microbatch's forward and backward of the default shape (~0.24 s).
COMM_CPU_PROBE_BYTES = 24 << 20
DEFAULTS = dict(hidden=512, ffn=320, seq=128, layers=2, micro_batch=2, microbatches=16, chunks=2, experts=32,
                top_k=8)


def add_args(p: argparse.ArgumentParser) -> None:
    add_block_args(p, block=3, repeats=4, max_repeats=12, min_quiet=4, time_budget=150.0, warmup=2)
    for k, v in DEFAULTS.items():
        p.add_argument("--" + k.replace("_", "-"), type=int, default=v, help=f"default {v}")
    p.add_argument("--real-routing", action="store_true",
                   help="route with the router's own logits (default: model.moe_router_force_load_balancing=true)")
    p.add_argument("--no-pin", action="store_true", help="leave the ranks free to move between cores")
    p.add_argument("--dispatch-fp8", action="store_true",
                   help="bf16 precision, and none and chunks again with train.ep_dispatch_dtype=fp8")


def run(args) -> Dict[str, Any]:
    res, t0 = spawn_ranks(_worker, args, prefix="mpo-bench-ep-pairing-")
    res.update(benchmark="ep_pairing", link=args.link, wall_s=time.perf_counter() - t0,
               setup={k: getattr(args, k) for k in ("block", "warmup", "block_warmup", *DEFAULTS, "real_routing", "no_pin",
                                                    "dispatch_fp8")})
    return res


# ---- in make bench: the measurement, the ratio and the simulator beside it ----------------------
def run_in_bench(rate: str, out: Path, budget: float, no_netns: bool = False, flags: Sequence[str] = (),
                 path: Optional[Path] = None, probe_link: bool = False) -> Dict[str, Any]:
    """For bench/run.py (and bench/ep_auto.py): this benchmark in a subprocess inside
    bench/netns.sh at `rate` (the bare loopback if the namespace cannot be made, and the link
    line says so), this machine's rates timed before it (the peak, the update, the CPU per byte
    sent; the model's and the experts' rates come from the rounds), and the simulator's
    prediction of every variant. `flags`: this benchmark's own options (its defaults without);
    `path`: where its JSON goes (default `out`/ep_pairing.json). The result keeps the machine's
    load average before and after, the command and its wall time; with `probe_link`, the link
    probed in the namespace too (`link_probe`: bench.predict.shaped_link, None on the bare
    loopback)."""
    import subprocess
    import sys

    from bench import predict
    from bench.common import ROOT, netns_prefix

    path = path or out / "ep_pairing.json"
    prefix, link = netns_prefix(rate, no_netns)
    p = argparse.ArgumentParser()
    add_args(p)
    base, variants, _ = planned(p.parse_args(list(flags)))
    before = predict.time_machine(base, variants)
    cmd = prefix + [sys.executable, "-m", "bench.ep_pairing", "--json", str(path), "--link", link,
                    "--time-budget", str(budget)] + list(flags)
    print("$ " + " ".join(cmd), flush=True)
    load = [Path("/proc/loadavg").read_text().strip()]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise SystemExit(f"bench.ep_pairing failed with exit status {proc.returncode}")
    load.append(Path("/proc/loadavg").read_text().strip())
    res = json.loads(path.read_text())
    res.update(machine_rates={k: [v] for k, v in before.items()}, loadavg_before_after=load, cmd=" ".join(cmd),
               measure_wall_s=time.time() - t0)
    if probe_link:
        res["link_probe"] = predict.shaped_link(rate) if prefix else None
    res["predicted"] = predict_variants(res, rate, probe=bool(prefix))
    return res


def predict_variants(res: Dict[str, Any], rate: str, probe: bool = True) -> Dict[str, Dict[str, float]]:
    """{variant: predicted step_s, ep in-flight and exposed seconds, exposed share, the pairing
    line, and the exchanges : experts ratio}, as bench.predict predicts the modes (its link
    probe, the machine rates timed beside the measurement, the rates timed in the rounds)."""
    from bench.predict import _compose, link_overrides, shaped_link
    from bench.rate_probe import machine_of
    from mpoverlap.overlap.layout import build_layout
    from dataclasses import replace

    from mpoverlap.simulate.core import simulate
    from mpoverlap.simulate.costs import chunk_costs
    from mpoverlap.simulate.collectives import group_links
    from mpoverlap.simulate.hardware import from_config, measured_rates
    from mpoverlap.overlap.estimate.core import compute_bytes
    from mpoverlap.overlap.config import CommOverlapConfig

    more = link_overrides(shaped_link(rate) if probe else None, rate)
    out: Dict[str, Dict[str, float]] = {}
    for name, extra in res["variant_overrides"].items():
        cfg = _compose(res["base_overrides"], extra, more)
        timed = (res.get("machine_rates") or {}).get(machine_of(cfg)) or [measured_rates(cfg)]
        in_rounds = dict((res.get("model_rate_probe") or {}).get(name, {}))
        if res.get("comm_cpu_probe"):  # what a hidden exchange took from compute, in the rounds
            in_rounds["comm_cpu_s_per_byte"] = res["comm_cpu_probe"]["comm_cpu_s_per_byte"]
        rates = [dict(t, **{k: v for k, v in in_rounds.items() if k in ("model_flops", "expert_flops",
                                                                        "comm_cpu_s_per_byte")}) for t in timed]
        hw = from_config(cfg, rates)
        r = simulate(cfg, hw)
        lo = build_layout(cfg)
        enabled = {m: s.enabled for m, s in CommOverlapConfig.from_config(cfg, lo.world).modes().items()}
        cost = chunk_costs(cfg, lo, hw, group_links(lo, hw), enabled, compute_bytes(cfg))[0]
        experts = (lo.num_microbatches or 1) * sum(p.experts for k in ("F", "B") for p in cost.layers[k])
        out[name] = {"step_s": r.step_s, "ep_in_flight_s": r.in_flight_s["ep"], "ep_exposed_s": r.exposed_s["ep"],
                     "share": r.exposed_share["ep"], "pairing": r.ep_pairing, "experts_s": experts,
                     # a rank's CPU over the step: its compute at a core's speed
                     "rank_cores": r.avg_compute_s / r.step_s / r.core_sharing.get("stretch", 1.0),
                     "core_stretch": r.core_sharing.get("stretch", 1.0),
                     # the same step with a core per rank (a machine with enough cores)
                     "step_s_core_per_rank": (simulate(cfg, replace(hw, cores=0)).step_s if r.core_sharing
                                              else r.step_s),
                     "exchanges_over_experts": r.in_flight_s["ep"] / experts if experts else 0.0,
                     "expert_gflops": hw.expert_flops / 1e9, "model_gflops": hw.flops / 1e9,
                     "link_mb_s": hw.inter.bandwidth / 1e6}
    return out


def measured_ratio(res: Dict[str, Any]) -> Optional[float]:
    """Exchanges : experts of the none variant as measured: its ep in flight per step and rank
    (the ledger, median step) over its experts' seconds per step (their FLOPs per step, layers
    x microbatches x one microbatch's experts forward + backward, at the rate timed in the
    rounds, `rate_probe`'s experts at one chunk = one microbatch's rows)."""
    row = (_rows(res).get("none") or {}).get("comm", {}).get("ep")
    probe = (res.get("model_rate_probe") or {}).get("none")
    if not row or not probe or not probe.get("expert_flops"):
        return None
    from mpoverlap.config import compose
    from mpoverlap.overlap.layout import build_layout
    from mpoverlap.simulate.measure import expert_work

    cfg = compose(res["base_overrides"] + res["variant_overrides"]["none"])
    lo = build_layout(cfg, 2)
    _, flops = expert_work(cfg, lo)  # one chunk of 1 = one microbatch, forward + backward
    seconds = cfg.model.num_layers * (lo.num_microbatches or 1) * flops / probe["expert_flops"]
    return row["in_flight_ms_median"] / 1e3 / seconds


def _rows(res: Dict[str, Any]) -> Dict[str, Any]:
    """Quiet blocks when every variant has enough of them, else all (bench.run's tables' rule)."""
    variants = res.get("variants") or {}
    return quiet_or_all(variants, res.get("variants_quiet"), list(variants))[0]


def render(results: Dict[str, Any]) -> str:
    res = results.get("ep_pairing")
    if not res:
        return ""
    s, rows, pred = res["setup"], _rows(res), res.get("predicted") or {}
    used_quiet = rows is res.get("variants_quiet")
    lines = ["## EP at 1:1, none / chunks / pairing / both", "", f"Link: {res['link']}.",
             f"Overrides: `{' '.join(res['base_overrides'])}`; hidden {s['hidden']}, "
             f"{s.get('experts', 8)} experts top-{s.get('top_k', 2)} of width {s['ffn']}, seq "
             f"{s['seq']}, {s['layers']} MoE layers, micro batch {s['micro_batch']} x {s['microbatches']} microbatches per "
             f"rank, chunks {s['chunks']}; routing: "
             + ("the router's own" if s.get("real_routing", True) else "forced balance (random logits)")
             + ("; ranks free to move between cores" if s.get("no_pin", True) else "; each rank pinned to a core")
             + f"; blocks of {s['block']} steps (first {s['block_warmup']} discarded), step = "
             "slowest rank. " + ("Quiet blocks used." if used_quiet else "WARNING: too few quiet blocks (other processes "
                                 f"used > {res['quiet_threshold_cores']} cores); all blocks used, expect noise."), "",
             "| variant | overrides | median step (ms) | IQR (ms) | vs chunks | ep in flight (ms/step/rank) | exposed | "
             "exposed share | predicted step (ms) | error | predicted share | difference |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    ref = rows.get("chunks", {}).get("step", {}).get("median_s")
    for name in [*VARIANTS, *(f"{n}_fp8" for n in FP8_OF if f"{n}_fp8" in rows)]:
        if name not in rows:
            lines.append(f"| {name} | - | {res.get('skipped', {}).get(name, 'not run')} |" + " - |" * 9)
            continue
        st, c, p = rows[name]["step"], rows[name]["comm"].get("ep", {}), pred.get(name)
        share = c["exposed_ms_median"] / c["in_flight_ms_median"] if c.get("in_flight_ms_median") else float("nan")
        cells = [f"{st['median_s'] * 1e3:.1f}", f"{st['q1_s'] * 1e3:.1f}-{st['q3_s'] * 1e3:.1f}",
                 f"{st['median_s'] / ref:.3f}" if ref else "-", f"{c.get('in_flight_ms_median', 0):.1f}",
                 f"{c.get('exposed_ms_median', 0):.1f}", f"{share:.2f}"]
        cells += ([f"{p['step_s'] * 1e3:.1f}", f"{p['step_s'] / st['median_s'] - 1:+.0%}", f"{p['share']:.2f}",
                   f"{p['share'] - share:+.2f}"] if p else ["-"] * 4)
        lines.append(f"| {name} | `{' '.join(res['variant_overrides'][name])}` | " + " | ".join(cells) + " |")
    lines.append("")
    ratio = measured_ratio(res)
    sim = pred.get("none", {}).get("exchanges_over_experts")
    lines.append(f"Exchanges : experts (the none variant's ep in flight over its experts' forward + backward): measured "
                 f"{'-' if ratio is None else f'{ratio:.2f}'}, simulated {'-' if sim is None else f'{sim:.2f}'}.")
    cc = res.get("comm_cpu_probe")
    if cc:
        lines.append(f"CPU a hidden exchange took from compute (bench.rate_probe.CommCpuSide, in the rounds): "
                     f"{cc['comm_cpu_s_per_byte'] * 1e9:.2f} ns per byte sent (the work's wall minus thread time "
                     f"{cc['alone_ms']:.1f} ms alone, {cc['with_comm_ms']:.1f} ms beside a {cc['bytes'] / 2**20:.0f} MiB "
                     f"send, which finished inside the work in {cc['finished_inside']:.0%} of {cc['samples']} steps); "
                     "the simulator uses it.")
    why_not: Dict[str, List[str]] = {}
    for n, w in (res.get("skipped") or {}).items():
        why_not.setdefault(w, []).append(n)
    for w, names in why_not.items():
        lines.append(f"Not run: {', '.join(names)} ({w}).")
    for name in FP8_OF:
        if f"{name}_fp8" in rows and name in rows:
            a, b = rows[name], rows[f"{name}_fp8"]
            lines.append(f"fp8 dispatch, {name}: step {b['step']['median_s'] / a['step']['median_s']:.3f}x bf16's, "
                         f"ep {b['comm']['ep']['mib_per_step']:.2f} MiB a step and rank against "
                         f"{a['comm']['ep']['mib_per_step']:.2f} (goal for none: <= 0.85x).")
    for name in PAIRED:
        if name in pred:
            lines.append(f"Simulator, {name}: {pred[name]['pairing']}.")
    if "pairing" in rows and "chunks" in rows:
        pr, ch = rows["pairing"], rows["chunks"]
        c = pr["comm"].get("ep", {})
        lines.append(f"Goals: pairing's exposed share {c['exposed_ms_median'] / c['in_flight_ms_median']:.2f} "
                     f"(goal <= 0.20); pairing / chunks step {pr['step']['median_s'] / ch['step']['median_s']:.3f} "
                     "(goal <= 0.85).")
    return "\n".join(lines) + "\n"


def main() -> None:
    json_cli(__doc__, add_args, run, link=True)


if __name__ == "__main__":
    main()
