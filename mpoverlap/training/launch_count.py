"""Count the operators a block of code dispatches: on a GPU each one is a kernel launch.

On CUDA every aten operator costs a few microseconds of host time, whatever the size of its
tensors; a step whose host work exceeds its GPU work leaves the GPU idle between kernels.
On CPU the same loops cost nothing visible, so CPU tests count operators instead: a budget test
fails when a change adds a loop sized by parameters, elements or experts to the hot path.

    from mpoverlap.training.launch_count import count_launches

    with count_launches() as launches:
        trainer.train_step()
    print(launches.summary())

`launches.ops` counts every aten operator dispatched below autograd (forward, backward, hooks,
optimizer), views included; `launches.foreach_tensors` counts the tensors handed to multi-tensor
operators (`aten._foreach_*` and `aten._fused_*`, e.g. the fused AdamW: the length of their first
tensor-list argument). Such an operator is one dispatch, but on a GPU its host work and its
kernels grow with its list: a list sized by elements (a norm over thousands of views) is the
defect class; one sized by parameters grows with depth, never with width.
`launches.by_op()` groups the counts by operator name.

Only the thread that opened the context is counted (a TorchDispatchMode is thread-local; on CPU
autograd runs backward on the calling thread). Not re-entrant: one counter at a time.
"""
from __future__ import annotations

import collections
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Dict, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode


@dataclass
class Launches:
    ops: int = 0
    foreach_tensors: int = 0
    counts: collections.Counter = field(default_factory=collections.Counter)

    def by_op(self) -> Dict[str, int]:
        return dict(self.counts)

    def summary(self, top: int = 8) -> str:
        common = ", ".join(f"{name} x{n}" for name, n in self.counts.most_common(top))
        return f"{self.ops} operator(s), {self.foreach_tensors} foreach tensor(s); most: {common or 'none'}"


_MULTI_TENSOR = ("aten::_foreach_", "aten::_fused_")


def _first_tensor_list(args) -> int:
    for a in args:
        if isinstance(a, (list, tuple)) and a and all(isinstance(t, torch.Tensor) for t in a):
            return len(a)
    return 0


class _Counter(TorchDispatchMode):
    def __init__(self, launches: Launches) -> None:
        super().__init__()
        self.launches = launches

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name()
        self.launches.ops += 1
        self.launches.counts[name] += 1
        if name.startswith(_MULTI_TENSOR):
            self.launches.foreach_tensors += _first_tensor_list(args)
        return func(*args, **(kwargs or {}))


@contextmanager
def count_launches() -> Iterator[Launches]:
    """Count the aten operators dispatched inside the block (see the module docstring)."""
    launches = Launches()
    with _Counter(launches):
        yield launches
