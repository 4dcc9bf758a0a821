"""Pipeline schedules as pure action tables: 1F1B, interleaved 1F1B, zero-bubble ZB-H1 and ZB-V.

`build_schedule(kind, pp, vpp, m)` returns one list of `Action`s per stage. Compute order:

- "1f1b" (vpp = 1): stage s runs min(pp-s-1, m) warm-up forwards, then alternates one
  forward and one backward, then drains the remaining backwards.
- "interleaved" (vpp > 1, Megatron's interleaved 1F1B): microbatches are taken in
  G = m // pp groups of as-equal-as-possible size (each >= pp, larger groups first); within a
  group the stage runs every virtual chunk in turn (forwards: vchunk 0..vpp-1, backwards:
  vpp-1..0), each over the group's microbatches. Warm-up: 2(pp-s-1) + (vpp-1) * (size of the
  first group) forwards (capped at m*vpp), then one forward / one backward, then the drain.

- "zb1p" (ZB-H1, zero_bubble.py): the 1F1B order (vpp = 1) or the interleaved order (vpp > 1)
  with each backward split into B (input gradient) and a deferred W (weight gradients), the
  W's placed where the stage would idle, activation memory capped at the base order's.
- "zbv" (ZB-V, zbv.py): two chunks per stage laid out in a V (stage s holds chunks s and
  2pp-1-s, `chunk_layout`), F, B and W per chunk in the 1F-1B-1W order; bubble the fill
  (pp-1) F only when F = B = W, activation memory 1F1B's.

Microbatch rule (`schedule_constraints`): 1F1B takes any m >= 1. Interleaved needs m >= pp
but, unlike Megatron, not m % pp == 0. Why m >= pp: a microbatch comes back to stage 0 for
its next virtual chunk only after a trip through all pp stages; with fewer than pp
microbatches in flight every stage idles during that trip and the bubble exceeds the
(pp-1)/(m*vpp) the layout is chosen for (pp=4, vpp=2, m=2: 1.25 instead of 0.75 of the
compute time). Why not m % pp == 0: with groups of >= pp microbatches the ring never runs
dry, so every m >= pp reaches exactly the theoretical bubble (the tests check this with
`simulated_bubble`) and the tables validate; a group larger than pp only keeps up to
(vpp-1) more activations alive during warm-up. Rejecting global batch sizes that are not
multiples of pp would buy nothing. ZB-V needs vpp = 2 and m >= 2(pp-1): its warm-up sends
2pp-1 microbatches down the V before the first W; with fewer the 1F-1B-1W steady state never
forms and the bubble exceeds the fill (pp=4, m=4: 6 F instead of 3 F; the tests check the
threshold with `simulated_bubble_time`).

MTP chunk (`mtp_chunk=True`, parallel.mtp_stage=s < pp-1 in a loop layout at pp >= 2; the
"loop_mtp" layouts of actions.py): the base table above, then per microbatch m the MTP chunk's
forward and its full backward (no W, also in zb1p) inserted back to back into stage s's order,
before the first base compute that starts, in the base table's unit-cost timing
(simulate_compute), at or after the end of F(head chunk, m) (`insert_mtp_chunk`). Why it cannot
deadlock, for any s: key every base compute by its start time and the two inserted ones by that
end time t_m (ahead of a base compute of equal key); every base dependency ends before its
dependant starts (costs are positive), F(head, m) starts before t_m, B(head, m) starts after
F(head, m) ends, and stage s's order is increasing in that key by construction; so every
dependency of the new orders goes to a strictly smaller key, the dependency graph is acyclic,
and the posting programs built on its timing are deadlock-free as for any other order
(program.py).

The p2p posting programs (both overlap modes) come from `program.posting_programs`; see
there why they cannot deadlock. `validate_schedule` (validate.py) re-checks everything.
"""
from __future__ import annotations

import functools
from typing import List, Set

from mpoverlap.pipeline.actions import (BACKWARD, FORWARD, LOOP, V_SHAPE, WEIGHT, Action, ScheduleError,
                                        chunk_index, input_message, layout_of_tables, loop_mtp_layout,
                                        main_vpp, num_model_chunks, output_message)
