"""SIGTERM handling around the workers: the self-launcher passes its own SIGTERM on to them
(SigtermForwarder); inside them every rank agrees on the step to stop after
(training/stop_agreement.py), saves and returns."""
from __future__ import annotations

import os
import signal

# Written into run.dir by rank 0 after a SIGTERM stop saved its checkpoint (the step, one
# line), removed when a run starts. torchrun exits non-zero when it was signalled even though
# every worker saved and exited 0: launch/slurm.sbatch reads this file to exit 0 instead.
PREEMPTED_MARKER = "PREEMPTED"


# The signals torch elastic's agent turns into its shutdown (LaunchConfig.signals_to_handle's
# default) less SIGTERM, which the self-launcher handles itself (SigtermForwarder).
AGENT_SIGNALS = "SIGINT,SIGHUP,SIGQUIT"


class SigtermForwarder:
    """The self-launcher's SIGTERM: passed on to its workers while torch elastic's agent keeps
    running, so that the workers' results (each saved a checkpoint and returned) are collected
    the ordinary way and the agent ends as after any finished run.

    Why not the agent's own handling: on SIGTERM the agent raises SignalException in its
    monitor loop and closes its worker processes (SIGTERM, up to 30 s for them to exit, then
    SIGKILL). A function worker that returned its value then waits, inside elastic's wrapper,
    for the agent to confirm it read every rank's value; a closing agent does not read, so
    every preemption stop would take those 30 s and end in SIGKILL. torchrun's workers are separate
    programs that simply exit, and do not wait.

    Use with LaunchConfig(signals_to_handle=AGENT_SIGNALS). A second SIGTERM, or one before any
    worker exists, raises the agent's SignalException after all: its shutdown (SIGTERM, grace,
    SIGKILL) takes over, as a scheduler escalating expects."""

    def __init__(self) -> None:
        self.forwarded = 0
        self._previous = None

    def __enter__(self) -> "SigtermForwarder":
        self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGTERM, self._previous)

    def _handle(self, signum, frame) -> None:
        import multiprocessing

        from torch.distributed.elastic.multiprocessing.api import SignalException

        # The agent's worker processes: the only multiprocessing children of the launcher.
        workers = multiprocessing.active_children()
        if self.forwarded or not workers:
            raise SignalException(f"Process {os.getpid()} got signal: {signal.Signals(signum)}",
                                  sigval=signal.Signals(signum))
        self.forwarded += 1
        for worker in workers:
            try:
                os.kill(worker.pid, signum)
            except ProcessLookupError:  # exited meanwhile
                pass
