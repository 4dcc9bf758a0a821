"""MoE on one device: `Trainer.train_step` of an MoE model in one process, the grouped
experts (model.moe_grouped_gemm=true) against the per-expert loop (false), alternating blocks.

Reports, per side: the median step, tokens per second, and the GEMM share of one profiled step
(the self CPU time of matrix products, grouped ones included, over the step's total self CPU
time of aten operators: on CPU what the GPU's kernel share is on a GPU; the rest is indexing,
elementwise work and the framework's per-operator host work).

    python -m bench.moe_step [--model moe_fine_tiny] [--block 4] [--repeats 3] [--warmup 2]
                             [--threads 1] [--json F] [extra overrides...]

`make bench` runs it with the defaults (bench/run.py: "MoE on one device").
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Dict, List

import torch

from bench.common import free_port, json_cli

GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_grouped_mm", "aten::matmul")
SIDES = {"grouped": "true", "loop": "false"}


def _trainer(model: str, side: str, root: Path, extra: List[str]):
    from mpoverlap.config import compose
    from mpoverlap.training.loop import Trainer
    from mpoverlap.training.setup import init_distributed

    cfg = compose([f"model={model}", f"model.moe_grouped_gemm={SIDES[side]}", "train.device=cpu",
                   "train.progress=false", "train.log_interval=100000", "checkpoint.interval=0",
                   "data.max_bytes=200000", f"run.dir={root / side}", *extra])
    return Trainer(cfg, init_distributed(cfg), root / side), cfg


def gemm_share(trainer) -> float:
    """GEMM self CPU time over all aten operators' self CPU time, one profiled step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        trainer.train_step()
    events = [e for e in prof.key_averages() if e.key.startswith("aten::")]
    total = sum(e.self_cpu_time_total for e in events)
    gemm = sum(e.self_cpu_time_total for e in events if e.key in GEMM_OPS)
    return gemm / total if total else 0.0


def run(args) -> Dict[str, Any]:
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    if not dist.is_initialized():  # one rank; init_distributed then builds on this group
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                                timeout=timedelta(seconds=120))
    times: Dict[str, List[float]] = {s: [] for s in SIDES}
    cpu: Dict[str, List[float]] = {s: [] for s in SIDES}  # this process's CPU time: least moved by other jobs
    out: Dict[str, Any] = {"setup": {"model": args.model, "block": args.block, "repeats": args.repeats,
                                     "warmup": args.warmup, "threads": args.threads, "overrides": args.overrides}}
    with tempfile.TemporaryDirectory() as d:
        trainers = {s: _trainer(args.model, s, Path(d), args.overrides) for s in SIDES}
        cfg = trainers["grouped"][1]
        tokens = cfg.train.global_batch_size * cfg.model.seq_length
        for s, (t, _) in trainers.items():
            for _ in range(args.warmup):
                t.train_step()
        for r in range(args.repeats):
            order = list(SIDES) if r % 2 == 0 else list(reversed(SIDES))
            for s in order:
                t = trainers[s][0]
                for _ in range(args.block):
                    t0, c0 = time.perf_counter(), time.process_time()
                    t.train_step()
                    times[s].append(time.perf_counter() - t0)
                    cpu[s].append(time.process_time() - c0)
        for s, (t, _) in trainers.items():
            med = statistics.median(times[s])
            out[s] = {"median_s": med, "median_cpu_s": statistics.median(cpu[s]), "tokens_per_s": tokens / med,
                      "gemm_share": gemm_share(t), "n": len(times[s])}
            t.close()
    out["speedup"] = out["loop"]["median_s"] / out["grouped"]["median_s"]
    out["speedup_cpu"] = out["loop"]["median_cpu_s"] / out["grouped"]["median_cpu_s"]
    out["setup"].update(tokens_per_step=tokens, num_experts=cfg.model.num_experts, top_k=cfg.model.moe_top_k)
    return out


def render(results: Dict[str, Any]) -> str:
    res = results.get("moe_step")
    if not res:
        return ""
    s = res["setup"]
    lines = ["## MoE on one device", "",
             f"{s['model']} ({s['num_experts']} experts, top-{s['top_k']}), {s['tokens_per_step']} tokens a step, "
             f"{s['threads']} thread(s), Trainer.train_step in one process; {s['repeats']} alternating blocks of "
             f"{s['block']} steps per side after {s['warmup']} warmup steps. GEMM share: matrix products' self CPU "
             "time over all aten operators' in one profiled step.", "",
             "| experts | median step (ms) | CPU time (ms) | tokens/s | GEMM share |", "|---|---:|---:|---:|---:|"]
    for side, label in (("grouped", "grouped GEMMs (moe_grouped_gemm=true)"),
                        ("loop", "per-expert loop (moe_grouped_gemm=false)")):
        r = res[side]
        lines.append(f"| {label} | {r['median_s'] * 1e3:.1f} | {r['median_cpu_s'] * 1e3:.1f} | "
                     f"{r['tokens_per_s']:.0f} | {100 * r['gemm_share']:.1f}% |")
    lines += ["", f"**loop / grouped step time = {res['speedup']:.2f}** (on this process's CPU time, least moved "
              f"by other jobs: {res['speedup_cpu']:.2f})", ""]
    return "\n".join(lines)


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="moe_fine_tiny")
    p.add_argument("--block", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("overrides", nargs="*", help="extra config overrides (key=value)")


if __name__ == "__main__":
    json_cli(__doc__, _add_args, run)
