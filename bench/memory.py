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
    # Activation-heavy interleaved pipeline: stage 0 keeps 7 chunk-microbatches alive.
    "pp2_vpp2": ["parallel.pp=2", "parallel.vpp=2", "model.num_layers=4", "model.hidden_size=256",
                 "model.ffn_hidden_size=704", "model.seq_length=256", "train.micro_batch_size=4",
                 "train.global_batch_size=16"],
}
# Activation recomputation: 8 activation-heavy layers, none / selective / full.
RECOMPUTE_BASE = ["parallel.dp=2", "model.num_layers=8", "model.hidden_size=256", "model.ffn_hidden_size=704",
                  "model.seq_length=512", "train.micro_batch_size=4", "train.global_batch_size=16"]
for _mode in ("none", "selective", "full"):
    LAYOUTS[f"recompute_{_mode}"] = RECOMPUTE_BASE + [f"model.recompute={_mode}"]
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


def estimate_stages(overrides: Sequence[str]) -> List[Dict[str, int]]:
    """Per pipeline stage, estimate(cfg, WORLD)'s memory dict (stage s runs on ranks
    s * WORLD / pp .. : pp is the outermost grid dimension)."""
    from mpoverlap.config import compose
    from mpoverlap.overlap.estimate import estimate

    return [dict(st.memory_bytes) for st in estimate(compose(list(overrides)), WORLD).stages]


# glibc keeps freed blocks below its mmap threshold (dynamic, growing up to 32 MiB) in the heap,
# so by default the peak RSS is the heap's high-water mark, fragmentation included (1.7x the
# live activations of the pp2_vpp2 layout). A fixed 128 KiB threshold maps every tensor-sized
# block on its own and returns it at free: the peak RSS then follows the live tensors.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def run(layouts: Sequence[str], steps: int, out: Path) -> Dict[str, Any]:
    """Each layout and its baseline under `out`/memory/<layout>[_baseline]."""
    import os

    from mpoverlap.config import compose

    saved = {k: os.environ.get(k) for k in MALLOC_ENV}
    os.environ.update(MALLOC_ENV)
    try:
        return _run(layouts, steps, out, compose)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _run(layouts: Sequence[str], steps: int, out: Path, compose) -> Dict[str, Any]:
    rows = {}
    for name in layouts:
        overrides = LAYOUTS[name] + [f"train.steps={steps}"]
        small = overrides + baseline_overrides(compose(overrides))
        measured_rows = run_train(overrides, out / "memory" / name)
        measured = measured_rows[-1]["peak_memory_bytes"]
        baseline = run_train(small, out / "memory" / f"{name}_baseline")[-1]["peak_memory_bytes"]
        rows[name] = {"overrides": overrides, "baseline_overrides": small, "rss_bytes": measured,
                      "baseline_rss_bytes": baseline, "estimate_bytes": estimate_bytes(overrides),
                      "baseline_estimate_bytes": estimate_bytes(small),
                      "stage_estimate_bytes": estimate_stages(overrides),
                      "baseline_stage_estimate_bytes": estimate_stages(small),
                      "step_time_s": sorted(r["step_time_s"] for r in measured_rows[1:] or measured_rows)[
                          len(measured_rows[1:] or measured_rows) // 2]}
    return {"steps": steps, "world": WORLD, "layouts": rows, "malloc_env": MALLOC_ENV}


def activation_rows(r: Dict[str, Any]) -> List[Dict[str, float]]:
    """Per rank: measured activations = RSS - baseline RSS - the estimate's weights, gradients
    and optimizer (over the baseline's), against the estimate's activations for that rank's
    stage (over the baseline's)."""
    stages, base = r["stage_estimate_bytes"], r["baseline_stage_estimate_bytes"]
    out = []
    for rank, (rss, rss0) in enumerate(zip(r["rss_bytes"], r["baseline_rss_bytes"])):
        s = rank * len(stages) // len(r["rss_bytes"])
        state = sum(v for k, v in stages[s].items() if k != "activations")
        state0 = sum(v for k, v in base[s].items() if k != "activations")
        measured = (rss - rss0) - (state - state0)
        est = stages[s]["activations"] - base[s]["activations"]
        out.append({"rank": rank, "stage": s, "measured": measured, "estimate": est, "ratio": measured / max(est, 1)})
    return out


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
             "one layer per pipeline chunk). Estimate = params + grads + optimizer + activations + the rest (the "
             "step's bf16 weight casts, the loss's backward, CP's attention work: `mpoverlap.overlap.estimate`).", "",
             "| layout | RSS (MiB) | baseline RSS (MiB) | RSS - baseline (MiB) | estimate (MiB) | "
             "estimate - est. baseline (MiB) | params / grads / optimizer / activations / the rest (MiB) | measured / estimate | "
             "median step (s) |",
             "|---|---:|---:|---:|---:|---:|---|---:|---:|"]
    for name, r in mem["layouts"].items():
        rss, base = max(r["rss_bytes"]), max(r["baseline_rss_bytes"])
        est, est_base = sum(r["estimate_bytes"].values()), sum(r["baseline_estimate_bytes"].values())
        named = ("params", "grads", "optimizer", "activations")
        parts = " / ".join([_mib(r["estimate_bytes"].get(k, 0)) for k in named]
                           + [_mib(sum(v for k, v in r["estimate_bytes"].items() if k not in named))])
        lines.append(f"| `{' '.join(r['overrides'][:-1])}` | {_mib(rss)} | {_mib(base)} | {_mib(rss - base)} | "
                     f"{_mib(est)} | {_mib(est - est_base)} | {parts} | {(rss - base) / max(est - est_base, 1):.2f} | "
                     f"{r.get('step_time_s', float('nan')):.3f} |")
    lines += ["", "Activations per rank (RSS - baseline - the estimate's weights, gradients and optimizer state; "
              "estimate: that rank's pipeline stage, in-flight chunks from the schedule):", "",
              "| layout | rank (stage) | measured (MiB) | estimate (MiB) | measured / estimate |",
              "|---|---|---:|---:|---:|"]
    for name, r in mem["layouts"].items():
        if "stage_estimate_bytes" in r:
            for a in activation_rows(r):
                lines.append(f"| `{name}` | {a['rank']} ({a['stage']}) | {_mib(a['measured'])} | "
                             f"{_mib(a['estimate'])} | {a['ratio']:.2f} |")
    lines += ["", "What RSS does and does not measure: it counts pages, not tensors. It includes the interpreter, "
              "torch's libraries and the corpus (the baseline takes these out), allocator caches, freed blocks the "
              "allocator has not returned to the OS, and transient buffers (foreach and gloo temporaries) the "
              "estimate does not model; it misses nothing the model really touched, but a peak "
              "reached once counts even if it lasted a millisecond. The runs set MALLOC_MMAP_THRESHOLD_=131072 so that "
              "glibc returns freed tensor-sized blocks to the OS (by default RSS shows the heap's high-water mark). "
              "At this model size the difference is tens of "
              "MiB against a runtime of a few hundred, so a few MiB of noise moves the ratio visibly; the per-rank "
              "figures are in results.json.", ""]
    return "\n".join(lines)
