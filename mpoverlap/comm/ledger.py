"""Per-step ledger: sums every waited CommHandle per mode.

`time_s` is the time handles were in flight (issue to completion), `exposed_s` the time
compute sat blocked in wait(). exposed_s / time_s is the share of that mode's communication
that overlap failed to hide.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Dict, List

FIELDS = ("ops", "bytes", "time_s", "exposed_s")


class CommLedger:
    def __init__(self) -> None:
        self._totals: Dict[str, Dict[str, float]] = defaultdict(lambda: dict.fromkeys(FIELDS, 0.0))
        self._spans: List[tuple] = []
        self.keep_spans = False

    def record(self, handle) -> None:
        row = self._totals[handle.mode]
        row["ops"] += 1
        row["bytes"] += handle.nbytes
        row["time_s"] += handle.in_flight_s
        row["exposed_s"] += handle.blocked_s
        if self.keep_spans:
            self._spans.append((handle.mode, handle.op, handle.issued_at, handle.completed_at, handle.blocked_s))

    def summary(self) -> Dict[str, Dict[str, float]]:
        """{mode: {ops, bytes, time_s, exposed_s}} for the modes that communicated."""
        out = {}
        for mode, row in self._totals.items():
            out[mode] = {"ops": int(row["ops"]), "bytes": int(row["bytes"]),
                         "time_s": row["time_s"], "exposed_s": row["exposed_s"]}
        return out

    def reset(self) -> Dict[str, Dict[str, float]]:
        out = self.summary()
        self._totals.clear()
        self._spans.clear()
        return out


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
