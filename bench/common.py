"""Helpers shared by the benchmarks: statistics, free ports, AdamW groups, machine CPU clocks,
the block options, the rounds of blocks and a Trainer as one of their sides, the spawned 2-rank
worker setup, the command line, and
whole `mpoverlap-train` runs (inside bench/netns.sh when it can be made) with their metrics."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

ROOT = Path(__file__).resolve().parent.parent
NETNS = ROOT / "bench" / "netns.sh"
NETNS_UNAVAILABLE = 3  # bench/netns.sh's exit status when it cannot set up the namespace


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


def own_children_cpu_s() -> float:
    """User+system CPU seconds of this process's finished (waited-for) children and theirs."""
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


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


def foreign_cores(ranks: List[tuple]) -> float:
    """Cores that processes other than our ranks used during a block: machine busy time (rank
    0's reading) minus every rank's CPU time, over rank 0's wall time."""
    busy, _, wall = ranks[0]
    return max(0.0, busy - sum(own for _, own, _ in ranks)) / max(wall, 1e-9)


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

    import torch.distributed as dist

    order = list(sides)
    for name in order:
        for _ in range(args.warmup):
            sides[name].train_step()
            sides[name].collect(False)
        sides[name].settle()
        dist.barrier()
    quiet = dict.fromkeys(order, 0)
    blocks: List[Dict[str, object]] = []
    start, r = time.perf_counter(), 0
    while not rounds_done(args, r, quiet, start):
        rot = r % len(order)
        for name in order[rot:] + order[:rot]:
            side = sides[name]
            gc.collect()
            side.settle()
            dist.barrier()
            block: Dict[str, object] = {"name": name, "times": [], "extras": []}
            clocks = block_clocks()
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
            block.update(block_figures(clocks, args.block))
            block["foreign_cores"] = gathered_foreign_cores(block)
            if block["foreign_cores"] <= args.quiet_cores:
                quiet[name] += 1
            blocks.append(block)
        r += 1
        if dist.get_rank() == 0:
            log_round(log_prefix, r, quiet)
    return blocks


# ---- which blocks the tables use -----------------------------------------------------------------
MIN_QUIET_BLOCKS = 3


def quiet_or_all(all_rows: Dict[str, Any], quiet_rows: Optional[Dict[str, Any]], names: List[str],
                 count: Callable[[Dict[str, Any]], int] = lambda r: r["blocks"]) -> Tuple[Dict[str, Any], bool]:
    """(the rows a table uses, whether they are the quiet ones): the quiet blocks' rows when every
    side of `names` has at least MIN_QUIET_BLOCKS of them (`count(row)`), else all blocks'."""
    if quiet_rows and all(n in quiet_rows and count(quiet_rows[n]) >= MIN_QUIET_BLOCKS for n in names):
        return quiet_rows, True
    return all_rows, False


# ---- rounds of blocks (rotating_blocks and bench.dp_overlap) ------------------------------------
def rounds_done(args, r: int, quiet: Dict[str, int], start: float) -> bool:
    """Whether to stop adding rounds after `r` of them: at least `args.repeats`, then as soon as
    every side has `args.min_quiet` quiet blocks, at `args.max_repeats` rounds or once
    `args.time_budget` s have passed since `start` on rank 0. Every rank gathers rank 0's
    clock and decides from the same numbers, so all run the same rounds."""
    import torch.distributed as dist

    elapsed = [0.0] * dist.get_world_size()
    dist.all_gather_object(elapsed, time.perf_counter() - start)
    enough = all(q >= args.min_quiet for q in quiet.values())
    return r >= args.repeats and (enough or r >= args.max_repeats or elapsed[0] > args.time_budget)


def block_clocks() -> Tuple[float, float, float, float, float]:
    """The readings a block starts from: machine busy, own CPU, wall, loopback bytes, irq."""
    return machine_busy_s(), time.process_time(), time.perf_counter(), lo_tx_bytes(), machine_irq_s()


def block_figures(clocks: Tuple[float, float, float, float, float], steps: int) -> Dict[str, float]:
    """A block's busy/own CPU/wall/irq seconds and loopback bytes per step since `block_clocks()`."""
    busy0, own0, wall0, wire0, irq0 = clocks
    return {"busy_s": machine_busy_s() - busy0, "own_cpu_s": time.process_time() - own0,
            "wall_s": time.perf_counter() - wall0, "irq_s": machine_irq_s() - irq0,
            "wire_bytes_per_step": (lo_tx_bytes() - wire0) / steps}


