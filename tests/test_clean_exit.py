"""Clean exits: a worker frees its process groups, and joins their native
threads, before the interpreter exits.

The DataParallel gradient hooks are bound methods the parameters keep on their C++ side, a cycle
Python's collector cannot see: the Trainer and every process group it used (each with its gloo
threads `pt_gloo_runloop` and `gloo_tcp_loop`, and on rank 0 the store's `pt_tcpstore_uv`)
would outlive `destroy_process_group` until interpreter exit, where a rank can die of "terminate
called without an active exception". Trainer.close removes the hooks and shutdown_distributed
frees the groups.

- test_no_native_thread_survives_the_worker (default suite): the CLI's worker function
  `run_worker`, called back to back for several layouts in two ranks, leaves no gloo or store
  thread and no Python thread but the main one behind after each run.
- test_back_to_back_cli_and_bench_runs_exit_cleanly (marker `exits`, `make test-exits`, about
  2 minutes): self-launched `mpoverlap-train` runs and bench scenarios, back to back, each exits
  0 without "terminate called".
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dist_harness import _context, free_port  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TINY = ["model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=4", "model.ffn_hidden_size=64",
        "model.seq_length=16", "train.global_batch_size=4", "train.micro_batch_size=2", "train.steps=2",
        "train.progress=false", "train.eval_iters=1", "data.max_bytes=100000", "train.device=cpu"]
MOE = ["model=moe_tiny", "model.moe_ffn_hidden_size=16"]
# Two ranks each: the pools and groups these touch (ZeRO-3 gathers and reduce-scatters, whose gloo
# works the ledger waits on its thread pool; MoE all-to-alls; SP with the tp_edp group).
LAYOUTS = {
    "moe_ep2_zero3": [*MOE, "parallel.dp=2", "parallel.ep=2", "overlap.ep=true", "overlap.ep_chunks=4",
                      "train.dp_sharding=optim_grads_params"],
    "moe_tp2_sp": [*MOE, "parallel.tp=2", "parallel.sequence_parallel=true"],
}
COMM_THREADS = ("pt_gloo", "gloo_", "pt_tcpstore")


def _native_thread_names():
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            names.append(Path(f"/proc/self/task/{tid}/comm").read_text().strip())
        except OSError:  # ended meanwhile
            pass
    return names


def _run_workers(rank, ports, root, results):
    import threading

    from mpoverlap.config import compose
    from mpoverlap.training.loop import run_worker

    left = {}
    try:
        for (name, overrides), port in zip(LAYOUTS.items(), ports):
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                              LOCAL_RANK=str(rank))
            run_worker(compose([*TINY, *overrides, f"run.dir={root}/{name}"]))
            left[name] = ([n for n in _native_thread_names() if n.startswith(COMM_THREADS)],
                          [t.name for t in threading.enumerate() if t is not threading.main_thread()])
        results.put((rank, left))
    except BaseException as err:  # noqa: BLE001 - reported to the parent
        results.put((rank, repr(err)))


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads thread names from /proc")
def test_no_native_thread_survives_the_worker(tmp_path):
    ctx = _context()
    results = ctx.Queue()
    ports = [free_port() for _ in LAYOUTS]
    procs = [ctx.Process(target=_run_workers, args=(r, ports, str(tmp_path), results), daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(60)
    for rank, left in got.items():
        assert isinstance(left, dict), f"rank {rank}: {left}"
        assert left == {name: ([], []) for name in LAYOUTS}, f"rank {rank}: threads left after run_worker: {left}"
    assert [p.exitcode for p in procs] == [0, 0]


# ---- back to back, as users and bench.run start them (separate target: `make test-exits`) ------
TRAIN_RUNS = {
    "gpt_dp2": ["parallel.dp=2"],
    "moe_ep2": [*MOE, "parallel.dp=2", "parallel.ep=2", "overlap.ep=true", "overlap.ep_chunks=4"],
    "zero3_dp2": ["parallel.dp=2", "train.dp_sharding=optim_grads_params"],
}
SMALL_BENCH = ["--repeats", "1", "--max-repeats", "1", "--min-quiet", "0", "--block", "2", "--warmup", "0",
               "--time-budget", "1", "--layers", "1"]
BENCH_RUNS = {"ep": ["--scenario", "ep", "--seq", "64", "--hidden", "128"],
              "tp": ["--scenario", "tp", "--seq", "64", "--hidden", "128"]}


@pytest.mark.exits
def test_back_to_back_cli_and_bench_runs_exit_cleanly(tmp_path):
    venv_bin = Path(sys.executable).parent
    commands = {f"train_{n}": [str(venv_bin / "mpoverlap-train"), *TINY, *ov, f"run.dir={tmp_path}/{n}"]
                for n, ov in TRAIN_RUNS.items()}
    commands.update({f"bench_{n}": [sys.executable, "-m", "bench.modes", *SMALL_BENCH, *ov,
                                    "--json", str(tmp_path / f"bench_{n}.json")] for n, ov in BENCH_RUNS.items()})
    for name, cmd in commands.items():
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
        out = done.stdout + done.stderr
        assert done.returncode == 0, f"{name} exited {done.returncode}:\n{out[-3000:]}"
        assert "terminate called" not in out, f"{name}:\n{out[-3000:]}"
