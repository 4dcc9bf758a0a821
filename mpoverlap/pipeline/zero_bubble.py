"""Zero-bubble compute orders (Qi et al., ICLR 2024): the backward split into B (the input
gradient, which the previous stage waits for) and W (the weight gradients, which nobody waits
for), with each W moved into a slot where its stage would otherwise idle.

`insert_weight_actions(orders, pp, vpp)` turns a 1F1B or interleaved order of F and B into one
with a W after each B: a timed run of all stages (unit costs F = B = W unless given) where a
stage about to idle (its next F or B waits on another stage) runs its oldest pending W instead.
Memory stays the base schedule's: a microbatch's activations live from its F to its W (the
queued weight-gradient closures hold the linear inputs and output gradients), so a stage runs
a pending W before an F whenever another F would hold more microbatches than the base
schedule's peak (over all stages: stage 0's p microbatches in 1F1B). Later stages, which hold
fewer in 1F1B, thereby keep W's pending through the steady state and run them in the
cool-down while the last B's travel back to stage 0 - ZB-H1's "pM_B" memory and its bubble.
At the end every pending W drains in order.

On 1F1B this is ZB-H1 (`zb1p`): bubble (p-1)(F+B-W) per step instead of 1F1B's (p-1)(F+B+W)
(the tests check both with `simulated_bubble_time`); on interleaved chunks the same rule fills
the interleaved warm-up and cool-down. `insert_weight_actions_paired` does the same on the
paired interleaved order (overlap.ep_pairing with zb1p, pipeline/paired.py): a pair runs as one
compute of cost F + B, so a W goes before or after a pair, never between its F and its B.
"""
from __future__ import annotations

from collections import deque
from typing import Deque, Dict, List, Sequence, Set, Tuple

from mpoverlap.pipeline.actions import BACKWARD, FORWARD, WEIGHT, ScheduleError, chunk_index
from mpoverlap.pipeline.program import ComputeOrder, dependencies


def peak_in_flight(order: ComputeOrder) -> int:
    """Most microbatch-chunks between their F and their last backward action (B, or W where the
    order has them) at any point of one stage's order: its activation memory in microbatches."""
    frees = WEIGHT if any(kind == WEIGHT for kind, _, _ in order) else BACKWARD
    live = peak = 0
    for kind, _, _ in order:
        live += 1 if kind == FORWARD else -1 if kind == frees else 0
        peak = max(peak, live)
    return peak


def insert_weight_actions(orders: Sequence[ComputeOrder], pp: int, vpp: int,
                          costs: Tuple[float, float, float] = (1.0, 1.0, 1.0)) -> List[ComputeOrder]:
    """Per stage, `orders` (F and B only) with one W per B placed as the module docstring says;
    `costs` = (F, B, W) per model chunk, the timing the placement is tuned for."""
    return insert_weight_actions_paired(orders, [set() for _ in orders], pp, vpp, costs)[0]


def insert_weight_actions_paired(orders: Sequence[ComputeOrder], paired: Sequence[Set[int]], pp: int, vpp: int,
                                 costs: Tuple[float, float, float] = (1.0, 1.0, 1.0)
                                 ) -> Tuple[List[ComputeOrder], List[Set[int]]]:
    """`insert_weight_actions` on a paired table (pipeline/paired.py: `paired[stage]` holds the
    indices of the forwards run with the next compute, a backward, as one overlapped action):
    each pair is placed as one compute of cost F + B that starts when both its inputs exist, so
    no W ever lands between a paired F and its B; a pair's B defers its W like any B. Returns
    (orders with W's, the paired forwards' indices in them)."""
    cost = dict(zip((FORWARD, BACKWARD, WEIGHT), costs))
    num_chunks = pp * vpp
    cap = max(peak_in_flight(order) for order in orders)
    out: List[ComputeOrder] = [[] for _ in orders]
    out_paired: List[Set[int]] = [set() for _ in orders]
    pos, free, live = [0] * pp, [0.0] * pp, [0] * pp
    pending: List[Deque[Tuple[int, int]]] = [deque() for _ in orders]
    end: Dict[Tuple[str, int, int], float] = {}

    def run(stage: int, computes: ComputeOrder, ready: float) -> None:
        start = max(free[stage], ready)
        free[stage] = start + sum(cost[kind] for kind, _, _ in computes)
        if len(computes) == 2:
            out_paired[stage].add(len(out[stage]))
        for kind, mb, vchunk in computes:
            end[(kind, mb, chunk_index(stage, vchunk, pp))] = free[stage]
            out[stage].append((kind, mb, vchunk))
            live[stage] += 1 if kind == FORWARD else -1 if kind == WEIGHT else 0
            if kind == BACKWARD:
                pending[stage].append((mb, vchunk))

    done = [False] * pp
    while not all(done):
        progressed = False
        for stage, order in enumerate(orders):
            while not done[stage]:
                if pos[stage] == len(order):
                    while pending[stage]:
                        run(stage, [(WEIGHT, *pending[stage].popleft())], 0.0)
                    done[stage] = progressed = True
                    break
                together = 2 if pos[stage] in paired[stage] else 1
                computes = order[pos[stage]:pos[stage] + together]
                keys = [(kind, mb, chunk_index(stage, vchunk, pp)) for kind, mb, vchunk in computes]
                deps = [d for key in keys for d in dependencies(*key, num_chunks) if d not in keys]
                if any(d not in end for d in deps):
                    break
                ready = max((end[d] for d in deps), default=0.0)
                over_memory = computes[0][0] == FORWARD and live[stage] >= cap
                if pending[stage] and (over_memory or free[stage] < ready):
                    run(stage, [(WEIGHT, *pending[stage].popleft())], 0.0)
                else:
                    run(stage, computes, ready)
                    pos[stage] += together
                progressed = True
        if not progressed:
            raise ScheduleError("zero-bubble placement: the base orders deadlock")
    return out, out_paired
