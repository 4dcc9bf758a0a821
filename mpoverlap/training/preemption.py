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
