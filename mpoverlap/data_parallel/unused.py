"""Parameters a microbatch's graph does not reach: marked ready right after its forward, so no
bucket waits for a gradient that will never come (DDP's `find_unused_parameters`).

The UnusedParams methods of DataParallel (a mixin, like sharded_grads.ShardedGrads). Without
them a parameter with no gradient in the last microbatch holds its bucket, and by the in-order
issue every later bucket, until `finish_grad_sync()`: those reductions run after backward,
exposed. `mark_unused(loss)` walks the loss's autograd graph from its grad_fn once, collects
the parameters its AccumulateGrad nodes hold, and marks the others ready with what their
gradient holds already (a zero contribution from this microbatch), so every bucket fills, and
is issued, during backward.

Host cost: the walk visits each graph node once (a few tens per transformer layer), a Python
loop sized by the graph, not by parameters or their elements, and it reads nothing from the
device. The list of the parameters left out is built only when some are.

Why it cannot hang when ranks differ (a branch used on some ranks, not others): plain data
parallelism and ZeRO-1 issue buckets strictly in bucket order, each once a step, and ZeRO-2/3
under marking issue them in bucket order once every microbatch; a rank marks locally, so
every rank issues the same collectives in the same order whatever it used. What does break is
a parameter marked unused whose gradient arrives anyway (a path the graph walk cannot see: a
gradient accumulated by hand inside some Function's backward): if its bucket was already
reduced, the reduction missed that gradient, so `_mark_ready` raises naming it instead.
"""
from __future__ import annotations

from typing import Iterable, List, Set

import torch
import torch.nn as nn


def reached_params(roots: Iterable[torch.Tensor]) -> Set[int]:
    """The ids of the leaf tensors (parameters) whose AccumulateGrad nodes the graphs of
    `roots` reach: one visit per graph node."""
    stack = [t.grad_fn for t in roots if t is not None and t.grad_fn is not None]
    seen = set(stack)
    leaves: Set[int] = set()
    while stack:
        node = stack.pop()
        variable = getattr(node, "variable", None)  # an AccumulateGrad node: a leaf's
        if variable is not None:
            leaves.add(id(variable))
        for nxt, _ in node.next_functions:
            if nxt is not None and nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return leaves


class UnusedParams:
    """`mark_unused`: the DataParallel method the training loop calls between a microbatch's
    forward (its loss) and its backward."""

    def _init_unused(self) -> None:
        self._param_ids = {id(p) for p in self.buffer.params}
        self._marked: Set[nn.Parameter] = set()  # marked unused in the microbatch running now
        self.unused_marked: List[str] = []  # names marked in the last call (tests, diagnostics)
        self._sharded_next = None  # ZeRO-2/3 under marking: the lowest bucket not yet issued

    def mark_unused(self, *roots: torch.Tensor) -> List[str]:
        """Call after the forward of each microbatch, before its backward, with the tensors the
        backward starts from (the loss). Marks ready every parameter their graph does not reach
        and returns those parameters' names. ZeRO-2/3 then issue this microbatch's buckets in
        bucket order (the same on every rank, whatever each used)."""
        if not self.shard_grads and not self._is_last:
            return []  # buckets are issued in the last microbatch only: nothing to mark
        reached = reached_params(roots)
        self._marked = set()
        if self.shard_grads:
            self._sharded_next = 0
        if len(reached & self._param_ids) == len(self._param_ids):
            self.unused_marked = []
            if self.shard_grads:
                self._advance_sharded()
            return self.unused_marked
        unused = [p for p in self.buffer.params if id(p) not in reached]
        self._marked = set(unused)
        self.unused_marked = [self.buffer.name_of[p] for p in unused]
        for p in unused:
            if self.shard_grads:
                self._before_accumulate(self.buffer.index[p][2], p)  # allocate, zero its bucket
            self._mark_ready(p)
        return self.unused_marked

    def _arrived_after_reduce(self, param: nn.Parameter, b: int) -> RuntimeError:
        name = self.buffer.name_of[param]
        if param in self._marked:
            return RuntimeError(
                f"parameter {name!r} was marked unused after the forward (the loss's autograd graph does not "
                f"reach it) but a gradient reached it after its bucket {b} was reduced: something accumulates "
                "its gradient outside the autograd graph; make the parameter an input of the Function that "
                "computes its gradient")
        return RuntimeError(
            f"gradient of {name!r} arrived after its bucket {b} was reduced; call start_step() at the start of "
            "every step and set_last_microbatch(False) for every microbatch but the last")
