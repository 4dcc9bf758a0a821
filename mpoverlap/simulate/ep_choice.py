"""`overlap.ep=auto` and `overlap.ep_chunks=auto` by the simulator's prediction.

Chunked EP overlap pays where the experts' compute is long enough to hide a chunk's exchange
and loses where it is not: every extra chunk adds the exchanges' latency (a collective step per
chunk and direction), and small layouts (ep <= 4, few microbatches) are latency-bound. So
`auto` simulates the step of this layout on this hardware with EP overlap off and on over the
candidate chunk counts, and takes overlap on only where its best predicted step is faster than
off's; `auto` chunks take the count with the fastest predicted step (the fewer on a tie).

The decision is a pure function of the config and the hardware figures (a preset's, or the
measured rates a caller passes in): every rank reaches the same one, and nothing is timed.
`hardware=measured` (hardware.measure=true) given no measured rates decides on the figures the
preset states (conf/hardware/measured.yaml), and the reason says so; `simulate(cfg, hw)` decides
on the rates it is given (core.simulate pins the choice first).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Optional, Tuple

CANDIDATE_CHUNKS = (1, 2, 4, 8)
# where the step cannot be predicted (a layout the rules would refuse): the former fixed choice
FALLBACK_CHUNKS = 4
_KEY_GROUPS = ("model", "parallel", "overlap", "train", "hardware")


@dataclass(frozen=True)
class EpChoice:
    enabled: bool  # EP overlap on
    chunks: int  # overlap.ep_chunks
    reason: str  # for overlap.ep's plan line
    chunks_reason: str  # for overlap.ep_chunks's plan line
    # ((overlap on, chunks, predicted step seconds), ...) of every candidate simulated
    predicted: Tuple[Tuple[bool, int, float], ...] = ()


def choose(cfg: Any, world_size: Optional[int] = None, hw: Any = None) -> EpChoice:
    """overlap.ep and overlap.ep_chunks as the simulator decides them for `cfg` on `hw` (None:
    the config's hardware preset, `decision_hardware`). Only for a layout with an expert exchange
    (parallel.ep > 1, an MoE model); memoised on the config's values and the hardware."""
    from mpoverlap.overlap.layout import build_layout
    from mpoverlap.simulate.plain import plain

    cfg = plain(cfg)
    world = build_layout(cfg, world_size).world
    measured_nominal = hw is None and bool(cfg.hardware.measure)
    if hw is None:
        hw = decision_hardware(cfg)
    return _choose(_key(cfg), world, hw, measured_nominal)


def decision_hardware(cfg: Any):
    """The Hardware `auto` decides on without measured rates at hand: the preset's figures (for
    hardware=measured, the figures its file states; measuring here would time one rank)."""
    from mpoverlap.simulate.hardware import from_config
    from mpoverlap.simulate.plain import plain, with_values

    cfg = plain(cfg)
    return from_config(with_values(cfg, {"hardware.measure": False}) if cfg.hardware.measure else cfg)


def pin_auto(cfg: Any, hw: Any, world_size: Optional[int] = None):
    """`cfg` with overlap.ep and overlap.ep_chunks as `choose` decides them on `hw`, where either
    is `auto` on a layout with an expert exchange; else `cfg` itself."""
    from mpoverlap.config import normalize_tristate
    from mpoverlap.overlap.layout import build_layout
    from mpoverlap.simulate.plain import plain

    o, m = cfg.overlap, cfg.model
    chunks_auto = isinstance(o.ep_chunks, str) and o.ep_chunks.strip().lower() == "auto"
    if not (normalize_tristate(o.ep) == "auto" or chunks_auto) or m.num_experts == 0:
        return cfg
    lo = build_layout(plain(cfg), world_size)
    if lo.ep is None or lo.ep <= 1 or not lo.degrees_ok:
        return cfg
    c = choose(cfg, world_size, hw)
    return pinned(cfg, c.enabled, c.chunks)


def pinned(cfg: Any, on: bool, chunks: int):
    """`cfg` (as plain objects) with overlap.ep and overlap.ep_chunks set explicitly."""
    from mpoverlap.simulate.plain import plain, with_values

    return with_values(plain(cfg), {"overlap.ep": "true" if on else "false", "overlap.ep_chunks": int(chunks)})


def _key(cfg) -> str:
    """The config's values that the step depends on, as one string (run.dir, data paths and the
    checkpoint settings left out: they change nothing the simulator reads)."""
    return json.dumps({g: _as_dict(getattr(cfg, g)) for g in _KEY_GROUPS}, sort_keys=True, default=str)


def _as_dict(node: Any) -> Any:
    if hasattr(node, "__dict__") and not isinstance(node, type):
        return {k: _as_dict(v) for k, v in vars(node).items()}
    if isinstance(node, (list, tuple)):
        return [_as_dict(v) for v in node]
    return node


@lru_cache(maxsize=256)
def _choose(key: str, world: Optional[int], hw: Any, measured_nominal: bool) -> EpChoice:
    from mpoverlap.config import normalize_tristate
    from mpoverlap.simulate.plain import _wrap

    cfg = _wrap(json.loads(key))
    asked_ep = normalize_tristate(cfg.overlap.ep)
    asked_chunks = cfg.overlap.ep_chunks
    auto_chunks = isinstance(asked_chunks, str) and asked_chunks.strip().lower() == "auto"
    pairing_forced = normalize_tristate(getattr(cfg.overlap, "ep_pairing", "false")) == "true"
    ons = [True] if asked_ep == "true" or (asked_ep == "auto" and pairing_forced) else \
        [False] if asked_ep == "false" else [False, True]
    predicted, failed = [], None
    for on in ons:
        # overlap off waits every exchange where it is issued: more chunks only add exchanges
        for k in (CANDIDATE_CHUNKS if on else (1,)) if auto_chunks else (int(asked_chunks),):
            try:
                predicted.append((on, k, _step(pinned(cfg, on, k), world, hw)))
            except (ZeroDivisionError, TypeError, AttributeError, ValueError, KeyError) as e:
                failed = f"{type(e).__name__}: {e}"
                break
        if failed:
            break
    context = _context(cfg, world, hw, measured_nominal)
    if failed:
        chunks = FALLBACK_CHUNKS if auto_chunks else int(asked_chunks)
        why = f"not predicted (the simulator could not run this layout: {failed[:200]})"
        return EpChoice(asked_ep != "false", chunks, f"token dispatch under experts; {why}",
                        f"{chunks} chunk(s); {why}")
    best = {on: min((p for p in predicted if p[0] == on), key=lambda p: (p[2], p[1]), default=None) for on in ons}
    on_best, off_best = best.get(True), best.get(False)
    enabled = on_best is not None and (off_best is None or on_best[2] < off_best[2])
    chosen = on_best if enabled else off_best
    return EpChoice(enabled, chosen[1], _ep_reason(asked_ep, pairing_forced, on_best, off_best, context),
                    _chunks_reason(auto_chunks, predicted, chosen, context), tuple(predicted))


def _step(cfg: Any, world: Optional[int], hw: Any) -> float:
    from mpoverlap.simulate.core import simulate

    return simulate(cfg, hw, world).step_s


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.3f} ms" if ms < 10 else f"{ms:,.1f} ms"


