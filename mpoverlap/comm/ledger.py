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

An optional `recorder` (a callable, None by default) sees every handle as it is recorded, for
the profiler's per-handle timeline; with it unset recording costs one attribute test.
"""
from __future__ import annotations

from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Dict, List, Optional, Tuple

FIELDS = ("ops", "bytes", "time_s", "exposed_s")
BACKGROUND_WAITERS = 16


class CommLedger:
    def __init__(self) -> None:
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

    def close(self) -> None:
        """Let the background waits still queued finish and stop the pool's threads (at the end
        of a run, before its process groups are destroyed). A later wait_in_background makes a
        new pool."""
        if self._waiters is not None:
            self._waiters.shutdown(wait=True)
            self._waiters = None

    def record(self, handle) -> None:
        if self.recorder is not None:
            self.recorder(handle)
        if handle.uses_cuda_events:
            self._unresolved.append(handle)
            return
        self._add(handle)

    def _add(self, handle) -> None:
        row = self._totals[handle.mode]
        row["ops"] += 1
        row["bytes"] += handle.nbytes
        end = handle.completed_at if handle.completed_at is not None else handle.issued_at
        self._intervals[handle.mode].append((handle.issued_at, end))
        if handle.wait_began_at is not None and handle.wait_ended_at > handle.wait_began_at:
            self._blocked[handle.mode].append((handle.wait_began_at, handle.wait_ended_at))
        if handle.post_span is not None:
            self._blocked[handle.mode].append(handle.post_span)

    def summary(self, per: int = 1) -> Dict[str, Dict[str, float]]:
        """{mode: {ops, bytes, time_s, exposed_s}} for the modes that communicated, divided by
        `per` (the number of steps recorded, for per-step figures)."""
        for handle in self._unresolved:
            handle.resolve_timing()
            self._add(handle)
        self._unresolved.clear()
        out = {}
        for mode, row in self._totals.items():
            in_flight = union_length(self._intervals[mode])
            # The blocked spans are sub-intervals of the in-flight ones; min() only absorbs
            # the last-bit rounding of summing the two unions differently.
            exposed = min(union_length(self._blocked[mode]), in_flight)
            out[mode] = {"ops": row["ops"] / per, "bytes": row["bytes"] / per,
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
        out[mode] = row
    return out
