"""`python -m bench.dp_overlap --buckets`: overlap.dp_bucket_mb at 1, 4, 16 and 64 MiB and `auto`,
at two link rates in one run, and auto's step against the best fixed size at each rate.

The outer run (`--bucket-rates R1,R2`) starts one inner run per rate inside bench/netns.sh
(loopback capped at that tc tbf rate); each inner run first resolves `auto` as the trainer does
for `hardware=measured` (simulate/bucket_size.py, with this machine and the namespace's link
measured once, here, before the ranks start: every rank then trains at that size), then times
every size as dp_overlap times its variants (alternating blocks in the same two processes).
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Tuple

from bench.common import ROOT, netns_command

SIZES_MB = (1, 4, 16, 64)
_PLAIN = ["overlap.dp=true", "train.distributed_optimizer=false"]


def bucket_variants(auto_mb: float) -> Dict[str, List[str]]:
    out = {f"mpo_b{mb}": [*_PLAIN, f"overlap.dp_bucket_mb={mb}"] for mb in SIZES_MB}
    out["mpo_auto"] = [*_PLAIN, f"overlap.dp_bucket_mb={auto_mb:g}"]
    return out


def auto_choice(base_overrides: List[str]) -> Tuple[float, str]:
    """The size overlap.dp_bucket_mb=auto takes for these overrides on hardware=measured (this
    machine and link, measured now)."""
    from mpoverlap.config import compose
    from mpoverlap.simulate.bucket_size import choose_bucket_mb
    from mpoverlap.simulate.hardware import from_config

    cfg = compose([*base_overrides, *_PLAIN, "overlap.dp_bucket_mb=auto", "hardware=measured"])
    choice = choose_bucket_mb(cfg, from_config(cfg))
    return choice.mb, choice.reason


def prepare_inner(args, base_overrides: List[str], variants: Dict[str, Any]) -> str:
    """An inner run: resolve auto (`args.auto_mb`, `args.auto_reason`), add the size variants to
    `variants`; returns them as the run's --variants."""
    args.auto_mb, args.auto_reason = auto_choice(base_overrides)
    variants.update(bucket_variants(args.auto_mb))
    return ",".join(bucket_variants(args.auto_mb))


def _median(res: Dict[str, Any], name: str) -> Tuple[float, str]:
    """A variant's median step (s), over its quiet blocks when it has them."""
    quiet = res.get("variants_quiet", {}).get(name)
    if quiet:
        return quiet["step"]["median_s"], "quiet blocks"
    return res["variants"][name]["step"]["median_s"], "all blocks (none quiet)"


def compare(res: Dict[str, Any]) -> Dict[str, Any]:
    """auto's step over the best of the fixed sizes in one inner run."""
    steps = {mb: _median(res, f"mpo_b{mb}")[0] for mb in SIZES_MB}
    auto, basis = _median(res, "mpo_auto")
    best = min(steps, key=steps.get)
    return {"steps_s": {f"{mb}": s for mb, s in steps.items()}, "auto_s": auto, "auto_mb": res["auto_mb"],
            "auto_reason": res["auto_reason"], "best_mb": best, "auto_over_best": auto / steps[best],
            "within_5pct": auto <= 1.05 * steps[best], "basis": basis}


def run_rates(args) -> Dict[str, Any]:
    """One inner run per rate of `args.bucket_rates`, inside bench/netns.sh, with this run's
    arguments but --bucket-rates and --json."""
    inner, skip = [], False
    for a in sys.argv[1:]:
        if skip:
            skip = False
            continue
        if a in ("--bucket-rates", "--json"):
            skip = True
            continue
        if not a.startswith(("--bucket-rates=", "--json=")):
            inner.append(a)
    out: Dict[str, Any] = {"benchmark": "dp_overlap --buckets", "rates": {}}
    for rate in [r.strip() for r in args.bucket_rates.split(",") if r.strip()]:
        with tempfile.TemporaryDirectory(prefix="mpo-bench-buckets-") as tmp:
            path = Path(tmp) / "inner.json"
            cmd = netns_command(rate) + [sys.executable, "-m", "bench.dp_overlap", *inner, "--bucket-rates", "",
                                         "--json", str(path)]
            proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL)
            if proc.returncode != 0:
                raise SystemExit(f"the inner run at RATE={rate} failed with exit status {proc.returncode}: "
                                 f"{' '.join(cmd)}")
            res = json.loads(path.read_text())
        row = compare(res)
        row["link"] = res.get("link")
        row["rounds"] = res.get("rounds")
        row["block_foreign_cores"] = [b["foreign_cores"] for b in res.get("block_foreign_cores", [])]
        out["rates"][rate] = row
        print(f"dp_overlap --buckets at {rate}: auto = {row['auto_mb']:g} MiB, step {row['auto_s'] * 1e3:.1f} ms; "
              f"best fixed {row['best_mb']} MiB {row['steps_s'][str(row['best_mb'])] * 1e3:.1f} ms; auto / best "
              f"{row['auto_over_best']:.3f} ({'within' if row['within_5pct'] else 'MISSES'} 5%, {row['basis']})",
              file=sys.stderr, flush=True)
    return out
