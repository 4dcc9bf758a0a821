"""Alpha-beta cost of one collective on one link, and where each group of the grid sits.

time = steps x latency + link bytes / (bandwidth x the op's efficiency on the link), where
link bytes are what each rank sends for the algorithm (`estimate.link_factor`: ring all-reduce
2(n-1)/n of the buffer, all-gather, reduce-scatter and all-to-all (n-1)/n, point-to-point the
sent half) and steps are the ring's 2(n-1) or (n-1) hops (all-to-all: n-1 pairwise exchanges,
p2p: one message).
"""
from __future__ import annotations

from typing import Dict

from mpoverlap.overlap.estimate.comm import link_factor
from mpoverlap.overlap.layout import Layout
from mpoverlap.simulate.hardware import Hardware, Link


def steps(op: str, n: int) -> int:
    if n <= 1:
        return 0
    if op == "all_reduce":
        return 2 * (n - 1)
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return n - 1
    if op == "send_recv":
        return 1
    raise ValueError(f"unknown collective {op!r}")


def collective_time(op: str, buffer_bytes: float, n: int, link: Link, calls: float = 1.0,
                    carried_by: str = "") -> float:
    """Seconds for `calls` collectives moving `buffer_bytes` (the ledger's buffer view, summed over
    the calls) over a group of `n` ranks on `link`; `carried_by`: the op whose rate the bytes
    move at when the collective is built from another (collective matmul's ring of
    point-to-point exchanges for SP's gathers and scatters)."""
    if n <= 1 or buffer_bytes <= 0:
        return 0.0
    return calls * steps(op, n) * link.latency + \
        buffer_bytes * link_factor(op, n) / link.op_bandwidth(carried_by or op)


def group_links(lo: Layout, hw: Hardware) -> Dict[str, Link]:
    """The link each kind of group runs on, for the first group of each kind (every group of a
    kind has the same stride; with nodes a multiple of the group span they all match).

    Grid order rank = tp + T (cp + C (dp + D pp)); expert ranks are c % ep of c = cp + C dp."""
    T, C, D, P, E = lo.tp, lo.cp, lo.dp, lo.pp, lo.ep
    return {
        "tp": hw.group_link(1, T),
        "cp": hw.group_link(T, C),
        "dp": hw.group_link(T * C, D) if C == 1 else hw.group_link(T, C * D),  # dense grads: dp x cp
        "ep": hw.group_link(T, E),
        "edp": hw.group_link(T * E, C * D // E),
        "pp": hw.group_link(T * C * D, P),
        # one hop between neighbouring stages
        "pp_hop": hw.group_link(T * C * D, 2) if P > 1 else hw.intra,
    }
