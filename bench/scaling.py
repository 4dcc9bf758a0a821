"""Weak scaling of pure data parallelism: step time at fixed work per rank, 1 -> 2 -> 4 -> 8 ranks.

One `mpoverlap-train` run per world size N (`bench.common.run_train`, inside bench/netns.sh when
it can be made): gpt_tiny, parallel.dp=N, overlap.dp=true (auto at N=1, which has nothing to
reduce), `MICRO_BATCH` x `MICROBATCHES` sequences per rank, so the global batch is N times one
rank's; one torch thread per rank. From metrics.jsonl: the median of rank 0's step time over
the steps after the first quarter (start-up), and the dp ledger's per-step in-flight and
exposed time (means over ranks). Efficiency = t1 / tN: 1.0 is perfect weak scaling.

Once there are more ranks than cores the ranks take turns on the cores, and the step time grows
with the total CPU work: efficiency there measures the machine, not the framework.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any, Dict, List, Sequence

from bench.common import machine_busy_s, own_children_cpu_s, run_train, stats

MICRO_BATCH, MICROBATCHES = 4, 4  # per rank: 16 sequences of 128 tokens


def world_overrides(world: int, steps: int, bucket_mb: float) -> List[str]:
    """The run for `world` ranks: same work per rank, overlapped gradient all-reduce."""
    return [f"parallel.dp={world}", f"overlap.dp={'true' if world > 1 else 'auto'}",
            f"overlap.dp_bucket_mb={bucket_mb}", f"train.micro_batch_size={MICRO_BATCH}",
            f"train.global_batch_size={MICRO_BATCH * MICROBATCHES * world}", f"train.steps={steps}"]


def run(worlds: Sequence[int], steps: int, bucket_mb: float, out: Path, prefix: Sequence[str],
        link: str) -> Dict[str, Any]:
    """One run per world size under `out`/scaling/dp<N>; returns the setup and a row per world."""
    skip = max(1, steps // 4)
    rows = []
    for world in worlds:
        overrides = world_overrides(world, steps, bucket_mb)
        t0, busy0, own0 = time.perf_counter(), machine_busy_s(), own_children_cpu_s()
        metrics = run_train(overrides, out / "scaling" / f"dp{world}", prefix)
        wall = time.perf_counter() - t0
        kept = metrics[skip:]
        if not kept:
            raise SystemExit(f"scaling: dp{world} logged {len(metrics)} steps, none left after the first {skip}")
        dp = [r["comm"]["dp"] for r in kept if "dp" in r.get("comm", {})]
        rows.append({
            "world": world, "overrides": overrides, "step": stats([r["step_time_s"] for r in kept]),
            "dp_time_s_median": statistics.median(c["time_s"] for c in dp) if dp else None,
            "dp_exposed_s_median": statistics.median(c["exposed_s"] for c in dp) if dp else None,
            "tokens_per_step": round(kept[0]["tokens_per_s"] * kept[0]["step_time_s"]),
            # Cores other processes used during this run (start-up included), as bench.run's header.
            "others_cores": max(0.0, (machine_busy_s() - busy0) - (own_children_cpu_s() - own0)) / wall,
            "wall_s": wall})
    return {"link": link, "steps": steps, "skipped_steps": skip, "per_rank_batch": MICRO_BATCH * MICROBATCHES,
            "rows": rows}


def render(results: Dict[str, Any]) -> str:
    """The scaling section of results.md ("" when the run had none)."""
    sc = results.get("scaling")
    if not sc:
        return ""
    cores = results["machine"]["cores"]
    rows = sc["rows"]
    t1 = next((r["step"]["median_s"] for r in rows if r["world"] == 1), None)
    lines = ["## Weak scaling, pure DP (gpt_tiny, fixed work per rank)", "", f"Link: {sc['link']}.",
             f"Overrides at {rows[-1]['world']} ranks: `{' '.join(rows[-1]['overrides'])}`; at N ranks "
             f"parallel.dp=N and a global batch of {sc['per_rank_batch']} N sequences (overlap.dp=auto at 1 rank); "
             f"1 torch thread per rank; median of rank 0's step time over steps {sc['skipped_steps'] + 1}.."
             f"{sc['steps']}. One run per N, not alternating blocks: compare within one results file.", "",
             "| ranks | median step (ms) | IQR (ms) | efficiency t1/tN | tokens/s (all ranks) | dp in flight (ms/step) "
             "| dp exposed (ms/step) | other processes (cores) |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        st = r["step"]
        eff = f"{t1 / st['median_s']:.2f}" if t1 else "-"
        tps = r["tokens_per_step"] / st["median_s"]
        dp = (f"{r['dp_time_s_median'] * 1e3:.1f} | {r['dp_exposed_s_median'] * 1e3:.1f}"
              if r["dp_time_s_median"] is not None else "- | -")
        lines.append(f"| {r['world']} | {st['median_s'] * 1e3:.1f} | {st['q1_s'] * 1e3:.1f}-{st['q3_s'] * 1e3:.1f} "
                     f"| {eff} | {tps:,.0f} | {dp} | {r['others_cores']:.2f} |")
    over = [r["world"] for r in rows if r["world"] > cores]
    lines += ["", f"This machine has {cores} cores. Each rank is one process with one compute thread (plus gloo's "
              "threads), so up to that many ranks can each have a core while nothing else runs (the last column "
              "says what else ran)."
              + (f" At {', '.join(map(str, over))} ranks the ranks oversubscribe the CPU ({max(over) / cores:g} ranks "
                 "per core at the most): the step time grows with the total CPU work and efficiency there measures "
                 "the CPU, not the framework." if over else ""), ""]
    return "\n".join(lines)
