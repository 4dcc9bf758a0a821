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

from mpoverlap.precision import grad_buffer

WeightGrad = Callable[[], torch.Tensor]


def weight_grad_2d(grad_y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """dW [out, in] = sum over the leading dims of grad_y^T x (grad_y [..., out], x [..., in])."""
    return grad_y.reshape(-1, grad_y.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1]))


class WeightGradGemm:
    """A deferred weight gradient that is one GEMM: dW [out, in] = grad_y^T x summed over the
    leading dims (grad_y [..., out], x [..., in]). Called, it returns dW, like any queued
    closure; `accumulate_into(grad)` adds it into an existing gradient in place: an fp32 GEMM
    by addmm_, so W neither allocates a weight-sized temporary nor reads and writes the
    gradient buffer a second time for the addition (Megatron's gradient-accumulation fusion);
    a bf16 GEMM's product by one add_ into the fp32 gradient, the cast folded into the add
    (no fp32 copy of the product, no autograd call; the same sum, bit for bit: the cast is
    exact and the addition is fp32 either way)."""

    __slots__ = ("grad_y", "x")

    def __init__(self, grad_y: torch.Tensor, x: torch.Tensor) -> None:
        self.grad_y, self.x = grad_y, x

    def _operands(self) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.grad_y.reshape(-1, self.grad_y.shape[-1]).t(), self.x.reshape(-1, self.x.shape[-1])

    def __call__(self) -> torch.Tensor:
        return weight_grad_2d(self.grad_y, self.x)

    def accumulate_into(self, grad: torch.Tensor) -> None:
        grad_t, x = self._operands()
        if x.dtype == grad.dtype:
            grad.addmm_(grad_t, x)
        else:
            grad.add_(grad_t.matmul(x))


def _accumulates_in_place(param: torch.nn.Parameter, compute: WeightGrad) -> bool:
    """Whether W may add `compute`'s product straight into param.grad: a closure that can
    (`accumulate_into(grad)`: WeightGradGemm, the grouped experts' moe/grouped.py _WeightGrad)
    and a buffer that takes an in-place add (precision.grad_buffer; the sharded levels' hooked
    weights take autograd's path)."""
    return hasattr(compute, "accumulate_into") and grad_buffer(param) is not None


def _accumulated(param: torch.nn.Parameter) -> None:
    """What autograd's AccumulateGrad does after it added a gradient: the parameter's
    post-accumulate hooks (the data-parallel wrapper's readiness), from the dict torch's
    `register_post_accumulate_grad_hook` fills (`Tensor._post_accumulate_grad_hooks`, as
    `_backward_hooks` above holds `register_hook`'s; tests/test_wgrad.py checks both paths)."""
    for hook in tuple((getattr(param, "_post_accumulate_grad_hooks", None) or {}).values()):
        hook(param)


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
        chunk's. A parameter queued twice on autograd's path (tied) is summed in queue order
        first, then accumulated once.

        Speed: a parameter whose entries all add in place (`accumulate_into`: one GEMM, fp32 by
        `addmm_`, bf16 by one promoting `add_`; the grouped experts' stacks, once per expert
        chunk, in the order the non-deferred backward adds them, moe/grouped.py) and that has
        a gradient already there (the usual case: the data-parallel wrapper's `.grad` is a view
        of its buffer from the start) is accumulated into that tensor in place, and its
        post-accumulate hooks are called once, as autograd would call them; anything else (the
        collective-matmul sums, embeddings, tied weights, sharded levels' hooks, no .grad yet)
        goes through `torch.autograd.backward`."""
        if self.ran:
            raise RuntimeError("a weight-gradient queue ran twice")
        self.ran = True
        entries, self.entries = self.entries, []
        last = {id(param): i for i, (param, _) in enumerate(entries)}
        # parameters every entry of which adds in place (one GEMM, or the grouped experts'
        # stacks once per expert chunk): their hooks fire once, after the last entry
        in_place: Dict[int, bool] = {}
        for param, compute in entries:
            in_place[id(param)] = in_place.get(id(param), True) and _accumulates_in_place(param, compute)
        partial: Dict[int, torch.Tensor] = {}
        for i in range(len(entries)):
            param, compute = entries[i]
            entries[i] = None  # type: ignore[call-overload]  # the closure's tensors go with it
            if in_place[id(param)]:
                with torch.no_grad():
                    compute.accumulate_into(param.grad)
                del compute
                if last[id(param)] == i:
                    _accumulated(param)
                continue
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
