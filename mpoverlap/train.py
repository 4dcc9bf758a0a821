"""`mpoverlap-train [overrides]` and `torchrun ... -m mpoverlap.train [overrides]`.

Outside torchrun (no RANK in the environment) it validates, then launches its own workers with
torch's elastic launcher (world = tp x pp x cp x dp); under torchrun each rank validates and
joins. Exit codes: 0 success, 2 invalid configuration (reported before any worker or process
group exists), 1 a failed run (with the failing rank and its reason).
"""
from __future__ import annotations

import logging
import os
import socket
import sys
import time
import traceback
import uuid
from pathlib import Path
from typing import Any, List, Optional

from mpoverlap.config import ConfigError, compose, world_size_from_env
from mpoverlap.multirun import expand_sweeps, job_dir, split_multirun
from mpoverlap.overlap.cuda_env import ENV_MAX_CONNECTIONS, apply_max_connections, device_choice
from mpoverlap.overlap.layout import build_layout
from mpoverlap.overlap.plan import render_problems
from mpoverlap.overlap.rules import validate

EXIT_INVALID = 2
EXIT_FAILED = 1
# How often the self-launcher's elastic agent looks at its workers.
_MONITOR_S = 0.5

# Errors a user can act on: printed as one paragraph, no traceback.
_USER_ERRORS = ("DataError", "CheckpointError", "ConfigError", "NonFiniteError", "PeerLostError")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _compose_and_validate(overrides: List[str], world: Optional[int]):
    """(cfg, exit_code): exit_code None when the config can run."""
    try:
        cfg = compose(overrides)
    except ConfigError as err:
        print(f"mpoverlap: invalid override or key: {err}", file=sys.stderr)
        return None, EXIT_INVALID
    problems = validate(cfg, world)
    if problems:
        print(render_problems(problems), file=sys.stderr)
        return None, EXIT_INVALID
    return cfg, None


def _record(fn):
    """torch elastic's @record: a worker's exception reaches the launcher with its rank."""
    from torch.distributed.elastic.multiprocessing.errors import record

    return record(fn)


@_record
def worker_entry(overrides: List[str]) -> Any:
    """Runs inside each worker (elastic launcher or torchrun). Module-level so spawn can pickle it."""
    if "TORCHELASTIC_RUN_ID" in os.environ:  # started by an elastic agent: end with it
        from mpoverlap.training.fork_server import restore_signals
        from mpoverlap.training.node_failure import die_with_parent

        restore_signals()  # forked from the self-launcher's fork server: its ignored signals back to default
        die_with_parent()
    world = world_size_from_env()
    cfg, code = _compose_and_validate(overrides, world)
    if code is not None:
        raise SystemExit(code)
    if device_choice(cfg.train.device, world)[0] == "cuda":
        _worker_max_connections(cfg, world)
    from mpoverlap.training.loop import run_worker

    rank = os.environ.get("RANK", "?")
    try:
        return run_worker(cfg)
    except Exception as err:
        if type(err).__name__ in _USER_ERRORS:
            # The user can act on it: one paragraph, no traceback, a non-zero exit.
            print(f"mpoverlap: rank {rank}: {err}", file=sys.stderr, flush=True)
            if type(err).__name__ == "PeerLostError":
                # Not the cause: the rank that stopped first is. Its agent names the first worker
                # exit it sees, so this one waits two of its polls; a worker forked from the fork
                # server exits without an interpreter teardown and would otherwise be seen in the
                # same poll as the dead peer, and named in its place.
                time.sleep(2 * _MONITOR_S)
            raise SystemExit(EXIT_FAILED) from None
        print(f"mpoverlap: rank {rank} failed: {type(err).__name__}: {err}\n{traceback.format_exc()}",
              file=sys.stderr, flush=True)
        raise


def _worker_max_connections(cfg: Any, world: Optional[int]) -> None:
    """Under torchrun nobody set CUDA_DEVICE_MAX_CONNECTIONS for us (the self-launcher's workers
    inherit it): set it here, before this process creates its CUDA context."""
    import torch

    from mpoverlap.overlap.config import CommOverlapConfig

    overlap = CommOverlapConfig.from_config(cfg, world)
    if not (overlap.tp.enabled or overlap.cp.enabled) or ENV_MAX_CONNECTIONS in os.environ:
        return
    if torch.cuda.is_initialized():  # too late to take effect (an embedding program started CUDA)
        print(f"mpoverlap: warning: CUDA started before {ENV_MAX_CONNECTIONS}=1 could be set; TP/CP overlap "
              f"may not overlap: export {ENV_MAX_CONNECTIONS}=1 before the run", file=sys.stderr, flush=True)
        return
    apply_max_connections(overlap)


