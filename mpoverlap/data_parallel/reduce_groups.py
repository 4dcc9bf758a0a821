"""Where DataParallel reduces each gradient bucket: over the dense group or the expert group.

Dense parameters are reduced over `group_kind` (dp x cp by default). Expert weights
(parameters marked `expert_parallel`) sit in buckets of their own, reduced over the
expert-data-parallel group (`expert_group_kind`, ranks holding the same experts) instead.
Each expert's local gradient already sums the contributions of every expert-parallel peer's
tokens (the dispatch backward brought them), so the sum over edp covers all dp x cp ranks and
is divided by the dp x cp size, like a dense bucket. With experts replicated over tp under
sequence parallelism the group is tp x edp (`tp_edp`): the sum over it also adds the tp ranks'
partial gradients (each routed S/tp positions), and the division stays by dp x cp.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.nn as nn

from mpoverlap.parallel.state import ParallelState


@dataclass(frozen=True)
class ReduceGroup:
    """Where one bucket's gradients are reduced: the group (None = one member), its size and
    this rank's position in it (its shard under the distributed optimizer)."""

    kind: str
    group: Any
    size: int
    rank: int
    spans_tp: bool = False  # members on several tp ranks (tp_edp): each holds a distinct shard


def expert_key(param: nn.Parameter) -> str:
    """The bucket key of a parameter: expert weights are bucketed apart from the dense ones."""
    return "expert" if getattr(param, "expert_parallel", False) else "dense"


def reduce_group(state: ParallelState, kind: str) -> ReduceGroup:
    """This rank's `kind` group of `state` as a ReduceGroup."""
    ranks = state.ranks(kind)
    if state.rank not in ranks:
        raise ValueError(f"rank {state.rank} has no {kind!r} group to reduce over")
    group = state.group(kind)
    if (group is None) != (len(ranks) == 1):
        raise RuntimeError(f"{kind!r} group object does not match its size {len(ranks)}")
    # Groups are built from sorted rank lists, so the group rank is the position in it.
    spans_tp = len({state.grid.coords(r).tp for r in ranks}) > 1
    return ReduceGroup(kind, group, len(ranks), ranks.index(state.rank), spans_tp)
