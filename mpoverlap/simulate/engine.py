"""Discrete-event run of the pipeline executor's programs (mpoverlap/pipeline/schedules.py).

Each stage runs its action table as `PipelineExecutor` does: per action, the batches of p2p
ops posted before it, its compute, the batches posted after it; overlap off (the "lazy"
program) waits every batch right after posting it, overlap on (the "prefetch" program) waits
a receive just before the compute that consumes it and the sends only at the end of the step.

A transfer is a rendezvous, as NCCL's send/recv and gloo's are for the activations a
pipeline sends: it starts once both ends have posted (and the link from sender to receiver
is free: transfers on one link go one at a time) and completes `hop_time` later, for the
sender and the receiver alike. So with overlap off a sender is held until its peer reaches
the receive (posted as late as the global posting order lets it), and the two stages run in
near lock-step; with overlap on the receives are posted ahead and the sender rarely waits.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from mpoverlap.pipeline.actions import BACKWARD, RECV, SEND, WEIGHT, ScheduleError, chunk_index
from mpoverlap.pipeline.schedules import build_schedule, chunk_layout, schedule_kind


@dataclass
class PipelineRun:
    times: List[List[Tuple[float, float]]]  # per stage, (start, end) of each action in order
    orders: List[List[Tuple[str, int, int]]]  # per stage, (kind, microbatch, vchunk)
    busy: List[float]  # per stage, seconds computing
    p2p_in_flight: List[float]  # per stage, seconds its sends and receives were on a link
    # As the ledger counts p2p handles (one per posted batch): in flight from post to
    # completion (a receive posted ahead counts while its producer still computes), exposed =
    # blocked in a wait (also while the producer computes: pipeline idle shows up here).
    ledger_in_flight: List[float] = None
    ledger_exposed: List[float] = None
    ends: List[float] = None  # per stage, when its last handle completed (run() returns)
    layout: str = "loop"  # how the schedule placed the chunks (pipeline/actions.py)


@lru_cache(maxsize=256)
def _programs(pp: int, vpp: int, microbatches: int, overlap: bool, schedule: Optional[str] = None):
    """Per stage, the executor's steps: ("post", batch id), ("wait", batch id) or
    ("compute", action index); with the batches (tuples of P2POp) and the actions."""
    tables = build_schedule(schedule or schedule_kind(vpp), pp, vpp, microbatches)
    out = []
    for table in tables:
        steps, batches = [], []

        def posts(group) -> None:
            for batch in group:
                batches.append(batch)
                steps.append(("post", len(batches) - 1))
                if not overlap:
                    steps.append(("wait", len(batches) - 1))

        for index, action in enumerate(table):
            before, after = action.batches(overlap)
            posts(before)
            steps.append(("compute", index))
            posts(after)
        out.append((tuple(steps), tuple(batches), tuple(table)))
    return tuple(out)


def run_pipeline(pp: int, vpp: int, microbatches: int, duration: Callable[[str, int], float],
                 hop_time: Callable[[int, int], float], overlap: bool,
                 first_extra: Sequence[float] = (), schedule: Optional[str] = None) -> PipelineRun:
    """`duration(kind, chunk)`: seconds of one action (kind "F", "B", and "W" for a zero-bubble
    `schedule`, whose "B" is then the input gradient only); `hop_time(src_stage, dst_stage)`:
    seconds of one message; `first_extra[s]`: seconds added to stage s's first action (a
    parameter gather it waits for). `schedule`: a pipeline.SCHEDULE_KINDS value (None: from vpp).
    A message between two chunks of one stage (zbv's turn) is ready when its producer ends."""
    programs = _programs(pp, vpp, microbatches, bool(overlap), schedule)
    local = set()
    for _, _, table in programs:
        here = {a.chunk for a in table}
        local |= {a.send for a in table if a.send is not None and a.send.dst_chunk in here}
    num_chunks = pp * vpp
    kinds = {a.kind for _, _, table in programs for a in table}
    dur = {(k, c): duration(k, c) for k in kinds for c in range(num_chunks)}
    hops = {(a, b): hop_time(a, b) for a in range(pp) for b in range(pp) if a != b}
    posted: Dict[Tuple[str, object], float] = {}  # (SEND|RECV, message) -> post time
    done: Dict[object, float] = {}  # message -> when its transfer completed
    link_free: Dict[Tuple[int, int], float] = {}
    in_flight = [0.0] * pp

    def post(stage: int, op, at: float) -> None:
        posted[(op.op, op.message)] = at
        other = RECV if op.op == SEND else SEND
        if (other, op.message) not in posted:
            return
        src, dst = (stage, op.peer) if op.op == SEND else (op.peer, stage)
        start = max(at, posted[(other, op.message)], link_free.get((src, dst), 0.0))
        hop = hops[(src, dst)]
        done[op.message] = link_free[(src, dst)] = start + hop
        in_flight[src] += hop
        in_flight[dst] += hop

    times: List[List[Tuple[float, float]]] = [[] for _ in range(pp)]
    free, busy = [0.0] * pp, [0.0] * pp
    post_time: List[Dict[int, float]] = [{} for _ in range(pp)]
    exposed = [0.0] * pp
    position = [0] * pp
    remaining = sum(len(steps) for steps, _, _ in programs)
    while remaining:
        progressed = False
        for stage, (steps, batches, table) in enumerate(programs):
            while position[stage] < len(steps):
                what, index = steps[position[stage]]
                if what == "post":
                    post_time[stage][index] = free[stage]
                    for op in batches[index]:
                        post(stage, op, free[stage])
                elif what == "wait":
                    if any(op.message not in done for op in batches[index]):
                        break
                    end = max([free[stage]] + [done[op.message] for op in batches[index]])
                    exposed[stage] += end - free[stage]
                    free[stage] = end
                else:
                    action = table[index]
                    start = free[stage]
                    if overlap and action.recv is not None:
                        if action.recv not in done:
                            break
                        start = max(start, done[action.recv])
                        exposed[stage] += start - free[stage]
                    took = dur[(action.kind, action.chunk)] + (first_extra[stage] if index == 0 and first_extra else 0.0)
                    times[stage].append((start, start + took))
                    busy[stage] += took
                    free[stage] = start + took
                    if action.send in local:
                        done[action.send] = free[stage]
                position[stage] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ScheduleError("simulated pipeline deadlocked (no stage can proceed)")
    ledger_in, ends = [0.0] * pp, list(free)
    for stage, (_, batches, _) in enumerate(programs):
        for index, batch in enumerate(batches):
            complete = max(done[op.message] for op in batch)
            ledger_in[stage] += complete - post_time[stage][index]
            ends[stage] = max(ends[stage], complete)
        exposed[stage] += ends[stage] - free[stage]  # run() waits the sends still in flight
    orders = [[(a.kind, a.microbatch, a.vchunk) for a in table] for _, _, table in programs]
    return PipelineRun(times=times, orders=orders, busy=busy, p2p_in_flight=in_flight, ledger_in_flight=ledger_in,
                       ledger_exposed=exposed, ends=ends, layout=chunk_layout(schedule or schedule_kind(vpp)))


def last_backward_spans(run: PipelineRun, stage: int, pp: int) -> Dict[int, Tuple[float, float]]:
    """Per model chunk of `stage`, (start, end) of its last backward: the one whose gradients the
    DP buckets reduce (they fire on the last microbatch); with W actions (zero bubble) the last
    W, whose weight gradients complete the buckets."""
    spans: Dict[int, Tuple[float, float]] = {}
    last = WEIGHT if any(kind == WEIGHT for kind, _, _ in run.orders[stage]) else BACKWARD
    for (kind, _mb, vchunk), span in zip(run.orders[stage], run.times[stage]):
        if kind == last:
            spans[chunk_index(stage, vchunk, pp, run.layout)] = span
    return spans
