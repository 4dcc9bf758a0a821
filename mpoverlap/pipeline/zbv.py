"""The ZB-V compute order (Qi et al., "Zero Bubble Pipeline Parallelism", section 6).

Layout: 2pp model chunks in a V, stage s holds chunk s (vchunk 0, on the way down) and chunk
2pp-1-s (vchunk 1, on the way back up); see actions.py. Every backward is split into B (input
gradient) and W (weight gradients), each with its own action.

Stage s runs, for microbatch counters that advance per chunk:

1. warm-up: 2(pp-s)-1 forwards of vchunk 0; then s pairs (F vchunk 1, F vchunk 0); then
   pp-s rounds of (F, B, W) on vchunk 1 - the first gradients are born on stage 0, which holds
   the loss chunk, and come back up the V;
2. steady state, 1F-1B-1W per chunk: (F v0, B v0, W v0, F v1, B v1, W v1) until every forward
   ran (the F v0 is left out once all microbatches entered);
3. cool-down: s pairs (B v0, B v1) whose W's wait, then pp-s rounds (B v0, W v0) filling the
   time the last gradients take to reach the bottom of the V, then the pending W's.

With F = B = W per chunk a stage idles only for the fill - its first forward waits for the s
chunks above it, and by symmetry the V's end: (pp-1) F per step, against 1F1B's
(pp-1)(F+B+W) per stage-sized action (6 (pp-1) chunk-sized F). The paper calls this zero bubble
(with its optimizer post-validation the fill overlaps the previous step). Activation memory:
at most 2pp chunk-microbatches live between F and W on any stage, the pp stage-sized
microbatches of 1F1B (pM_B). The order needs m >= 2(pp-1) microbatches to reach its steady
state (schedules.schedule_constraints); with m = 2pp-2 stage 0's warm-up counts one
microbatch too many, whose actions are dropped.
"""
from __future__ import annotations

from typing import List

from mpoverlap.pipeline.actions import BACKWARD, FORWARD, WEIGHT

ComputeOrder = List[tuple]


def zbv_order(pp: int, num_microbatches: int, stage: int) -> ComputeOrder:
    """Stage `stage`'s (kind, microbatch, vchunk) computes in ZB-V order (module docstring)."""
    n = num_microbatches
    order: ComputeOrder = []
    forwards, backwards, weights = [0, 0], [0, 0], [0, 0]

    def add(kind: str, vchunk: int) -> None:
        counter = {FORWARD: forwards, BACKWARD: backwards, WEIGHT: weights}[kind]
        order.append((kind, counter[vchunk], vchunk))
        counter[vchunk] += 1

    for _ in range(2 * (pp - stage) - 1):
        add(FORWARD, 0)
    for _ in range(stage):
        add(FORWARD, 1)
        add(FORWARD, 0)
    for _ in range(pp - stage):
        add(FORWARD, 1)
        add(BACKWARD, 1)
        add(WEIGHT, 1)
    while forwards[1] < forwards[0] or forwards[0] < n:
        if forwards[0] < n:
            add(FORWARD, 0)
        for vchunk in (0, 1):
            if vchunk == 1:
                add(FORWARD, 1)
            add(BACKWARD, vchunk)
            add(WEIGHT, vchunk)
    for _ in range(stage):
        add(BACKWARD, 0)
        add(BACKWARD, 1)
    for _ in range(pp - stage):
        add(BACKWARD, 0)
        add(WEIGHT, 0)
    for vchunk in (1, 0):
        while weights[vchunk] < backwards[vchunk]:
            add(WEIGHT, vchunk)
    return [action for action in order if action[1] < num_microbatches]
