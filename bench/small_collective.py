"""What one small gloo collective costs a rank's CPU (the per-step stop flag: a 4-byte MAX
all-reduce per step): 2 gloo ranks, each iteration `--matmuls` 256x256 fp32 matmuls (one
thread), with nothing, a raw `dist.all_reduce(async_op=True)` issued before them and waited
after, or mpoverlap's handle (`mpoverlap.comm.all_reduce`, its completion callback included),
the three kinds in turn; rank 0's process CPU (all its threads, the kernel's work for it
included) and wall time per iteration, each over the nothing kind's.

    python -m bench.small_collective [--matmuls 10] [--iterations 3000]

Read the CPU column: the wall column also holds the two ranks' synchronization, which the
nothing kind lacks (a training step synchronizes its ranks anyway).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

from bench.common import free_port


def _worker(rank: int, port: int, matmuls: int, iterations: int) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from mpoverlap.comm import all_reduce

    group = dist.new_group([0, 1])
    flag, x = torch.zeros(()), torch.randn(256, 256)
    kinds = ("none", "raw", "handle")
    cpu = {k: [] for k in kinds}
    wall = {k: [] for k in kinds}
    for it in range(iterations):
        kind = kinds[it % 3]
        c0, w0 = time.process_time(), time.perf_counter()
        work = handle = None
        if kind == "raw":
            work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group, async_op=True)
        elif kind == "handle":
            handle = all_reduce(flag, group, mode="stop", ledger=None, op=dist.ReduceOp.MAX)
        for _ in range(matmuls):
            x @ x
        if work is not None:
            work.wait()
        if handle is not None:
            handle.wait()
        cpu[kind].append(time.process_time() - c0)
        wall[kind].append(time.perf_counter() - w0)
    if rank == 0:
        skip = min(100, iterations // 10)
        base = {"cpu": statistics.fmean(cpu["none"][skip:]), "wall": statistics.fmean(wall["none"][skip:])}
        for kind in kinds:
            c, w = statistics.fmean(cpu[kind][skip:]), statistics.fmean(wall[kind][skip:])
            print(f"{matmuls} matmuls, {kind:>6}: CPU {c * 1e6:7.0f} us (+{(c - base['cpu']) * 1e6:4.0f}), "
                  f"wall {w * 1e6:7.0f} us (+{(w - base['wall']) * 1e6:4.0f})", flush=True)
    dist.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--matmuls", type=int, default=10)
    p.add_argument("--iterations", type=int, default=3000)
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(_worker, args=(free_port(), args.matmuls, args.iterations), nprocs=2, start_method="spawn")


if __name__ == "__main__":
    main()
