"""From compute orders to posting programs: when each stage posts each send and receive.

Three steps, all pure:

1. `simulate_compute(orders, pp, vpp)`: a timed run of the per-stage compute orders with
   zero-cost communication (forward 1, backward 2 time units per model chunk; in orders with
   W actions forward, input-gradient B and weight-gradient W 1 each; a compute starts when
   its stage is free and its input exists). It fails if the orders can deadlock
   even with unlimited buffering; otherwise it gives every compute a start and end time.
2. Global order: every message gets the key (time its producer ends, act before grad, dst
   chunk, microbatch). All stages post their p2p ops in increasing key order, so the two ends
   of every link see the same sequence (sends and receives in both directions) and, by
   induction on the key, no stage can wait on an op its peer has not reached - with blocking
   sends too.
3. Placement. A send is posted right after the compute producing it. A receive floats between
   its neighbours in key order: "lazy" (overlap off) posts it as late as possible (at the
   latest just before its consumer), "prefetch" (overlap on) as early as possible (together
   with the op before it in key order, typically one or more computes ahead). Ops posted at
   the same point with the same peer form one batch (at most one receive per batch, so a
   wait never holds a compute hostage to a later receive).

`vpp` is the main chunks per stage; in a loop_mtp layout the MTP chunk's stage (0, or the
middle stage the layout names) also runs the MTP chunk pp*vpp (actions.py), its vchunk vpp.

A local message (both ends on one stage: zbv's turn at stage pp-1) has no ops: the compute
order already runs its producer before its consumer on that stage.

Paired forwards (`paired`: per stage the indices k of the forwards that run with compute k+1, a
backward, as one overlapped action; paired.py): the simulation starts the pair when both
inputs exist and ends both at start + F + B; the backward's receive is placed before the
pair (its consumer is k) and the forward's send after it (point k+2), so nothing is posted
between the two.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

from mpoverlap.pipeline.actions import (ACTIVATION, BACKWARD, FORWARD, LOOP, RECV, SEND, WEIGHT,
                                        Batch, Message, P2POp, ScheduleError, chunk_index,
                                        input_message, is_local, num_model_chunks, output_message,
                                        producer_of, stage_of)

ComputeOrder = List[Tuple[str, int, int]]  # per stage: (kind, microbatch, vchunk)
FORWARD_COST, BACKWARD_COST = 1, 2


def dependencies(kind: str, mb: int, chunk: int, num_chunks: int) -> List[Tuple[str, int, int]]:
    deps = []
    msg = input_message(kind, mb, chunk, num_chunks)
    if msg is not None:
        deps.append(producer_of(msg))
    if kind == BACKWARD:
        deps.append((FORWARD, mb, chunk))
    if kind == WEIGHT:
        deps.append((BACKWARD, mb, chunk))
    return deps


def has_weight_actions(orders: Sequence[ComputeOrder]) -> bool:
    return any(kind == WEIGHT for order in orders for kind, _, _ in order)


def simulate_compute(orders: Sequence[ComputeOrder], pp: int, vpp: int,
                     forward_cost: float = FORWARD_COST, backward_cost: float = BACKWARD_COST,
                     weight_cost: float = 0.0, layout: str = LOOP,
                     paired: Optional[Sequence[Set[int]]] = None,
                     cost_of: Optional[Callable[[str, int, int], float]] = None,
                     latency: float = 0.0,
                     start: Optional[Sequence[float]] = None) -> List[List[Tuple[float, float]]]:
    """(start, end) of every compute of every stage; ScheduleError if the orders deadlock.
    `backward_cost` is what a B action costs (the full backward in orders without W);
    `paired`: per stage the indices of the forwards run with the next compute (see above).
    `cost_of(kind, stage, vchunk)`, when given, replaces the three costs (measured per stage
    and chunk: an embedding or loss chunk is not a middle one); `latency` is added to every
    dependency on another stage's compute (a message's transfer; a local one is free);
    `start`, when given, is the time each stage begins its first compute at the earliest (the
    stages of a real step do not enter the schedule together: the one with less work after its
    last action enters the next step first)."""
    costs = {FORWARD: forward_cost, BACKWARD: backward_cost, WEIGHT: weight_cost}
    num_chunks = num_model_chunks(pp, vpp, layout)
    end: Dict[Tuple[str, int, int], float] = {}
    times: List[List[Tuple[float, float]]] = [[] for _ in orders]
    free = [0.0] * len(orders) if start is None else [float(x) for x in start]
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for stage, order in enumerate(orders):
            while len(times[stage]) < len(order):
                index = len(times[stage])
                together = 2 if paired is not None and index in paired[stage] else 1
                computes = [(kind, mb, chunk_index(stage, vchunk, pp, layout))
                            for kind, mb, vchunk in order[index:index + together]]
                deps = [d for c in computes for d in dependencies(*c, num_chunks) if d not in computes]
                if any(d not in end for d in deps):
                    break
                start = max([free[stage]] + [end[d] + (latency if stage_of(d[2], pp, layout) != stage else 0.0)
                                             for d in deps])
                finish = start + sum(costs[kind] if cost_of is None else cost_of(kind, stage, vchunk)
                                     for kind, _, vchunk in order[index:index + together])
                for c in computes:
                    end[c] = finish
                    times[stage].append((start, finish))
                free[stage] = finish
                remaining -= together
                progressed = True
        if not progressed:
            stuck = {s: order[len(times[s])] for s, order in enumerate(orders) if len(times[s]) < len(order)}
            raise ScheduleError(f"compute orders deadlock even with unlimited buffers; stuck at {stuck}")
    return times


def message_key(message: Message, producer_end: float) -> tuple:
    """Global posting order: production time, then activations before gradients (so a tie
    lets the forward's input be prefetched under the longer backward), then chunk, microbatch."""
    return (producer_end, 0 if message.kind == ACTIVATION else 1, message.dst_chunk, message.microbatch)


def _stage_ops(stage: int, order: ComputeOrder, keys: Dict[Message, tuple], pp: int, vpp: int,
               layout: str = LOOP, paired: Set[int] = frozenset()):
    """This stage's p2p ops in key order: (key, op, fixed point of a send / consumer index).
    A pair (k in `paired`, k+1) consumes at k and produces at k+2."""
    num_chunks = num_model_chunks(pp, vpp, layout)
    ops = []
    for index, (kind, mb, vchunk) in enumerate(order):
        chunk = chunk_index(stage, vchunk, pp, layout)
        msg_in = input_message(kind, mb, chunk, num_chunks)
        msg_out = output_message(kind, mb, chunk, num_chunks)
        consumer = index - 1 if index - 1 in paired else index
        after = index + 2 if index in paired else index + 1
        if msg_in is not None and not is_local(msg_in, pp, layout):
            ops.append((keys[msg_in], P2POp(RECV, stage_of(msg_in.src_chunk, pp, layout), msg_in), consumer))
        if msg_out is not None and not is_local(msg_out, pp, layout):
            ops.append((keys[msg_out], P2POp(SEND, stage_of(msg_out.dst_chunk, pp, layout), msg_out), after))
    ops.sort(key=lambda item: item[0])
    return ops


def _place(ops, prefetch: bool) -> List[int]:
    """Posting point of each op (point p = after compute p-1 = before compute p)."""
    points = [0] * len(ops)
    if prefetch:
        previous = 0
        for i, (_, op, where) in enumerate(ops):
            points[i] = where if op.op == SEND else previous
            previous = points[i]
    else:
        following = None
        for i in range(len(ops) - 1, -1, -1):
            _, op, where = ops[i]
            points[i] = where if op.op == SEND or following is None else min(where, following)
            following = points[i]
    for i, (_, op, where) in enumerate(ops):
        late = op.op == RECV and points[i] > where
        if late or (i and points[i] < points[i - 1]):
            raise ScheduleError(f"cannot place {op} in key order (point {points[i]})")
    return points


def _batches_at_points(ops, points, num_points: int) -> List[List[Batch]]:
    """Group ops per point into batches: consecutive, same peer, at most one receive."""
    per_point: List[List[List[P2POp]]] = [[] for _ in range(num_points)]
    for (_, op, _), point in zip(ops, points):
        batches = per_point[point]
        last = batches[-1] if batches else None
        if last and last[0].peer == op.peer and not (op.op == RECV and any(o.op == RECV for o in last)):
            last.append(op)
        else:
            batches.append([op])
    return [[tuple(b) for b in batches] for batches in per_point]


def posting_programs(orders: Sequence[ComputeOrder], pp: int, vpp: int, layout: str = LOOP,
                     paired: Optional[Sequence[Set[int]]] = None) -> Dict[bool, List[List[List[Batch]]]]:
    """{prefetch: per stage, per point 0..n, the batches posted there} for both modes."""
    # Any timing consistent with the orders gives a deadlock-free global order; these are the
    # unit costs the tables are built for.
    times = (simulate_compute(orders, pp, vpp, 1, 1, 1, layout, paired) if has_weight_actions(orders)
             else simulate_compute(orders, pp, vpp, layout=layout, paired=paired))
    num_chunks = num_model_chunks(pp, vpp, layout)
    keys: Dict[Message, tuple] = {}
    for stage, order in enumerate(orders):
        for (kind, mb, vchunk), (_, finish) in zip(order, times[stage]):
            msg = output_message(kind, mb, chunk_index(stage, vchunk, pp, layout), num_chunks)
            if msg is not None:
                keys[msg] = message_key(msg, finish)
    out: Dict[bool, List[List[List[Batch]]]] = {False: [], True: []}
    for stage, order in enumerate(orders):
        ops = _stage_ops(stage, order, keys, pp, vpp, layout, paired[stage] if paired else frozenset())
        for prefetch in (False, True):
            points = _place(ops, prefetch)
            out[prefetch].append(_batches_at_points(ops, points, len(order) + 1))
    return out
