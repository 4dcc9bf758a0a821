"""The simulator against the benchmarks: every DP and bench.modes scenario (overlap on and
off) predicted with `hardware=measured` (this machine's rates, mpoverlap/simulate/measure.py:
one-thread matmul peak, the model's forward + backward with both ranks' copies running, the
optimizer step per parameter, ring attention's block math, the CPU cost of a byte sent; the link:
what 2 gloo ranks achieve over the loopback inside bench/netns.sh at the run's rate in an
all-reduce, shared by the 2 ranks, and each other collective's rate over it) and printed beside
the measured median step and exposed share (quiet blocks where there are any, as the tables
above use).

    python -m bench.predict bench/results/<stamp>/results.json [--rate 2gbit] [--nominal-link]
    python -m bench.predict --quiet-2026-11-22      # the quiet medians docs/benchmarks.md publishes

`make bench` (bench/run.py) runs it on its own results at the end. Goals: step
within 25% of the measured median, exposed share within 0.15 (absolute).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from bench.rate_probe import machine_of

STEP_TOLERANCE, SHARE_TOLERANCE = 0.25, 0.15


def _scenarios(results: Dict[str, Any]):
    """(scenario, mode, base overrides, {variant: (overrides, measured row)}, machine rates timed
    before and after the measurement or {}, {variant: model rate timed in its rounds} or {})
    per benchmark."""
    dp = results.get("dp")
    if dp:
        rows = {**dp["variants"], **dp.get("variants_quiet", {})}
        variants = {n: (r.get("overrides") or dp["variants"][n].get("overrides"), r) for n, r in rows.items()
                    if n.startswith("mpo_") and (dp["variants"][n].get("overrides"))}
        yield "dp", "dp", dp["setup"]["base_overrides"], variants, dp.get("machine_rates") or {}, {}
    for scenario, res in (results.get("modes") or {}).items():
        if scenario == "bubble" or "base_overrides" not in res:
            continue
        rows = {**res["variants"], **res.get("variants_quiet", {})}
        variants = {n: (res["variant_overrides"][n], r) for n, r in rows.items()
                    if res["variant_overrides"].get(n) is not None}
        yield scenario, scenario, res["base_overrides"], variants, res.get("machine_rates") or {}, \
            res.get("model_rate_probe") or {}


def _compose(base: List[str], extra: List[str], more: List[str] = ()):
    from mpoverlap.config import compose

    return compose(list(base) + list(extra) + ["hardware=measured", "parallel.world_size=2"] + list(more))


def time_machine(base: List[str], variants: Dict[str, Optional[List[str]]]) -> Dict[str, Dict[str, float]]:
    """This machine's rates (`hardware.measured_rates`), timed now, for every distinct machine of
    a benchmark's mpoverlap variants (peers, None, are skipped): {machine key: rates}.
    bench/run.py times them right before and right after each benchmark, and `predict` uses
    their mean: this machine's speed drifts by tens of percent within minutes, and rates
    timed at the end of a whole run can miss a scenario measured ten minutes earlier."""
    from mpoverlap.simulate.hardware import measured_rates

    out: Dict[str, Dict[str, float]] = {}
    for extra in variants.values():
        if extra is None:
            continue
        cfg = _compose(base, extra)
        key = machine_of(cfg)
        if key not in out:
            out[key] = measured_rates(cfg)
    return out


def _measured_share(mode: str, row: Dict[str, Any]) -> Tuple[Optional[float], Optional[float]]:
    """(the median step's exposed share: median exposed over median in flight, or None where
    the results predate those medians; the share over all steps: summed exposed over summed in
    flight). The simulator predicts a typical step, and steps are compared at their median, so
    the goal is judged on the first; a few steps in which one rank was descheduled (its peer
    waits out the collective) weigh heavily in the second."""
    if mode == "dp":
        c = row.get("dp_comm") or {}
        median = c["exposed_s_median"] / c["time_s_median"] if c.get("time_s_median") else None
        return median, c.get("exposed_share")
    c = (row.get("comm") or {}).get(mode)
    if not c:
        return None, None
    median = c["exposed_ms_median"] / c["in_flight_ms_median"] if c.get("in_flight_ms_median") else None
    return median, c["exposed_share"]


def shaped_link(rate: str) -> Optional[Dict[str, Any]]:
    """`measure.loopback_rate` of 2 gloo ranks over a loopback shaped to `rate` by
    bench/netns.sh (bytes_s they move together in an all-reduce, each collective's efficiency
    over it, latency per collective step), or None when the namespace cannot be made. TCP over
    the tbf queue delivers less than the rate."""
    from bench.common import netns_prefix
    from mpoverlap.simulate.hardware import loopback_probe

    prefix, _ = netns_prefix(rate, False)
    if not prefix:
        return None
    try:
        return loopback_probe(2, tuple(prefix))
    except RuntimeError as e:
        raise SystemExit(f"the loopback probe in bench/netns.sh failed: {e}")


def link_overrides(probed: Optional[Dict[str, Any]], rate: str) -> List[str]:
    """The hardware overrides of the link a benchmark ran on: the probed bandwidth, latency and
    each collective's efficiency over it (`shaped_link`), else `rate`'s nominal bandwidth alone."""
    from mpoverlap.simulate.hardware import parse_rate

    link = probed["bytes_s"] if probed else parse_rate(f"rate {rate}")
    more = [f"hardware.inter_bw={link}", f"hardware.intra_bw={link}"]
    if probed:
        more += [f"hardware.inter_latency={probed['latency']}", f"hardware.intra_latency={probed['latency']}"] + \
            [f"hardware.collective_efficiency.{op}={x}" for op, x in probed["efficiency"].items()]
    return more


def predict(results: Dict[str, Any], rate: str, probe: bool = True) -> List[Dict[str, Any]]:
    """Every scenario's prediction beside its measurement. The machine: the mean of the rates
    timed before and after the scenario's measurement where the results hold them
    (`machine_rates`, see `time_machine`), else this machine timed now; the model's (and the
    experts') rate timed in the benchmark's own rounds instead where there is one
    (`model_rate_probe`, bench/rate_probe.py). The link: with `probe`, what 2 ranks achieve in bench/netns.sh at
    `rate` (`shaped_link`), else the nominal rate."""
    from mpoverlap.simulate.core import simulate
    from mpoverlap.simulate.hardware import from_config, measured_rates

    probed = shaped_link(rate) if probe else None
    more = link_overrides(probed, rate)
    rows, machines = [], {}
    for scenario, mode, base, variants, timed, in_rounds in _scenarios(results):
        for name, (extra, measured) in variants.items():
            cfg = _compose(base, extra, more)
            key = machine_of(cfg)
            if key not in machines:
                # the rates timed beside this measurement (bench/run.py), else this machine now;
                # the model rate timed in the benchmark's own rounds where there is one
                rates = timed.get(key) or [measured_rates(cfg)]
                if name in in_rounds:
                    timed_there = {k: v for k, v in in_rounds[name].items() if k in ("model_flops", "expert_flops")}
                    rates = [dict(t, **timed_there) for t in rates]
                machines[key] = from_config(cfg, rates)
            hw = machines[key]
            r = simulate(cfg, hw)
            if mode == "pp":
                share = r.ledger_pp["exposed_s"] / r.ledger_pp["in_flight_s"] if r.ledger_pp.get("in_flight_s") else 0.0
            else:
                share = r.exposed_share.get(mode, 0.0)
            typical, all_steps = _measured_share(mode, measured)
            rows.append({"scenario": scenario, "variant": name, "overlap": r.enabled[mode],
                         "measured_step_s": measured["step"]["median_s"], "predicted_step_s": r.step_s,
                         "measured_share": typical, "measured_share_all_steps": all_steps, "predicted_share": share,
                         "peak_gflops": hw.peak_flops / 1e9, "efficiency": hw.gemm_efficiency,
                         "expert_gflops": hw.expert_flops / 1e9,
                         # the model rate of each timing averaged (before, after the measurement)
                         "model_gflops_timed": [t["model_flops"] / 1e9 for t in timed.get(key, [])],
                         "model_gflops_in_rounds": (in_rounds[name]["model_flops"] / 1e9 if name in in_rounds
                                                    else None),
                         "link_mb_s": hw.inter.bandwidth / 1e6, "link_efficiency": dict(hw.inter.efficiency)})
    return rows


def render(rows: List[Dict[str, Any]]) -> str:
    if not rows:
        return ""
    lines = ["## Simulator vs measurement (`hardware=measured`, bench/predict.py)", "",
             "Exposed share measured two ways: of the median step (median exposed over median in flight, "
             "the goal's measure: the step is compared at its median too) and over all steps (sums).", "",
             "| scenario | variant | overlap | measured step (ms) | predicted (ms) | error | measured exposed share "
             "(median step) | (all steps) | predicted | difference (median step) | (all steps) "
             "| matmul GFLOP/s x model fraction | model GFLOP/s timed before, after | in the rounds "
             "| link per rank (MB/s) |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    ok_step = ok_share = ok_all = 0

    def fmt(x: Optional[float], sign: str = "") -> str:
        return "-" if x is None else f"{x:{sign}.2f}"

    for r in rows:
        err = r["predicted_step_s"] / r["measured_step_s"] - 1
        ms, ma = r["measured_share"], r.get("measured_share_all_steps")
        diff = None if ms is None else r["predicted_share"] - ms
        diff_all = None if ma is None else r["predicted_share"] - ma
        ok_step += abs(err) <= STEP_TOLERANCE
        ok_share += diff is not None and abs(diff) <= SHARE_TOLERANCE
        ok_all += diff_all is not None and abs(diff_all) <= SHARE_TOLERANCE
        lines.append(f"| {r['scenario']} | {r['variant']} | {'on' if r['overlap'] else 'off'} | "
                     f"{r['measured_step_s'] * 1e3:.1f} | {r['predicted_step_s'] * 1e3:.1f} | {err:+.0%} | "
                     f"{fmt(ms)} | {fmt(ma)} | {r['predicted_share']:.2f} | {fmt(diff, '+')} | {fmt(diff_all, '+')} | "
                     f"{r['peak_gflops']:.1f} x {r['efficiency']:.2f} | "
                     f"{', '.join(f'{g:.1f}' for g in r.get('model_gflops_timed') or []) or 'now'} | "
                     f"{'-' if r.get('model_gflops_in_rounds') is None else format(r['model_gflops_in_rounds'], '.1f')} | "
                     f"{r['link_mb_s']:.0f} |")
    lines += ["", f"Step within {STEP_TOLERANCE:.0%}: {ok_step}/{len(rows)}; exposed share within "
                  f"{SHARE_TOLERANCE}: {ok_share}/{len(rows)} (median step), {ok_all}/{len(rows)} (all steps)."]
    slower = rows[0].get("link_efficiency") or {}
    if slower:
        lines += ["", "The link's rate is the all-reduce's; the other collectives at their own fraction of it "
                      "(probed): " + ", ".join(f"{op} {x:.2f}" for op, x in slower.items()) + "."]
    return "\n".join(lines)


# The quiet medians and exposed shares published in docs/benchmarks.md (runs 20261122-181734 for
# DP and EP, 20261122-162715 and its reruns for TP, CP, PP): scenario -> (base overrides,
# {variant: (overrides, median step ms, exposed share)}).
_RUN = ["train.steps=100000", "train.progress=false", "checkpoint.interval=0", "checkpoint.resume=none",
        "data.max_bytes=2000000"]
QUIET_2026_11_22 = {
    "dp": ("parallel.dp=2 model.num_layers=8 overlap.dp_bucket_mb=0.5 train.micro_batch_size=8 "
           "train.global_batch_size=32",
           {"mpo_overlap": ("overlap.dp=true train.distributed_optimizer=false", 361.2, .11),
            "mpo_no_overlap": ("overlap.dp=false train.distributed_optimizer=false", 387.3, .95),
            "mpo_zero1": ("overlap.dp=true train.distributed_optimizer=true overlap.dp_param_gather=true", 378.4, .13)}),
    "tp": ("overlap.dp=false parallel.tp=2 parallel.sequence_parallel=true model.hidden_size=256 "
           "model.ffn_hidden_size=1024 model.seq_length=256 model.num_layers=4 model.num_attention_heads=8 "
           "train.micro_batch_size=4 train.global_batch_size=4",
           {"mpo_tp_overlap": ("overlap.tp=true", 322.6, .58), "mpo_tp_off": ("overlap.tp=false", 488.6, .97)}),
    "cp": ("overlap.dp=false parallel.cp=2 model.hidden_size=128 model.ffn_hidden_size=512 model.seq_length=2048 "
           "model.num_layers=2 model.num_attention_heads=4 train.micro_batch_size=1 train.global_batch_size=1",
           {"mpo_cp_overlap": ("overlap.cp=true", 305.1, .31), "mpo_cp_off": ("overlap.cp=false", 356.9, .93)}),
    "pp": ("overlap.dp=false parallel.pp=2 parallel.vpp=2 model.tie_embeddings=false model.hidden_size=128 "
           "model.ffn_hidden_size=512 model.seq_length=128 model.num_layers=8 model.num_attention_heads=4 "
           "train.micro_batch_size=2 train.global_batch_size=16",
           {"mpo_pp_overlap": ("overlap.pp=true", 274.2, .12), "mpo_pp_off": ("overlap.pp=false", 354.3, .79)}),
    "ep": ("overlap.dp=false model=moe_tiny parallel.ep=2 model.moe_ffn_hidden_size=128 train.global_batch_size=8 "
           "model.hidden_size=512 model.seq_length=256 model.num_layers=2 model.num_attention_heads=8 "
           "train.micro_batch_size=4",
           {"mpo_ep_overlap": ("overlap.ep=true model.shared_expert=false", 461.5, .54),
            "mpo_ep_off": ("overlap.ep=false model.shared_expert=false", 528.7, .97),
            "mpo_ep_overlap_shared": ("overlap.ep=true model.shared_expert=true", 499.4, .40),
            "mpo_ep_off_shared": ("overlap.ep=false model.shared_expert=true", 553.1, .97)}),
}


def quiet_results() -> Dict[str, Any]:
    """QUIET_2026_11_22 in the shape of a bench.run results.json (for `predict`)."""
    def row(mode: str, ms: float, share: float) -> Dict[str, Any]:
        comm = {"dp_comm": {"exposed_share": share}} if mode == "dp" else {"comm": {mode: {"exposed_share": share}}}
        return {"step": {"median_s": ms / 1e3}, **comm}

    out: Dict[str, Any] = {"modes": {}}
    for scenario, (base, variants) in QUIET_2026_11_22.items():
        rows = {n: row(scenario, ms, sh) for n, (_, ms, sh) in variants.items()}
        if scenario == "dp":
            for n, (extra, _, _) in variants.items():
                rows[n]["overrides"] = extra.split()
            out["dp"] = {"setup": {"base_overrides": base.split() + _RUN}, "variants": rows}
        else:
            out["modes"][scenario] = {"base_overrides": _RUN + base.split(), "variants": rows,
                                      "variant_overrides": {n: v[0].split() for n, v in variants.items()}}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="?", help="results.json of a bench.run")
    p.add_argument("--quiet-2026-11-22", action="store_true",
                   help="predict the quiet medians published in docs/benchmarks.md instead")
    p.add_argument("--rate", default=None, help="tc tbf rate of the run (default: the run's --rate)")
    p.add_argument("--nominal-link", action="store_true",
                   help="take the tbf rate as the link instead of probing what gloo achieves at it in bench/netns.sh")
    args = p.parse_args()
    if args.quiet_2026_11_22:
        results = quiet_results()
    elif args.results:
        results = json.loads(Path(args.results).read_text())
    else:
        p.error("give a results.json or --quiet-2026-11-22")
    rate = args.rate or results.get("args", {}).get("rate", "2gbit")
    print(render(predict(results, rate, probe=not args.nominal_link)))


if __name__ == "__main__":
    main()