from mpoverlap.pipeline.paired import paired_order
from mpoverlap.pipeline.program import ComputeOrder, posting_programs, simulate_compute
from mpoverlap.pipeline.zbv import zbv_order
from mpoverlap.pipeline.zbv_paired import zbv_paired_order
from mpoverlap.pipeline.zero_bubble import insert_weight_actions, insert_weight_actions_paired

SCHEDULE_KINDS = ("1f1b", "interleaved", "zb1p", "zbv")
# `parallel.pp_schedule` values: auto = schedule_kind(vpp), or one of SCHEDULE_KINDS.
SCHEDULE_CHOICES = ("auto",) + SCHEDULE_KINDS


def resolve_schedule(choice: str, vpp: int) -> str:
    """The schedule kind `parallel.pp_schedule=choice` runs with `vpp` chunks per stage."""
    return schedule_kind(vpp) if choice == "auto" else choice


def defers_weight_grads(kind: str) -> bool:
    """Whether the schedule has W actions (its B computes only the input gradient)."""
    return kind in ("zb1p", "zbv")


def chunk_layout(kind: str) -> str:
    """How the schedule places model chunks on stages (actions.py): "v" for zbv, else "loop"."""
    return V_SHAPE if kind == "zbv" else LOOP


def schedule_kind(vpp: int) -> str:
    """The schedule a layout runs: interleaved 1F1B when vpp > 1, else 1F1B."""
    return "interleaved" if vpp > 1 else "1f1b"


def schedule_constraints(kind: str, pp: int, vpp: int, num_microbatches: int) -> List[str]:
    """Every reason the schedule cannot be built (empty list: buildable). Each message names
    the quantity and a fix, for the rule engine to wrap with its config keys."""
    problems = []
    if kind not in SCHEDULE_KINDS:
        return [f"unknown pipeline schedule {kind!r}; one of {SCHEDULE_KINDS}"]
    for name, value in (("pp", pp), ("vpp", vpp), ("number of microbatches", num_microbatches)):
        if not isinstance(value, int) or value < 1:
            problems.append(f"{name} must be a positive integer, got {value!r}")
    if problems:
        return problems
    if kind == "1f1b" and vpp != 1:
        problems.append(f"1F1B runs one model chunk per stage (vpp=1), got vpp={vpp}; "
                        "use the interleaved schedule for vpp > 1")
    if kind == "zbv":
        if pp < 2:
            problems.append(f"the zbv schedule lays 2 x pp chunks out in a V over pp >= 2 stages, got "
                            f"pp={pp}; set pp >= 2 or use the 1f1b schedule")
        if vpp != 2:
            problems.append(f"the zbv schedule holds exactly two model chunks per stage (the V's way down "
                            f"and back up), got vpp={vpp}; set vpp=2")
        if pp >= 2 and num_microbatches < 2 * (pp - 1):
            problems.append(
                f"the zbv schedule needs at least 2(pp-1) = {2 * (pp - 1)} microbatches per step, got "
                f"{num_microbatches}: its warm-up sends 2pp-1 microbatches down the V before the "
                f"first weight gradient, and with fewer the 1F-1B-1W steady state never forms and "
                f"the bubble exceeds the fill (pp-1) F; raise the global batch to at least "
                f"micro_batch_size x dp x {2 * (pp - 1)}, or use the zb1p schedule")
        return problems
    if kind == "interleaved" and vpp == 1:
        problems.append("the interleaved schedule needs vpp > 1 model chunks per stage, got vpp=1; "
                        "set vpp >= 2 or use the 1f1b schedule")
    if kind in ("interleaved", "zb1p") and vpp > 1:
        if pp < 2:
            problems.append(f"virtual pipeline chunks (vpp={vpp}) need pp >= 2, got pp={pp}; "
                            "set vpp=1 or pp >= 2")
        elif num_microbatches < pp:
            problems.append(
                f"the interleaved schedule needs at least pp={pp} microbatches per step, got "
                f"{num_microbatches}: a microbatch returns to stage 0 for its next virtual chunk "
                f"only after a trip through all {pp} stages, so with fewer in flight the stages "
                f"idle and the bubble exceeds (pp-1)/(m*vpp); raise the global batch to at least "
                f"micro_batch_size x dp x {pp}, or set vpp=1")
    return problems


