"""Per-step ledger: sums every waited CommHandle per mode.

`time_s` is the wall time during which at least one handle of the mode was in flight (the
union of issue-to-completion intervals, so handles queued behind each other are not counted
twice), `exposed_s` the time compute sat blocked on them (the union of the blocked spans: in
wait(), and on CPU inside the post itself, see handle.py).
Each blocked span lies inside its handle's in-flight interval (see handle.py), so
0 <= exposed_s <= time_s for every mode, step and rank; exposed_s / time_s is the share of
that mode's communication that overlap failed to hide.

Completion: most backends call back when a handle completes. Gloo's point-to-point and
reduce-scatter works give no completion future and report `is_completed()` False until
waited, so for them `wait_in_background` waits on a small thread pool owned by the ledger
and stamps the completion time there; the handle's own wait() then waits for that task.
Their in-flight time so ends when the transfer ends, not at the wait (which could be a whole
compute phase later and would inflate time_s). Waiting a gloo work never drives its progress
(sends and receives are posted at issue), so a queued background wait cannot deadlock.

Strict mode (`CommLedger(strict=True)`, or the environment variable MPOVERLAP_STRICT_LEDGER=1,
which the test suite sets and spawned workers inherit; off by default): the ledger also keeps
every handle from its issue, with a short stack of the issuing site, and `end_step()` raises
UnwaitedCommError naming the mode, op and site of each handle nobody waited. A handle that is
meant to cross the step boundary (the parameter all-gathers a distributed optimizer leaves for
the next forward) says so with `handle.carry_over()` and must be waited before the next one.

CUDA timing events (three per handle: at issue, before and after the wait) come from a pool
the ledger owns: `end_step()` resolves the handles whose last event has completed (a query,
no synchronisation) and returns their events to the pool, so the events alive are about those
of one step, not of every step since the last log step; `summary()` synchronises only on the
handles still unresolved then.

An optional `recorder` (a callable, None by default) sees every handle as it is recorded, for
the profiler's per-handle timeline; with it unset recording costs one attribute test.
"""
from __future__ import annotations

import os
import sys
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional, Tuple

FIELDS = ("ops", "bytes", "link_bytes", "time_s", "exposed_s")
BACKGROUND_WAITERS = 16
STRICT_ENV = "MPOVERLAP_STRICT_LEDGER"
_STACK_FRAMES = 4  # issuing-site frames kept per handle in strict mode (outside comm/)
_COMM_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


class UnwaitedCommError(RuntimeError):
    """Strict ledger: handles issued in a step that nobody waited (a data race on NCCL)."""


def _cuda_timing_event():
    import torch

    return torch.cuda.Event(enable_timing=True)


def issuing_site() -> str:
    """The innermost frames outside mpoverlap/comm that led to this issue, innermost first
    (a walk up the frames: no source lines read, a few microseconds)."""
    parts, frame = [], sys._getframe(1)
    while frame is not None and len(parts) < _STACK_FRAMES:
        code = frame.f_code
        if not code.co_filename.startswith(_COMM_DIR):
            parts.append(f"{os.path.basename(code.co_filename)}:{frame.f_lineno} {code.co_name}")
        frame = frame.f_back
    return " <- ".join(parts)


class EventPool:
    """CUDA timing events for reuse: `take()` one (made by `factory` when the pool is empty),
    `give(events)` back once read. `created` counts the events ever made."""

    def __init__(self, factory: Callable[[], Any] = _cuda_timing_event) -> None:
        self.factory, self._free, self.created = factory, [], 0

    def take(self):
        if self._free:
            return self._free.pop()
        self.created += 1
        return self.factory()

    def give(self, events) -> None:
        self._free.extend(e for e in events if e is not None)


