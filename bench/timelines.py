"""A drawn communication timeline per parallel mode, from short profiled runs.

For each scenario one `mpoverlap-train` run of `STEPS` steps with train.profile=true over steps
`PROFILE_START`..`PROFILE_START + PROFILE_STEPS - 1` (`bench.common.run_train`, inside
bench/netns.sh when it can be made), then `mpoverlap-timeline` draws
`<results>/timelines/<scenario>.png` (run directories beside it). The PNGs show where each mode's
handles were in flight and where compute sat blocked in their waits; they illustrate, the
benchmark tables measure.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, Sequence

from bench.common import ROOT, console_script, run_train

STEPS, PROFILE_START, PROFILE_STEPS = 5, 3, 2
SCENARIOS = {
    "dp2": ["parallel.dp=2", "overlap.dp=true"],
    "tp2": ["parallel.tp=2", "parallel.sequence_parallel=true", "overlap.tp=true"],
    "pp2": ["parallel.pp=2", "parallel.vpp=2", "overlap.pp=true"],
    "cp2": ["parallel.cp=2", "overlap.cp=true"],
    "ep2": ["model=moe_tiny", "parallel.dp=2", "parallel.ep=2", "overlap.ep=true"],
}
PROFILED = [f"train.steps={STEPS}", "train.profile=true", f"train.profile_start_step={PROFILE_START}",
            f"train.profile_steps={PROFILE_STEPS}"]


def run(scenarios: Sequence[str], bucket_mb: float, out: Path, prefix: Sequence[str], link: str) -> Dict[str, Any]:
    """Each scenario's profiled run under `out`/timelines/<scenario>, drawn to <scenario>.png."""
    drawn = {}
    for name in scenarios:
        overrides = SCENARIOS[name] + [f"overlap.dp_bucket_mb={bucket_mb}"] + PROFILED
        run_dir = out / "timelines" / name
        run_train(overrides, run_dir, prefix)
        png = out / "timelines" / f"{name}.png"
        cmd = console_script("mpoverlap-timeline", "mpoverlap.timeline") + [str(run_dir), "--out", str(png)]
        print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
        proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed with exit status {proc.returncode}")
        summary = [line for line in proc.stdout.splitlines() if not line.startswith("wrote ")]
        drawn[name] = {"overrides": overrides, "png": str(png.relative_to(out)), "summary": summary}
    return {"link": link, "scenarios": drawn}


def render(results: Dict[str, Any]) -> str:
    """The timelines section of results.md, the PNGs linked relative to it ("" when none)."""
    tl = results.get("timelines")
    if not tl:
        return ""
    lines = ["## Timelines", "", f"Link: {tl['link']}. Steps {PROFILE_START}..{PROFILE_START + PROFILE_STEPS - 1} "
             f"of {STEPS}, train.profile=true; grey = compute, light = a mode in flight, hatched = blocked in its "
             "wait. Per rank and mode: handles, bytes, in-flight and exposed ms over the profiled steps.", ""]
    for name, d in tl["scenarios"].items():
        lines += [f"### {name}: `{' '.join(d['overrides'])}`", "", f"![{name}]({d['png']})", ""]
        lines += [f"- {s}" for s in d["summary"]] + [""]
    return "\n".join(lines)
