"""SIGTERM handling: every rank agrees at each step boundary (StopAgreement), saves and returns;
the self-launcher passes its own SIGTERM on to its workers (SigtermForwarder)."""
from __future__ import annotations

import os
import signal
from typing import Any, Optional

import torch
import torch.distributed as dist

from mpoverlap.comm import all_reduce

# Written into run.dir by rank 0 after a SIGTERM stop saved its checkpoint (the step, one
# line), removed when a run starts. torchrun exits non-zero when it was signalled even though
# every worker saved and exited 0: launch/slurm.sbatch reads this file to exit 0 instead.
PREEMPTED_MARKER = "PREEMPTED"


class StopAgreement:
    """Every rank's stop flag, agreed at every step: SIGTERM (SLURM preemption, a launcher
    shutting down) on any rank stops every rank at the same step boundary, where the loop saves
    a checkpoint and returns.

    Each step issues a one-element MAX all-reduce of this rank's flag over the world at its
    start (`issue`) and waits it before the gradient norm (`flag_to_read`), so the collective
    runs under the step's forward and backward like any other handle; the ledger counts it
    under the mode `stop` (4 bytes per step). The flag's value is read in the same host read
    as the gradient norm (DataParallelAdamW.clip_grad_norm_with): no host sync of its own.
    A signal that lands during step k is in the flag of step k + 1 (or of k, if it came before
    k's issue): every rank stops at the end of k or k + 1. At world 1 nothing is issued."""

    MODE = "stop"

    def __init__(self, group: Optional[Any], device: torch.device, ledger: Any) -> None:
        self.raised = False
        self._group, self._ledger = group, ledger
        self._flag = torch.zeros((), device=device) if group is not None else None
        self._handle = None
        self._previous = None

    # -- the signal -------------------------------------------------------------------------
    def install(self) -> None:
        """SIGTERM sets the flag (Trainer.run: for the run's duration)."""
        self._previous = signal.signal(signal.SIGTERM, self._handle_signal)

    def _handle_signal(self, signum, frame) -> None:
        self.raised = True

    def restore(self) -> None:
        """Back to the previous handler, unless the run stopped for a SIGTERM: then the process
        is on its way out and a second SIGTERM (SLURM signals every process of the step, and
        torchrun's agent forwards its own to the workers) must not kill it with the default
        action, which its agent would report as a failed worker."""
        if self._previous is not None and not self.raised:
            signal.signal(signal.SIGTERM, self._previous)
        self._previous = None

    # -- the agreement ----------------------------------------------------------------------
    def issue(self) -> None:
        """At the start of a step: this rank's flag into the world's MAX all-reduce."""
        if self._flag is None:
            return
        self._flag.fill_(1.0 if self.raised else 0.0)  # a scalar argument: no host read
        self._handle = all_reduce(self._flag, self._group, mode=self.MODE, ledger=self._ledger,
                                  op=dist.ReduceOp.MAX)

    def flag_to_read(self) -> Optional[torch.Tensor]:
        """Before the gradient norm: the issued all-reduce waited (on CUDA: the stream ordered
        after it, no host wait), and the agreed flag to read with the norm; None at world 1."""
        if self._handle is None:
            return None
        self._handle.wait()
        self._handle = None
        return self._flag

    def agreed(self, value: Optional[float]) -> bool:
        """The step's decision from the value read with the norm (None: world 1, no
        collective; this rank's own flag is the world's)."""
        return bool(value) if value is not None else self.raised


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
    for the agent to confirm it read every rank's value; a closing agent no longer reads, so
    every preemption stop took those 30 s and ended in SIGKILL. torchrun's workers are separate
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
