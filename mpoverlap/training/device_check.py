"""Find tensors created without their inputs' device, on a machine without a GPU.

On CUDA a tensor made by a factory call without `device=` (`torch.arange(n)`, `torch.tensor([..])`)
lands on the CPU and the first op that mixes it with the model's tensors fails (or, for some
indexing ops, copies it over at a host sync). A CPU-only test cannot see that: every tensor is
on the CPU anyway. So this check turns the default device into `meta` while the model runs on
the CPU: a device-less factory call now makes a meta tensor, and any op whose tensor arguments
mix meta with a real device is recorded (some ops, e.g. `index_select`, would not even raise).

    from mpoverlap.training.device_check import stray_device_tensors

    with stray_device_tensors() as strays:
        loss = model(tokens).sum(); loss.backward()
    assert not strays.events, strays.summary()

0-d tensors are ignored (CUDA ops accept CPU scalars). Ops that fail on the mix are recorded
before they raise, and the error propagates.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, List, Tuple

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten


def _where() -> str:
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if ("/mpoverlap/" in name or "/models/" in name) and not name.endswith("device_check.py"):
            return f"{name.rsplit('/', 2)[-2]}/{name.rsplit('/', 1)[-1]}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


@dataclass
class StrayTensors:
    events: List[Tuple[str, str]] = field(default_factory=list)  # (op, "file:line")

    def summary(self) -> str:
        return ", ".join(f"{op} at {where}" for op, where in self.events) or "none"


class _MixedDeviceMode(TorchFunctionMode):
    def __init__(self, found: StrayTensors) -> None:
        super().__init__()
        self.found = found

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        devices = {t.device.type for t in tree_flatten((args, kwargs))[0]
                   if isinstance(t, torch.Tensor) and t.dim() > 0}
        if "meta" in devices and len(devices) > 1:
            self.found.events.append((getattr(func, "__name__", str(func)), _where()))
        return func(*args, **kwargs)


@contextmanager
def stray_device_tensors() -> Iterator[StrayTensors]:
    """Record every op that mixes a device-less (now meta) tensor with a real one."""
    found = StrayTensors()
    with torch.device("meta"), _MixedDeviceMode(found):
        yield found
