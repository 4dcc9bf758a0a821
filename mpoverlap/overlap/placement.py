"""Where the ranks run: which host each rank is on, which groups cross the host boundary.

The launcher decides the placement (torchrun gives each node consecutive global ranks), the
grid decides the groups; together they say which collectives ride the slow inter-node link.
A tensor-parallel group across hosts puts every layer's activations on that link: the plan
warns about it.
"""
from __future__ import annotations

from typing import Dict, List, Sequence

# The kinds whose groups the plan checks, in the order it prints them.
_KINDS = ("tp", "cp", "ep", "dp", "pp")
# Communication on every layer, on the critical path: these groups belong inside a host.
_KEEP_INSIDE = ("tp", "cp")


def _ranges(ranks: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'"""
    out, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ", ".join(out)


def ranks_by_host(hosts: Sequence[str]) -> Dict[str, List[int]]:
    """hostname of each rank (index = global rank) -> that host's ranks, in first-seen order."""
    out: Dict[str, List[int]] = {}
    for rank, host in enumerate(hosts):
        out.setdefault(host, []).append(rank)
    return out


def crossing_groups(grid, hosts: Sequence[str]) -> Dict[str, List[List[int]]]:
    """kind -> its groups whose ranks sit on more than one host (kinds with none left out)."""
    out = {}
    for kind in _KINDS:
        crossing = [g for g in grid.groups(kind) if len(g) > 1 and len({hosts[r] for r in g}) > 1]
        if crossing:
            out[kind] = crossing
    return out


def placement_lines(grid, hosts: Sequence[str]) -> List[str]:
    """The plan's lines about hosts: one per host with its ranks, the groups that cross hosts,
    and a warning for each tp/cp layout whose groups leave a host."""
    by_host = ranks_by_host(hosts)
    lines = [f"  hosts: {len(by_host)}"]
    lines += [f"    {host}: ranks {_ranges(ranks)}" for host, ranks in by_host.items()]
    if len(by_host) == 1:
        return lines
    crossing = crossing_groups(grid, hosts)
    multi = [k for k in _KINDS if any(len(g) > 1 for g in grid.groups(k))]
    inside = [k for k in multi if k not in crossing]
    lines.append("  groups across hosts (inter-node link): "
                 + (", ".join(f"{k} ({len(g)} of {len(grid.groups(k))} groups, e.g. "
                              f"{_with_hosts(g[0], hosts)})" for k, g in crossing.items()) or "none"))
    lines.append("  groups inside a host: " + (", ".join(inside) or "none"))
    for kind in _KEEP_INSIDE:
        if kind in crossing:
            per_host = min(len(r) for r in by_host.values())
            lines.append(
                f"  warning: parallel.{kind}={getattr(grid, kind)} groups cross hosts "
                f"({_with_hosts(crossing[kind][0], hosts)}): every layer's {kind} collectives go over the "
                f"inter-node link. Keep {kind} inside a node: parallel.{kind} at most the ranks per node "
                f"({per_host}) and dividing it, e.g. parallel.{kind}={_divisor_at_most(per_host, getattr(grid, kind))}, "
                "or more processes per node (torchrun --nproc-per-node)")
    return lines


def _with_hosts(group: Sequence[int], hosts: Sequence[str]) -> str:
    return "[" + ", ".join(f"{r}@{hosts[r]}" for r in group) + "]"


def _divisor_at_most(per_host: int, size: int) -> int:
    return max(d for d in range(1, per_host + 1) if per_host % d == 0 and size % d == 0)
