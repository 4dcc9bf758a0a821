"""Asynchronous checkpoint saves (checkpoint.async_save=true): does training keep its pace while
a checkpoint is written in the background?

2 gloo ranks on CPU (parallel.tp=2 by default, --parallel dp for parallel.dp=2), one torch thread each, a GPT big enough that writing a
checkpoint takes several step times (the defaults: about 25M parameters, so about 300 MB of
weights and Adam state per checkpoint, written once between the two ranks) and a batch small
enough that a step is short. In one spawn, after warmup steps:

  no_save   `--steps` steps without any save, half before the saves and half after the async
            cycles: the reference step time
  sync      `--saves` synchronous saves (Trainer.save() with a checkpoint.async_save=false
            Checkpointer): what a synchronous save costs the loop
  async     `--saves` cycles of Trainer.save() (asynchronous: staging at the step boundary) then
            K steps, K = twice the sync save's time in step times + 2 (agreed by the ranks); each step
            is labelled by whether a write was in flight (on any rank) at its start, and
            whether it still was at its end ("whole step under the write")

Step time = slowest rank, per step. Reported: median step time of each kind, the ratio
"whole step under the write" / no_save (acceptance: <= 1.5), the boundary cost of an async save
(Trainer.save() returning: the state built, staged (copied) and handed to DCP), the staging copy
alone, the background write (hand-over to COMPLETE + rename), the sync save's time, and the
process CPU time per step of each kind (the writer thread's CPU shows up there).

    python -m bench.async_ckpt [--layers 8] [--hidden 512] [--ffn 2048] [--seq 32]
                               [--steps 12] [--saves 3] [--warmup 3] [--json F]
"""
from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any, Dict, List

from bench.common import close_trainers, init_bench_worker, json_cli, spawn_ranks, stats


def add_args(p) -> None:
    p.add_argument("--parallel", default="tp", choices=("tp", "dp"),
                   help="parallel.tp=2 (default: a step's optimizer and gradient work are halved, the saved "
                        "state is not) or parallel.dp=2")
    p.add_argument("--layers", type=int, default=8, help="model.num_layers (default 8)")
    p.add_argument("--hidden", type=int, default=512, help="model.hidden_size (default 512)")
    p.add_argument("--ffn", type=int, default=2048, help="model.ffn_hidden_size (default 2048)")
    p.add_argument("--seq", type=int, default=32, help="model.seq_length (default 32)")
    p.add_argument("--global-batch", type=int, default=2, help="train.global_batch_size (default 2: 1 per rank)")
    p.add_argument("--steps", type=int, default=12, help="steps without saves (default 12)")
    p.add_argument("--saves", type=int, default=5, help="sync saves, then async save cycles (default 5)")
    p.add_argument("--warmup", type=int, default=5, help="discarded steps first (default 5)")


def overrides(args, tmp: str) -> List[str]:
    return [f"parallel.{getattr(args, 'parallel', 'tp')}=2", f"model.num_layers={args.layers}",
            f"model.hidden_size={args.hidden}",
            f"model.ffn_hidden_size={args.ffn}", f"model.seq_length={args.seq}", "model.num_attention_heads=8",
            "train.micro_batch_size=1", f"train.global_batch_size={args.global_batch}", "train.steps=100000",
            "train.progress=false", "train.device=cpu", "data.max_bytes=400000", "checkpoint.interval=0",
            "checkpoint.resume=none", "checkpoint.keep=1", "checkpoint.async_save=true",
            f"checkpoint.dir={tmp}/async", f"run.dir={tmp}/run"]


def _timed_step(trainer) -> tuple:
    t0, c0 = time.perf_counter(), time.process_time()
    trainer.train_step()
    return time.perf_counter() - t0, time.process_time() - c0