def _one_f_one_b_order(pp: int, m: int, stage: int) -> ComputeOrder:
    warmup = min(pp - stage - 1, m)
    order = [(FORWARD, mb, 0) for mb in range(warmup)]
    for i in range(m - warmup):
        order += [(FORWARD, warmup + i, 0), (BACKWARD, i, 0)]
    return order + [(BACKWARD, mb, 0) for mb in range(m - warmup, m)]


def microbatch_groups(pp: int, num_microbatches: int) -> List[range]:
    """Interleaved grouping: m // pp consecutive groups, sizes as equal as possible (>= pp),
    larger first (the warm-up is sized for the first group)."""
    count = max(1, num_microbatches // pp)
    base, extra = divmod(num_microbatches, count)
    groups, first = [], 0
    for i in range(count):
        size = base + (1 if i < extra else 0)
        groups.append(range(first, first + size))
        first += size
    return groups


def _interleaved_parts(pp: int, vpp: int, m: int, stage: int):
    """(forwards, backwards, warm-up count) of one stage's interleaved table."""
    groups = microbatch_groups(pp, m)
    forwards = [(mb, v) for group in groups for v in range(vpp) for mb in group]
    backwards = [(mb, v) for group in groups for v in reversed(range(vpp)) for mb in group]
    warmup = min(m * vpp, 2 * (pp - stage - 1) + (vpp - 1) * len(groups[0]))
    return forwards, backwards, warmup


def _interleaved_order(pp: int, vpp: int, m: int, stage: int) -> ComputeOrder:
    forwards, backwards, warmup = _interleaved_parts(pp, vpp, m, stage)
    total = m * vpp
    order = [(FORWARD, mb, v) for mb, v in forwards[:warmup]]
    for k in range(total - warmup):
        order += [(FORWARD, *forwards[warmup + k]), (BACKWARD, *backwards[k])]
    return order + [(BACKWARD, mb, v) for mb, v in backwards[total - warmup:]]


def compute_orders(kind: str, pp: int, vpp: int, num_microbatches: int,
                   pairing: bool = False) -> List[ComputeOrder]:
    """Per stage, the (kind, microbatch, vchunk) computes in order (no p2p). A fresh copy of a
    cached table: the orders are pure in their arguments, and `--search` and the activation
    estimate ask for the same ones many times. `pairing`: the paired table (paired.py)."""
    return [list(order) for order in _cached_orders(kind, pp, vpp, num_microbatches, pairing)[0]]


def paired_forwards(kind: str, pp: int, vpp: int, num_microbatches: int) -> List[Set[int]]:
    """Per stage, the indices of the forwards of the paired table that run with the next
    compute (a backward) as one overlapped action (paired.py)."""
    return [set(p) for p in _cached_orders(kind, pp, vpp, num_microbatches, True)[1]]


@functools.lru_cache(maxsize=256)
def _cached_orders(kind: str, pp: int, vpp: int, num_microbatches: int, pairing: bool = False):
    orders, paired = _build_orders(kind, pp, vpp, num_microbatches, pairing)
    return tuple(tuple(order) for order in orders), tuple(frozenset(p) for p in paired)


def pairing_constraints(kind: str, pp: int, vpp: int) -> List[str]:
    """Why the schedule has no paired table (empty: it has one)."""
    if pp == 1 or kind == "interleaved":
        return []
    if kind == "zbv":  # the paired V (zbv_paired.py)
        return []
    if kind == "zb1p" and vpp >= 2:  # the paired interleaved table with W actions (zero_bubble.py)
        return []
    return [f"forward/backward pairing at pp={pp} runs in the interleaved schedule, zb1p at vpp >= 2 or zbv, "
            f"not in {kind!r} at vpp={vpp}: with one chunk per stage a pair's backward waits for the next "
            "stage's pair, which waits for this stage's previous pair (the F it sends leaves only after its "
            "pair), so neighbouring stages take turns instead of running together; "
            "set parallel.vpp=2 (with parallel.pp_schedule=interleaved or zb1p)"]


def _build_orders(kind: str, pp: int, vpp: int, num_microbatches: int, pairing: bool = False):
    problems = schedule_constraints(kind, pp, vpp, num_microbatches)
    if pairing:
        problems += pairing_constraints(kind, pp, vpp)
    if problems:
        raise ScheduleError("; ".join(problems))
    if pairing and kind == "zbv":
        if num_microbatches < 2 * pp:
            raise ScheduleError(f"the paired V needs at least 2pp = {2 * pp} microbatches per step, got "
                                f"{num_microbatches}: its main phase pairs the forwards of one half of the "
                                "microbatches with the backwards of the other")
        pairs = [zbv_paired_order(pp, num_microbatches, s) for s in range(pp)]
        return [order for order, _ in pairs], [p for _, p in pairs]
    if pairing:
        pairs = [paired_order(*_interleaved_parts(pp, vpp, num_microbatches, s)) for s in range(pp)]
        orders, paired = [order for order, _ in pairs], [p for _, p in pairs]
        if defers_weight_grads(kind):  # zb1p: each B's W placed as insert_weight_actions does
            return insert_weight_actions_paired(orders, paired, pp, vpp)
        return orders, paired
    return _plain_orders(kind, pp, vpp, num_microbatches), [set() for _ in range(pp)]


def _plain_orders(kind: str, pp: int, vpp: int, num_microbatches: int) -> List[ComputeOrder]:
    if kind == "zbv":
        return [zbv_order(pp, num_microbatches, s) for s in range(pp)]
    if vpp == 1:
        orders = [_one_f_one_b_order(pp, num_microbatches, s) for s in range(pp)]
    else:
        orders = [_interleaved_order(pp, vpp, num_microbatches, s) for s in range(pp)]
    if defers_weight_grads(kind):
        orders = insert_weight_actions(orders, pp, vpp)
    return orders


def insert_mtp_chunk(orders: List[ComputeOrder], pp: int, vpp: int, stage: int = 0) -> List[ComputeOrder]:
    """The loop-layout orders with the MTP chunk's F and B of every microbatch inserted into
    `stage`'s order (see the module docstring: placement and why it cannot deadlock)."""
    if pp < 2:
        raise ScheduleError(f"the MTP chunk of the loop_mtp layout needs pp >= 2, got pp={pp}")
    if not 0 <= stage < pp - 1:
        raise ScheduleError(f"the MTP chunk runs on a stage 0 .. {pp - 2} (pp-1 holds the head), got {stage}")
    weights = any(kind == WEIGHT for order in orders for kind, _, _ in order)
    times = (simulate_compute(orders, pp, vpp, 1, 1, 1) if weights else simulate_compute(orders, pp, vpp))
    head = pp - 1
    ready = {mb: end for (kind, mb, v), (_, end) in zip(orders[head], times[head])
             if kind == FORWARD and v == vpp - 1}
    starts = [start for start, _ in times[stage]]
    out: ComputeOrder = []
    pending = sorted(ready, key=lambda mb: (ready[mb], mb))
    for action, start in zip(orders[stage], starts):
        while pending and ready[pending[0]] <= start:
            mb = pending.pop(0)
            out += [(FORWARD, mb, vpp), (BACKWARD, mb, vpp)]
        out.append(action)
    for mb in pending:
        out += [(FORWARD, mb, vpp), (BACKWARD, mb, vpp)]
    return [out if s == stage else list(order) for s, order in enumerate(orders)]


def build_schedule(kind: str, pp: int, vpp: int, num_microbatches: int,
                   pairing: bool = False, mtp_chunk: bool = False, mtp_stage: int = 0) -> List[List[Action]]:
    """One list of Actions per stage, with both posting programs (overlap off and on).
    `pairing`: the paired table (overlap.ep_pairing, paired.py): steady-state forwards marked
    `paired`, each run with the backward after it as one overlapped action. `mtp_chunk`: the
    loop_mtp layout, the MTP chunk pp*vpp on stage `mtp_stage` (`insert_mtp_chunk`; loop
    layouts without pairing)."""
    orders = compute_orders(kind, pp, vpp, num_microbatches, pairing)
    paired = paired_forwards(kind, pp, vpp, num_microbatches) if pairing else [set() for _ in orders]
    layout = chunk_layout(kind)
    if mtp_chunk:
        if layout != LOOP or pairing:
            raise ScheduleError(f"the MTP chunk of its own is built for the loop layouts without pairing, "
                                f"not {kind!r} (pairing={pairing})")
        orders = insert_mtp_chunk(orders, pp, vpp, mtp_stage)
        layout = loop_mtp_layout(mtp_stage, vpp)
    programs = posting_programs(orders, pp, vpp, layout, paired)
    num_chunks = num_model_chunks(pp, vpp, layout)
    tables = []
    for stage, order in enumerate(orders):
        lazy, eager = programs[False][stage], programs[True][stage]
        actions = []
        for index, (kind_, mb, vchunk) in enumerate(order):
            chunk = chunk_index(stage, vchunk, pp, layout)
            first = index == 0
            actions.append(Action(
                kind_, mb, vchunk, chunk,
                recv=input_message(kind_, mb, chunk, num_chunks),
                send=output_message(kind_, mb, chunk, num_chunks),
                posts_before=tuple(lazy[0]) if first else (),
                posts_after=tuple(lazy[index + 1]),
                prefetch_before=tuple(eager[0]) if first else (),
                prefetch_after=tuple(eager[index + 1]),
                paired=index in paired[stage]))
        tables.append(actions)
    return tables


def bubble_fraction(pp: int, vpp: int, num_microbatches: int, kind: str = "1f1b") -> float:
    """Theory: pipeline idle time over ideal compute time, (pp - 1) / (m * vpp); for zb1p a
    third of it ((p-1)(F+B-W) over m(F+B+W) with F = B = W), and for zbv (vpp = 2) too: the
    fill (p-1) F over 2m(F+B+W) per-chunk costs, F = B = W."""
    base = (pp - 1) / (num_microbatches * vpp)
    return base / 3 if defers_weight_grads(kind) else base


def _timed_run(tables: List[List[Action]], forward_cost: float, input_grad_cost: float,
               weight_cost: float, cost_of=None, latency: float = 0.0, start=None) -> List[List[tuple]]:
    """The tables' compute orders timed (program.simulate_compute; `cost_of(kind, stage,
    vchunk)`, `latency` and `start` as there)."""
    pp = len(tables)
    vpp = main_vpp(tables)
    layout = layout_of_tables(tables)
    orders = [[(a.kind, a.microbatch, a.vchunk) for a in table] for table in tables]
    if any(kind == WEIGHT for order in orders for kind, _, _ in order):
        return simulate_compute(orders, pp, vpp, forward_cost, input_grad_cost, weight_cost, layout,
                                cost_of=cost_of, latency=latency, start=start)
    return simulate_compute(orders, pp, vpp, forward_cost, input_grad_cost + weight_cost, layout=layout,
                            cost_of=cost_of, latency=latency, start=start)


def simulated_bubble(tables: List[List[Action]], forward_cost: float = 1.0,
                     backward_cost: float = 2.0) -> List[float]:
    """Per stage, idle time over busy time of a timed run of the tables' compute order with
    free communication (compare with `bubble_fraction`). `backward_cost` is the full
    backward; in tables with W actions B and W take half of it each."""
    half = backward_cost / 2
    times = _timed_run(tables, forward_cost, half, backward_cost - half)
    makespan = max(t[-1][1] for t in times if t)
    busy = [sum(e - s for s, e in t) for t in times]
    return [(makespan - b) / b for b in busy]


def simulated_bubble_time(tables: List[List[Action]], forward_cost: float, input_grad_cost: float,
                          weight_cost: float) -> List[float]:
    """Per stage, the idle time of one step (step time minus the stage's compute) in a timed
    run with free communication, for per-chunk costs F, B (input gradient) and W (weight
    gradients); a table without W actions runs B and W as one backward of cost B + W.
    1F1B: (p-1)(F+B+W) on every stage; ZB-H1: (p-1)(F+B-W) (paper Table 2); ZB-V: the fill
    (p-1) F when F = B = W, (p-1) B when B = W >= F (its order is built for B = W)."""
    times = _timed_run(tables, forward_cost, input_grad_cost, weight_cost)
    makespan = max(t[-1][1] for t in times if t)
    return [makespan - sum(e - s for s, e in t) for t in times]
