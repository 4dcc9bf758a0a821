"""Run a function on N gloo ranks from a test: `run_distributed(fn, world_size, *args)`.

Each worker is forked from a fork server that imported torch and mpoverlap once (forking the test
process itself would inherit its torch threads);
it joins a gloo group on 127.0.0.1, runs `fn(rank, world_size, *args)` and sends back its
(picklable) return value. A worker's exception is re-raised in the parent with the worker's
traceback text. `fn` must be importable by name (a module-level function of a test module).

Import from a test module with:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from dist_harness import run_distributed
"""
from __future__ import annotations

import os
import queue
import socket
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, List


class WorkerError(RuntimeError):
    """A worker raised; the message carries its rank and traceback."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, timeout_s: float, fn: Callable, args: tuple,
            results) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    # Several ranks share 2 cores: one intra-op thread each avoids oversubscription.
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
        try:
            out = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, out))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        results.put((rank, False, traceback.format_exc()))


# Modules every worker needs: the fork server imports them once, and each worker forked from it
# starts with them loaded (a spawned worker spends ~3 s of CPU importing torch and mpoverlap; a
# test session starts a few hundred workers on 2 cores). The second line is what a worker's first
# Trainer imports lazily: torch.optim's first optimizer imports torch._dynamo, the first compose
# Hydra, the first validation the last rule modules (together ~0.5 s of CPU per worker), the first
# save or resume the sharded checkpoint planners (torch.distributed.checkpoint, ~1 s).
_PRELOAD = ["torch", "torch.distributed", "mpoverlap.config", "mpoverlap.training.loop", "mpoverlap.training.setup",
            "torch._dynamo", "hydra.compose", "hydra.initialize", "mpoverlap.overlap.cp_rules",
            "mpoverlap.overlap.dp_rules", "mpoverlap.overlap.ep_rules", "mpoverlap.checkpoint"]


def _context():
    """A fork-server context: a single-threaded server process that has imported `_PRELOAD` and
    nothing else (no process group, no torch thread pool), so forking it is safe where forking the
    test process (with its torch threads) would not be. MPOVERLAP_TEST_START=spawn goes back to
    fresh interpreters."""
    import torch.multiprocessing as mp

    method = os.environ.get("MPOVERLAP_TEST_START", "forkserver")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout_s: float = 120) -> List[Any]:
    """Spawn `world_size` gloo ranks running `fn(rank, world_size, *args)`; return their
    results in rank order. Raises WorkerError (first failing rank, with its traceback) or
    TimeoutError after `timeout_s` seconds; all workers are gone when it returns."""
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, timeout_s, fn, args, results),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    out: dict = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"run_distributed: ranks {sorted(set(range(world_size)) - set(out))} "
                                   f"did not finish within {timeout_s} s")
            try:
                rank, ok, value = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in out]
                if dead:
                    raise WorkerError(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode} "
                                      "without reporting")
                continue
            if not ok:
                raise WorkerError(f"rank {rank} failed:\n{value}")
            out[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5 if len(out) == world_size else 0.5)
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
    return [out[r] for r in range(world_size)]