def _worker(rank: int, port: int, args, tmp: str) -> None:
    init_bench_worker(rank, port)
    import torch
    import torch.distributed as dist

    from mpoverlap.config import compose
    from mpoverlap.models.gpt import num_parameters
    from mpoverlap.training.checkpoint import Checkpointer
    from mpoverlap.training.loop import Trainer
    from mpoverlap.training.setup import init_distributed

    cfg = compose(overrides(args, tmp))
    Path(tmp, "run").mkdir(parents=True, exist_ok=True)
    trainer = Trainer(cfg, init_distributed(cfg), Path(tmp) / "run")
    trainer.log = lambda message: None  # the save lines would only clutter the benchmark's output
    async_ck = trainer.checkpointer
    async_ck._log = trainer.log
    for _ in range(args.warmup):
        trainer.train_step()
    no_save = [_timed_step(trainer) for _ in range(args.steps // 2)]  # the other half after the async cycles

    trainer.checkpointer = Checkpointer(Path(tmp) / "sync", keep=1)
    sync_s = []
    for _ in range(args.saves):
        dist.barrier()
        t0 = time.perf_counter()
        trainer.save()
        sync_s.append(time.perf_counter() - t0)
        trainer.train_step()
    trainer.checkpointer = async_ck

    # Steps per async cycle: twice the slowest rank's sync save in its own step times (the write at
    # low priority takes longer than a sync save), plus 2, so that each cycle ends with steps
    # after the write.
    k = torch.tensor([math.ceil(2 * max(sync_s) / sorted(s for s, _ in no_save)[len(no_save) // 2]) + 2.0])
    dist.all_reduce(k, op=dist.ReduceOp.MAX)
    steps_per_cycle = int(k.item())
    cycles = []
    for _ in range(args.saves):
        dist.barrier()
        t0 = time.perf_counter()
        trainer.save()
        boundary = time.perf_counter() - t0
        steps = []
        for _ in range(steps_per_cycle):
            before = async_ck.in_flight
            wall, cpu = _timed_step(trainer)
            steps.append((wall, cpu, before, async_ck.in_flight))
        async_ck.wait()
        cycles.append({"boundary_s": boundary, "steps": steps, **async_ck.last_async})
    no_save += [_timed_step(trainer) for _ in range(args.steps - args.steps // 2)]
    mine = {"no_save": no_save, "sync_s": sync_s, "cycles": cycles}
    everyone: List[Any] = [None, None]
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        import json

        result = _summarise(everyone, steps_per_cycle)
        result["setup"] = {"overrides": overrides(args, "<tmp>"), "parameters": num_parameters(trainer.model),
                           "checkpoint_bytes": sum(f.stat().st_size for f in Path(tmp, "sync").rglob("*") if f.is_file()),
                           "threads_per_rank": torch.get_num_threads(), "steps_per_cycle": steps_per_cycle}
        Path(args.json_tmp).write_text(json.dumps(result))
    dist.barrier()
    close_trainers([trainer])


def _summarise(ranks: List[Dict[str, Any]], steps_per_cycle: int) -> Dict[str, Any]:
    """Per step the slowest rank's wall time and the ranks' mean process CPU; a step is under a
    write when some rank had one in flight at its start (`whole`: still at its end, on every rank
    that had one)."""
    no_save = [max(r["no_save"][i][0] for r in ranks) for i in range(len(ranks[0]["no_save"]))]
    no_save_cpu = [sum(r["no_save"][i][1] for r in ranks) / len(ranks) for i in range(len(ranks[0]["no_save"]))]
    under, whole, after = [], [], []
    cpu = {"under": [], "after": []}
    for c in range(len(ranks[0]["cycles"])):
        for i in range(steps_per_cycle):
            per = [r["cycles"][c]["steps"][i] for r in ranks]
            wall, mean_cpu = max(s[0] for s in per), sum(s[1] for s in per) / len(per)
            started = any(s[2] for s in per)
            if started:
                under.append(wall)
                cpu["under"].append(mean_cpu)
                if all(s[3] for s in per if s[2]):
                    whole.append(wall)
            else:
                after.append(wall)
                cpu["after"].append(mean_cpu)
    base = stats(no_save)["median_s"]
    out: Dict[str, Any] = {
        "no_save": stats(no_save), "under_write": stats(under) if under else None,
        "whole_step_under_write": stats(whole) if whole else None,
        "after_write": stats(after) if after else None,
        "sync_save": stats([max(r["sync_s"][i] for r in ranks) for i in range(len(ranks[0]["sync_s"]))]),
        "async_boundary": stats([max(r["cycles"][c]["boundary_s"] for r in ranks) for c in range(len(ranks[0]["cycles"]))]),
        "async_staging": stats([max(r["cycles"][c]["stage_s"] for r in ranks) for c in range(len(ranks[0]["cycles"]))]),
        "async_write": stats([max(r["cycles"][c]["write_s"] for r in ranks) for c in range(len(ranks[0]["cycles"]))]),
        "cpu_per_step_s": {"no_save": stats(no_save_cpu)["median_s"],
                           **{k: stats(v)["median_s"] for k, v in cpu.items() if v}},
    }
    if whole:
        out["ratio_whole_under_write"] = out["whole_step_under_write"]["median_s"] / base
    if under:
        out["ratio_under_write"] = out["under_write"]["median_s"] / base
    if whole and after:  # within the async cycles: the same minutes of machine load on both sides
        out["ratio_whole_vs_after_write"] = out["whole_step_under_write"]["median_s"] / out["after_write"]["median_s"]
    out["steps_hidden_per_save"] = out["async_write"]["median_s"] / base
    return out


def run(args) -> Dict[str, Any]:
    load_before = os.getloadavg()
    result, _ = spawn_ranks(_worker, args, prefix="mpo-async-ckpt-")
    result["loadavg_before"], result["loadavg_after"] = load_before, os.getloadavg()
    return result


def run_in_bench(out: Path) -> Dict[str, Any]:
    """For bench/run.py: this benchmark in a subprocess (no rate-limited link: it writes to disk)."""
    import json
    import subprocess
    import sys

    from bench.common import ROOT

    path = out / "async_ckpt.json"
    proc = subprocess.run([sys.executable, "-m", "bench.async_ckpt", "--json", str(path)], cwd=ROOT,
                          stdout=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise SystemExit(f"bench.async_ckpt failed with exit status {proc.returncode}")
    return json.loads(path.read_text())


def _ms(x: Dict[str, float]) -> str:
    return f"{x['median_s'] * 1e3:.0f} ({x['q1_s'] * 1e3:.0f}-{x['q3_s'] * 1e3:.0f}, n={x['n']})"


def render(results: Dict[str, Any]) -> str:
    res = results.get("async_ckpt")
    if not res:
        return ""
    s = res["setup"]
    lines = ["## Asynchronous checkpoint saves, 2 ranks (gloo, CPU)", "",
             f"`{s['overrides'][0]}`, {s['parameters'] / 1e6:.1f}M parameters (this rank's), {s['checkpoint_bytes'] / 2**20:.0f} MiB per checkpoint, "
             f"{s['threads_per_rank']} thread per rank, {s['steps_per_cycle']} steps per async cycle. "
             f"Load average before/after: {res['loadavg_before'][0]:.2f} / {res['loadavg_after'][0]:.2f}.", "",
             "| figure | median ms (IQR, n) |", "|---|---:|",
             f"| step, no save | {_ms(res['no_save'])} |"]
    for key, label in (("whole_step_under_write", "step wholly under an async write"),
                       ("under_write", "step started under an async write"),
                       ("after_write", "step of an async cycle after the write ended"),
                       ("async_boundary", "async save at the step boundary (Trainer.save() returns)"),
                       ("async_staging", "of which the staging copy"),
                       ("async_write", "async background write (to COMPLETE + rename)"),
                       ("sync_save", "sync save (Trainer.save())")):
        if res.get(key):
            lines.append(f"| {label} | {_ms(res[key])} |")
    lines.append("")
    if "ratio_whole_under_write" in res:
        r = res["ratio_whole_under_write"]
        lines.append(f"Step under the write / step without: {r:.2f} (goal <= 1.5: {'met' if r <= 1.5 else 'NOT met'}); "
                     f"steps that started under it: {res.get('ratio_under_write', float('nan')):.2f}; "
                     f"under the write / after it, in the same cycles: "
                     f"{res.get('ratio_whole_vs_after_write', float('nan')):.2f}. "
                     f"Process CPU s per step (mean of ranks): " + ", ".join(
                         f"{k} {v * 1e3:.0f} ms" for k, v in res["cpu_per_step_s"].items()) + ".")
    return "\n".join(lines)


def main() -> None:
    json_cli(__doc__, add_args, run)


if __name__ == "__main__":
    main()