def _launch(cfg: Any, overrides: List[str]) -> int:
    """Start world-size workers on this machine with torch's elastic launcher."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from mpoverlap.training.preemption import AGENT_SIGNALS, SigtermForwarder

    lo = build_layout(cfg)
    world = lo.world
    # Every worker must agree on the run directory: resolve it once here.
    run_dir = str(Path(cfg.run.dir).resolve())
    worker_overrides = [o for o in overrides if not o.startswith("run.dir=")] + [f"run.dir={run_dir}",
                                                                               f"parallel.dp={lo.dp}"]
    # auto with fewer GPUs than ranks runs on CPU: the rank-0 worker prints why (setup.py).
    device = device_choice(cfg.train.device, world)[0]
    if device == "cuda":
        # TP/CP overlap needs CUDA_DEVICE_MAX_CONNECTIONS=1 before CUDA starts in the workers
        # (they inherit it); only then, and never over the user's own value (a value other
        # than 1 turned an `auto` mode off, or was refused for `true`, by the rule engine).
        from mpoverlap.overlap.config import CommOverlapConfig

        apply_max_connections(CommOverlapConfig.from_config(cfg, world))
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world)))
    # CPU workers fork from a server that imported torch and the trainer once (training/fork_server.py:
    # ~6 s of CPU less per rank). CUDA workers stay spawned, fresh interpreters, until a GPU run has
    # checked that nothing the server imports initialises the CUDA driver before the fork.
    if device == "cpu":
        from mpoverlap.training import fork_server

        try:
            start_method = fork_server.start()
        except fork_server.ForkServerError as err:  # before any worker exists
            print(f"mpoverlap: {err}", file=sys.stderr)
            return EXIT_FAILED
    else:
        start_method = "spawn"
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=world, run_id=f"mpoverlap-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{_free_port()}", rdzv_configs={"timeout": 120},
        max_restarts=0, monitor_interval=_MONITOR_S, start_method=start_method,
        # SIGTERM is ours (SigtermForwarder): the agent keeps collecting the workers' results.
        signals_to_handle=AGENT_SIGNALS,
    )
    # The workers print their own errors (one paragraph, or a traceback for a bug); torch
    # elastic's agent would repeat each as a multi-screen log in the launcher.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        with SigtermForwarder():
            results = elastic_launch(config, worker_entry)(worker_overrides)
    except SignalException as sig:
        # The agent's own shutdown (SIGINT, a second SIGTERM): its workers got the signal too.
        print(f"mpoverlap: stopped by {sig.sigval.name}; the workers saved a checkpoint at their next step "
              "boundary if they could (see above); rerun the same command to resume", file=sys.stderr)
        return 0
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        if failure.exitcode == EXIT_INVALID:
            return EXIT_INVALID
        print(f"mpoverlap: run failed: rank {rank} exited with code {failure.exitcode}"
              f"{_failure_reason(failure)}; see its message above", file=sys.stderr)
        return EXIT_FAILED
    if results is None:
        return EXIT_FAILED
    if any(isinstance(r, dict) and r.get("preempted") for r in results.values()):
        print("mpoverlap: stopped by SIGTERM; the workers saved a checkpoint (see above); rerun the same "
              "command to resume", file=sys.stderr)
    return 0


def _failure_reason(failure: Any) -> str:
    message = failure.message
    if isinstance(message, dict):  # the error file torch elastic's @record wrote
        message = message.get("message", "")
        if isinstance(message, dict):  # nested form {"message": {"message": ...}}
            message = message.get("message", "")
    message = str(message or "").strip().splitlines()
    if not message or message[0] == "N/A" or message[0].startswith("To enable traceback"):
        return ""
    return f" ({message[0]})"


def main(argv: Optional[List[str]] = None) -> int:
    overrides = list(sys.argv[1:] if argv is None else argv)
    if overrides and overrides[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    if "RANK" in os.environ:  # under torchrun: this process is one rank
        try:
            worker_entry(overrides)
        except SystemExit as exit_:
            return int(exit_.code or 0)
        except Exception:
            return EXIT_FAILED
        return 0
    multirun, overrides = split_multirun(overrides)
    if multirun:
        return _multirun(overrides)
    cfg, code = _compose_and_validate(overrides, None)
    if code is not None:
        return code
    code = _preflight_data(cfg)
    if code is not None:
        return code
    return _launch(cfg, overrides)


def _multirun(overrides: List[str]) -> int:
    try:
        jobs = expand_sweeps(overrides)
    except Exception as err:  # Hydra's parser names the malformed override
        print(f"mpoverlap: invalid override: {err}", file=sys.stderr)
        return EXIT_INVALID
    base_cfg, code = _compose_and_validate([o for o in jobs[0]], None)
    if code is not None:
        return code
    base = str(Path(base_cfg.run.dir).resolve())
    swept = [i for i, o in enumerate(jobs[0]) if len({job[i] for job in jobs}) > 1]
    planned = []
    for index, job in enumerate(jobs):
        label = [job[i] for i in swept]
        job = [o for o in job if not o.startswith("run.dir=")]
        job.append(f"run.dir={job_dir(base, index, label)}")
        cfg, code = _compose_and_validate(job, None)
        if code is not None:
            print(f"mpoverlap: multirun job {index} ({' '.join(job)}) cannot run; no job was started",
                  file=sys.stderr)
            return code
        planned.append((cfg, job))
    print(f"mpoverlap: multirun of {len(planned)} jobs under {base}", flush=True)
    worst = 0
    for index, (cfg, job) in enumerate(planned):
        print(f"mpoverlap: job {index}: {' '.join(job)}", flush=True)
        code = _preflight_data(cfg) or _launch(cfg, job)
        worst = worst or code
    return worst


def _preflight_data(cfg: Any) -> Optional[int]:
    """Open the dataset once before any worker starts: a missing or corrupt file (or a
    vocabulary larger than model.vocab_size, or a missing optional package) is reported here,
    as a configuration problem, instead of by every rank."""
    from mpoverlap.training.data import DataError, build_datasets
    from mpoverlap.training.tensorboard import tensorboard_missing

    if cfg.train.tensorboard and tensorboard_missing():
        print(f"mpoverlap: the configuration cannot run: {tensorboard_missing()}", file=sys.stderr)
        return EXIT_INVALID
    try:
        build_datasets(cfg.data, cfg.model.seq_length, cfg.model.vocab_size)
    except DataError as err:
        print(f"mpoverlap: the configuration cannot run: {err}", file=sys.stderr)
        return EXIT_INVALID
    return None


if __name__ == "__main__":
    sys.exit(main())
