"""Measure what autograd keeps for backward: the bytes of every distinct storage a forward
saves (`torch.autograd.graph.saved_tensors_hooks`), each storage counted once (q, k and v
that view one qkv output keep the whole output alive). Left out: parameters and their
compute-dtype copies (autocast's bf16 weight casts: weights, not activations) and any
storages the caller names (the RoPE tables, shared by every layer).

    saved = saved_activation_bytes(lambda: block(x, cos, sin), block.parameters(), [cos, sin])

`queued_bytes(queue, params)`: the same for what a zero-bubble W queue's closures keep (the
distinct storages they reach, the parameters left out).
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch

_THROUGH = ("ToCopyBackward0", "TBackward0", "ViewBackward0", "TransposeBackward0", "PermuteBackward0",
            "UnsafeViewBackward0", "ExpandBackward0")


def _is_weight_copy(t: torch.Tensor) -> bool:
    """True when t is a cast / view of a parameter: following its grad_fn through casts and
    views reaches a leaf's AccumulateGrad."""
    fn = t.grad_fn
    for _ in range(8):
        if fn is None:
            return False
        name = type(fn).__name__
        if name == "AccumulateGrad":
            return True
        if name not in _THROUGH:
            return False
        nexts = [f for f, _ in fn.next_functions if f is not None]
        if len(nexts) != 1:
            return False
        fn = nexts[0]
    return False


def saved_activation_bytes(forward: Callable[[], object], params: Iterable[torch.Tensor] = (),
                           exclude: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of the distinct storages the forward saves for backward (see the module doc)."""
    skip = {p.untyped_storage().data_ptr() for p in list(params) + list(exclude)}
    seen = {}

    def pack(t):
        if isinstance(t, torch.Tensor):
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in skip and not _is_weight_copy(t):
                seen[ptr] = max(seen.get(ptr, 0), storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return sum(seen.values())


def _closure_tensors(obj, out, seen):
    """Every tensor a queued W closure reaches (its cells and defaults, a WeightGradGemm's or
    Fp8WeightGrad's operands, through lists and tuples)."""
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            _closure_tensors(o, out, seen)
    elif callable(obj):
        for cell in getattr(obj, "__closure__", None) or ():
            _closure_tensors(cell.cell_contents, out, seen)
        for d in getattr(obj, "__defaults__", None) or ():
            _closure_tensors(d, out, seen)
        for name in getattr(type(obj), "__slots__", ()):  # WeightGradGemm: its (grad_y, x)
            _closure_tensors(getattr(obj, name, None), out, seen)


def queued_bytes(queue, params: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of the distinct storages the W closures of `queue` (wgrad.WeightGradQueue) reach,
    `params`' storages left out."""
    tensors, seen = [], set()
    for _, compute in queue.entries:
        _closure_tensors(compute, tensors, seen)
    skip = {p.untyped_storage().data_ptr() for p in params}
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(n for ptr, n in storages.items() if ptr not in skip)
