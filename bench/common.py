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
