"""`overlap.<mode>=true` on a layout where that mode has nothing to communicate.

These hold for the modes whose layers have not landed yet too: `true` means required, so a
required mode that cannot apply is an error, never dropped silently.
"""
from __future__ import annotations

from mpoverlap.overlap.layout import Layout
from mpoverlap.overlap.rules import Problem, rule

_NEEDS = {
    "tp": ("parallel.tp", "tensor-parallel collectives exist only with parallel.tp >= 2 (and SP)"),
    "pp": ("parallel.pp", "pipeline send/receive exists only with parallel.pp >= 2"),
    "cp": ("parallel.cp", "the K/V ring exists only with parallel.cp >= 2"),
    "ep": ("parallel.ep", "token dispatch exists only with parallel.ep >= 2 and an MoE model"),
}


@rule("mode.required_applies", "general", tuple(f"overlap.{m}" for m in _NEEDS) + tuple(k for k, _ in _NEEDS.values()),
      "a mode set to true has communication to overlap on this layout")
def _required_applies(lo: Layout):
    for mode, (key, why) in _NEEDS.items():
        degree = getattr(lo, mode)
        if lo.mode(mode) == "true" and degree == 1:
            yield Problem("mode.required_applies", {f"overlap.{mode}": "true", key: degree},
                          f"overlap.{mode}=true is required but cannot apply: {why}",
                          [f"overlap.{mode}=auto"])
