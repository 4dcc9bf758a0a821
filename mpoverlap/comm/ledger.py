"""Per-step ledger: sums every waited CommHandle per mode.

`time_s` is the wall time during which at least one handle of the mode was in flight (the
union of issue-to-completion intervals, so handles queued behind each other are not counted
twice), `exposed_s` the time compute sat blocked in wait(). exposed_s / time_s is the share of
that mode's communication that overlap failed to hide.

An optional `recorder` (a callable, None by default) sees every handle as it is recorded, for
the profiler's per-handle timeline; with it unset recording costs one attribute test.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Callable, Dict, List, Optional, Tuple

FIELDS = ("ops", "bytes", "time_s", "exposed_s")


class CommLedger:
    def __init__(self) -> None:
        self._totals: Dict[str, Dict[str, float]] = defaultdict(lambda: dict.fromkeys(FIELDS, 0.0))
        self._intervals: Dict[str, List[Tuple[float, float]]] = defaultdict(list)
        self._unresolved: List = []  # CUDA handles whose events are read at summary time
        self._polled: List = []  # handles whose backend gives no completion callback
        # Called with each handle at record() (right after its wait, before CUDA timings are
        # resolved: the recorder resolves them itself when it needs them). Off when None.
        self.recorder: Optional[Callable[[object], None]] = None

    def watch(self, handle) -> None:
        self._polled.append(handle)

    def poll(self) -> None:
        """Stamp completion of watched handles that finished (called at every issue/wait)."""
        if self._polled:
            self._polled = [h for h in self._polled if not h.poll()]

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
        row["exposed_s"] += handle.blocked_s
        end = handle.completed_at if handle.completed_at is not None else handle.issued_at
        self._intervals[handle.mode].append((handle.issued_at, end))

    def summary(self, per: int = 1) -> Dict[str, Dict[str, float]]:
        """{mode: {ops, bytes, time_s, exposed_s}} for the modes that communicated, divided by
        `per` (the number of steps recorded, for per-step figures)."""
        for handle in self._unresolved:
            handle.resolve_timing()
            self._add(handle)
        self._unresolved.clear()
        out = {}
        for mode, row in self._totals.items():
            out[mode] = {"ops": row["ops"] / per, "bytes": row["bytes"] / per,
                         "time_s": union_length(self._intervals[mode]) / per,
                         "exposed_s": row["exposed_s"] / per}
        return out

    def reset(self, per: int = 1) -> Dict[str, Dict[str, float]]:
        out = self.summary(per)
        self._totals.clear()
        self._intervals.clear()
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
