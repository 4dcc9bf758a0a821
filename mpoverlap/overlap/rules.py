"""The rule registry: every rule of every mode, in one place.

A rule reads the whole (composed, override-applied) config through a `Layout` and yields
Problems. A Problem names the keys and their values, says why the combination cannot work,
and carries a fix as Hydra overrides that, applied, clear it (tests apply each fix).

Rules live in the modules of their mode (`general_rules.py`, `dp_rules.py`, ...) and register
here with the `rule` decorator; `all_rules()` imports them all.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional

from mpoverlap.overlap.layout import Layout, build_layout


@dataclass(frozen=True)
class Problem:
    rule: str
    keys: Dict[str, Any]
    reason: str
    fix: List[str] = field(default_factory=list)

    def render(self) -> str:
        shown = ", ".join(f"{k}={_show(v)}" for k, v in self.keys.items())
        fix = " ".join(self.fix) if self.fix else "(none: see the reason)"
        return f"[{self.rule}] {shown}: {self.reason}\n    fix: {fix}"


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    return str(value)


@dataclass(frozen=True)
class Rule:
    id: str
    mode: str  # general | dp | tp | pp | cp | ep
    keys: tuple
    summary: str
    check: Callable[[Layout], Iterable[Problem]]


_REGISTRY: Dict[str, Rule] = {}
_MODULE_OF: Dict[str, str] = {}


def rule(id: str, mode: str, keys: tuple, summary: str):
    """Register `fn(layout) -> Iterable[Problem]` as rule `id`."""

    def wrap(fn: Callable[[Layout], Optional[Iterable[Problem]]]) -> Callable:
        if id in _REGISTRY:
            raise RuntimeError(f"duplicate rule id {id}")

        def check(layout: Layout) -> List[Problem]:
            return list(fn(layout) or [])

        _REGISTRY[id] = Rule(id=id, mode=mode, keys=keys, summary=summary, check=check)
        _MODULE_OF[id] = fn.__module__
        return fn

    return wrap


def all_rules() -> List[Rule]:
    # Importing registers; the modules are listed here so the registry is always complete.
    from mpoverlap.overlap import (  # noqa: F401,I001
        general_rules, dp_rules, tp_rules, pp_rules, cp_rules, ep_rules, mode_rules, recompute_rules, interop_rules,
        attention_rules, compile_rules, environment_rules, dp_delay_rules, router_rules, mtp_rules, fp8_rules,
    )

    # Module order, then definition order: the same whichever module some caller imported first
    # (the README's rule table and the order of reported problems must not depend on it).
    modules = [m.__name__ for m in (general_rules, dp_rules, tp_rules, pp_rules, cp_rules, ep_rules, mode_rules,
                                    recompute_rules, interop_rules, attention_rules, compile_rules,
                                    environment_rules, dp_delay_rules, router_rules, mtp_rules,
                                    fp8_rules)]
    return sorted(_REGISTRY.values(), key=lambda r: modules.index(_MODULE_OF[r.id]))


def validate(cfg: Any, world_size: Optional[int] = None) -> List[Problem]:
    """Every problem of the config at once (never the first only)."""
    layout = build_layout(cfg, world_size)
    problems: List[Problem] = []
    for r in all_rules():
        problems.extend(r.check(layout))
    return problems


def next_multiple(value: int, of: int) -> int:
    return int(math.ceil(value / of) * of)


def divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def nearest_divisor(n: int, target: int) -> int:
    return min(divisors(n), key=lambda d: (abs(d - target), d))
