"""Measured peak memory per rank against `mpoverlap.overlap.estimate` for a few 2-rank layouts.

For each layout a short `mpoverlap-train` run (`bench.common.run_train`, bare loopback: only
memory is read) and the same layout with a near-empty model (hidden 32, seq 16, one layer per
pipeline chunk), the **baseline**. metrics.jsonl's `peak_memory_bytes` is, on CPU, each rank's
peak resident set size (ru_maxrss) up to the last step. It counts every page the process
touched: the Python interpreter and torch's libraries, the corpus, allocator caches and freed
blocks not yet returned to the OS, and short-lived temporaries (logits, the optimizer's foreach
buffers, gloo's buffers) that the estimate leaves out. The estimate counts fp32 parameters,
gradients, Adam state and the saved activations of the busiest pipeline stage. So the table
compares measured - baseline against estimate - estimate(baseline): what the model adds, with
the runtime (about the same in both runs) taken out. Neither side is exact; the ratio says how
far the estimate is from the pages the model really costs, at this size to within a few MiB of
RSS noise.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Sequence

from bench.common import run_train

LAYOUTS = {
    "dp2": ["parallel.dp=2"],
    "dp2_zero1": ["parallel.dp=2", "train.distributed_optimizer=true"],
    "tp2_sp": ["parallel.tp=2", "parallel.sequence_parallel=true"],
    "pp2": ["parallel.pp=2"],
    "moe_ep2": ["model=moe_tiny", "parallel.dp=2", "parallel.ep=2"],
    # Activation-heavy interleaved pipeline (issue 22): stage 0 keeps 7 chunk-microbatches alive.
    "pp2_vpp2": ["parallel.pp=2", "parallel.vpp=2", "model.num_layers=4", "model.hidden_size=256",
                 "model.ffn_hidden_size=704", "model.seq_length=512", "train.micro_batch_size=4",
                 "train.global_batch_size=16"],
}
WORLD = 2


def baseline_overrides(cfg: Any) -> List[str]:
    """The same layout with a near-empty model: hidden 32, seq 16, one layer per pipeline chunk."""
    small = ["model.hidden_size=32", "model.ffn_hidden_size=64", "model.seq_length=16",
             f"model.num_layers={cfg.parallel.pp * cfg.parallel.vpp}"]
    return small + (["model.moe_ffn_hidden_size=32"] if cfg.model.num_experts else [])


def estimate_bytes(overrides: Sequence[str]) -> Dict[str, int]:
    """estimate(cfg, WORLD).memory_bytes of the composed overrides."""
    from mpoverlap.config import compose
    from mpoverlap.overlap.estimate import estimate

    return dict(estimate(compose(list(overrides)), WORLD).memory_bytes)


def run(layouts: Sequence[str], steps: int, out: Path) -> Dict[str, Any]:
    """Each layout and its baseline under `out`/memory/<layout>[_baseline]."""
    from mpoverlap.config import compose

    rows = {}
    for name in layouts:
        overrides = LAYOUTS[name] + [f"train.steps={steps}"]
        small = overrides + baseline_overrides(compose(overrides))
        measured = run_train(overrides, out / "memory" / name)[-1]["peak_memory_bytes"]
        baseline = run_train(small, out / "memory" / f"{name}_baseline")[-1]["peak_memory_bytes"]
        rows[name] = {"overrides": overrides, "baseline_overrides": small, "rss_bytes": measured,
                      "baseline_rss_bytes": baseline, "estimate_bytes": estimate_bytes(overrides),
                      "baseline_estimate_bytes": estimate_bytes(small)}
    return {"steps": steps, "world": WORLD, "layouts": rows}


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def render(results: Dict[str, Any]) -> str:
    """The memory section of results.md ("" when the run had none)."""
    mem = results.get("memory")
    if not mem:
        return ""
    lines = ["## Peak memory per rank vs the estimate", "",
             f"{mem['world']} ranks, {mem['steps']} steps, bare loopback. RSS = each rank's peak resident set "
             "(ru_maxrss, metrics.jsonl `peak_memory_bytes`); the table takes the larger rank (the estimate is for "
             "the busiest pipeline stage). Baseline = the same layout with a near-empty model (hidden 32, seq 16, "
             "one layer per pipeline chunk). Estimate = params + grads + optimizer + activations "
             "(`mpoverlap.overlap.estimate`).", "",
             "| layout | RSS (MiB) | baseline RSS (MiB) | RSS - baseline (MiB) | estimate (MiB) | "
             "estimate - est. baseline (MiB) | params / grads / optimizer / activations (MiB) | measured / estimate |",
             "|---|---:|---:|---:|---:|---:|---|---:|"]
    for name, r in mem["layouts"].items():
        rss, base = max(r["rss_bytes"]), max(r["baseline_rss_bytes"])
        est, est_base = sum(r["estimate_bytes"].values()), sum(r["baseline_estimate_bytes"].values())
        parts = " / ".join(_mib(v) for v in r["estimate_bytes"].values())
        lines.append(f"| `{' '.join(r['overrides'][:-1])}` | {_mib(rss)} | {_mib(base)} | {_mib(rss - base)} | "
                     f"{_mib(est)} | {_mib(est - est_base)} | {parts} | {(rss - base) / max(est - est_base, 1):.2f} |")
    lines += ["", "What RSS does and does not measure: it counts pages, not tensors. It includes the interpreter, "
              "torch's libraries and the corpus (the baseline takes these out), allocator caches, freed blocks the "
              "allocator has not returned to the OS, and transient buffers (logits, the loss, foreach and gloo "
              "temporaries) the estimate does not model; it misses nothing the model really touched, but a peak "
              "reached once counts even if it lasted a millisecond. At this model size the difference is tens of "
              "MiB against a runtime of a few hundred, so a few MiB of noise moves the ratio visibly; the per-rank "
              "figures are in results.json.", ""]
    return "\n".join(lines)
