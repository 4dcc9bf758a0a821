"""EP auto against measured on and off: bench/ep_pairing.py's none (overlap.ep=false) and chunks
(overlap.ep=true) variants measured, and what `overlap.ep=auto overlap.ep_chunks=auto` resolves
to (simulate/ep_choice.py) on the hardware the benchmark's own prediction uses (bench.ep_pairing
.predict_variants: the link probed in bench/netns.sh, the machine's rates timed before the run,
the model's and the experts' rates timed in its rounds).

    .venv/bin/python -m bench.ep_auto --json F [ep_pairing flags, e.g. --microbatches 1]
    .venv/bin/python -m bench.ep_auto --from F    # the picks again from a saved result

The measurement runs inside bench/netns.sh at --rate (2gbit, the scenario's link); the result
keeps the link probe and the machine's load average before and after, and adds per variant's
rates ("none": the experts' rate at one chunk, "chunks": at the benchmark's chunk count; the
simulator has one expert rate) auto's pick: on or off, the chunk count, the reasons with the
predicted steps, and the pick at the benchmark's own chunk count (on against off at that count).

In `make bench` (bench/run.py, `--skip-ep-auto` leaves it out) the picks are made on the run's
own bench.ep_pairing measurement (its defaults, the link probed beside it), measured here only
when the run skips that one (`--skip-ep-pairing`).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Dict, List, Optional

from bench import ep_pairing

AUTO = ["overlap.ep=auto", "overlap.ep_chunks=auto", "overlap.ep_pairing=false"]


def measure(flags: List[str], json_path: Path, rate: str, budget: float, no_netns: bool = False) -> Dict[str, Any]:
    """bench.ep_pairing with `flags` inside bench/netns.sh, as bench/run.py runs it
    (ep_pairing.run_in_bench), with the link probe and the load average kept."""
    return ep_pairing.run_in_bench(rate, json_path.parent, budget, no_netns, flags=flags, path=json_path,
                                   probe_link=True)


def _hardware(res: Dict[str, Any], name: str, rate: str):
    """The Hardware predict_variants simulates variant `name` on, from the saved probe."""
    from bench.predict import _compose, link_overrides
    from bench.rate_probe import machine_of
    from mpoverlap.simulate.hardware import from_config

    more = link_overrides(res.get("link_probe"), rate)
    cfg = _compose(res["base_overrides"], res["variant_overrides"][name], more)
    in_rounds = dict((res.get("model_rate_probe") or {}).get(name, {}))
    if res.get("comm_cpu_probe"):
        in_rounds["comm_cpu_s_per_byte"] = res["comm_cpu_probe"]["comm_cpu_s_per_byte"]
    keep = ("model_flops", "expert_flops", "comm_cpu_s_per_byte")
    rates = [dict(t, **{k: v for k, v in in_rounds.items() if k in keep}) for t in res["machine_rates"][machine_of(cfg)]]
    return from_config(cfg, rates), more


def picks(res: Dict[str, Any], rate: str) -> Dict[str, Any]:
    """{variant whose rates are used: auto's pick}, each as described in the module docstring."""
    from bench.predict import _compose
    from mpoverlap.simulate.ep_choice import choose

    chunks = next(int(o.split("=")[1]) for o in res["variant_overrides"]["chunks"] if o.startswith("overlap.ep_chunks="))
    out = {}
    for name in ("none", "chunks"):
        hw, more = _hardware(res, name, rate)
        c = choose(_compose(res["base_overrides"], AUTO, more), 2, hw)
        at = choose(_compose(res["base_overrides"], [AUTO[0], f"overlap.ep_chunks={chunks}", AUTO[2]], more), 2, hw)
        out[name] = {"enabled": c.enabled, "chunks": c.chunks, "reason": c.reason, "chunks_reason": c.chunks_reason,
                     "predicted": c.predicted, "at_bench_chunks": {"chunks": chunks, "enabled": at.enabled,
                                                                   "reason": at.reason}}
    return out


def render(res: Dict[str, Any]) -> str:
    rows = ep_pairing._rows(res)
    lines = [f"load average before / after: {res.get('loadavg_before_after')}",
             f"foreign cores per block: {min(res['block_foreign_cores']):.2f}-{max(res['block_foreign_cores']):.2f}"
             if res.get("block_foreign_cores") else "foreign cores: -"]
    for name in ("none", "chunks"):
        st = rows[name]["step"]
        lines.append(f"{name}: median {st['median_s'] * 1e3:.1f} ms, IQR {st['q1_s'] * 1e3:.1f}-{st['q3_s'] * 1e3:.1f}")
    for name, p in res["auto"].items():
        lines.append(f"auto on {name}'s rates: ep {'on' if p['enabled'] else 'off'}, {p['chunks']} chunks; {p['reason']}; "
                     f"chunks: {p['chunks_reason']}; at {p['at_bench_chunks']['chunks']} chunks: "
                     f"{p['at_bench_chunks']['reason']}")
    return "\n".join(lines)


# ---- in make bench: auto's picks on the run's EP 1:1 measurement --------------------------------
def run_in_bench(measured: Optional[Dict[str, Any]], rate: str, out: Path, budget: float,
                 no_netns: bool = False) -> Dict[str, Any]:
    """For bench/run.py: auto's picks on the run's bench.ep_pairing result (`measured`, at its
    defaults, with its `link_probe`: the none and chunks variants this benchmark compares), kept
    as {"measured_in": "ep_pairing", "auto": ...}; when the run skipped bench.ep_pairing
    (`measured` None), `measure` at its defaults first, into `out`/ep_auto.json, and the whole
    result with its picks."""
    if measured is not None:
        return {"measured_in": "ep_pairing", "auto": picks(measured, rate)}
    res = measure([], out / "ep_auto.json", rate, budget, no_netns)
    res["auto"] = picks(res, rate)
    return res


def render_in_bench(results: Dict[str, Any]) -> str:
    """results.md's section of `run_in_bench`'s result ("" when the run has none)."""
    res = results.get("ep_auto")
    if not res:
        return ""
    if res.get("measured_in") == "ep_pairing":
        res = {**results["ep_pairing"], **res}
    return "\n".join(["## EP auto against measured on and off", "",
                      "bench.ep_pairing's none (overlap.ep=false) and chunks (overlap.ep=true) measured, and what "
                      "`overlap.ep=auto overlap.ep_chunks=auto` resolves to on the hardware its prediction uses.", "",
                      render(res), ""])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", help="write the result here")
    p.add_argument("--from", dest="source", help="a saved result: compute the picks again, measure nothing")
    p.add_argument("--rate", default="2gbit")
    p.add_argument("--time-budget", type=float, default=150.0)
    args, flags = p.parse_known_args()
    if args.source:
        res = json.loads(Path(args.source).read_text())
    else:
        if not args.json:
            raise SystemExit("bench.ep_auto: --json F (where the measurement goes) or --from F")
        res = measure(flags, Path(args.json), args.rate, args.time_budget)
    res["auto"] = picks(res, args.rate)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2, default=str))
    print(render(res))


if __name__ == "__main__":
    main()
