"""SIGTERM handling: save at the next agreed step boundary, then exit cleanly."""
from __future__ import annotations

import signal

import torch
import torch.distributed as dist

# Written into run.dir by rank 0 after a SIGTERM stop saved its checkpoint (the step, one
# line), removed when a run starts. torchrun exits non-zero when it was signalled even though
# every worker saved and exited 0: launch/slurm.sbatch reads this file to exit 0 instead.
PREEMPTED_MARKER = "PREEMPTED"


class PreemptionFlag:
    """SIGTERM (SLURM preemption, the launcher shutting down) sets the flag; the loop agrees on
    it across ranks at the next step boundary, saves a checkpoint and exits cleanly."""

    def __init__(self) -> None:
        self.raised = False
        self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame) -> None:
        self.raised = True

    def agreed(self, device: torch.device) -> bool:
        """True on every rank as soon as any rank was signalled (a tiny MAX all-reduce)."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return self.raised
        flag = torch.tensor([1.0 if self.raised else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def restore(self) -> None:
        """Back to the previous handler, unless the run stopped for a SIGTERM: then the process
        is on its way out and a second SIGTERM (SLURM signals every process of the step, and
        torchrun's agent forwards its own to the workers) must not kill it with the default
        action, which its agent would report as a failed worker."""
        if not self.raised:
            signal.signal(signal.SIGTERM, self._previous)


def leave_once_result_is_sent(grace_s: float = 1.0) -> None:
    """After a SIGTERM stop under torch elastic's agent: end this worker once its result is sent.

    The agent that got the SIGTERM forwards it to its workers, then waits for them to exit (30 s,
    then SIGKILL); but its worker wrapper (elastic's `_wrap`), after putting the return value,
    waits for the agent to say it read every rank's, which a shutting-down agent never says: each
    preemption stop took 30 s. A daemon thread ends the process (exit code 0, output flushed)
    once the main thread is in that wait (the value is in the pipe) and `grace_s` more passed; an
    agent that is still running releases the wait within its monitor interval, and a worker that
    leaves after sending its value is what elastic expects anyway. If the wrapper is not found
    (another torch), nothing changes."""
    import os
    import sys
    import threading
    import time

    main = threading.main_thread()

    def waiting_for_agent() -> bool:
        frame = sys._current_frames().get(main.ident)
        while frame is not None and frame.f_back is not None:
            if frame.f_code.co_name == "wait" and frame.f_back.f_code.co_name == "_wrap":
                return True
            frame = frame.f_back
        return False

    def leave() -> None:
        while not waiting_for_agent():
            time.sleep(0.1)
        time.sleep(grace_s)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(0)

    threading.Thread(target=leave, name="mpoverlap-preempted-exit", daemon=True).start()
