"""Closed-form pipeline bubbles: idle seconds per stage and step, for per-chunk costs F (forward),
B (input gradient) and W (weight gradients; a schedule without W actions runs B + W as one
backward). The step is synchronous (no optimizer post-validation), so the bubble is the step's
makespan minus a stage's compute: what `simulated_bubble_time` returns for the same tables.

Forms (sources: the Zero Bubble paper, Qi et al., "Zero Bubble Pipeline Parallelism", Table 2;
the DeepSeek-V3 technical report, Table 2, for DualPipe):

| schedule | bubble | exact for |
|---|---|---|
| 1f1b, interleaved (and its paired table, free p2p) | (p-1)(F+B+W), per-chunk costs | any costs |
| zb1p, vpp = 1 (ZB-H1) | (p-1)(F+B-W) | W <= min(F, B) (the paper's T_W < T_F < T_B) |
|  | (p-1) max(F, B) | W > min(F, B): the W's no longer fit the 1F1B fill |
| zb1p, vpp > 1 | (p-1)(F+B+W)/3 = (p-1) F | F = B = W only (no published form; the W's are placed for unit costs) |
| zbv (ZB-V) | (p-1) max(F, B): the fill | F <= B = W (the V's order is built for F = B = W) |
| paired V (DualPipeV) | (p-1)(FB+B-2W), FB the paired F&B action | DualPipe's table; zbv_paired.py's at F = B = W with FB = F+B |

zbv's "zero bubble" is the paper's: with F = B = W no stage idles between its own first and last
action; what the synchronous step keeps is the fill, stage s's first forward waiting for the s
chunks above it, (p-1) F against the makespan (`in_window_idle` gives the first measure).
DeepSeek's table writes B for the full backward: (PP/2-1)(F&B+B-3W) over PP/2 devices is
(p-1)(FB+(B+W)-3W) here. A serial pair (FB = F+B+W) gives (p-1)(F+2B-W); a perfect overlap
(FB = max(F, B+W)) gives (p-1)(max(F, B+W)+B-2W), (p-1) F at F = B = W: the overlap, not the
order, is what makes DualPipeV's bubble the V's. zbv_paired.py's table runs each pair's W as
its own action after the pair (FB = F+B), so even serial pairs keep the V's fill at F = B = W
(tests/test_paired_schedules.py); at other costs its bubble is not this form (reported as not
exact).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from mpoverlap.pipeline.schedules import defers_weight_grads

Costs = Tuple[float, float, float]


@dataclass(frozen=True)
class BubbleForm:
    seconds: float   # the closed form's value
    formula: str     # e.g. "(p-1)(F+B-W)"
    exact: bool      # whether the schedule's own table gives exactly this at these costs
    condition: str   # where the formula is exact

    def describe(self) -> str:
        return f"{self.formula}{'' if self.exact else ' (exact only where ' + self.condition + ')'}"


def _equal(*xs: float, rel: float = 1e-9) -> bool:
    top = max(abs(x) for x in xs) or 1.0
    return max(xs) - min(xs) <= rel * top


def closed_form_bubble(kind: str, pp: int, vpp: int, f: float, b: float, w: float,
                       paired: bool = False, fb: Optional[float] = None) -> BubbleForm:
    """The bubble of schedule `kind` at per-chunk costs F, B, W (module docstring). `paired`:
    forward/backward pairing; for zbv that is the DualPipeV-class paired V, whose pair costs
    `fb` (default: serial, F+B+W)."""
    p = pp - 1
    if pp <= 1:
        return BubbleForm(0.0, "0 (one stage)", True, "any costs")
    if kind in ("1f1b", "interleaved"):
        return BubbleForm(p * (f + b + w), "(p-1)(F+B+W)", True, "any costs")
    if kind == "zb1p" and vpp == 1:
        if w <= min(f, b) * (1 + 1e-12):
            return BubbleForm(p * (f + b - w), "(p-1)(F+B-W)", True, "W <= min(F, B)")
        return BubbleForm(p * max(f, b), "(p-1)max(F,B)", True, "W > min(F, B)")
    if kind == "zb1p":
        return BubbleForm(p * (f + b + w) / 3, "(p-1)(F+B+W)/3", _equal(f, b, w), "F = B = W")
    if kind == "zbv" and paired:
        pair = f + b + w if fb is None else fb
        return BubbleForm(p * (pair + b - 2 * w), "(p-1)(FB+B-2W)", False,
                          "DualPipe's table; zbv_paired.py's only at F = B = W with FB = F+B")
    if kind == "zbv":
        return BubbleForm(p * max(f, b), "(p-1)max(F,B)", f <= b * (1 + 1e-12) and _equal(b, w), "F <= B = W")
    raise ValueError(f"no closed form for pipeline schedule {kind!r}")


def stage_costs(kind: str, pp: int, vpp: int, cost_of) -> List[Costs]:
    """Per stage, its mean per-chunk (F, B, W) from `cost_of(kind, stage, vchunk)` (W 0 for a
    schedule without W actions)."""
    kinds = ("F", "B", "W") if defers_weight_grads(kind) else ("F", "B")
    out = []
    for s in range(pp):
        means = [sum(cost_of(k, s, v) for v in range(vpp)) / vpp for k in kinds]
        out.append(tuple(means) + (0.0,) * (3 - len(means)))
    return out


def closed_forms(kind: str, pp: int, vpp: int, per_stage: Sequence[Costs],
                 paired: bool = False) -> Tuple[Costs, BubbleForm, List[BubbleForm]]:
    """(pooled costs, the form at the pooled per-chunk costs, the form at each stage's own
    costs): both figures a report prints beside the measured or simulated bubble."""
    pooled = tuple(sum(c[i] for c in per_stage) / len(per_stage) for i in range(3))
    return (pooled, closed_form_bubble(kind, pp, vpp, *pooled, paired=paired),
            [closed_form_bubble(kind, pp, vpp, *c, paired=paired) for c in per_stage])


def in_window_idle(times: Sequence[Sequence[Tuple[float, float]]]) -> List[float]:
    """Per stage, idle time between its own first action's start and last action's end (the
    ZB paper's measure: zbv's is 0 at F = B = W) from a timed run's (start, end) per action."""
    return [t[-1][1] - t[0][0] - sum(e - s for s, e in t) for t in times]
