"""Forward/backward pairing at pp 1 (overlap.ep_pairing): one microbatch's expert exchanges in
flight while another microbatch computes.

Schedule over m microbatches (Megatron's combined 1F1B at pp 1, DualPipe's overlapped pair):

    F0 alone;  then for i = 1 .. m-1: F(i) paired with B(i-1);  then B(m-1) alone.

A pair runs the two generators of steps.py / tape.py round-robin, each until its next YIELD
(an exchange of its own just issued), THE BACKWARD FIRST (Megatron's combined 1F1B order,
combined_1f1b.py). Forward layer j meets backward layer L-1-j; per pair of layers (the
backward's sub-steps are the forward's run in reverse, tape.py):

    step  runs (compute)                                      on the link meanwhile
    B     post-combine backward (head backward first), issue  F's combines of layer j-1
          the reverse combines of layer L-1-j
    F     wait combines j-1, combine j-1 (embedding first),   B's reverse combines
          pre-dispatch j, issue the dispatches of j
    B     wait reverse combines, experts backward, issue      F's dispatches
          the reverse dispatches, shared expert backward
    F     shared expert, experts of j chunk by chunk (each    B's reverse dispatches
          chunk's dispatch waited, its combine issued)
    B     wait reverse dispatches, pre-dispatch backward,     F's combines of layer j
          (next layer's post-combine backward ...)

so every exchange of either microbatch, the forward's first dispatch included, is in flight
under a compute sub-step of the other: F's dispatches under B's experts backward, B's reverse
combines under F's pre-dispatch, B's reverse dispatches under F's experts, F's combines under
B's pre-dispatch backward (comm combine_bwd | pre_dispatch_fwd, dispatch_fwd | mlp_bwd,
dispatch_bwd | mlp_fwd, combine_fwd | pre_dispatch_bwd). The edges: B's head backward runs
before F's embedding, F's last combines are waited (and its head and loss run) after B's
embedding backward. Every rank runs the same program, so every group sees its collectives in
the same order. The first forward and the last backward run alone: their exchanges hide only
under their own chunks (overlap.ep_chunks; the lone backward waits every reverse combine
before the experts' backward, one autograd call, so it hides nothing; a chunked backward
would need one autograd call per chunk, each accumulating into the experts' weights, and the
DP readiness of those weights held per layer until the last chunk: not done).

Exactness: the sub-steps compute the unpaired model's math; the loss scale (1/m), the router
losses (attached as in the layer), the expert-bias loads (recorded in each forward) and the
gradient accumulation into the DP buffer are the unpaired path's. DP reductions that wait for
the last microbatch (`set_last_microbatch`) see it set only for B(m-1).

ZeRO-3: two units can be in use at once (F's layer j, B's layer L-1-j, each with its
prefetch). `UnitPins` counts the uses of each unit's buckets; a bucket is freed (after its
forward under reshard_after_forward, or after its gradients were reduced) only when no use
holds it, so at most two units (plus prefetch) are gathered at a time.

Extra activation memory: one more microbatch in flight (F(i)'s activations grow while
B(i-1)'s are released), see overlap/estimate/activations.py.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, List, Optional, Sequence

import torch

from mpoverlap.pairing.steps import microbatch_forward
from mpoverlap.pairing.tape import Tape


class UnitPins:
    """The ZeRO-3 gatherer's units by name, pinned while a sub-step program uses them."""

    def __init__(self, gatherer) -> None:
        self.gatherer = gatherer
        self.index = {u.name: i for i, u in enumerate(gatherer.units)}

    def pin(self, unit: str, forward: bool) -> None:
        i = self.index.get(unit)
        if i is not None:
            self.gatherer.pin(i, +1 if forward else -1)

    def unpin(self, unit: str, forward: bool) -> None:
        i = self.index.get(unit)
        if i is not None:
            # After a forward: freed under reshard_after_forward; after a backward: the
            # gradient reduction already asked for the free (deferred while pinned).
            self.gatherer.unpin(i, free=forward and self.gatherer.reshard_after_forward)


def run_pair(forward, backward, forward_context=nullcontext) -> None:
    """Round-robin two sub-step generators (either may be None) to their ends, THE BACKWARD
    FIRST (Megatron's order, see the module docstring); the forward's steps run inside
    `forward_context()` (autocast), the backward's outside."""
    live = [(g, forward_context if g is forward else nullcontext) for g in (backward, forward) if g is not None]
    while live:
        for item in list(live):
            gen, ctx = item
            with ctx():
                try:
                    next(gen)
                except StopIteration:
                    live.remove(item)


def train_paired(model, microbatches: Sequence, split: Callable, ddp, *, autocast=None,
                 trace: Optional[List] = None, mtp_sum: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Forward and backward of every microbatch, paired; returns the summed scaled loss (the LM
    loss alone with MTP targets, their MTP loss added into `mtp_sum`).
    `split(mb) -> (tokens, targets, positions)`; `ddp`: the DataParallel wrapper of `model`
    (gradient readiness, ZeRO-3 gathers); `trace` receives (microbatch, "F"|"B",
    "compute"|"issue"|"wait", name) events in program order."""
    pins = UnitPins(ddp.gatherer) if ddp.gatherer is not None else None
    # The tied embedding's weight gets gradient from the head and the embedding segments.
    ddp.hold_ready([p for _, params in model.foreign_reads() for p in params])
    try:
        return _paired_steps(model, microbatches, split, ddp, pins, autocast, trace, mtp_sum)
    finally:
        ddp.hold_ready([])


def _paired_steps(model, microbatches, split, ddp, pins, autocast, trace, mtp_sum) -> torch.Tensor:
    m = len(microbatches)
    ctx = (lambda: autocast) if autocast is not None else nullcontext
    loss_sum = None
    previous: Optional[Tape] = None
    for i in range(m + 1):
        forward, tape, result = None, None, {}
        if i < m:
            tokens, targets, positions = split(microbatches[i])
            tape = Tape(i, trace.append if trace is not None else None)
            forward = microbatch_forward(tape, model, tokens, targets, positions, m, pins, result)
        backward = _then(previous.backward_steps(), ddp.release_ready) if previous is not None else None
        ddp.set_last_microbatch(i == m)  # the backward running now is microbatch m-1's
        run_pair(forward, backward, ctx)
        if i < m:
            loss_sum = result["loss"] if loss_sum is None else loss_sum + result["loss"]
            if mtp_sum is not None and "mtp_loss" in result:
                mtp_sum += result["mtp_loss"]
        previous = tape
    return loss_sum


def _then(steps, finish: Callable):
    """The generator `steps`, then `finish()`."""
    yield from steps
    finish()
