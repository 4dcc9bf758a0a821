"""The ranks that hold parts of the same microbatch sequences, as the router sees them.

Under sequence parallelism each tensor-parallel rank routes S/tp positions of every sequence;
under context parallelism each context-parallel rank routes its 2 of 2*cp chunks; with both,
the tp x cp ranks of one replica together hold the microbatch. The router's load-balancing
and z losses are functions of the WHOLE microbatch, so their statistics are summed over these
ranks (Megatron-core's "sequence partition group") before the losses are formed.

Gradient scale. Dense gradients are averaged over dp x cp (the context-parallel ranks each
contribute the gradient of their local mean loss), and summed over tp under SP (the norms'
rule). A per-rank loss term whose terms SUM to the whole-microbatch loss therefore needs the
factor `grad_mean_size` = cp so that the cp average of the gradients is the gradient of the
whole loss; the tp sum needs no factor.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from mpoverlap.comm import all_reduce


@dataclass(frozen=True)
class SequenceShards:
    group: Any = None  # None: this rank holds whole sequences
    size: int = 1  # ranks in `group`
    grad_mean_size: int = 1  # of them, how many have their gradients averaged (cp)
    mode: str = "tp"  # the ledger mode the statistics' all-reduce is counted under
    ledger: Optional[Any] = None

    def sum(self, local: torch.Tensor) -> torch.Tensor:
        """Sum of `local` (detached, 1-D) over the group; a one-member group returns it."""
        if self.group is None:
            return local
        total = local.detach().clone()
        # Waited at once: the losses cannot be formed without the totals. A few floats per MoE
        # layer and microbatch, one collective.
        all_reduce(total, self.group, mode=self.mode, ledger=self.ledger).wait()
        return total


def sequence_shards(state, *, sequence_parallel: bool, ledger=None) -> SequenceShards:
    """The group of ranks sharing this rank's sequences under `state`'s layout."""
    tp = state.grid.tp if sequence_parallel else 1
    cp = state.grid.cp
    if tp * cp == 1:
        return SequenceShards()
    kind = "tp_cp" if tp > 1 and cp > 1 else ("tp" if tp > 1 else "cp")
    return SequenceShards(group=state.group(kind), size=tp * cp, grad_mean_size=cp,
                          mode="cp" if cp > 1 else "tp", ledger=ledger)
