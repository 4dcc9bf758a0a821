"""The simulator against the benchmarks: every DP and bench.modes scenario (overlap on and
off) predicted with `hardware=measured` (this machine's one-thread matmul and model rate, the
namespace's tbf rate shared by the 2 ranks) and printed beside the measured median step and
exposed share (quiet blocks where there are any, as the tables above use).

    python -m bench.predict bench/results/<stamp>/results.json [--rate 2gbit]

`make bench` (bench/run.py) runs it on its own results at the end. Goals (issue 20): step
within 25% of the measured median, exposed share within 0.15 (absolute).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Dict, List, Optional

STEP_TOLERANCE, SHARE_TOLERANCE = 0.25, 0.15


def _scenarios(results: Dict[str, Any]):
    """(scenario, mode, base overrides, {variant: (overrides, measured row)}) per benchmark."""
    dp = results.get("dp")
    if dp:
        rows = {**dp["variants"], **dp.get("variants_quiet", {})}
        variants = {n: (r.get("overrides") or dp["variants"][n].get("overrides"), r) for n, r in rows.items()
                    if n.startswith("mpo_") and (dp["variants"][n].get("overrides"))}
        yield "dp", "dp", dp["setup"]["base_overrides"], variants
    for scenario, res in (results.get("modes") or {}).items():
        if scenario == "bubble" or "base_overrides" not in res:
            continue
        rows = {**res["variants"], **res.get("variants_quiet", {})}
        variants = {n: (res["variant_overrides"][n], r) for n, r in rows.items()
                    if res["variant_overrides"].get(n) is not None}
        yield scenario, scenario, res["base_overrides"], variants


def _measured_share(mode: str, row: Dict[str, Any]) -> Optional[float]:
    if mode == "dp":
        return (row.get("dp_comm") or {}).get("exposed_share")
    c = (row.get("comm") or {}).get(mode)
    return c["exposed_share"] if c else None


def predict(results: Dict[str, Any], rate: str) -> List[Dict[str, Any]]:
    from mpoverlap.config import compose
    from mpoverlap.simulate.core import simulate
    from mpoverlap.simulate.hardware import from_config, parse_rate

    link = parse_rate(f"rate {rate}")
    rows, machines = [], {}
    for scenario, mode, base, variants in _scenarios(results):
        for name, (extra, measured) in variants.items():
            cfg = compose(list(base) + list(extra) + ["hardware=measured", "parallel.world_size=2",
                                                      f"hardware.inter_bw={link}", f"hardware.intra_bw={link}"])
            key = json.dumps([str(cfg.model), cfg.train.micro_batch_size, str(cfg.train.precision)])
            if key not in machines:
                machines[key] = from_config(cfg)
            hw = machines[key]
            r = simulate(cfg, hw)
            if mode == "pp":
                share = r.ledger_pp["exposed_s"] / r.ledger_pp["in_flight_s"] if r.ledger_pp.get("in_flight_s") else 0.0
            else:
                share = r.exposed_share.get(mode, 0.0)
            rows.append({"scenario": scenario, "variant": name, "overlap": r.enabled[mode],
                         "measured_step_s": measured["step"]["median_s"], "predicted_step_s": r.step_s,
                         "measured_share": _measured_share(mode, measured), "predicted_share": share,
                         "peak_gflops": hw.peak_flops / 1e9, "efficiency": hw.gemm_efficiency,
                         "link_mb_s": hw.inter.bandwidth / 1e6})
    return rows


def render(rows: List[Dict[str, Any]]) -> str:
    if not rows:
        return ""
    lines = ["## Simulator vs measurement (`hardware=measured`, bench/predict.py)", "",
             "| scenario | variant | overlap | measured step (ms) | predicted (ms) | error | measured exposed share "
             "| predicted | difference | matmul GFLOP/s x model fraction | link per rank (MB/s) |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    ok_step = ok_share = 0
    for r in rows:
        err = r["predicted_step_s"] / r["measured_step_s"] - 1
        ms = r["measured_share"]
        diff = None if ms is None else r["predicted_share"] - ms
        ok_step += abs(err) <= STEP_TOLERANCE
        ok_share += diff is not None and abs(diff) <= SHARE_TOLERANCE
        lines.append(f"| {r['scenario']} | {r['variant']} | {'on' if r['overlap'] else 'off'} | "
                     f"{r['measured_step_s'] * 1e3:.1f} | {r['predicted_step_s'] * 1e3:.1f} | {err:+.0%} | "
                     f"{'-' if ms is None else f'{ms:.2f}'} | {r['predicted_share']:.2f} | "
                     f"{'-' if diff is None else f'{diff:+.2f}'} | {r['peak_gflops']:.1f} x {r['efficiency']:.2f} | "
                     f"{r['link_mb_s']:.0f} |")
    lines += ["", f"Step within {STEP_TOLERANCE:.0%}: {ok_step}/{len(rows)}; exposed share within "
                  f"{SHARE_TOLERANCE}: {ok_share}/{len(rows)}."]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", help="results.json of a bench.run")
    p.add_argument("--rate", default=None, help="tc tbf rate of the run (default: the run's --rate)")
    args = p.parse_args()
    results = json.loads(Path(args.results).read_text())
    rate = args.rate or results.get("args", {}).get("rate", "2gbit")
    print(render(predict(results, rate)))


if __name__ == "__main__":
    main()
