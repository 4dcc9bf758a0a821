"""Helpers shared by the benchmarks: statistics, free ports, AdamW groups, machine CPU clocks."""
from __future__ import annotations

import os
import socket
import statistics
from typing import Dict, List, Sequence

import torch


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stats(samples: Sequence[float]) -> Dict[str, float]:
    """median / min / interquartile range of a list of seconds (n >= 1)."""
    xs = sorted(samples)
    n = len(xs)
    if n >= 4:
        q = statistics.quantiles(xs, n=4)
        q1, q3 = q[0], q[2]
    else:
        q1, q3 = xs[0], xs[-1]
    return {"n": n, "median_s": statistics.median(xs), "min_s": xs[0], "q1_s": q1, "q3_s": q3}


def adamw_groups(model: torch.nn.Module, weight_decay: float) -> List[dict]:
    """The same split DataParallelAdamW uses: weight decay on tensors with ndim >= 2 only."""
    params = list(model.parameters())  # tied parameters appear once
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    return [g for g in ({"params": decay, "weight_decay": weight_decay},
                        {"params": no_decay, "weight_decay": 0.0}) if g["params"]]


def machine_busy_s() -> float:
    """Core-seconds the machine spent in user+nice+system since boot (/proc/stat), or nan.

    irq/softirq time (loopback and tc work of our own traffic) and steal are left out, so
    this minus our processes' CPU time is what OTHER processes took from the cores.
    """
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:4]]
        return sum(fields) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return float("nan")


def machine_irq_s() -> float:
    """Core-seconds the machine spent in irq+softirq since boot (network stack work), or nan."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:8]]
        return (fields[5] + fields[6]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return float("nan")


def lo_tx_bytes() -> float:
    """Bytes sent on this network namespace's loopback so far (both ranks' traffic), or nan."""
    try:
        with open("/sys/class/net/lo/statistics/tx_bytes") as f:
            return float(f.read())
    except (OSError, ValueError):
        return float("nan")


def foreign_cores(both: List[tuple]) -> float:
    """Cores that processes other than our two ranks used during a block: machine busy time
    (rank 0's reading) minus both ranks' CPU time, over rank 0's wall time."""
    (busy, own0, wall), (_, own1, _) = both
    return max(0.0, busy - own0 - own1) / max(wall, 1e-9)


def rotating_blocks(sides: Dict[str, object], args, log_prefix: str = "bench") -> List[Dict[str, object]]:
    """The dp_overlap method for any set of sides stepped in the same 2 (or more) gloo ranks.

    Each side has `train_step()`, `settle()` (called outside timing around every block and
    after the warmup: leave nothing in flight) and `collect(keep) -> dict` (called after each
    step; per-step extras such as the ledger's figures, kept when `keep`). Warmup steps first,
    then rounds of one block per side in rotating order until every side has `args.min_quiet`
    quiet blocks (at least `args.repeats`, at most `args.max_repeats` rounds, within
    `args.time_budget` s). Every rank decides from gathered numbers, so all run the same rounds.
    Returns this rank's blocks: name, times (kept steps), extras, busy/own CPU/wall/irq/wire
    figures, foreign_cores.
    """
    import gc
    import sys
    import time

    import torch.distributed as dist

    order = list(sides)
    world = dist.get_world_size()
    for name in order:
        for _ in range(args.warmup):
            sides[name].train_step()
            sides[name].collect(False)
        sides[name].settle()
        dist.barrier()
    quiet = dict.fromkeys(order, 0)
    blocks: List[Dict[str, object]] = []
    start, r = time.perf_counter(), 0
    while True:
        elapsed = [0.0] * world
        dist.all_gather_object(elapsed, time.perf_counter() - start)
        enough = all(q >= args.min_quiet for q in quiet.values())
        if r >= args.repeats and (enough or r >= args.max_repeats or elapsed[0] > args.time_budget):
            break
        rot = r % len(order)
        for name in order[rot:] + order[:rot]:
            side = sides[name]
            gc.collect()
            side.settle()
            dist.barrier()
            block: Dict[str, object] = {"name": name, "times": [], "extras": []}
            busy0, own0, wall0 = machine_busy_s(), time.process_time(), time.perf_counter()
            wire0, irq0 = lo_tx_bytes(), machine_irq_s()
            for i in range(args.block):
                t0 = time.perf_counter()
                side.train_step()
                dt = time.perf_counter() - t0
                keep = i >= args.block_warmup
                extra = side.collect(keep)
                if keep:
                    block["times"].append(dt)
                    block["extras"].append(extra)
            side.settle()
            dist.barrier()
            block.update(busy_s=machine_busy_s() - busy0, own_cpu_s=time.process_time() - own0,
                         wall_s=time.perf_counter() - wall0, irq_s=machine_irq_s() - irq0,
                         wire_bytes_per_step=(lo_tx_bytes() - wire0) / args.block)
            both: List[object] = [None] * world
            dist.all_gather_object(both, (block["busy_s"], block["own_cpu_s"], block["wall_s"]))
            block["foreign_cores"] = foreign_cores(both[:2])
            if block["foreign_cores"] <= args.quiet_cores:
                quiet[name] += 1
            blocks.append(block)
        r += 1
        if dist.get_rank() == 0:
            print(f"{log_prefix}: round {r} done, quiet blocks " + " ".join(f"{k}={q}" for k, q in quiet.items()),
                  file=sys.stderr, flush=True)
    return blocks
