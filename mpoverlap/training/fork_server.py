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

The server ignores them when it imports this module, the last of `PRELOAD`; and multiprocessing's
server skips a preloaded module whose import fails without a word. So `start()` does not take
that on trust: it forks one probe from the server, which reports the dispositions it inherited,
and raises ForkServerError, naming the modules the server could not import, unless all three
are ignored.
"""
from __future__ import annotations

import os
import signal
import sys
from typing import Any, Dict, List

# What a worker needs before its first step (import times on the 2.5 GHz Xeon: torch 2.5 s,
# torch._dynamo 2.1 s, the trainer and its config 0.3 s, the sharded checkpoint planners 0.1 s).
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "hydra.compose", "hydra.initialize",
           "mpoverlap.config", "mpoverlap.training.loop", "mpoverlap.training.setup", "mpoverlap.checkpoint",
           "mpoverlap.overlap.rules", __name__]

# Set in the server's environment only (start()) to the launcher's pid: the server's parent. A
# process forked from the server has the server for its parent, so importing this module there
# (the probe's, when the server could not) ignores nothing.
_ENV = "MPOVERLAP_FORK_SERVER"
_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
# How long start() waits for the probe: the server first imports PRELOAD (~6 s of CPU on a
# 2.5 GHz core, several times that on a loaded machine).
_PROBE_S = 180.0

_in_server = os.environ.get(_ENV) == str(os.getppid())  # imported by the fork server itself
if _in_server:
    for _sig in _SIGNALS:
        signal.signal(_sig, signal.SIG_IGN)


class ForkServerError(RuntimeError):
    """The fork server would not outlive a SIGTERM to the process group."""


def start() -> str:
    """Start the fork server (once per launcher process), confirm that it ignores SIGTERM,
    SIGHUP and SIGQUIT (ForkServerError where it does not), and return the start method to
    pass to torch elastic: "forkserver"."""
    import multiprocessing
    from multiprocessing import forkserver

    # A server this process started before (another library's, a test harness's) is reused by
    # ensure_running() as it is, without this preload: said in the error below if it fails.
    earlier = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)
    multiprocessing.set_forkserver_preload(PRELOAD)
    os.environ[_ENV] = str(os.getpid())
    try:
        forkserver.ensure_running()
    finally:
        del os.environ[_ENV]
    report = _probe(multiprocessing.get_context("forkserver"))
    kept = [name for name, ignored in report["ignored"].items() if not ignored]
    if kept:
        missing = ", ".join(report["missing"]) or "none"
        if earlier is not None:
            raise ForkServerError(
                f"the self-launcher's fork server does not ignore {', '.join(kept)}: this process already ran a "
                f"multiprocessing fork server (pid {earlier}) started before mpoverlap's launcher, without its preload, "
                "and multiprocessing reuses it. A signal to the whole process group would end it and, by their "
                "parent-death signal, every worker in the middle of the checkpoint a SIGTERM asks for. Call "
                "mpoverlap-train from a process that has not started a fork server, or launch the workers with "
                "torchrun (launch/local.sh)")
        raise ForkServerError(
            f"the self-launcher's fork server does not ignore {', '.join(kept)}: a signal to the whole process group "
            "(SLURM signals every process of a job step) would end it and, by their parent-death signal, every "
            f"worker in the middle of the checkpoint a SIGTERM asks for. Modules of its preload it could not import: "
            f"{missing}. It ignores them when it imports {__name__}; check that `{sys.executable} -c "
            f"'import {__name__}'` works, or launch the workers with torchrun (launch/local.sh), which does not "
            "fork them from this server")
    return "forkserver"


def _probe(ctx: Any) -> Dict[str, Any]:
    """Fork one process from the server and return what `_report` sent back."""
    reader, writer = ctx.Pipe(duplex=False)
    probe = ctx.Process(target=_report, args=(writer, list(PRELOAD)), name="mpoverlap-fork-server-probe",
                        daemon=True)
    probe.start()
    writer.close()
    try:
        unconfirmed = ("the self-launcher's fork server could not confirm that it ignores SIGTERM, SIGHUP and "
                       "SIGQUIT, which its workers' checkpoint on a SIGTERM to the process group needs")
        if not reader.poll(_PROBE_S):
            raise ForkServerError(f"{unconfirmed}: it forked no probe within {_PROBE_S:g}s (its preload imports "
                                  f"{', '.join(PRELOAD)} first)")
        try:
            return reader.recv()
        except EOFError:
            probe.join(5.0)
            raise ForkServerError(
                f"{unconfirmed}: its probe exited with code {probe.exitcode} before it reported (its error is above; "
                f"the probe imports {__name__}, as the server's preload does). Check that `{sys.executable} -c "
                f"'import {__name__}'` works, or launch the workers with torchrun (launch/local.sh)") from None
    finally:
        reader.close()
        probe.join(5.0)


def _report(conn: Any, preload: List[str]) -> None:
    """In the probe, forked from the server: the dispositions it inherited, and the modules of
    the preload that the server did not import."""
    missing = [name for name in preload if name not in sys.modules or (name == __name__ and not _in_server)]
    conn.send({"ignored": {sig.name: signal.getsignal(sig) is signal.SIG_IGN for sig in _SIGNALS},
               "missing": missing})
    conn.close()


def restore_signals() -> None:
    """In a worker forked from the server: the default SIGTERM, SIGHUP and SIGQUIT again."""
    if os.environ.pop(_ENV, None) is None:
        return
    for sig in _SIGNALS:
        if signal.getsignal(sig) is signal.SIG_IGN:
            signal.signal(sig, signal.SIG_DFL)