def gathered_foreign_cores(block: Dict[str, Any]) -> float:
    """`foreign_cores` of a block from every rank's busy/own CPU/wall figures (gathered)."""
    import torch.distributed as dist

    both: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(both, (block["busy_s"], block["own_cpu_s"], block["wall_s"]))
    return foreign_cores(both)


def log_round(prefix: str, r: int, quiet: Dict[str, int]) -> None:
    print(f"{prefix}: round {r} done, quiet blocks " + " ".join(f"{k}={q}" for k, q in quiet.items()),
          file=sys.stderr, flush=True)


class TrainerSide:
    """A side of `rotating_blocks` that is an mpoverlap Trainer (`.t`): a step is its
    `train_step()`; settling finishes the parameter all-gather still in flight and empties the
    ledger, and takes `probe`'s figures when there is one (an object with `take()`), so a block
    starts from zero; each step's extras are the ledger's figures by mode (`comm`), to which a
    subclass's `collect` adds its own."""

    def __init__(self, trainer, probe=None) -> None:
        self.t = trainer
        self.probe = probe

    def train_step(self):
        return self.t.train_step()

    def settle(self) -> None:
        self.t.optimizer.finish_param_sync()
        self.t.ledger.reset()
        if self.probe:
            self.probe.take()

    def collect(self, keep: bool) -> Dict[str, Any]:
        return {"comm": self.t.ledger.reset()}


# ---- the spawned 2-rank worker ------------------------------------------------------------------
def init_bench_worker(rank: int, port: int, world: int = 2, pin: bool = False) -> None:
    """A spawned rank's setup: rendezvous env, one intra-op thread, a gloo process group; a
    crash in native code (SIGABRT, SIGSEGV) prints every Python thread's stack to stderr.
    `pin`: the rank and every thread it starts later (gloo's included) on core `rank` of the
    cores this process may use, so the ranks do not trade cores (less skew between them)."""
    import faulthandler

    faulthandler.enable(all_threads=True)
    if pin:
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[rank % len(cores)]})
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))


def _worker_then_free(rank: int, worker: Callable, *args: Any) -> None:
    """`worker(rank, *args)`, then free its process groups while the interpreter is alive
    (shutdown_distributed: the worker closed its Trainers, and its frame, the last reference
    to them, is gone). Left to interpreter exit, their gloo threads can end a rank inside a
    destructor: "terminate called without an active exception"."""
    from mpoverlap.training.setup import shutdown_distributed

    worker(rank, *args)
    shutdown_distributed()


def close_trainers(trainers) -> None:
    """The end of a bench worker (its `finally`): close every mpoverlap Trainer it built
    (Trainer.close) and destroy the process groups."""
    import torch.distributed as dist

    for trainer in trainers:
        trainer.close()
    if dist.is_initialized():
        dist.destroy_process_group()