def _context(cfg: Any, world: Optional[int], hw: Any, measured_nominal: bool) -> str:
    from mpoverlap.overlap.layout import build_layout

    micro = build_layout(cfg, world).num_microbatches or 1
    where = (f"hardware=measured's stated figures ({hw.name}; no measured rates at hand)" if measured_nominal
             else f"hardware {hw.name}")
    return f"at ep {cfg.parallel.ep}, {micro} microbatch{'es' if micro != 1 else ''}, on {where}"


def _ep_reason(asked: str, pairing_forced: bool, on_best, off_best, context: str) -> str:
    if on_best is not None and off_best is not None:
        if on_best[2] < off_best[2]:
            return (f"token dispatch under experts: predicted {_ms(on_best[2])} a step with chunked EP overlap "
                    f"({on_best[1]} chunks) vs {_ms(off_best[2])} without, {context}")
        return (f"off: predicted {_ms(off_best[2])} a step without chunked EP overlap vs {_ms(on_best[2])} with it "
                f"({on_best[1]} chunks), {context}; overlap.ep=true forces it")
    if asked == "auto" and pairing_forced:
        return (f"token dispatch under experts: overlap.ep_pairing=true keeps the exchanges in flight, which "
                f"needs EP overlap (predicted {_ms(on_best[2])} a step, {on_best[1]} chunks, {context})")
    p = on_best or off_best
    return f"predicted {_ms(p[2])} a step ({p[1]} chunks), {context}"


def _chunks_reason(auto: bool, predicted, chosen, context: str) -> str:
    if not auto:
        return f"as given; predicted {_ms(chosen[2])} a step, {context}"
    if not chosen[0]:
        return "EP overlap off: every exchange waited where it is issued, more chunks would only add exchanges"
    tried = ", ".join(f"{k}: {_ms(s)}" for on, k, s in predicted if on)
    return f"the fastest predicted step with EP overlap on ({tried}), {context}"
