"""The torch release mpoverlap runs on: checked before any worker or process group starts.

The floor is the oldest release that has everything the default paths call:
- `torch._grouped_mm` with a CPU kernel (the grouped experts on CPU; 2.8 has the op but no CPU
  kernel, 2.9 has both);
- `Store.clone()` (the stop agreement's watcher threads each take their own store client);
- autocast's weight-cast cache kept across an inner autocast-off region until the outermost
  region exits (precision.step_cast_cache casts each weight once a step on it), fixed in late
  2025, so in the first release after: 2.10.
pyproject.toml's `torch>=` requirement says the same (tests/test_packaging.py compares them).
"""
from __future__ import annotations

import re
from typing import Optional, Tuple

from mpoverlap.overlap.layout import Layout
from mpoverlap.overlap.rules import Problem, rule

TORCH_FLOOR = (2, 10)


def torch_version() -> str:
    """The installed torch's version, read from its metadata (no torch import: mpoverlap-check
    stays fast), else from the module."""
    from importlib import metadata

    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        import torch

        return torch.__version__


def release(version: str) -> Optional[Tuple[int, int]]:
    """'2.13.0+cpu' -> (2, 13); a development build '2.14.0a0+git...' -> (2, 14); None if unreadable."""
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def floor_text() -> str:
    return ".".join(map(str, TORCH_FLOOR))


@rule("environment.torch_version", "general", (),
      f"torch is {'.'.join(map(str, TORCH_FLOOR))} or newer (grouped GEMMs on CPU, Store.clone, the step's "
      "weight-cast cache)")
def _torch_version(lo: Layout):
    version = torch_version()
    found = release(version)
    if found is not None and found < TORCH_FLOOR:
        yield Problem("environment.torch_version", {"torch": version},
                      f"mpoverlap needs torch {floor_text()} or newer: its default paths call torch._grouped_mm "
                      "on CPU (no CPU kernel before 2.9), Store.clone() and autocast's step-long weight-cast "
                      "cache (fixed after 2.9)",
                      [f"pip install 'torch>={floor_text()}'"])
