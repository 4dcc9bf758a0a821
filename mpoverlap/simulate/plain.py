"""A composed config as plain attribute objects: the simulator and the planner read thousands of
keys per layout, and OmegaConf's attribute access (~50 us each) would dominate their time."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any


class Plain(SimpleNamespace):
    """A config node: attributes, plus `get` as DictConfig has it."""

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key, default)

    def __getitem__(self, key: str) -> Any:
        return getattr(self, key)


def plain(cfg: Any) -> Plain:
    """`cfg` (a DictConfig or a Plain) as nested Plain objects, resolved; Plain passes through."""
    if isinstance(cfg, Plain):
        return cfg
    from omegaconf import OmegaConf

    return _wrap(OmegaConf.to_container(cfg, resolve=True))


def _wrap(value: Any) -> Any:
    if isinstance(value, dict):
        return Plain(**{k: _wrap(v) for k, v in value.items()})
    return value


def with_values(cfg: Plain, values: dict) -> Plain:
    """A copy of `cfg` with dotted keys set (`{"parallel.tp": 8}`); untouched groups are shared."""
    groups = {}
    for key, v in values.items():
        group, name = key.split(".", 1)
        groups.setdefault(group, {})[name] = v
    out = Plain(**vars(cfg))
    for group, items in groups.items():
        setattr(out, group, Plain(**{**vars(getattr(cfg, group)), **items}))
    return out
