"""The paired V (DualPipeV-class) compute order: zbv's layout (stage s holds chunks s and
2pp-1-s) with forward/backward pairs in its steady state (overlap.ep_pairing=true with
parallel.pp_schedule=zbv). The executor runs each pair as one overlapped action and
defers the pair's B's weight GEMMs to the W after it (PipelineExecutor._paired_backward).

Phases of stage s (of pp; m >= 2pp microbatches; per-vchunk microbatch counters; "zb" = the
B's W deferred to a later W action, FIFO; otherwise its W follows it at once), written from
the DeepSeek-V3 report's description and the phase names of DualPipeV's step (nF0, nF0F1,
nB1W1F1, nF0B1F1B0, nB1F1B0, nB1B0, nWB0, nW):

1. 2(pp-s-1) forwards of vchunk 0;
2. s+1 rounds (F v0, F v1);
3. pp-s-1 rounds (B v1 zb, W, F v1);
4. main, m-2pp+s+1 rounds of two pairs: (F v0 + B v1) then (F v1 + B v0) - each pair one
   overlapped action, the F of one microbatch with the B of another chunk's microbatch (on the
   turn stage the first round's (F v0, B v1) runs unpaired: the B needs that same stage's F v1);
5. pp-s-1 rounds (B v1, then the pair F v1 + B v0);
6. s+1 rounds (B v1, B v0), their W deferred from the middle round on;
7. pp-s-1 rounds (W, B v0 zb);
8. the pending W's.
"""
from __future__ import annotations

from collections import deque
from typing import Set, Tuple

from mpoverlap.pipeline.actions import BACKWARD, FORWARD, WEIGHT
from mpoverlap.pipeline.program import ComputeOrder


def zbv_paired_order(pp: int, m: int, stage: int) -> Tuple[ComputeOrder, Set[int]]:
    """(compute order, indices of its paired forwards) of stage `stage` (module docstring)."""
    order: ComputeOrder = []
    paired: Set[int] = set()
    forwards, backwards = [0, 0], [0, 0]
    pending: deque = deque()

    def forward(v: int) -> None:
        order.append((FORWARD, forwards[v], v))
        forwards[v] += 1

    def backward(v: int, defer: bool) -> None:
        key = (backwards[v], v)
        order.append((BACKWARD, *key))
        backwards[v] += 1
        if defer:
            pending.append(key)
        else:
            order.append((WEIGHT, *key))

    def weight() -> None:
        order.append((WEIGHT, *pending.popleft()))

    def pair(vf: int, vb: int) -> None:
        paired.add(len(order))
        forward(vf)
        backward(vb, defer=True)  # its W right after the pair, not between the F and the B
        weight()

    r, last = stage, stage == pp - 1
    for _ in range(2 * (pp - r - 1)):
        forward(0)
    for _ in range(r + 1):
        forward(0)
        forward(1)
    for _ in range(pp - r - 1):
        backward(1, defer=True)
        weight()
        forward(1)
    for i in range(m - 2 * pp + r + 1):
        if i == 0 and last:
            forward(0)
            backward(1, defer=False)
        else:
            pair(0, 1)
        pair(1, 0)
    for _ in range(pp - r - 1):
        backward(1, defer=False)
        pair(1, 0)
    defer = False
    for i in range(r + 1):
        if i == (r + 1) // 2 and r % 2 == 1:
            defer = True
        backward(1, defer)
        if i == (r + 1) // 2 and r % 2 == 0:
            defer = True
        backward(0, defer)
    for _ in range(pp - r - 1):
        weight()
        backward(0, defer=True)
    while pending:
        weight()
    return order, paired
