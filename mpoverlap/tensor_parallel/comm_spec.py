"""TPComm: everything a tensor-parallel layer needs to communicate, handed in explicitly.

A layer never reads global state: it is given its tp group, its rank in it, the group's
size, the group's global ranks (point-to-point peers on gloo are global ranks), the
sequence-parallel flag, the TP overlap switch (`overlap.tp`) and the ledger its handles
report to.

    sequence_parallel   activations outside TP regions are [B, S/tp, H] (sequence on dim 1)
    overlap             False: every TP collective is waited at once.
                        True: backward collectives run under the next GEMM, and with SP
                        (tp >= 2) the SP all-gather / reduce-scatter become collective
                        matmul rings of p2p steps (see collective_matmul.py).
    trace               debug: a list the ring steps append (label, step, event, time) to
                        (events: issue, wait, gemm_start, gemm_end; picotron's VERBOSE idea).
    wgrad               the model's WeightGradDeferral (mpoverlap/wgrad) under a zero-bubble
                        pipeline schedule, else None: inside its deferring region the
                        backward queues the weight-gradient GEMM for the schedule's W action.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

import torch.distributed as dist


@dataclass
class TPComm:
    group: Optional[Any] = None
    rank: int = 0
    size: int = 1
    ranks: Optional[Sequence[int]] = None
    sequence_parallel: bool = False
    overlap: bool = False
    ledger: Optional[Any] = None
    trace: Optional[List[tuple]] = None
    wgrad: Optional[Any] = None

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tp_rank={self.rank} must lie in [0, tp_size={self.size})")
        if self.size > 1 and self.group is None:
            raise ValueError(f"tp_size={self.size} needs a tp_group (None means a group of one)")
        if self.group is not None:
            if dist.get_world_size(self.group) != self.size or dist.get_rank(self.group) != self.rank:
                raise ValueError(
                    f"tp_group has size {dist.get_world_size(self.group)} and this rank is "
                    f"{dist.get_rank(self.group)} in it, but tp_size={self.size}, tp_rank={self.rank}")
            if self.ranks is not None and list(self.ranks) != dist.get_process_group_ranks(self.group):
                raise ValueError(f"tp_ranks={list(self.ranks)} are not the tp_group's global ranks "
                                 f"{dist.get_process_group_ranks(self.group)} in group order")
        if self.ranks is not None:
            self.ranks = tuple(int(r) for r in self.ranks)
            if len(self.ranks) != self.size:
                raise ValueError(f"tp_ranks={list(self.ranks)} must list tp_size={self.size} ranks")

    def defer_wgrad(self, param, compute) -> bool:
        """Queue `compute` (param's weight gradient) for the W action if a deferring region
        is active; False: the caller computes it now."""
        return self.wgrad is not None and self.wgrad.defer(param, compute)

    @property
    def use_ring(self) -> bool:
        """Collective matmul (p2p ring) instead of SP all-gather / reduce-scatter."""
        return self.overlap and self.sequence_parallel and self.size > 1

    @property
    def next_peer(self) -> int:
        return self._peers()[(self.rank + 1) % self.size]

    @property
    def prev_peer(self) -> int:
        return self._peers()[(self.rank - 1) % self.size]

    def _peers(self) -> Sequence[int]:
        if self.ranks is None:
            raise ValueError("collective matmul (overlap=True with sequence_parallel) needs "
                             "tp_ranks, the tp group's global ranks: pass state.ranks('tp')")
        return self.ranks

    def mark(self, label: str, step: int, event: str) -> None:
        if self.trace is not None:
            self.trace.append((label, step, event, time.perf_counter()))


def make_comm(tp_group=None, tp_rank: int = 0, tp_size: int = 1, tp_ranks=None,
              sequence_parallel: bool = False, overlap: bool = False, ledger=None,
              trace=None) -> TPComm:
    return TPComm(group=tp_group, rank=tp_rank, size=tp_size, ranks=tp_ranks,
                  sequence_parallel=sequence_parallel, overlap=overlap, ledger=ledger, trace=trace)


def tp_kwargs(state, *, sequence_parallel: bool, overlap: bool, ledger=None) -> dict:
    """The layer keyword arguments for this rank's tp group of a ParallelState:
    `ColumnParallelLinear(..., **tp_kwargs(state, sequence_parallel=sp, overlap=ov, ledger=l))`."""
    return dict(tp_group=state.group("tp"), tp_rank=state.coords.tp, tp_size=state.size("tp"),
                tp_ranks=list(state.ranks("tp")), sequence_parallel=sequence_parallel,
                overlap=overlap, ledger=ledger)
