"""`overlap.dp_bucket_mb=auto`: the gradient bucket size the simulator predicts fastest for this
model, layout and machine.

The trade-off is the simulator's own DP model (core.py `_dp_stage`, overlap.py): each bucket's
collective costs the link's per-step latency (ring steps x `hardware.*_latency`) plus its bytes
at the link's bandwidth, and buckets are issued as the last backward produces their gradients
(the backward's time per layer, from the chunk costs). Small buckets start reducing early but
pay the latency once per bucket; large buckets pay it rarely but leave more of the reduction
after backward: the last bucket is issued only when backward ends. Each candidate size is
simulated (`CANDIDATES_MB`, 1 to 256 MiB) and the one with the shortest predicted step is
chosen (on a tie, the smaller exposed DP time, then the smaller bucket: less memory in flight).

A number given for overlap.dp_bucket_mb is used as it is.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

CANDIDATES_MB = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Where no layout is fixed yet (the first pass of `--search`, a memory estimate of an unresolved
# config): DDP's bucket_cap_mb default, the size the guides give.
PROVISIONAL_MB = 25.0


def is_auto(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() == "auto"


def requested_bucket_mb(cfg: Any) -> Optional[float]:
    """overlap.dp_bucket_mb as a number, or None for `auto`; ValueError for anything else."""
    value = cfg.overlap.dp_bucket_mb
    if is_auto(value):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"overlap.dp_bucket_mb={value!r}: a size in MiB or auto; fix: overlap.dp_bucket_mb=auto "
                         "(or a number, e.g. overlap.dp_bucket_mb=25)") from None


def bucket_mb_or_provisional(cfg: Any) -> float:
    """The number given, or for `auto` `PROVISIONAL_MB` (where no machine is at hand to choose)."""
    mb = requested_bucket_mb(cfg)
    return PROVISIONAL_MB if mb is None else mb


@dataclass(frozen=True)
class BucketChoice:
    mb: float
    requested: str  # "auto" or the number given
    reason: str
    # auto: (MiB, predicted step s, predicted exposed dp s) per candidate, in CANDIDATES_MB order
    predicted: Tuple[Tuple[float, float, float], ...] = ()


def choose_bucket_mb(cfg: Any, hw: Any, world_size: Optional[int] = None) -> BucketChoice:
    """The candidate bucket size with the shortest predicted step of `cfg` on `hw`."""
    from mpoverlap.simulate.core import simulate
    from mpoverlap.simulate.plain import plain, with_values

    base = plain(cfg)
    rows: List[Tuple[float, float, float]] = []
    in_flight = 0.0
    try:
        for mb in CANDIDATES_MB:
            r = simulate(with_values(base, {"overlap.dp_bucket_mb": float(mb)}), hw, world_size)
            rows.append((float(mb), r.step_s, r.exposed_s.get("dp", 0.0)))
            in_flight = max(in_flight, r.in_flight_s.get("dp", 0.0))
    except (NotImplementedError, ValueError) as exc:  # a layout the simulator cannot cost (ScheduleError)
        return BucketChoice(PROVISIONAL_MB, "auto", f"the simulator cannot cost this layout ({type(exc).__name__}: "
                            f"{exc}); {PROVISIONAL_MB:g} MiB (DDP's default); set a size to choose another, "
                            "e.g. overlap.dp_bucket_mb=16")
    if in_flight <= 0:
        return BucketChoice(PROVISIONAL_MB, "auto", f"no dp gradient reduction in this layout: the size changes "
                            f"nothing; {PROVISIONAL_MB:g} MiB (DDP's default)", tuple(rows))
    best = min(rows, key=lambda row: (round(row[1], 9), round(row[2], 9), row[0]))
    figures = ", ".join(f"{mb:g}: {exp * 1e3:.2f}" for mb, _, exp in rows)
    reason = (f"predicted on {hw.name}: step {best[1] * 1e3:.2f} ms, dp exposed {best[2] * 1e3:.2f} ms "
              f"({_buckets_note(rows, best)}); dp exposed ms per MiB {figures}")
    return BucketChoice(best[0], "auto", reason, tuple(rows))


def _buckets_note(rows, best) -> str:
    worst = max(rows, key=lambda row: row[1])
    return f"slowest candidate {worst[0]:g} MiB: step {worst[1] * 1e3:.2f} ms, +{worst[1] / best[1] - 1:.1%}" \
        if best[1] > 0 and not math.isclose(worst[1], best[1]) else "every candidate predicts the same step"


def resolve_bucket_mb(cfg: Any, hw: Any = None, world_size: Optional[int] = None) -> BucketChoice:
    """overlap.dp_bucket_mb as a BucketChoice: the number given, or `choose_bucket_mb` on `hw`
    (default: `hardware.*` of `cfg`)."""
    mb = requested_bucket_mb(cfg)
    if mb is not None:
        return BucketChoice(mb, f"{mb:g}", "as set")
    if hw is None:
        from mpoverlap.simulate.hardware import from_config

        hw = from_config(cfg)
    return choose_bucket_mb(cfg, hw, world_size)


def with_resolved_bucket(cfg: Any, hw: Any, world_size: Optional[int] = None) -> Any:
    """`cfg` itself when overlap.dp_bucket_mb is a number, else a plain copy with the chosen size."""
    if requested_bucket_mb(cfg) is not None:
        return cfg
    from mpoverlap.simulate.plain import plain, with_values

    return with_values(plain(cfg), {"overlap.dp_bucket_mb": choose_bucket_mb(cfg, hw, world_size).mb})
