"""Activation recomputation (Korthikanti et al. 2022), on torch's non-reentrant checkpoint.

`model.recompute`:
  none       every activation autograd needs is kept from forward to backward.
  selective  the attention core (scores, softmax, values: `core_attention`) keeps only q, k, v
             and is recomputed in backward. With SDPA's flash kernels (CPU and CUDA) the core
             keeps no s^2 tensor anyway (its output and log-sum-exp, O(s) per head), so the
             saving is that output; with context parallelism the ring's per-block results
             are recomputed, K/V exchanges included (the ring runs again, overlapped as in
             forward, and the ledger counts it under cp).
  full       whole transformer blocks keep only their input x [B, S(/tp), H] and are recomputed
             in backward: for `model.recompute_num_layers` blocks per pipeline chunk (the first
             ones of the chunk; None = all). Under TP the recomputed forward issues its
             all-gathers / ring steps again exactly as the forward does (overlapped under the
             GEMM chunks with overlap.tp) and the ledger counts them under tp; an MoE MLP
             inside a block is recomputed too, its dispatch and combine included (counted
             under ep, overlapped as in forward), and does not record its router statistics
             twice.

Recomputation reproduces the forward bitwise: the same ops on the same inputs, and torch's
checkpoint restores the RNG state (the model has no random op; dropout would be covered).
"""
from __future__ import annotations

import contextvars
from contextlib import nullcontext
from typing import Callable, Iterable, Optional, Sequence

import torch
from torch.utils.checkpoint import checkpoint

RECOMPUTE_MODES = ("none", "selective", "full")

# True while a recomputed region runs (first forward and replay). Code that builds an inner
# autograd graph of its own and differentiates it with torch.autograd.grad (all-to-all CP)
# reads it: under the region's saved-tensor hooks every such call would replay the region.
_IN_REGION = contextvars.ContextVar("mpoverlap_recompute_region", default=False)


def in_recompute_region() -> bool:
    return _IN_REGION.get()


def _in_region(fn: Callable) -> Callable:
    def run(*args):
        token = _IN_REGION.set(True)
        try:
            return fn(*args)
        finally:
            _IN_REGION.reset(token)
    return run


class _Recomputing:
    """Tells `modules` (those with a `recomputing` attribute) that their forward is a replay.
    A class, not a generator: torch may replay one region more than once (a second backward
    graph task reaching the same saved tensors) and enters the same object each time."""

    def __init__(self, modules: Sequence[torch.nn.Module]) -> None:
        self.modules = modules

    def __enter__(self) -> None:
        for m in self.modules:
            m.recomputing = True

    def __exit__(self, *exc) -> None:
        for m in self.modules:
            m.recomputing = False


def recomputed(fn: Callable, *args, replaying: Iterable[torch.nn.Module] = ()):
    """fn(*args), keeping only `args` for backward, where fn runs again. `replaying`: modules
    told (attribute `recomputing`) that the second run is a replay. Outside autograd (no grad,
    or no input that needs one) it is a plain call."""
    if not torch.is_grad_enabled():
        return fn(*args)
    modules = [m for m in replaying if hasattr(m, "recomputing")]
    return checkpoint(_in_region(fn), *args, use_reentrant=False, preserve_rng_state=True,
                      context_fn=lambda: (nullcontext(), _Recomputing(modules)))


def recomputed_layers(mode: str, num_layers_in_chunk: int, recompute_num_layers: Optional[int]) -> int:
    """How many of a chunk's blocks (its first ones) run under full recomputation."""
    if mode != "full":
        return 0
    if recompute_num_layers is None:
        return num_layers_in_chunk
    return min(num_layers_in_chunk, recompute_num_layers)
