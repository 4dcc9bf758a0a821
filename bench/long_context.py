"""Long context: ring attention (cp 2) at 16K to 64K tokens on the fused block kernels against
the explicit block math, peak memory against mpoverlap-check, and the ring's compute against
the same blocks through SDPA alone.

Three parts (each rank one torch thread, the bare loopback: compute and memory, not the link):

1. Training runs (`mpoverlap-train`, model=gpt_long_tiny: 2 layers, hidden 64, 2 heads of 32,
   cp 2, micro batch 1) at each sequence length, `parallel.cp_attention_backend=fused` and
   `=explicit` side by side: step time (median of the steps after the first), tokens/s and
   each rank's peak RSS. The explicit side runs up to --explicit-max-seq (32K: at 64K its
   c x c scores per head cost ~6 GiB per rank and ~10 minutes or more per step on two cores (4x its 32K step)), and a side
   whose mpoverlap-check estimate, times the two ranks, exceeds the machine's available
   memory is not run; the table says which and why.
2. Memory against the estimate, as bench/memory.py does: (peak RSS - baseline RSS) against
   (estimate - the baseline's estimate), the baseline being the same layout at seq 64 (the
   runtime, corpus and libraries taken out of both sides).
3. The ring's overhead, in one process: RingAttentionFunction forward + backward for each rank
   of cp 2 (a local ring whose exchange is a copy; only the time between the ring's
   compute_begin and compute_end events counts, transfers excluded), against the same
   blocks' forward + backward through F.scaled_dot_product_attention alone (autograd, one
   call per block, nothing merged or accumulated).

    python -m bench.long_context [--seqs 16384,32768,65536] [--steps 3] [--explicit-max-seq 32768]
                                 [--overhead-seq 16384] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from bench.common import ROOT, run_train

# conf/model/gpt_long_tiny.yaml: 2 layers, hidden 64, 2 heads of 32, ffn 128.
MODEL = ["model=gpt_long_tiny", "parallel.cp=2", "train.micro_batch_size=1", "train.global_batch_size=1",
         "train.eval_iters=1", "train.lr_warmup_steps=0"]
BACKENDS = ("fused", "explicit")
WORLD = 2


def overrides(seq: int, backend: str, steps: int) -> List[str]:
    return [*MODEL, f"model.seq_length={seq}", f"parallel.cp_attention_backend={backend}", f"train.steps={steps}"]


def estimate_total(ov: Sequence[str]) -> int:
    from mpoverlap.config import compose
    from mpoverlap.overlap.estimate import estimate

    return sum(estimate(compose(list(ov)), WORLD).memory_bytes.values())


def available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def train_side(seq: int, backend: str, steps: int, out: Path, explicit_max_seq: int) -> Dict[str, Any]:
    ov = overrides(seq, backend, steps)
    est = estimate_total(ov)
    if backend == "explicit" and seq > explicit_max_seq:
        return {"overrides": ov, "estimate_bytes": est, "skipped": f"above --explicit-max-seq {explicit_max_seq} "
                f"(estimated {est / 2**30:.1f} GiB per rank with its c x c scores, and ~10 minutes or more per step on two cores (4x its 32K step))"}
    avail = available_bytes()
    # The runtime (~0.4 GiB per rank) and a margin on top of the estimate.
    if WORLD * (est + 2**29) > avail:
        return {"overrides": ov, "estimate_bytes": est, "skipped": f"estimate {est / 2**30:.1f} GiB per rank x "
                f"{WORLD} ranks > {avail / 2**30:.1f} GiB available"}
    t0 = time.perf_counter()
    rows = run_train(ov, out / "long_context" / f"{backend}_{seq}")
    wall = time.perf_counter() - t0
    later = rows[1:] or rows
    return {"overrides": ov, "estimate_bytes": est, "wall_s": wall, "steps": len(rows),
            "step_time_s": statistics.median(r["step_time_s"] for r in later),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in later),
            "peak_rss_bytes": rows[-1]["peak_memory_bytes"], "losses": [r["loss"] for r in rows]}


def memory_vs_estimate(side: Dict[str, Any], seq: int, backend: str, out: Path) -> Dict[str, Any]:
    """(RSS - baseline RSS) against (estimate - baseline estimate), per rank."""
    base_ov = overrides(64, backend, 2)
    base_rss = run_train(base_ov, out / "long_context" / f"{backend}_{seq}_baseline")[-1]["peak_memory_bytes"]
    est = side["estimate_bytes"] - estimate_total(base_ov)
    per_rank = [rss - rss0 for rss, rss0 in zip(side["peak_rss_bytes"], base_rss)]
    return {"baseline_rss_bytes": base_rss, "measured_bytes": per_rank, "estimate_bytes": est,
            "ratios": [m / est for m in per_rank]}


class _LocalRing:
    """Rank `cp_rank` of a cp ring in one process: `exchange` copies (sizes and work are the
    ring's; values of the travelling dK/dV are not, and nothing here reads them)."""

    def __init__(self, cp_rank: int, cp_size: int):
        self.cp_rank, self.cp_size, self.overlap = cp_rank, cp_size, False

    def source_of_step(self, step: int) -> int:
        return (self.cp_rank - step) % self.cp_size

    def exchange(self, send, recv):
        from types import SimpleNamespace

        recv.copy_(send)
        return SimpleNamespace(wait=lambda: None, waited=True)


def ring_overhead(seq: int, repeats: int = 3, heads: int = 2, head_dim: int = 32) -> Dict[str, Any]:
    """Seconds of the ring's compute (fwd + bwd, both ranks of cp 2, median of `repeats`)
    against the same blocks through F.scaled_dot_product_attention."""
    import torch
    import torch.nn.functional as F

    from mpoverlap.context_parallel.block_kernels import FLASH_CPU
    from mpoverlap.context_parallel.ring_attention import RingAttentionFunction, _blocks
    from mpoverlap.context_parallel.stats import CPStats

    torch.set_num_threads(1)
    cp, S_local = 2, seq // 2
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, S_local, head_dim, generator=g) for _ in range(3))
    ring_s, sdpa_s = [], []
    for _ in range(repeats):
        ring_t = sdpa_t = 0.0
        for r in range(cp):
            ring = _LocalRing(r, cp)
            stats = CPStats()
            qkv = [t.clone().requires_grad_() for t in (q, k, v)]
            out = RingAttentionFunction.apply(*qkv, ring, head_dim ** -0.5, stats, FLASH_CPU)
            out.backward(torch.ones_like(out))
            ev = stats.events
            for phase in ("fwd", "bwd"):
                begins = [e[3] for e in ev if e[:2] == (phase, "compute_begin")]
                ends = [e[3] for e in ev if e[:2] == (phase, "compute_end")]
                ring_t += sum(b - a for a, b in zip(begins, ends))
            for step in range(cp):
                for rows, keys, causal in _blocks(ring, ring.source_of_step(step), S_local // 2, True):
                    blk = [q[:, :, rows].clone().requires_grad_(), k[:, :, keys].clone().requires_grad_(),
                           v[:, :, keys].clone().requires_grad_()]
                    t0 = time.perf_counter()
                    o = F.scaled_dot_product_attention(*blk, is_causal=causal, scale=head_dim ** -0.5)
                    o.backward(torch.ones_like(o))
                    sdpa_t += time.perf_counter() - t0
        ring_s.append(ring_t)
        sdpa_s.append(sdpa_t)
    ring_med, sdpa_med = statistics.median(ring_s), statistics.median(sdpa_s)
    return {"seq": seq, "ring_compute_s": ring_med, "sdpa_s": sdpa_med, "ratio": ring_med / sdpa_med,
            "ring_runs_s": ring_s, "sdpa_runs_s": sdpa_s}


def run(seqs: Sequence[int], steps: int, out: Path, memory_seq: Optional[int] = None,
        overhead_seq: int = 16384, explicit_max_seq: int = 32768) -> Dict[str, Any]:
    import os

    from bench.memory import MALLOC_ENV

    # As bench/memory.py: the peak RSS follows the live tensors, not glibc's heap high-water mark.
    os.environ.update(MALLOC_ENV)
    sides: Dict[str, Dict[str, Any]] = {}
    loadavg = [Path("/proc/loadavg").read_text().split()[:3]]
    for seq in seqs:
        for backend in BACKENDS:
            sides[f"{backend}_{seq}"] = train_side(seq, backend, steps, out, explicit_max_seq)
    res: Dict[str, Any] = {"seqs": list(seqs), "steps": steps, "sides": sides}
    mem_seq = memory_seq or max(seqs)
    fused = sides.get(f"fused_{mem_seq}")
    if fused and "skipped" not in fused:
        res["memory"] = {"seq": mem_seq, **memory_vs_estimate(fused, mem_seq, "fused", out)}
    if overhead_seq:
        res["ring_overhead"] = ring_overhead(overhead_seq)
    loadavg.append(Path("/proc/loadavg").read_text().split()[:3])
    res["loadavg_before_after"] = loadavg
    return res


def run_in_bench(out: Path, seqs: str) -> Dict[str, Any]:
    """For bench/run.py: this benchmark in a subprocess."""
    import subprocess
    import sys

    path = out / "long_context.json"
    proc = subprocess.run([sys.executable, "-m", "bench.long_context", "--seqs", seqs, "--json", str(path),
                           "--out", str(out)], cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"bench.long_context failed with exit status {proc.returncode}")
    return json.loads(path.read_text())


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def render(results: Dict[str, Any]) -> str:
    res = results.get("long_context")
    if not res:
        return ""
    lines = ["## Long context: cp 2 ring attention, fused block kernels vs explicit math", "",
             f"`{' '.join(MODEL)}`, {res['steps']} steps per run, one torch thread per rank, bare loopback. "
             "Step time and tokens/s: median of the steps after the first. Load average before / after: "
             f"{' '.join(res['loadavg_before_after'][0])} / {' '.join(res['loadavg_before_after'][1])} "
             "(a shared machine: absolute times are noisy, the ratios less so).", "",
             "| seq | fused s/step | explicit s/step | explicit / fused | fused tokens/s | explicit tokens/s | "
             "fused peak RSS per rank (GiB) | explicit peak RSS per rank (GiB) |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for seq in res["seqs"]:
        f, e = res["sides"][f"fused_{seq}"], res["sides"][f"explicit_{seq}"]

        def cell(side, key, fmt):
            return "not run" if "skipped" in side else fmt(side[key])
        ratio = "-" if "skipped" in f or "skipped" in e else f"{e['step_time_s'] / f['step_time_s']:.2f}x"
        lines.append(f"| {seq:,} | {cell(f, 'step_time_s', lambda x: f'{x:.1f}')} | "
                     f"{cell(e, 'step_time_s', lambda x: f'{x:.1f}')} | {ratio} | "
                     f"{cell(f, 'tokens_per_s', lambda x: f'{x:,.0f}')} | {cell(e, 'tokens_per_s', lambda x: f'{x:,.0f}')} | "
                     f"{cell(f, 'peak_rss_bytes', lambda x: ' / '.join(_gib(b) for b in x))} | "
                     f"{cell(e, 'peak_rss_bytes', lambda x: ' / '.join(_gib(b) for b in x))} |")
    for name, side in res["sides"].items():
        if "skipped" in side:
            lines.append(f"\n{name}: not run: {side['skipped']}")
    mem = res.get("memory")
    if mem:
        lines += ["", f"Memory at seq {mem['seq']:,} (fused): RSS - baseline RSS per rank "
                  f"{' / '.join(_gib(b) for b in mem['measured_bytes'])} GiB against mpoverlap-check's estimate - "
                  f"the baseline's {_gib(mem['estimate_bytes'])} GiB: ratio "
                  f"{' / '.join(f'{r:.2f}' for r in mem['ratios'])} (baseline: the same layout at seq 64)."]
    ov = res.get("ring_overhead")
    lines += [] if not ov else ["", f"Ring overhead at seq {ov['seq']:,} (cp 2, both ranks, fwd + bwd, one process): the ring's compute "
              f"{ov['ring_compute_s']:.2f} s against the same blocks through F.scaled_dot_product_attention alone "
              f"{ov['sdpa_s']:.2f} s: {ov['ratio']:.2f}x (median of {len(ov['ring_runs_s'])})."]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", default="16384,32768,65536", help="sequence lengths (default 16384,32768,65536)")
    p.add_argument("--steps", type=int, default=3, help="steps per training run (default 3)")
    p.add_argument("--overhead-seq", type=int, default=16384, help="sequence of the ring-overhead part (0: skip it)")
    p.add_argument("--explicit-max-seq", type=int, default=32768,
                   help="longest sequence the explicit side runs at (default 32768; 65536: ~4x its 32K step, 10+ minutes here)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "long_context"), help="run directories")
    args = p.parse_args()
    seqs = [int(x) for x in args.seqs.split(",") if x.strip()]
    res = run(seqs, args.steps, Path(args.out), overhead_seq=args.overhead_seq, explicit_max_seq=args.explicit_max_seq)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    print(render({"long_context": res}))


if __name__ == "__main__":
    main()
