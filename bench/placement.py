"""Rank placement against a slow inter-host link: two hosts (tests/multihost.py) whose veth is
rate-limited with tc tbf, 2 ranks each, world 4, two layouts of the same model and batch:

    tp inside a host   parallel.dp=2 parallel.tp=2   (tp over the fast in-host loopback, dp across)
    tp across hosts    parallel.tp=4                 (every layer's tp collectives cross the link)

Each trains through two real torchrun agents; the figures are per-step means over the logged
steps after the first: step time and each mode's exposed communication from metrics.jsonl.
Then `mpoverlap-check --simulate` predicts both on a "hardware" of 2 ranks per node whose
inter-node bandwidth is the tc rate shared by the host's 2 ranks, and the two verdicts are
printed side by side.

    .venv/bin/python -m bench.placement [--rate 100mbit] [--steps 8]      (root)
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List

from bench.common import ROOT, console_script

sys.path.insert(0, str(ROOT / "tests"))
from multihost import TwoHosts, unavailable_reason  # noqa: E402

MODEL = ["model.num_layers=2", "model.hidden_size=256", "model.num_attention_heads=8", "model.ffn_hidden_size=1024",
         "model.seq_length=128", "train.global_batch_size=16", "train.micro_batch_size=4"]
TRAIN = ["train.log_interval=1", "train.progress=false", "train.eval_iters=1", "data.max_bytes=300000",
         "checkpoint.interval=0", "train.eval_interval=0"]
LAYOUTS = {"tp inside a host": ["parallel.dp=2", "parallel.tp=2"], "tp across hosts": ["parallel.tp=4"]}
RANKS_PER_HOST = 2


def _rate_bytes_s(rate: str) -> float:
    num, unit = re.fullmatch(r"([\d.]+)([kmg]?)bit", rate.lower()).groups()
    return float(num) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[unit] / 8


def measure(hosts: TwoHosts, layout: List[str], steps: int, tmp: Path) -> Dict[str, object]:
    run = tmp / "run"
    agents = hosts.torchrun(["-m", "mpoverlap.train", *MODEL, *TRAIN, *layout, f"train.steps={steps}",
                             f"run.dir={run}"], nproc_per_node=RANKS_PER_HOST, log_dir=tmp / "logs")
    codes = [a.wait(timeout=600) for a in agents]
    if codes != [0, 0]:
        raise SystemExit(f"bench.placement: {layout} failed {codes}: "
                         + (tmp / "logs" / "agent0.err").read_text()[-2000:])
    rows = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r][1:]
    exposed = {m: sum(r["comm"].get(m, {}).get("exposed_s", 0.0) for r in rows) / len(rows) for m in ("tp", "dp")}
    plan = (tmp / "logs" / "agent0.out").read_text() + (tmp / "logs" / "agent1.out").read_text()
    return {"step_s": sum(r["step_time_s"] for r in rows) / len(rows), "exposed": exposed,
            "warned": "warning: parallel.tp=" in plan}


def simulate(layout: List[str], inter_bw: float) -> Dict[str, float]:
    hw = ["hardware=measured", "hardware.measure=false", f"hardware.gpus_per_node={RANKS_PER_HOST}",
          "hardware.intra_bw=1e9", f"hardware.inter_bw={inter_bw:g}", "hardware.inter_latency=2e-4"]
    out = subprocess.run([*console_script("mpoverlap-check", "mpoverlap.check"), "--simulate", *MODEL, *layout, *hw],
                         capture_output=True, text=True, check=True).stdout
    step, exposed = re.search(r"step ([\d.,]+) ms on stage.*exposed communication ([\d.,]+) ms", out).groups()
    modes = {m: float(x.replace(",", "")) for m, x in re.findall(r"^  (\w+)\s+\|[^|]+\|[^|]+\|[^|]+\|\s*([\d.,]+) \|", out, re.M)}
    return {"step_ms": float(step.replace(",", "")), "exposed_ms": float(exposed.replace(",", "")), "modes": modes}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", default="100mbit", help="tc tbf rate of the link between the hosts")
    p.add_argument("--steps", type=int, default=6)
    args = p.parse_args()
    why = unavailable_reason()
    if why:
        print(f"bench.placement: skipped: {why}", file=sys.stderr)
        return 3
    inter_bw = _rate_bytes_s(args.rate) / RANKS_PER_HOST  # both ranks of a host share the veth
    measured, predicted = {}, {}
    with TwoHosts() as hosts, tempfile.TemporaryDirectory() as tmp:
        hosts.slow_link(args.rate)
        for i, (name, layout) in enumerate(LAYOUTS.items()):
            measured[name] = measure(hosts, layout, args.steps, Path(tmp) / str(i))
            print(f"bench.placement: measured {name}: {measured[name]}", file=sys.stderr, flush=True)
    for name, layout in LAYOUTS.items():
        predicted[name] = simulate(layout, inter_bw)
    print(f"bench.placement: 2 hosts x {RANKS_PER_HOST} ranks, link {args.rate} (tc tbf on the veth), "
          f"{args.steps} steps, means over steps 2..{args.steps}")
    print(f"  {'layout':<18} | {'step (s)':>8} | {'tp exposed (s)':>14} | {'dp exposed (s)':>14} | plan warns | "
          f"{'simulated step (ms)':>19} | {'simulated exposed tp / dp (ms)':>30}")
    for name in LAYOUTS:
        m, s = measured[name], predicted[name]
        print(f"  {name:<18} | {m['step_s']:8.3f} | {m['exposed']['tp']:14.3f} | {m['exposed']['dp']:14.3f} | "
              f"{'yes' if m['warned'] else 'no':>10} | {s['step_ms']:19.2f} | "
              f"{s['modes'].get('tp', 0.0):>14.2f} / {s['modes'].get('dp', 0.0):<13.2f}")
    fast_measured = min(LAYOUTS, key=lambda n: measured[n]["step_s"])
    fast_predicted = min(LAYOUTS, key=lambda n: predicted[n]["step_ms"])
    print(f"  faster: measured '{fast_measured}', simulator predicts '{fast_predicted}'"
          + ("" if fast_measured == fast_predicted else " (disagree)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