class CommLedger:
    def __init__(self, strict: Optional[bool] = None, event_factory: Optional[Callable[[], Any]] = None) -> None:
        self.strict = os.environ.get(STRICT_ENV, "0") == "1" if strict is None else bool(strict)
        self._open: Dict[int, Any] = {}  # strict: id -> handle issued and not yet waited
        self.events = EventPool(event_factory or _cuda_timing_event)
        self._totals: Dict[str, Dict[str, float]] = defaultdict(lambda: dict.fromkeys(FIELDS, 0.0))
        self._intervals: Dict[str, List[Tuple[float, float]]] = defaultdict(list)
        self._blocked: Dict[str, List[Tuple[float, float]]] = defaultdict(list)
        self._unresolved: List = []  # CUDA handles whose events are read at summary time
        self._waiters: Optional[ThreadPoolExecutor] = None  # made on first use
        # Called with each handle at record() (right after its wait, before CUDA timings are
        # resolved: the recorder resolves them itself when it needs them). Off when None.
        self.recorder: Optional[Callable[[object], None]] = None

    def wait_in_background(self, works: List, on_complete: Callable[[], None]) -> Future:
        """Wait `works` on a pool thread, then call `on_complete` (stamps the completion time).
        The returned future re-raises the backend's error (a timeout) in whoever takes its result."""
        if self._waiters is None:
            self._waiters = ThreadPoolExecutor(BACKGROUND_WAITERS, thread_name_prefix="mpoverlap-comm-wait")

        def wait_all_works() -> None:
            for work in works:
                work.wait()
            on_complete()
        return self._waiters.submit(wait_all_works)

    def issued(self, handle) -> None:
        """Strict mode: remember `handle` (and where it was issued) until it is waited."""
        if self.strict:
            handle.site = issuing_site()
            self._open[id(handle)] = handle

    def close(self) -> None:
        """Let the background waits still queued finish and stop the pool's threads (at the end
        of a run, before its process groups are destroyed). A later wait_in_background makes a
        new pool."""
        if self._waiters is not None:
            self._waiters.shutdown(wait=True)
            self._waiters = None

    def record(self, handle) -> None:
        self._open.pop(id(handle), None)
        if self.recorder is not None:
            self.recorder(handle)
        if handle.uses_cuda_events:
            self._unresolved.append(handle)
            return
        self._add(handle)

    def record_span(self, mode: str, op: str, nbytes: int, start: float, end: float,
                    blocked: Optional[Tuple[float, float]] = None) -> None:
        """Communication that went through no handle (the stop agreement's store requests,
        training/stop_agreement.py): one op of `nbytes`, in flight over [start, end], and
        `blocked` the span compute waited on it."""
        row = self._totals[mode]
        row["ops"] += 1
        row["bytes"] += nbytes
        row["link_bytes"] += nbytes  # a store request: all of it crosses the link
        self._intervals[mode].append((min(start, end), end))
        if blocked is not None and blocked[1] > blocked[0]:
            self._blocked[mode].append((max(blocked[0], min(start, end)), min(blocked[1], end)))

    def end_step(self) -> None:
        """The step boundary: resolve the CUDA timings already complete (their events go back
        to the pool) and, in strict mode, raise for every handle nobody waited. A handle marked
        `carry_over()` may stay open across one boundary, not two."""
        still = []
        for handle in self._unresolved:
            if handle.resolve_timing(block=False):
                self._add(handle)
            else:
                still.append(handle)
        self._unresolved = still
        if not self.strict:
            return
        unwaited = []
        for key, handle in list(self._open.items()):
            if handle.carried and not handle.crossed_boundary:
                handle.crossed_boundary = True
                continue
            unwaited.append(handle)
            del self._open[key]
        if unwaited:
            lines = [f"  {h.mode}:{h.op} {h.nbytes} B issued at {h.site}" for h in unwaited]
            raise UnwaitedCommError(f"{len(unwaited)} communication handle(s) issued and never waited before the "
                                    "step ended (on NCCL nothing orders compute after them):\n" + "\n".join(lines))

    def _add(self, handle) -> None:
        row = self._totals[handle.mode]
        row["ops"] += 1
        row["bytes"] += handle.nbytes
        row["link_bytes"] += handle.link_bytes
        end = handle.completed_at if handle.completed_at is not None else handle.issued_at
        self._intervals[handle.mode].append((handle.issued_at, end))
        if handle.wait_began_at is not None and handle.wait_ended_at > handle.wait_began_at:
            self._blocked[handle.mode].append((handle.wait_began_at, handle.wait_ended_at))
        if handle.post_span is not None:
            self._blocked[handle.mode].append(handle.post_span)

    def summary(self, per: int = 1) -> Dict[str, Dict[str, float]]:
        """{mode: {ops, bytes, link_bytes, time_s, exposed_s}} for the modes that communicated, divided by
        `per` (the number of steps recorded, for per-step figures)."""
        for handle in self._unresolved:
            handle.resolve_timing(block=True)
            self._add(handle)
        self._unresolved.clear()
        out = {}
        for mode, row in self._totals.items():
            in_flight = union_length(self._intervals[mode])
            # The blocked spans are sub-intervals of the in-flight ones; min() only absorbs
            # the last-bit rounding of summing the two unions differently.
            exposed = min(union_length(self._blocked[mode]), in_flight)
            out[mode] = {"ops": row["ops"] / per, "bytes": row["bytes"] / per, "link_bytes": row["link_bytes"] / per,
                         "time_s": in_flight / per, "exposed_s": exposed / per}
        return out

    def reset(self, per: int = 1) -> Dict[str, Dict[str, float]]:
        out = self.summary(per)
        self._totals.clear()
        self._intervals.clear()
        self._blocked.clear()
        return out


def union_length(intervals: List[Tuple[float, float]]) -> float:
    """Total length covered by possibly overlapping [start, end] intervals."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def mean_over_ranks(summaries: List[Dict[str, Dict[str, float]]]) -> Dict[str, Dict[str, float]]:
    """Average each mode's figures over the ranks that report (ops and bytes are per rank)."""
    n = len(summaries)
    modes = sorted({m for s in summaries for m in s})
    out = {}
    for mode in modes:
        row = {f: sum(s.get(mode, {}).get(f, 0.0) for s in summaries) / n for f in FIELDS}
        row["ops"] = round(row["ops"], 3)
        row["bytes"] = int(round(row["bytes"]))
        row["link_bytes"] = int(round(row["link_bytes"]))
        out[mode] = row
    return out
