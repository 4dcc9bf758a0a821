"""Forward/backward pairing inside the pipeline (overlap.ep_pairing at pp > 1).

The paired interleaved table (pipeline/paired.py) marks each steady-state forward that runs
with the backward after it as one overlapped "FB" action. The pipeline executor runs every
forward and backward of such a table through `PairedChunks`: a chunk's forward is the
sub-step program of steps.py on a Tape (its input the received activation when the chunk does
not embed, its output the hidden state to send when it does not compute the loss), its
backward the tape's mirror, seeded with the received output gradient (or the loss's), ending
with the gradient of the received input. A lone F or B runs its program alone; an FB runs the
two round-robin, THE BACKWARD FIRST (executor.run_pair: each exchange of one in flight under a
compute sub-step of the other, as at pp 1). The p2p of both is posted around the pair by the
pipeline executor (both inputs received before, both outputs sent after).

Exactness: the sub-steps compute the unpaired chunk's math (loss scale 1/m, router losses,
expert-bias loads, gradient accumulation into the DP buffer); the executor's backward hook
sets the DP wrapper's last-microbatch flag before each B, as for the unpaired table. ZeRO-3:
the units of this stage's chunks (names unique over the chunks: the layers carry their model
index) are pinned per use as at pp 1 (executor.UnitPins).

MTP (model.mtp_num_layers): the head chunk's sub-step program runs the depths in its head
segment and seeds the trained loss (LM + mtp_loss_scale x MTP, as unpaired); the LM loss and
the MTP loss (each / m) go into `mtp_sums`, so the step's metrics report the two apart as the
unpaired pipeline's forward step does (training/pipeline_glue.py).
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from mpoverlap.pairing.executor import UnitPins, run_pair
from mpoverlap.pairing.steps import microbatch_forward
from mpoverlap.pairing.tape import Tape, stepwise


class ChunkRun:
    """One (vchunk, microbatch) forward on its tape: `steps` (the forward's generator), then
    `output` (the loss on the last model chunk, detached; else the hidden state to send) and,
    after the backward, `input_grad` (None on the chunk that embeds)."""

    def __init__(self, tape: Tape, steps, result: dict) -> None:
        self.tape, self.steps, self.result = tape, steps, result

    @property
    def output(self) -> torch.Tensor:
        return self.result["loss"] if "loss" in self.result else self.result["output"]

    @property
    def input_grad(self) -> Optional[torch.Tensor]:
        return self.result.get("input_grad")


class PairedChunks:
    """The pipeline executor's compute when the table is paired (PipelineExecutor `paired`).
    `inputs(mb) -> (tokens, targets, positions)`; `ddp`: the DP wrapper of this stage's chunks;
    `trace` receives the sub-step events (microbatch, "F"|"B", kind, name) in program order;
    `mtp_sums` (two scalars, the caller's per step) receive the head chunk's LM loss and MTP
    loss, each / m, per forward with MTP targets."""

    def __init__(self, chunks: Sequence, ddp, inputs: Callable[[int], tuple], num_microbatches: int,
                 autocast=None, trace: Optional[List] = None) -> None:
        self.chunks, self.ddp, self.inputs = list(chunks), ddp, inputs
        self.num_microbatches = num_microbatches
        self.autocast, self.trace = autocast, trace
        self.mtp_sums: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
        self.pins = UnitPins(ddp.gatherer) if ddp.gatherer is not None else None
        # A parameter read by two segments of one backward (a tied head's embedding copy)
        # accumulates twice: its DP readiness waits for the end of that backward.
        ddp.hold_ready([p for c in self.chunks for _, params in c.foreign_reads() for p in params])

    def forward(self, vchunk: int, microbatch: int, hidden: Optional[torch.Tensor]) -> ChunkRun:
        chunk = self.chunks[vchunk]
        tokens, targets, positions = self.inputs(microbatch)
        tape = Tape(microbatch, self.trace.append if self.trace is not None else None)
        result: dict = {}
        first = tokens if chunk.pre_process else hidden
        steps = microbatch_forward(tape, chunk, first, targets, positions, self.num_microbatches, self.pins, result)
        return ChunkRun(tape, steps, result)

    def backward(self, run: ChunkRun, grad: Optional[torch.Tensor], each_step: Optional[Callable] = None):
        """Generator: the backward of `run`, seeded with `grad` (the received gradient of its
        output; None on the last model chunk, whose loss seeded itself). `each_step`: a context
        each of its steps runs in (not the paired forward's, run between them): a zero-bubble
        table's B that has a W passes its deferral region, so its linears compute only their
        input gradients and queue their weight GEMMs for the W."""
        steps = self._backward(run, grad)
        if each_step is None:
            return steps
        return stepwise(steps, each_step)

    def _backward(self, run: ChunkRun, grad: Optional[torch.Tensor]):
        if grad is not None:
            run.tape.add_grad(run.result.pop("output"), grad)
        yield from run.tape.backward_steps()
        self.ddp.release_ready()

    def weights_done(self) -> None:
        """After a W action (zero-bubble paired tables): a held parameter (a tied head's
        embedding copy) whose deferred gradient that W accumulated becomes ready now, not at the
        end of its B, when nothing of it had arrived yet."""
        self.ddp.release_ready()

    def run(self, forward: Optional[ChunkRun], backward) -> None:
        """Run a forward's steps and a backward generator (either may be None) to their ends,
        paired when both are given."""
        ctx = (lambda: self.autocast) if self.autocast is not None else nullcontext
        pair = forward is not None and backward is not None and self.trace is not None
        if pair:  # the pair's span in the trace (tests/test_pairing.py)
            self.trace.append((None, "FB", "begin", ""))
        run_pair(forward.steps if forward is not None else None, backward, ctx)
        if pair:
            self.trace.append((None, "FB", "end", ""))
        if forward is not None and "mtp_loss" in forward.result:
            if self.mtp_sums is None:
                raise RuntimeError("the head chunk ran MTP depths: set PairedChunks.mtp_sums to collect their losses")
            main_sum, mtp_sum = self.mtp_sums
            main_sum += forward.result["loss"]
            mtp_sum += forward.result["mtp_loss"]
