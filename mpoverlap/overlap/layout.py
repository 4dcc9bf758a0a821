"""Layout: the numbers every rule reads, derived once from a composed config.

Nothing here raises on bad values: a value that is not usable becomes None and the rule that
owns its key reports it (with the key, the value and a fix), so every problem is reported at
once instead of the first one crashing the rest.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from mpoverlap.config import normalize_tristate, world_size_from_env

DEGREES = ("tp", "pp", "vpp", "cp", "ep")


def as_positive_int(value: Any) -> Optional[int]:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value >= 1 else None
    if isinstance(value, str) and value.strip().isdigit():
        v = int(value)
        return v if v >= 1 else None
    return None


@dataclass
class Layout:
    cfg: Any
    tp: Optional[int]
    pp: Optional[int]
    vpp: Optional[int]
    cp: Optional[int]
    ep: Optional[int]
    dp: Optional[int]
    dp_requested: Any
    world_env: Optional[int]  # WORLD_SIZE under torchrun, else parallel.world_size, else None

    @property
    def degrees_ok(self) -> bool:
        return None not in (self.tp, self.pp, self.vpp, self.cp, self.ep, self.dp)

    @property
    def world(self) -> Optional[int]:
        if not self.degrees_ok:
            return None
        return self.tp * self.pp * self.cp * self.dp

    @property
    def dp_cp(self) -> Optional[int]:
        return None if None in (self.dp, self.cp) else self.dp * self.cp

    @property
    def num_microbatches(self) -> Optional[int]:
        t = self.cfg.train
        if self.dp is None or not isinstance(t.micro_batch_size, int) or t.micro_batch_size < 1:
            return None
        per = t.micro_batch_size * self.dp
        if t.global_batch_size % per:
            return None
        return t.global_batch_size // per

    def mode(self, name: str) -> Any:
        return normalize_tristate(getattr(self.cfg.overlap, name))


def build_layout(cfg: Any, world_size: Optional[int] = None) -> Layout:
    """`world_size`: the known world (torchrun's WORLD_SIZE), or None outside a launcher."""
    p = cfg.parallel
    world_env = world_size if world_size is not None else world_size_from_env()
    if world_env is None and p.world_size is not None:
        world_env = as_positive_int(p.world_size)
    degrees = {name: as_positive_int(getattr(p, name)) for name in DEGREES}
    dp_requested = p.dp
    if isinstance(dp_requested, str) and dp_requested.lower() == "auto":
        fixed = degrees["tp"], degrees["pp"], degrees["cp"]
        world = world_env
        if world is None:
            dp = 1  # self-launch with nothing else said: one replica
        elif None in fixed or world % (fixed[0] * fixed[1] * fixed[2]):
            dp = None  # reported by the degree and world-size rules
        else:
            dp = world // (fixed[0] * fixed[1] * fixed[2])
    else:
        dp = as_positive_int(dp_requested)
    return Layout(cfg=cfg, dp=dp, dp_requested=dp_requested, world_env=world_env, **degrees)
