"""Count host reads of tensor values: the syncs that stall a GPU's stream and end any overlap.

On CUDA every read of a tensor's value on the host (`.item()`, `.tolist()`, `float(t)`,
`int(t)`, `bool(t)` / `if t:`, `bincount` without `minlength`, whose output size depends on the
data) waits for all work queued before it. On CPU they cost nothing, so CPU tests count them
instead: a budget test fails when a change adds a read to the hot path.

    from mpoverlap.training.host_sync import count_host_reads

    with count_host_reads() as reads:
        trainer.train_step()
    assert reads.count <= 1, reads.summary()

Counted: `item`, `tolist`, `__bool__`, `__int__`, `__float__`, `__index__`, boolean-mask
indexing (`x[mask]`, which sizes its output from the data), `nonzero` and `bincount` without
`minlength` (function and method forms). `reads.count` is the number of reads, `reads.events`
one `(kind, where)` per read (`where` is the innermost mpoverlap frame, "file:line"),
`reads.by_kind()` / `reads.by_site()` group them, `reads.summary()` prints them.

Reads made by torch's own Python code are left out unless `include_torch=True`: e.g. the
non-fused AdamW reads its CPU `step` counters with `.item()`, which is no GPU sync (those
counters live on the host; CUDA runs use the fused AdamW, which keeps them on the device).
Only the thread that opened the context is counted (the ledger's pool and autograd's worker
threads are not the hot path's host thread). Not re-entrant: one counter at a time.
"""
from __future__ import annotations

import collections
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Tuple

import torch

_PATCHED = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero")


def _is_mask(index) -> bool:
    if isinstance(index, tuple):
        return any(_is_mask(i) for i in index)
    return isinstance(index, torch.Tensor) and index.dtype == torch.bool


def _called_from_torch() -> bool:
    """True when the read was made by torch's own Python code (the patched function's caller)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename == __file__:
        frame = frame.f_back
    name = frame.f_code.co_filename if frame is not None else ""
    return "/torch/" in name and "/mpoverlap/" not in name


def _where() -> str:
    """The innermost frame inside the mpoverlap package (else the innermost non-torch frame)."""
    frame = sys._getframe(1)
    fallback = None
    while frame is not None:
        name = frame.f_code.co_filename
        if "/mpoverlap/" in name and not name.endswith("host_sync.py"):
            return f"{name.split('/mpoverlap/', 1)[1]}:{frame.f_lineno}"
        if fallback is None and "/torch/" not in name and not name.endswith("host_sync.py"):
            fallback = f"{name.rsplit('/', 1)[-1]}:{frame.f_lineno}"
        frame = frame.f_back
    return fallback or "?"


@dataclass
class HostReads:
    events: List[Tuple[str, str]] = field(default_factory=list)

    @property
    def count(self) -> int:
        return len(self.events)

    def by_kind(self) -> Dict[str, int]:
        return dict(collections.Counter(kind for kind, _ in self.events))

    def by_site(self) -> Dict[str, int]:
        return dict(collections.Counter(f"{kind} at {where}" for kind, where in self.events))

    def summary(self) -> str:
        sites = ", ".join(f"{k} x{n}" for k, n in sorted(self.by_site().items()))
        return f"{self.count} host read(s): {sites or 'none'}"


_active = threading.local()


@contextmanager
def count_host_reads(include_torch: bool = False) -> Iterator[HostReads]:
    """Patch the reads on torch.Tensor (and torch.bincount / torch.nonzero) while the block runs."""
    reads = HostReads()
    owner = threading.get_ident()
    depth = [0]  # a read implemented with another read (int() -> __index__) counts once

    def note(kind: str) -> None:
        if threading.get_ident() == owner and not depth[0] and (include_torch or not _called_from_torch()):
            reads.events.append((kind, _where()))

    def guarded(fn, args, kwargs):
        depth[0] += 1
        try:
            return fn(*args, **kwargs)
        finally:
            depth[0] -= 1

    def wrap(name, fn):
        def patched(*args, **kwargs):
            note(name.strip("_"))
            return guarded(fn, args, kwargs)
        return patched

    def wrap_bincount(fn):
        def patched(input, *args, **kwargs):
            minlength = kwargs.get("minlength", args[1] if len(args) > 1 else 0)
            if not minlength:
                note("bincount")
            return guarded(fn, (input,) + args, kwargs)
        return patched

    def wrap_getitem(fn):
        def patched(self, index):
            if _is_mask(index):
                note("mask_index")
            return guarded(fn, (self, index), {})
        return patched

    saved = [(torch.Tensor, name, getattr(torch.Tensor, name)) for name in _PATCHED]
    saved += [(torch.Tensor, "bincount", torch.Tensor.bincount), (torch.Tensor, "__getitem__", torch.Tensor.__getitem__),
              (torch, "bincount", torch.bincount), (torch, "nonzero", torch.nonzero)]
    for owner_obj, name, fn in saved:
        if name == "bincount":
            new = wrap_bincount(fn)
        elif name == "__getitem__":
            new = wrap_getitem(fn)
        else:
            new = wrap(name, fn)
        setattr(owner_obj, name, new)
    try:
        yield reads
    finally:
        for owner_obj, name, fn in saved:
            setattr(owner_obj, name, fn)
