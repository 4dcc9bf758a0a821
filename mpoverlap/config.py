"""Configuration composition: Hydra merges conf/ and the command line's overrides into the typed
schema (mpoverlap/schema.py, re-exported here), cached per override list; `ConfigError` for a
config that cannot be composed.
"""
from __future__ import annotations

import functools
import os
from importlib import resources
from typing import Any, List, Optional

from omegaconf import DictConfig, OmegaConf

from mpoverlap.schema import (  # noqa: F401 (the schema, re-exported)
    CheckpointConfig, CollectiveEfficiency, DataConfig, HardwareConfig, ModelConfig, MPOverlapConfig, OverlapConfig,
    ParallelConfig, RopeScalingConfig, RunConfig, TrainConfig,
)


class ConfigError(Exception):
    """A configuration that could not be composed (unknown key, wrong type, bad override)."""


def config_dir() -> str:
    return str(resources.files("mpoverlap.conf"))


def _register_schema() -> None:
    """Store the schema in Hydra's ConfigStore, once per process: each compose loads a deep copy
    of it, and building it (OmegaConf.structured) is a sixth of a compose."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    if "mpoverlap_schema.yaml" not in store.repo:
        store.store(name="mpoverlap_schema", node=MPOverlapConfig)


@functools.lru_cache(maxsize=None)
def _config_groups() -> frozenset:
    """The config groups of conf/ (a folder each): an override naming one chooses a file of the
    defaults list; every other override sets a value after the defaults are composed (Hydra's own
    order)."""
    return frozenset(d.name for d in resources.files("mpoverlap.conf").iterdir()
                     if d.is_dir() and any(f.name.endswith(".yaml") for f in d.iterdir()))


# Composed defaults (unresolved, no value override applied) by the group overrides that chose them.
_COMPOSED: dict = {}


def _hydra_compose(overrides: List[str]) -> DictConfig:
    """Hydra's compose of conf/train.yaml, unresolved (Hydra's exceptions propagate)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    _register_schema()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
            return hydra_compose(config_name="train", overrides=list(overrides))
    finally:
        GlobalHydra.instance().clear()


def _compose_cached(overrides: List[str]) -> DictConfig:
    """What `_hydra_compose(overrides)` gives, in a fifth of its time when the group choices were
    composed before in this process: the defaults list is composed once per distinct set of group
    overrides and kept; the value overrides are applied to a copy by the function Hydra applies
    them with (`ConfigLoaderImpl._apply_overrides_to_config`: struct mode, the same checks and
    messages). Overrides that change more than values (sweeps, `hydra.*`, adding or deleting a
    group) go through Hydra whole. tests/test_config_cache.py holds the two equal."""
    import copy

    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import OverrideType

    parsed = OverridesParser.create().parse_overrides(overrides=list(overrides))
    group_names = _config_groups()
    groups = [o for o in parsed if o.key_or_group in group_names]
    if any(o.is_sweep_override() or o.is_hydra_override() for o in parsed) or \
            any(o.type != OverrideType.CHANGE or o.package is not None for o in groups):
        return _hydra_compose(overrides)
    key = tuple(o.input_line for o in groups)
    if key not in _COMPOSED:
        _COMPOSED[key] = _hydra_compose(list(key))
    cfg = copy.deepcopy(_COMPOSED[key])
    ConfigLoaderImpl._apply_overrides_to_config([o for o in parsed if o.key_or_group not in group_names], cfg)
    return cfg


def compose(overrides: List[str] | None = None) -> DictConfig:
    """Compose `conf/train.yaml` with Hydra overrides into a typed, resolved config.

    Raises ConfigError (with Hydra's message naming the key) on unknown keys, wrong types
    or malformed overrides.
    """
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        cfg = _compose_cached(list(overrides or []))
        OmegaConf.resolve(cfg)
    except (HydraException, OmegaConfBaseException, ValueError) as err:
        # Hydra suggests `+key=value` for unknown keys; the schema would refuse that too.
        message = "\n".join(line for line in str(err).splitlines() if not line.startswith("To append"))
        raise ConfigError(message) from None
    return cfg


def normalize_tristate(value: Any) -> Any:
    """`true`/`false`/`auto` in any spelling Hydra hands over (bool or str) -> canonical str.

    Anything else is returned unchanged so the rule engine can name it.
    """
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str) and value.lower() in ("true", "false", "auto"):
        return value.lower()
    return value


def world_size_from_env() -> Optional[int]:
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return None
