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

Paired tables (overlap.ep_pairing, pipeline/paired.py and zbv_paired.py): a paired F and the
B after it run as one overlapped action, as the executor runs them: the pair starts once both
inputs have arrived (both receives are posted before it), its F part and B part take what
`pair_duration(f_chunk, b_chunk)` says (the two sides' compute and each side's exchanges left
exposed beside the other's compute, simulate/pairing.py), and nothing is posted between them.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from mpoverlap.pipeline.actions import (BACKWARD, LOOP_MTP, RECV, SEND, WEIGHT, ScheduleError, chunk_index,
                                        num_model_chunks)
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
    # per stage, per action: (pair role, partner's chunk) as _Compiled.actions (0, -1: unpaired)
    pairs: List[List[Tuple[int, int]]] = None


@lru_cache(maxsize=128)
def _tables(kind: str, pp: int, vpp: int, microbatches: int, pairing: bool, mtp_chunk: bool = False):
    """build_schedule's tables, built once for both posting programs (each table carries both);
    `mtp_chunk`: the loop_mtp layout's, the MTP chunk pp*vpp on stage 0."""
    return tuple(tuple(t) for t in build_schedule(kind, pp, vpp, microbatches, pairing=pairing, mtp_chunk=mtp_chunk))


@lru_cache(maxsize=256)
def _programs(pp: int, vpp: int, microbatches: int, overlap: bool, schedule: Optional[str] = None,
              pairing: bool = False, mtp_chunk: bool = False):
    """Per stage, the executor's steps: ("post", batch id), ("wait", batch id) or
    ("compute", action index); with the batches (tuples of P2POp) and the actions.
    `pairing`: the paired table (build_schedule's)."""
    tables = _tables(schedule or schedule_kind(vpp), pp, vpp, microbatches, pairing, mtp_chunk)
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
    whether its send is a local hand-over, send id or -1, pair role, partner's chunk, partner's
    recv id or -1) with pair role 0 unpaired, 1 a paired F (its partner the B after it), 2 that B
    (its partner the F before it)."""

    programs: tuple
    steps: tuple
    mids: tuple
    actions: tuple
    messages: int
    kinds: frozenset


@lru_cache(maxsize=256)
def _compiled(pp: int, vpp: int, microbatches: int, overlap: bool, schedule: Optional[str] = None,
              pairing: bool = False, mtp_chunk: bool = False) -> _Compiled:
    programs = _programs(pp, vpp, microbatches, overlap, schedule, pairing, mtp_chunk)
    ids: Dict[object, int] = {}

    def mid(message) -> int:
        return ids.setdefault(message, len(ids))

    def recv_id(action) -> int:
        return -1 if action.recv is None else mid(action.recv)

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
        compiled = []
        for i, a in enumerate(table):
            role, partner = 0, None
            if a.paired:
                role, partner = 1, table[i + 1]
            elif i > 0 and table[i - 1].paired:
                role, partner = 2, table[i - 1]
            compiled.append((a.kind, a.chunk, recv_id(a), a.send in local, -1 if a.send is None else mid(a.send), role,
                             -1 if partner is None else partner.chunk, -1 if partner is None else recv_id(partner)))
        actions.append(tuple(compiled))
    kinds = frozenset(a.kind for _, _, table in programs for a in table)
    return _Compiled(programs, tuple(steps), tuple(mids), tuple(actions), len(ids), kinds)


def run_pipeline(pp: int, vpp: int, microbatches: int, duration: Callable[[str, int], float],
                 hop_time: Callable[[int, int], float], overlap: bool,
                 first_extra: Sequence[float] = (), schedule: Optional[str] = None,
                 pair_duration: Optional[Callable[[int, int], Tuple[float, float]]] = None,
                 mtp_chunk: bool = False) -> PipelineRun:
    """`duration(kind, chunk)`: seconds of one action (kind "F", "B", and "W" for a zero-bubble
    `schedule`, whose "B" is then the input gradient only); `hop_time(src_stage, dst_stage)`:
    seconds of one message; `first_extra[s]`: seconds added to stage s's first action (a
    parameter gather it waits for). `schedule`: a pipeline.SCHEDULE_KINDS value (None: from vpp).
    A message between two chunks of one stage (zbv's turn) is ready when its producer ends.
    `pair_duration(f_chunk, b_chunk)`: runs the schedule's paired table (overlap.ep_pairing),
    each pair taking (its F part, its B part) seconds; `duration` then times the lone actions.
    `mtp_chunk`: the loop_mtp tables (parallel.mtp_stage=0), the MTP chunk pp*vpp on stage 0 and
    its two messages (the head chunk's output to it, its gradient back) on the pp link."""
    overlap = bool(overlap)
    prog = _compiled(pp, vpp, microbatches, overlap, schedule, pair_duration is not None, mtp_chunk)
    layout = LOOP_MTP if mtp_chunk else chunk_layout(schedule or schedule_kind(vpp))
    num_chunks = num_model_chunks(pp, vpp, layout)
    dur = {(k, c): duration(k, c) for k in sorted(prog.kinds) for c in range(num_chunks)}
    pair_dur: Dict[Tuple[int, int], Tuple[float, float]] = {}
    for actions in prog.actions:
        for kind, chunk, _, _, _, role, partner, _ in actions:
            if role == 1 and (chunk, partner) not in pair_dur:
                pair_dur[(chunk, partner)] = pair_duration(chunk, partner)
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
    held = [-1] * pp  # per stage, a paired F's local hand-over, ready when its pair ends
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
                    kind, chunk, recv, local_send, send, role, partner, partner_recv = actions[index]
                    start = now
                    if overlap and role != 2:  # a pair starts once both its inputs exist
                        if recv >= 0:
                            ready = done[recv]
                            if ready is None:
                                break
                            start = max(start, ready)
                        if role == 1 and partner_recv >= 0:
                            ready = done[partner_recv]
                            if ready is None:
                                break
                            start = max(start, ready)
                        exposed[stage] += start - now
                    if role == 0:
                        took = dur[(kind, chunk)]
                    else:  # its B part right after its F part
                        took = pair_dur[(chunk, partner)][0] if role == 1 else pair_dur[(partner, chunk)][1]
                    took += first_extra[stage] if index == 0 and first_extra else 0.0
                    times[stage].append((start, start + took))
                    busy[stage] += took
                    now = start + took
                    if local_send and role == 1:  # a pair's sends leave after its B part
                        held[stage] = send
                    elif local_send:
                        done[send] = now
                    if role == 2 and held[stage] >= 0:
                        done[held[stage]], held[stage] = now, -1
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
    pairs = [[(a[5], a[6]) for a in actions] for actions in prog.actions]
    return PipelineRun(times=times, orders=orders, busy=busy, p2p_in_flight=in_flight, ledger_in_flight=ledger_in,
                       ledger_exposed=exposed, ends=ends, layout=layout,
                       pairs=pairs)


def last_backward_spans(run: PipelineRun, stage: int, pp: int) -> Dict[int, Tuple[float, float]]:
    """Per model chunk of `stage`, (start, end) of its last backward: the one whose gradients the
    DP buckets reduce (they fire on the last microbatch); with W actions (zero bubble) the last
    W, whose weight gradients complete the buckets (the MTP chunk, which has no W: its last B)."""
    backward: Dict[int, Tuple[float, float]] = {}
    weight: Dict[int, Tuple[float, float]] = {}
    for (kind, _mb, vchunk), span in zip(run.orders[stage], run.times[stage]):
        if kind in (BACKWARD, WEIGHT):
            (weight if kind == WEIGHT else backward)[chunk_index(stage, vchunk, pp, run.layout)] = span
    return {chunk: weight.get(chunk, span) for chunk, span in backward.items()}
