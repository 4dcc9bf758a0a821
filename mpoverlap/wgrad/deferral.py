"""WeightGradDeferral (the switch a model's linears hold) and WeightGradQueue (one per
(chunk, microbatch) backward; the W action runs it).

Why gradients go back through autograd in W: the data-parallel wrapper learns that a
parameter's gradient is complete from autograd's accumulate hooks (a bucket's reduction starts
when its last parameter reported). `torch.autograd.backward(params, grads)` on the leaf
parameters accumulates each gradient into its `.grad` (the fp32 buffer view) and fires those
hooks, so a bucket becomes ready when its last W has run, at every `train.dp_sharding` level,
with no second code path in data_parallel/.

The one thing the hooks must learn: a Function that deferred its weight gradient returns None
for the weight, and autograd still calls the parameter's accumulate hooks (with nothing
added). `withheld(param)` is True from that moment until the region ends, and the hooks skip
such calls.

Threads: the region is a plain attribute of an object the layers captured at forward time
(not a thread- or context-local), so it is seen by the autograd engine's device threads on
CUDA and by the recomputed forward of activation checkpointing alike.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch

WeightGrad = Callable[[], torch.Tensor]


class WeightGradQueue:
    """The deferred weight-gradient GEMMs of one (chunk, microbatch) backward, in the order
    the backward met them. Each entry keeps its (input, output gradient) alive until run."""

    def __init__(self) -> None:
        self.entries: List[Tuple[torch.nn.Parameter, WeightGrad]] = []
        self.ran = False

    def __len__(self) -> int:
        return len(self.entries)

    def run(self) -> None:
        """Compute every queued weight gradient and accumulate it into its parameter.

        Memory: each entry's closure (its input and output gradient) is dropped as soon as its
        GEMM ran, and each gradient is accumulated (one autograd call per parameter: its
        accumulate hooks fire then) as soon as the parameter's last entry ran, so W holds one
        weight-sized gradient at a time, as the backward it replaces does, not the whole
        chunk's. A parameter queued twice (tied) is summed in queue order first, then
        accumulated once."""
        if self.ran:
            raise RuntimeError("a weight-gradient queue ran twice")
        self.ran = True
        entries, self.entries = self.entries, []
        last = {id(param): i for i, (param, _) in enumerate(entries)}
        partial: Dict[int, torch.Tensor] = {}
        for i in range(len(entries)):
            param, compute = entries[i]
            entries[i] = None  # type: ignore[call-overload]  # the closure's tensors go with it
            grad = compute().to(param.dtype)  # bf16 GEMM -> the fp32 master gradient
            del compute
            held = partial.pop(id(param), None)
            if held is not None:  # a weight used twice in one chunk (tied)
                grad = held + grad
                del held
            if last[id(param)] == i:
                torch.autograd.backward([param], [grad])
            else:
                partial[id(param)] = grad
            del grad


class WeightGradDeferral:
    """Held by every deferrable linear of a model; `deferring(queue)` makes their backward
    queue the weight-gradient GEMM instead of running it."""

    def __init__(self) -> None:
        self._queue: Optional[WeightGradQueue] = None
        self._withheld: set = set()

    @property
    def active(self) -> bool:
        return self._queue is not None

    @contextmanager
    def deferring(self, queue: WeightGradQueue) -> Iterator[WeightGradQueue]:
        if self._queue is not None:
            raise RuntimeError("weight-gradient deferring regions do not nest")
        self._queue = queue
        try:
            yield queue
        finally:
            self._queue = None
            self._withheld.clear()

    def defer(self, param: torch.nn.Parameter, compute: WeightGrad) -> bool:
        """Queue `compute` (returns param's gradient) if a region is active; False otherwise
        (the caller then computes the gradient at once, as without deferral)."""
        if self._queue is None or not param.requires_grad:
            return False
        self._queue.entries.append((param, compute))
        self._withheld.add(id(param))
        return True

    def withheld(self, param: torch.Tensor) -> bool:
        """True while the current region deferred `param`'s gradient: an accumulate hook
        called now carries no gradient for it."""
        return id(param) in self._withheld
