"""The self-launcher's workers start from a fork server that imported torch and the trainer once.

A spawned worker is a fresh interpreter that imports torch, torch._dynamo (torch.optim's first
optimizer pulls it in), Hydra and mpoverlap before its first step: about 6 s of CPU per rank,
measured on a 2.5 GHz Xeon core (`python -X importtime`). The fork server (Python's
multiprocessing "forkserver") is one fresh, single-threaded process that imports `PRELOAD` once;
each worker is forked from it and starts with those modules loaded. It is safe where forking the
launcher is not: the server never touched CUDA, a process group or a thread pool.

Signals. The server is in the launcher's process group, and the workers are its children, each
with the parent-death signal set (node_failure.die_with_parent): if the server died of a
SIGTERM sent to the whole group (SLURM signals every process of a step), the kernel would kill
every worker in the middle of the checkpoint that SIGTERM asks for. So the server ignores
SIGTERM, SIGHUP and SIGQUIT (SIGINT it ignores by itself) and ends only when the launcher goes
(multiprocessing closes its pipe; then the workers get their parent-death signal, as they would
with the launcher's own death). A worker inherits the ignored dispositions: `restore_signals()`,
the worker's first call, puts the defaults back.
"""
from __future__ import annotations

import os
import signal

# What a worker needs before its first step (import times on the 2.5 GHz Xeon: torch 2.5 s,
# torch._dynamo 2.1 s, the trainer and its config 0.3 s, the sharded checkpoint planners 0.1 s).
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "hydra.compose", "hydra.initialize",
           "mpoverlap.config", "mpoverlap.training.loop", "mpoverlap.training.setup", "mpoverlap.checkpoint",
           "mpoverlap.overlap.rules", __name__]

# Set in the server's environment only (start()), read by this module's import there.
_ENV = "MPOVERLAP_FORK_SERVER"
_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)

if os.environ.get(_ENV) == "1":  # imported by the fork server itself (PRELOAD's last module)
    for _sig in _SIGNALS:
        signal.signal(_sig, signal.SIG_IGN)


def start() -> str:
    """Start the fork server (once per launcher process) and return the start method to pass
    to torch elastic: "forkserver"."""
    import multiprocessing
    from multiprocessing import forkserver

    multiprocessing.set_forkserver_preload(PRELOAD)
    os.environ[_ENV] = "1"
    try:
        forkserver.ensure_running()
    finally:
        del os.environ[_ENV]
    return "forkserver"


def restore_signals() -> None:
    """In a worker forked from the server: the default SIGTERM, SIGHUP and SIGQUIT again."""
    if os.environ.pop(_ENV, None) is None:
        return
    for sig in _SIGNALS:
        if signal.getsignal(sig) is signal.SIG_IGN:
            signal.signal(sig, signal.SIG_DFL)
