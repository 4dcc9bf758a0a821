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


@dataclass(frozen=True)
class _Compiled:
    """`_programs` with every message numbered, so that a run indexes lists instead of hashing
    messages, and each blocking step (a wait or a compute) fused with the posts after it, which
    never block (the search simulates thousands of programs). Per stage, `steps`: (head, index,
    posted batch ids, their ops) with head 0 none (the posts before the first compute) / 1 wait
    of batch `index` / 2 compute of action `index`; an op is (is_send, message id, src stage,
    dst stage). `mids[batch]`: the batch's message ids; `actions`: (kind, chunk, recv id or -1,
    whether its send is a local hand-over, send id or -1)."""

    programs: tuple
    steps: tuple
    mids: tuple
    actions: tuple
    messages: int
    kinds: frozenset


@lru_cache(maxsize=256)
def _compiled(pp: int, vpp: int, microbatches: int, overlap: bool, schedule: Optional[str] = None) -> _Compiled:
    programs = _programs(pp, vpp, microbatches, overlap, schedule)
    ids: Dict[object, int] = {}

    def mid(message) -> int:
        return ids.setdefault(message, len(ids))

    local = set()
    for _, _, table in programs:
        here = {a.chunk for a in table}
        local |= {a.send for a in table if a.send is not None and a.send.dst_chunk in here}
    steps, mids, actions = [], [], []
    for stage, (stage_steps, batches, table) in enumerate(programs):
        ops = [tuple((op.op == SEND, mid(op.message), *((stage, op.peer) if op.op == SEND else (op.peer, stage)))
                     for op in batch) for batch in batches]
        fused = []  # [head, index, batch ids, ops]
        for what, index in stage_steps:
            if what == "post":
                if not fused:
                    fused.append([0, -1, [], []])
                fused[-1][2].append(index)
                fused[-1][3].extend(ops[index])
            else:
                fused.append([1 if what == "wait" else 2, index, [], []])
        steps.append(tuple((head, index, tuple(posted), tuple(posted_ops)) for head, index, posted, posted_ops in fused))
        mids.append(tuple(tuple(mid(op.message) for op in batch) for batch in batches))
        actions.append(tuple((a.kind, a.chunk, -1 if a.recv is None else mid(a.recv), a.send in local,
                              -1 if a.send is None else mid(a.send)) for a in table))
    kinds = frozenset(a.kind for _, _, table in programs for a in table)
    return _Compiled(programs, tuple(steps), tuple(mids), tuple(actions), len(ids), kinds)


def run_pipeline(pp: int, vpp: int, microbatches: int, duration: Callable[[str, int], float],
                 hop_time: Callable[[int, int], float], overlap: bool,
                 first_extra: Sequence[float] = (), schedule: Optional[str] = None) -> PipelineRun:
    """`duration(kind, chunk)`: seconds of one action (kind "F", "B", and "W" for a zero-bubble
    `schedule`, whose "B" is then the input gradient only); `hop_time(src_stage, dst_stage)`:
    seconds of one message; `first_extra[s]`: seconds added to stage s's first action (a
    parameter gather it waits for). `schedule`: a pipeline.SCHEDULE_KINDS value (None: from vpp).
    A message between two chunks of one stage (zbv's turn) is ready when its producer ends."""
    overlap = bool(overlap)
    prog = _compiled(pp, vpp, microbatches, overlap, schedule)
    num_chunks = pp * vpp
    dur = {(k, c): duration(k, c) for k in sorted(prog.kinds) for c in range(num_chunks)}
    hops = [0.0] * (pp * pp)  # by src * pp + dst
    for a in range(pp):
        for b in range(pp):
            if a != b:
                hops[a * pp + b] = hop_time(a, b)
    n = prog.messages
    posted_send: List[Optional[float]] = [None] * n  # message id -> post time of its send
    posted_recv: List[Optional[float]] = [None] * n
    done: List[Optional[float]] = [None] * n  # message id -> when its transfer completed
    link_free = [0.0] * (pp * pp)
    in_flight = [0.0] * pp

    times: List[List[Tuple[float, float]]] = [[] for _ in range(pp)]
    free, busy = [0.0] * pp, [0.0] * pp
    post_time: List[List[float]] = [[0.0] * len(m) for m in prog.mids]
    exposed = [0.0] * pp
    position = [0] * pp
    remaining = sum(len(steps) for steps in prog.steps)
    while remaining:
        progressed = False
        for stage in range(pp):
            steps, mids, actions, posted_at = prog.steps[stage], prog.mids[stage], prog.actions[stage], post_time[stage]
            pos, now, count = position[stage], free[stage], len(steps)
            while pos < count:
                head, index, batches, ops = steps[pos]
                if head == 1:  # wait
                    arrived = [done[m] for m in mids[index]]
                    if None in arrived:
                        break
                    end = max([now] + arrived)
                    exposed[stage] += end - now
                    now = end
                elif head == 2:  # compute
                    kind, chunk, recv, local_send, send = actions[index]
                    start = now
                    if overlap and recv >= 0:
                        ready = done[recv]
                        if ready is None:
                            break
                        start = max(start, ready)
                        exposed[stage] += start - now
                    took = dur[(kind, chunk)] + (first_extra[stage] if index == 0 and first_extra else 0.0)
                    times[stage].append((start, start + took))
                    busy[stage] += took
                    now = start + took
                    if local_send:
                        done[send] = now
                for b in batches:
                    posted_at[b] = now
                # posts: a transfer starts once both ends posted and its link is free
                for is_send, m, src, dst in ops:
                    if is_send:
                        posted_send[m] = now
                        other = posted_recv[m]
                    else:
                        posted_recv[m] = now
                        other = posted_send[m]
                    if other is None:
                        continue
                    link = src * pp + dst
                    start = max(now, other, link_free[link])
                    hop = hops[link]
                    done[m] = link_free[link] = start + hop
                    in_flight[src] += hop
                    in_flight[dst] += hop
                pos += 1
                remaining -= 1
                progressed = True
            position[stage], free[stage] = pos, now
        if not progressed:
            raise ScheduleError("simulated pipeline deadlocked (no stage can proceed)")
    ledger_in, ends = [0.0] * pp, list(free)
    for stage in range(pp):
        for index, batch in enumerate(prog.mids[stage]):
            complete = max(done[m] for m in batch)
            ledger_in[stage] += complete - post_time[stage][index]
            ends[stage] = max(ends[stage], complete)
        exposed[stage] += ends[stage] - free[stage]  # run() waits the sends still in flight
    orders = [[(a.kind, a.microbatch, a.vchunk) for a in table] for _, _, table in prog.programs]
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
