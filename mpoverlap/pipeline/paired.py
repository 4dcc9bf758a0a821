"""Forward/backward pairing in the pipeline tables (overlap.ep_pairing at pp > 1).

Megatron's combined 1F1B with interleaved chunks: in the steady state of the interleaved 1F1B
table each forward action of one (microbatch, vchunk) runs together with the backward action
that follows it on the same stage as ONE overlapped "FB" action (the two sub-step programs of
mpoverlap/pairing interleaved, each one's expert exchanges in flight under the other's compute).

A table marks a pair on its forward: `Action.paired` is True on an F whose next action (a B of
another (microbatch, vchunk)) runs with it; the table stays a list of F and B actions, so the
coverage and data-flow checks count an FB as its F and its B. The posting programs treat the
pair as one compute: both inputs are received before it (the B's output gradient included),
both outputs sent after it, nothing is posted between the two (program.py, `paired`).

The extra warm-up forward. In the plain interleaved table the last stage runs each steady
forward of the last model chunk right before that same (microbatch, chunk)'s backward (the
loss is there: F(mb0,v1) B(mb0,v1) at pp = 2, vpp = 2): a forward cannot be paired with its
own backward. Like Megatron (`get_pp_rank_microbatches`: one more warm-up microbatch under
`overlap_moe_expert_parallel_comm`), each stage runs ONE MORE warm-up forward than the
interleaved table (capped at m x vpp), so the forward of a pair is one slot ahead of the
backward it is paired with, and the two are independent. The timed simulation
(`program.simulate_compute`, a pair starts when both its inputs exist) and validate.py (no F
paired with its own B; the rendezvous simulation waits both receives before the pair) check
it for every table built; in the free-communication simulation the bubble equals the plain
interleaved table's. Price: one more (microbatch, chunk) of activations alive per stage in
the steady state; the drain has one more lone backward.

The interleaved schedule (vpp >= 2) is paired here, and zb1p at vpp >= 2 is this order with
one W per B placed by zero_bubble.insert_weight_actions_paired (a pair placed as one compute, so
no W lands between its F and its B); zbv has its own paired table (zbv_paired.py, the
DualPipeV-class V). At vpp = 1 (1F1B, zb1p) the extra warm-up forward removes the
self-dependency, but a pair's B then waits for the next stage's pair, which waits for the F this
stage sends after its previous pair: neighbouring stages take turns (tests/test_paired_schedules.py
times it), so rules ep_pairing.pp_needs_vpp and ep_pairing.pp_needs_interleaved refuse them.
"""
from __future__ import annotations

from typing import List, Set, Tuple

from mpoverlap.pipeline.actions import BACKWARD, FORWARD
from mpoverlap.pipeline.program import ComputeOrder


def paired_order(forwards: List[Tuple[int, int]], backwards: List[Tuple[int, int]],
                 warmup: int) -> Tuple[ComputeOrder, Set[int]]:
    """(compute order, indices of the paired forwards) of one stage: its interleaved table's
    (microbatch, vchunk) forwards and backwards, in their order, with `warmup` + 1 warm-up
    forwards, then each forward paired with the backward after it, then the drain."""
    total = len(forwards)
    warm = min(total, warmup + 1)
    order: ComputeOrder = [(FORWARD, mb, v) for mb, v in forwards[:warm]]
    paired: Set[int] = set()
    for k in range(total - warm):
        paired.add(len(order))
        order += [(FORWARD, *forwards[warm + k]), (BACKWARD, *backwards[k])]
    return order + [(BACKWARD, mb, v) for mb, v in backwards[total - warm:]], paired