def spawn_ranks(worker: Callable, args, prefix: str) -> Tuple[Dict[str, Any], float]:
    """Runs `worker(rank, port, args, tmp)` on 2 spawned ranks; rank 0 writes its result to
    `args.json_tmp`. Returns that result and the perf_counter at the spawn."""
    import torch.multiprocessing as mp

    os.environ["OMP_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        args.json_tmp = str(Path(tmp) / "result.json")
        t0 = time.perf_counter()
        mp.start_processes(_worker_then_free, args=(worker, free_port(), args, tmp), nprocs=2, start_method="spawn",
                           join=True)
        return json.loads(Path(args.json_tmp).read_text()), t0


# ---- command line -------------------------------------------------------------------------------
def add_block_args(p: argparse.ArgumentParser, *, block: int, repeats: int, max_repeats: int, min_quiet: int,
                   time_budget: float, warmup: int, unit: str = "variant") -> None:
    """The options of the block method (`--block` .. `--quiet-cores`), with a script's own defaults."""
    p.add_argument("--block", type=int, default=block, help=f"steps per block (default {block})")
    p.add_argument("--repeats", type=int, default=repeats,
                   help=f"at least this many blocks per {unit} (default {repeats})")
    p.add_argument("--max-repeats", type=int, default=max_repeats,
                   help=f"at most this many blocks per {unit} (default {max_repeats})")
    p.add_argument("--min-quiet", type=int, default=min_quiet,
                   help=f"go on (up to --max-repeats / --time-budget) until every {unit} has this many quiet blocks")
    p.add_argument("--time-budget", type=float, default=time_budget,
                   help=f"stop adding rounds after this many seconds of measuring (default {time_budget:g})")
    p.add_argument("--warmup", type=int, default=warmup, help=f"discarded steps per {unit} first (default {warmup})")
    p.add_argument("--block-warmup", type=int, default=1, help="discarded steps at the start of each block (default 1)")
    p.add_argument("--quiet-cores", type=float, default=0.1,
                   help="a block is 'quiet' when other processes used at most this many cores during it")


def json_cli(doc: str, add_args: Callable[[argparse.ArgumentParser], None],
             run: Callable[[argparse.Namespace], Dict[str, Any]], link: bool = False) -> None:
    """A benchmark's main(): parse, run, write the result to --json, print it. `link` adds --link
    (text describing the link, default $MPO_BENCH_LINK)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p)
    p.add_argument("--json", help="write the result here")
    if link:
        p.add_argument("--link", default=os.environ.get("MPO_BENCH_LINK", "loopback, not rate-limited"),
                       help="text describing the link, recorded in the result")
    args = p.parse_args()
    text = json.dumps(run(args), indent=2)
    if args.json:
        Path(args.json).write_text(text)
    print(text)


# ---- the plain-PyTorch peers' training step ------------------------------------------------------
def plain_microbatches(model, micro, autocast=None, device=None) -> torch.Tensor:
    """Forward and backward of every microbatch [B, S+1] of a single-process GPT (loss scaled by
    1 / microbatches, gradients accumulating); returns the detached sum of the scaled losses.
    `autocast`: the forward's context (mpoverlap.precision.autocast_context; none = fp32);
    `device`: where the microbatches go (none = where they are)."""
    loss_sum = None
    for mb in micro:
        if device is not None:
            mb = mb.to(device, non_blocking=True)
        with autocast if autocast is not None else contextlib.nullcontext():
            logits = model(mb[:, :-1])
        loss = model.loss(logits.float(), mb[:, 1:]) / len(micro)
        loss.backward()
        loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
    return loss_sum if loss_sum is not None else torch.zeros(())


def step_with_lr(optimizer, lr: float) -> None:
    """Set `lr` on every parameter group, then step."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()


# ---- whole mpoverlap-train runs (bench.scaling, bench.memory, bench.timelines) -------------------
# No progress bar, a metrics row per step, no checkpoints, a small slice of the stdlib corpus.
TRAIN_BASE = ["train.progress=false", "train.log_interval=1", "checkpoint.interval=0", "checkpoint.resume=none",
              "data.max_bytes=2000000"]


def netns_command(rate: str) -> List[str]:
    """The command prefix that runs a command inside bench/netns.sh, its loopback capped at `rate`
    (without probing whether the namespace can be made: netns_prefix probes)."""
    return ["env", f"RATE={rate}", "bash", str(NETNS)]


def netns_prefix(rate: str, no_netns: bool) -> Tuple[List[str], str]:
    """(command prefix, link description) for commands run inside bench/netns.sh at `rate`.

    Probes the namespace once. When it cannot be made (or with `no_netns`) the prefix is empty,
    the description says the commands run on the bare loopback, and a NOTE goes to stderr."""
    prefix = netns_command(rate)
    if no_netns:
        note = "--no-netns: ran on the bare loopback"
    else:
        proc = subprocess.run(prefix + ["sh", "-c", 'printf %s "$MPO_BENCH_LINK"'], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True)
        if proc.returncode == 0:
            return prefix, proc.stdout.strip()
        if proc.returncode != NETNS_UNAVAILABLE:
            raise SystemExit(f"bash bench/netns.sh failed with exit status {proc.returncode}")
        note = "bench/netns.sh could not create the rate-limited namespace (see its message above): ran on the bare loopback"
    print(f"NOTE: {note}. Communication is then nearly free on the wire and costs CPU instead.",
          file=sys.stderr, flush=True)
    return [], f"loopback, NOT rate-limited ({note})"


def console_script(name: str, module: str) -> List[str]:
    """The venv's console script `name` beside this Python, else `python -m module`."""
    script = Path(sys.executable).parent / name
    return [str(script)] if script.exists() else [sys.executable, "-m", module]


def run_train(overrides: Sequence[str], run_dir: Path, prefix: Sequence[str] = ()) -> List[Dict[str, Any]]:
    """Runs `mpoverlap-train` with TRAIN_BASE + `overrides` in a fresh `run_dir` (deleted first:
    metrics.jsonl is appended to), one torch thread per rank, under `prefix` (netns_prefix's).
    Returns metrics.jsonl's training rows (not the validation rows). Its output is shown only
    when it fails, and then the benchmark stops naming the command."""
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = list(prefix) + console_script("mpoverlap-train", "mpoverlap.train") + TRAIN_BASE + list(overrides) \
        + [f"run.dir={run_dir}"]
    print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("RANK", None)  # a RANK would make mpoverlap-train act as one torchrun rank
    proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-6000:])
        raise SystemExit(f"{' '.join(cmd)} failed with exit status {proc.returncode}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if "step_time_s" in r]
