"""The communication half of ring attention: one p2p exchange around the cp ring.

Every rank sends to the next rank of the ring and receives from the previous one, in one
batched `send_recv` (mode "cp") that returns a CommHandle. The order of exchanges is the same
program on every rank, so the k-th message from rank r to r+1 always meets the k-th receive
posted by r+1 (no deadlock, also for cp=2 where next == previous).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from mpoverlap.comm.collectives import send_recv
from mpoverlap.comm.handle import CommHandle


@dataclass(frozen=True)
class CPRing:
    """The non-tensor arguments of a context-parallel attention call.

    cp_group: ProcessGroup of the cp ranks (None when cp_size == 1).
    cp_ranks: global ranks of the group in ring order; cp_ranks[cp_rank] is this rank.
    overlap:  the `overlap.cp` switch: False waits every handle right after it is issued.
    ledger:   CommLedger the handles report to (or None).
    """

    cp_group: Optional[object]
    cp_ranks: tuple
    cp_rank: int
    cp_size: int
    overlap: bool
    ledger: Optional[object]

    @classmethod
    def make(cls, cp_group, cp_ranks: Sequence[int], cp_rank: int, cp_size: int, overlap: bool,
             ledger) -> "CPRing":
        cp_ranks = tuple(int(r) for r in cp_ranks)
        if len(cp_ranks) != cp_size:
            raise ValueError(f"cp_ranks={list(cp_ranks)} must list cp_size={cp_size} ranks")
        if not 0 <= cp_rank < cp_size:
            raise ValueError(f"cp_rank={cp_rank} must be in [0, cp_size={cp_size})")
        if cp_size > 1 and cp_group is None:
            raise ValueError(f"cp_size={cp_size} needs a cp_group")
        return cls(cp_group, cp_ranks, int(cp_rank), int(cp_size), bool(overlap), ledger)

    @property
    def next_peer(self) -> int:
        return self.cp_ranks[(self.cp_rank + 1) % self.cp_size]

    @property
    def prev_peer(self) -> int:
        return self.cp_ranks[(self.cp_rank - 1) % self.cp_size]

    def source_of_step(self, step: int) -> int:
        """cp rank whose K/V block this rank holds at ring step `step` (0 = its own)."""
        return (self.cp_rank - step) % self.cp_size

    def exchange(self, send_t: torch.Tensor, recv_t: torch.Tensor) -> CommHandle:
        """Issue: send_t -> next rank, recv_t <- previous rank. Returns at once. send_t must not
        be written and recv_t not read until the handle is waited."""
        return send_recv([(send_t, self.next_peer)], [(recv_t, self.prev_peer)], self.cp_group,
                         mode="cp", ledger=self.ledger)
