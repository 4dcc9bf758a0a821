"""Hydra-style multirun for the self-launcher: `mpoverlap-train -m overlap.dp=true,false ...`.

Each combination of the sweep values is one job with its own run directory
(`<run.dir>/<index>_<overrides>`) and its own workers, run one after another. Every job is
validated before the first one starts, so a bad combination costs no cluster time.
"""
from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import List, Tuple

MULTIRUN_FLAGS = ("-m", "--multirun")


def split_multirun(args: List[str]) -> Tuple[bool, List[str]]:
    rest = [a for a in args if a not in MULTIRUN_FLAGS]
    return len(rest) != len(args), rest


def expand_sweeps(overrides: List[str]) -> List[List[str]]:
    """The cartesian product of every sweep override (`key=a,b`, `key=range(1,3)`, ...)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    choices = []
    for o in parsed:
        if o.is_sweep_override():
            key = o.get_key_element()
            choices.append([f"{key}={v}" for v in o.sweep_string_iterator()])
        else:
            choices.append([o.input_line])
    return [list(combo) for combo in itertools.product(*choices)]


def job_dir(base: str, index: int, swept: List[str]) -> str:
    label = "_".join(re.sub(r"[^A-Za-z0-9.-]+", "-", s) for s in swept)[:80]
    return str(Path(base) / (f"{index}_{label}" if label else str(index)))
