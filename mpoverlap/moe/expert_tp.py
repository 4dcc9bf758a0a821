"""Expert tensor parallelism (parallel.etp = tp): the experts' FFN split over the tp group.

Each tp rank holds F/tp hidden units of every local expert (experts.py slices the full,
seed-drawn weights), so every rank of a tp group must run its experts on the SAME tokens and
the partial outputs are summed over the group. With T_r tokens routed on tp rank r:

  sequence parallel (each tp rank routed its own S/tp positions):
    gather:  x [T_r, H], ids [T_r, k], weights [T_r, k] -> [sum_r T_r, ...] (rank order),
             all-gathers whose backward reduce-scatters the partial gradients;
    reduce:  partial y [sum_r T_r, H] -> summed y [T_r, H] (reduce-scatter; backward all-gather).
  no sequence parallelism (every tp rank routed the same tokens):
    gather:  identity forward, all-reduce of the partial input/weight gradients in backward;
    reduce:  all-reduce of the partial outputs (backward identity).

The dispatch in between runs over the ep group of this tp rank (ep groups never mix tp ranks,
grid.py), so rank (t, e) computes slice t of the experts of ep rank e. The collectives are tp
group traffic (ledger mode "tp"), waited at once. The router's statistics are unaffected:
they were formed on the routing rank's own tokens before the gather.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from mpoverlap.tensor_parallel.comm_spec import TPComm
from mpoverlap.tensor_parallel.mappings import (CopyToTensorParallelRegion, GatherFromSequenceParallel,
                                               ReduceFromTensorParallelRegion,
                                               ReduceScatterToSequenceParallel, seq_all_gather_async)


@dataclass
class ExpertTP:
    comm: TPComm  # the tp group (etp = tp)

    @property
    def size(self) -> int:
        return self.comm.size

    @property
    def rank(self) -> int:
        return self.comm.rank

    def gather(self, x_TH: torch.Tensor, ids_Tk: torch.Tensor,
               weights_Tk: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's routed tokens -> the tp group's (see the module docstring)."""
        if not self.comm.sequence_parallel:
            return (CopyToTensorParallelRegion.apply(x_TH, self.comm), ids_Tk,
                    CopyToTensorParallelRegion.apply(weights_Tk, self.comm))
        x = GatherFromSequenceParallel.apply(x_TH.unsqueeze(0), self.comm, True)[0]
        w = GatherFromSequenceParallel.apply(weights_Tk.unsqueeze(0), self.comm, True)[0]
        ids = seq_all_gather_async(ids_Tk.unsqueeze(0), self.comm).wait()[0]
        return x, ids, w

    def reduce(self, y_partial_NH: torch.Tensor) -> torch.Tensor:
        """Partial expert outputs of the group's tokens -> this rank's summed outputs."""
        if not self.comm.sequence_parallel:
            return ReduceFromTensorParallelRegion.apply(y_partial_NH, self.comm)
        return ReduceScatterToSequenceParallel.apply(y_partial_NH.unsqueeze(0), self.comm)[0]


def expert_tp(state, *, etp: int, sequence_parallel: bool, ledger=None) -> Optional[ExpertTP]:
    """The expert-TP context of this rank (None when etp = 1). etp must be 1 or tp (rule
    `etp.value`); the group is the tp group."""
    if etp == 1:
        return None
    if etp != state.grid.tp:
        raise ValueError(f"etp={etp} must be 1 or tp={state.grid.tp} (rule etp.value)")
    from mpoverlap.tensor_parallel.comm_spec import make_comm

    return ExpertTP(make_comm(state.group("tp"), state.coords.tp, state.grid.tp, list(state.ranks("tp")),
                              sequence_parallel=sequence_parallel, overlap=False, ledger=ledger))
