"""CPStats: what one rank's context-parallel attention did, for tests and benchmarks.

Handed explicitly to `ring_attention` / `a2a_attention` (never global). Two things are kept:

- `counts`: work counters, keyed "<phase>.<name>" with phase "fwd" or "bwd":
    pairs_full / pairs_diag / pairs_skip  (query chunk, key chunk) pairs computed without mask,
                                           computed with the causal mask, skipped (fully masked)
    scores_computed    B*N*Q*K score entries materialised (a diagonal pair costs a full block)
    scores_visible     B*N * unmasked entries among them (the useful FLOP-equivalent)
    matmul_flops       2*D flops per computed score entry and matmul (fwd: q k^T and p v = 2;
                       bwd: recomputed q k^T, dv, dp, dq, dk = 5)
    transfers          p2p exchanges / all-to-alls issued
- `events`: (phase, what, step, perf_counter time) in program order, e.g. ("fwd", "issue", 1, t):
  the transfer feeding step 1 was issued. The driver records issue / wait / compute_begin /
  compute_end, so a test can check that a transfer was issued before the compute it hides under.
"""
from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

_MATMULS = {"fwd": 2, "bwd": 5}


@dataclass
class CPStats:
    counts: Dict[str, int] = field(default_factory=lambda: defaultdict(int))
    events: List[Tuple[str, str, int, float]] = field(default_factory=list)

    def count_pair(self, phase: str, relation: str, B: int, N: int, Q: int, K: int, D: int) -> None:
        """Record one (query chunk, key chunk) pair: relation is "full", "diag" or "skip"."""
        self.counts[f"{phase}.pairs_{relation}"] += 1
        if relation == "skip":
            return
        computed = B * N * Q * K
        visible = computed if relation == "full" else B * N * Q * (Q + 1) // 2
        self.counts[f"{phase}.scores_computed"] += computed
        self.counts[f"{phase}.scores_visible"] += visible
        self.counts[f"{phase}.matmul_flops"] += 2 * D * _MATMULS[phase] * computed

    def count_dense(self, phase: str, B: int, N: int, S: int, D: int) -> None:
        """Record one dense causal attention over a full sequence of S (the all-to-all variant)."""
        self.counts[f"{phase}.scores_computed"] += B * N * S * S
        self.counts[f"{phase}.scores_visible"] += B * N * S * (S + 1) // 2
        self.counts[f"{phase}.matmul_flops"] += 2 * D * _MATMULS[phase] * B * N * S * S

    def event(self, phase: str, what: str, step: int) -> None:
        if what.startswith("issue"):
            self.counts[f"{phase}.transfers"] += 1
        self.events.append((phase, what, step, time.perf_counter()))

    def work(self) -> Dict[str, int]:
        """The work counters only (no transfers): equal on every rank of a balanced split."""
        return {k: v for k, v in sorted(self.counts.items()) if not k.endswith("transfers")}


class NullStats(CPStats):
    """Records nothing: what the drivers use when the caller passes stats=None."""

    def count_pair(self, *args, **kwargs) -> None:
        pass

    def count_dense(self, *args, **kwargs) -> None:
        pass

    def event(self, *args, **kwargs) -> None:
        pass
