"""Discrete-event run of the pipeline schedule's action tables (mpoverlap/pipeline/schedules.py).

Every stage runs its compute order; an action starts when its stage is free and the message
it consumes (`actions.input_message`) has arrived. A message leaves when its producer ends
(and the link from its stage to the peer is free: transfers on one link go one at a time) and
arrives `hop_time` later. With PP overlap on, sends and receives are posted ahead and the
stage computes on while they fly; off, the sending stage is blocked until its send completes
(the executor waits each batch at once).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Sequence, Tuple

from mpoverlap.pipeline.actions import BACKWARD, FORWARD, ScheduleError, chunk_index, input_message, output_message
from mpoverlap.pipeline.schedules import compute_orders, schedule_kind


@dataclass
class PipelineRun:
    times: List[List[Tuple[float, float]]]  # per stage, (start, end) of each action in order
    orders: List[List[Tuple[str, int, int]]]  # per stage, (kind, microbatch, vchunk)
    busy: List[float]  # per stage, seconds computing
    p2p_in_flight: List[float]  # per stage, seconds its sends and receives were on a link
    # As the ledger counts p2p handles: in flight from post to completion (a receive posted
    # ahead counts while its producer still computes), exposed = blocked in a wait (also while
    # the producer computes: pipeline idle shows up here).
    ledger_in_flight: List[float] = None
    ledger_exposed: List[float] = None

    @property
    def ends(self) -> List[float]:
        return [t[-1][1] if t else 0.0 for t in self.times]


def run_pipeline(pp: int, vpp: int, microbatches: int, duration: Callable[[str, int], float],
                 hop_time: Callable[[int, int], float], overlap: bool,
                 first_extra: Sequence[float] = ()) -> PipelineRun:
    """`duration(kind, chunk)`: seconds of one action; `hop_time(src_stage, dst_stage)`: seconds
    of one message; `first_extra[s]`: seconds added to stage s's first action (a parameter
    gather it waits for)."""
    orders = compute_orders(schedule_kind(vpp), pp, vpp, microbatches)
    num_chunks = pp * vpp
    dur = {(k, c): duration(k, c) for k in (FORWARD, BACKWARD) for c in range(num_chunks)}
    hops = {(a, b): hop_time(a, b) for a in range(pp) for b in range(pp) if a != b}
    # Per stage: (duration key, consumed message key, produced message key, peer stage); a
    # message key is (kind, microbatch, source chunk) as `input_message`/`output_message` say.
    plans = []
    for stage, order in enumerate(orders):
        plan = []
        for kind, mb, vchunk in order:
            chunk = chunk_index(stage, vchunk, pp)
            need, out = input_message(kind, mb, chunk, num_chunks), output_message(kind, mb, chunk, num_chunks)
            plan.append(((kind, chunk), None if need is None else (need.kind, mb, need.src_chunk),
                         None if out is None else (out.kind, mb, out.src_chunk),
                         None if out is None else out.dst_chunk % pp))
        plans.append(plan)
    arrival: Dict[Tuple, float] = {}
    link_free: Dict[Tuple[int, int], float] = {}
    times: List[List[Tuple[float, float]]] = [[] for _ in range(pp)]
    free = [0.0] * pp
    busy = [0.0] * pp
    in_flight = [0.0] * pp
    led_in, led_exp = [0.0] * pp, [0.0] * pp
    prev_start = [0.0] * pp
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for stage, plan in enumerate(plans):
            done = times[stage]
            while len(done) < len(plan):
                key, need, out, dst = plan[len(done)]
                if need is not None and need not in arrival:
                    break
                start = max(free[stage], arrival[need] if need is not None else 0.0)
                if need is not None:
                    posted = prev_start[stage] if overlap else free[stage]
                    led_in[stage] += max(arrival[need], posted) - posted
                    led_exp[stage] += start - free[stage]
                prev_start[stage] = start
                took = dur[key] + (first_extra[stage] if not done and first_extra else 0.0)
                end = start + took
                busy[stage] += took
                done.append((start, end))
                free[stage] = end
                if out is not None:
                    leave = max(end, link_free.get((stage, dst), 0.0))
                    hop = hops[(stage, dst)]
                    arrival[out] = leave + hop
                    link_free[(stage, dst)] = leave + hop
                    in_flight[stage] += hop
                    in_flight[dst] += hop
                    led_in[stage] += leave + hop - end
                    if not overlap:
                        free[stage] = leave + hop
                        led_exp[stage] += leave + hop - end
                remaining -= 1
                progressed = True
        if not progressed:
            raise ScheduleError("simulated pipeline deadlocked (no stage can proceed)")
    return PipelineRun(times=times, orders=orders, busy=busy, p2p_in_flight=in_flight, ledger_in_flight=led_in,
                       ledger_exposed=led_exp)


def last_backward_spans(run: PipelineRun, stage: int, pp: int) -> Dict[int, Tuple[float, float]]:
    """Per model chunk of `stage`, (start, end) of its last backward: the one whose gradients the
    DP buckets reduce (they fire on the last microbatch)."""
    spans: Dict[int, Tuple[float, float]] = {}
    for (kind, _mb, vchunk), span in zip(run.orders[stage], run.times[stage]):
        if kind == BACKWARD:
            spans[chunk_index(stage, vchunk, pp)] = span
    return spans
