"""The communication half of the pipeline: post one batch of a schedule's p2p ops.

A batch (ops of one stage with one peer, at most one receive) becomes ONE
`send_recv` call of mode "pp" with global peer ranks, hence one CommHandle. Stages are
numbered 0..pp-1; `pp_ranks[stage]` is the global rank of that stage in this rank's
pipeline (`ParallelState.ranks("pp")`).

With MPOVERLAP_VERBOSE_P2P=1 every op is printed to stderr, one line each:
    [pp-p2p] step 3 call 17 rank 1 send to rank 3 (stage 1) act vchunk 0 mb 5
(step = executor run, call = send_recv call within the run) - a hang shows the last line
each rank reached, and the two ends of a link can be compared line by line.
"""
from __future__ import annotations

import os
import sys
from typing import List, Sequence

import torch

from mpoverlap.comm.collectives import send_recv
from mpoverlap.comm.handle import CommHandle
from mpoverlap.pipeline.actions import RECV, SEND, Batch, P2POp, vchunk_of

VERBOSE_ENV = "MPOVERLAP_VERBOSE_P2P"


def verbose_from_env() -> bool:
    return os.environ.get(VERBOSE_ENV, "0") == "1"


class StageP2P:
    """Posts batches for one pipeline stage.

    stage: this rank's stage; pp_ranks: global rank of every stage (stage order);
    group: the pp process group (None when pp == 1); ledger: CommLedger or None.
    """

    def __init__(self, stage: int, pp_ranks: Sequence[int], group, ledger, verbose: bool) -> None:
        self.stage = int(stage)
        self.pp_ranks = [int(r) for r in pp_ranks]
        if not 0 <= self.stage < len(self.pp_ranks):
            raise ValueError(f"stage {stage} outside pp_ranks={self.pp_ranks}")
        if len(self.pp_ranks) > 1 and group is None:
            raise ValueError(f"pp={len(self.pp_ranks)} needs the pp process group, got None")
        self.group = group
        self.ledger = ledger
        self.verbose = bool(verbose)
        self.rank = self.pp_ranks[self.stage]
        self.calls = 0

    def describe(self, op: P2POp, step: int) -> str:
        pp = len(self.pp_ranks)
        msg = op.message
        local_chunk = msg.src_chunk if op.op == SEND else msg.dst_chunk
        direction = "to" if op.op == SEND else "from"
        return (f"[pp-p2p] step {step} call {self.calls} rank {self.rank} {op.op} {direction} rank "
                f"{self.pp_ranks[op.peer]} (stage {op.peer}) {msg.kind} vchunk "
                f"{vchunk_of(local_chunk, pp)} mb {msg.microbatch}")

    def post(self, batch: Batch, tensors: List[torch.Tensor], step: int) -> CommHandle:
        """Issue `batch` (tensors[i] is the data to send / the buffer to fill for batch[i]);
        returns at once with the handle."""
        if len(batch) != len(tensors):
            raise ValueError(f"{len(batch)} ops but {len(tensors)} tensors")
        self.calls += 1
        if self.verbose:
            for op in batch:
                print(self.describe(op, step), file=sys.stderr, flush=True)
        sends = [(t, self.pp_ranks[op.peer]) for op, t in zip(batch, tensors) if op.op == SEND]
        recvs = [(t, self.pp_ranks[op.peer]) for op, t in zip(batch, tensors) if op.op == RECV]
        return send_recv(sends, recvs, self.group, mode="pp", ledger=self.ledger)

