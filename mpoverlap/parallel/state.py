"""ParallelState: the one object that owns this rank's process groups.

Created once per process after `init_process_group`, then handed explicitly to every layer,
schedule and optimizer that communicates. There are no module-level groups anywhere.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
import socket
from typing import Any, Dict, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from mpoverlap.parallel.grid import GROUP_KINDS, RankCoords, RankGrid


@dataclass
class ParallelState:
    grid: RankGrid
    rank: int
    device: torch.device
    backend: str
    # kind -> this rank's group (None when the group has a single member: nothing to talk to,
    # and on the embedding group for a middle pipeline stage).
    groups: Dict[str, Optional[Any]] = field(default_factory=dict)
    # Each rank's hostname, index = global rank (gathered once in `create`): which ranks share
    # a node, for the plan and for anything that must know what crosses the inter-node link.
    hosts: Tuple[str, ...] = ()
    # The kinds whose groups were created with NCCL's high-priority streams
    # (overlap.comm_priority; empty on gloo, which has no streams).
    high_priority: Tuple[str, ...] = ()

    @property
    def coords(self) -> RankCoords:
        return self.grid.coords(self.rank)

    @property
    def world(self) -> int:
        return self.grid.world

    def size(self, kind: str) -> int:
        return len(self.grid.group_of(kind, self.rank))

    def group(self, kind: str) -> Optional[Any]:
        if kind not in self.groups:
            raise KeyError(f"group kind {kind!r} was not created for this ParallelState (created: "
                           f"{sorted(self.groups)}); pass it to ParallelState.create(..., skip=...) "
                           "by leaving it out of `skip`")
        return self.groups[kind]

    def ranks(self, kind: str) -> list:
        return self.grid.group_of(kind, self.rank)

    @property
    def is_first_stage(self) -> bool:
        return self.coords.pp == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coords.pp == self.grid.pp - 1

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> "ParallelState":
        """A one-rank state for tests and tools that run without torch.distributed."""
        return cls(grid=RankGrid(), rank=0, device=torch.device(device), backend="none",
                   groups={kind: None for kind in GROUP_KINDS})

    @classmethod
    def create(cls, grid: RankGrid, device: torch.device, timeout_s: float = 300.0,
               skip: Sequence[str] = (), high_priority: Sequence[str] = ()) -> "ParallelState":
        """Build every group of the grid except the kinds in `skip` (kinds the caller never
        uses: each NCCL group is a communicator with its own memory and set-up time).
        Collective: every rank must call it with the same `skip`, because `new_group` is
        itself collective over the world and must be called in the same order everywhere;
        the order is GROUP_KINDS' order, decided here and not by first use. On nccl the kinds in
        `high_priority` (overlap/priority.py high_priority_kinds) get high-priority streams."""
        if not dist.is_initialized():
            raise RuntimeError("ParallelState.create needs torch.distributed to be initialised")
        world, rank = dist.get_world_size(), dist.get_rank()
        if world != grid.world:
            raise RuntimeError(f"world size {world} != tp*cp*dp*pp = {grid.world}")
        backend = dist.get_backend()
        groups: Dict[str, Optional[Any]] = {}
        timeout = timedelta(seconds=timeout_s)
        unknown = set(skip) - set(GROUP_KINDS)
        if unknown:
            raise ValueError(f"unknown group kind(s) {sorted(unknown)} in skip; one of {GROUP_KINDS}")
        for kind in GROUP_KINDS:
            if kind in skip:
                continue
            groups[kind] = None
            for ranks in grid.groups(kind):
                if len(ranks) < 2:
                    continue
                # new_group must be called by every rank for every group, members or not.
                pg = dist.new_group(ranks=ranks, backend=backend, timeout=timeout,
                                    pg_options=nccl_group_options(kind, high_priority, backend))
                if rank in ranks:
                    groups[kind] = pg
        hosts: list = [None] * world
        dist.all_gather_object(hosts, socket.gethostname())
        prioritized = tuple(k for k in groups if backend == "nccl" and k in high_priority and groups[k] is not None)
        return cls(grid=grid, rank=rank, device=device, backend=backend, groups=groups, hosts=tuple(hosts),
                   high_priority=prioritized)


def nccl_group_options(kind: str, high_priority: Sequence[str], backend: str) -> Any:
    """`pg_options` of a kind's groups: NCCL's high-priority-stream option on the nccl backend
    for a kind in `high_priority`; None (torch's default options) otherwise."""
    if backend != "nccl" or kind not in high_priority:
        return None
    return dist.ProcessGroupNCCL.Options(is_high_priority_stream=True)
