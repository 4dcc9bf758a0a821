"""PipelineExecutor: runs one stage's action table with its p2p as CommHandles.

Contract for the caller (the training loop):

- `forward_step(vchunk, microbatch, input_tensor)` runs local virtual chunk `vchunk` on one
  microbatch and returns its output activation (shape `tensor_shape`, dtype `dtype`); on the
  last model chunk (stage pp-1, vchunk vpp-1; the MTP chunk on its stage in a loop_mtp
  layout, pipeline/actions.py) it returns the scalar loss, already scaled by
  1/num_microbatches (backpropagated as is, grad None; returned per microbatch). On
  the first model chunk `input_tensor` is None and forward_step reads the data itself;
  elsewhere it is the received activation (a leaf with requires_grad).
- `backward_hook(vchunk, microbatch, is_last)` runs right before each backward (B) and each
  weight-gradient action (W); `is_last` is True for the last B and for the last W of that
  vchunk in this step, so a data-parallel wrapper can issue its gradient reduction then:
  `ddp[vchunk].set_last_microbatch(is_last)` (parameters B accumulates, norms, are final
  after the last B; the deferred weights after the last W). After
  `run()` returns the caller calls `finish_grad_sync()` of each chunk's wrapper, then the
  optimizer.
- `run(m)` returns the per-microbatch (scaled) loss tensors, detached, on the last stage and
  [] elsewhere; all p2p is complete when it returns.

overlap=False: every batch is waited right after it is posted. overlap=True: the table's
prefetch program posts receives ahead; a receive is waited just before its tensor is used,
send-only batches complete in the background (reaped when done, all waited at the end).
Both modes post the same ops in the same order on both ends of every link (see
program.py), so gloo's per-pair ordering can neither mismatch nor deadlock.

`bubble_s` is the last run's pipeline bubble on this stage: the time spent blocked on a
receive (the table's order is fixed, so no other action is runnable then). It counts the
fill and the waits inside the step; the time an early-finishing stage then waits in the
step's collectives (gradient reduction, norm) is not the executor's and is not in it.

`trace` holds (event, action_index, time) of the last run: "post_recv" (index of the
compute that consumes it), "post_send" (index of the producer), "wait_recv", "compute".

A local message (zbv's turn: chunk pp-1 hands its activation to chunk pp on the same stage,
and the gradient back) is never posted: its producer stores the detached tensor, its
consumer takes it (the activation as a fresh leaf, as a received one would be).

Zero-bubble tables (W actions, zb1p and zbv): the B of a (vchunk, microbatch) that has a W runs
inside `weight_grads.deferring(queue)` (mpoverlap/wgrad): the model's linears compute only
their input gradients and queue their weight-gradient GEMMs, which the W action runs.
`shared_params`: parameters two chunks of this stage both use (zbv's tied embedding, read by
the embedding chunk and the head chunk of stage 0). Their gradient reaches the parameter once
per microbatch, in the microbatch's last W on this stage: an earlier W computes its share
into a running sum that the last one adds (the data-parallel hooks then see each parameter
accumulate once per microbatch, as on a single chunk, and a bucket is never reduced before
its shared parameter's last share).

Paired tables (overlap.ep_pairing, pipeline/paired.py): `paired` (pairing/pipeline.py's
PairedChunks) runs every forward and backward as sub-step programs instead of `forward_step`
and one autograd call; an F marked `paired` and the B after it run as ONE action, their
programs interleaved (the backward first), both inputs waited before it, both outputs posted
after it (the table posts nothing between them). In the paired V (zbv with pairing) and the
paired zb1p table a B that has a W runs its sub-steps in the deferral region of its queue, one
step at a time, so its W (after the pair) computes its weight gradients. A shared parameter of
the paired V (the tied embedding, or the embedding the MTP depths read) is queued by both chunks'
B like any deferred weight and summed as above; the readiness PairedChunks holds for it is
released after the W that accumulates it (PairedChunks.weights_done), never at the end of a B.

Profiling: each action (its receive wait, compute and posts) runs inside a `pp/<action>` range,
e.g. `pp/F(mb0,v1)`, in a torch profiler trace while one records, and as NVTX on CUDA.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from mpoverlap.comm.handle import CommHandle, named_range, now
from mpoverlap.pipeline.actions import (BACKWARD, CHUNK_LAYOUTS, FORWARD, RECV, SEND, WEIGHT, Action,
                                        Batch, Message, chunk_index, loop_mtp_layout)
from mpoverlap.pipeline.p2p import StageP2P, verbose_from_env

ForwardStep = Callable[[int, int, Optional[torch.Tensor]], torch.Tensor]
BackwardHook = Callable[[int, int, bool], None]


class PipelineExecutor:
    def __init__(self, actions: Sequence[Action], *, stage: int, pp_ranks: Sequence[int], group,
                 overlap: bool, ledger, tensor_shape: Tuple[int, ...], dtype: torch.dtype,
                 device, forward_step: ForwardStep, backward_hook: Optional[BackwardHook] = None,
                 verbose: Optional[bool] = None, weight_grads=None,
                 shared_params: Sequence[torch.nn.Parameter] = (), paired=None) -> None:
        self.actions = list(actions)
        if any(a.paired for a in self.actions) and paired is None:
            raise ValueError("the table pairs forwards with backwards (overlap.ep_pairing): pass paired, "
                             "the PairedChunks of this stage's chunks")
        self.paired = paired
        pp = len(pp_ranks)
        # Loop layout: chunk = vchunk * pp + stage; the zbv V: stage s holds chunks s and 2pp-1-s;
        # a middle stage's MTP chunk (its last vchunk v) is chunk v * pp.
        top = max((a.vchunk for a in self.actions), default=0)
        layouts = CHUNK_LAYOUTS + ((loop_mtp_layout(stage, top),) if 0 < stage < len(pp_ranks) - 1 else ())
        bad = [a for a in self.actions
               if a.chunk not in (chunk_index(stage, a.vchunk, pp, layout) for layout in layouts)]
        if bad:
            raise ValueError(f"actions {bad[:3]} belong to another stage than {stage} (pp={pp})")
        # Messages both produced and consumed here (the V's turn): handed over in memory.
        chunks_here = {a.chunk for a in self.actions}
        self.local = {a.send for a in self.actions if a.send is not None and a.send.dst_chunk in chunks_here}
        self.stage = int(stage)
        self.overlap = bool(overlap)
        self.tensor_shape = tuple(tensor_shape)
        self.dtype = dtype
        self.device = torch.device(device)
        self._nvtx = self.device.type == "cuda"
        self.forward_step = forward_step
        self.backward_hook = backward_hook
        verbose = verbose_from_env() if verbose is None else verbose
        self.p2p = StageP2P(stage, pp_ranks, group, ledger, verbose)
        self.num_microbatches = 1 + max((a.microbatch for a in self.actions), default=-1)
        # The last model chunk: the one whose forward sends nothing (the loss; in a loop_mtp
        # layout the MTP chunk on its stage, the head's chunk then sending on like a middle one).
        self.last_chunk = next((a.chunk for a in self.actions if a.kind == FORWARD and a.send is None), None)
        self.is_last_stage = self.last_chunk is not None
        # Index of the last backward (and W) of each vchunk, and of each message's consumer/producer.
        self.last_backward = {a.vchunk: i for i, a in enumerate(self.actions) if a.kind == BACKWARD}
        self.last_weight = {a.vchunk: i for i, a in enumerate(self.actions) if a.kind == WEIGHT}
        self.deferred = {(a.vchunk, a.microbatch) for a in self.actions if a.kind == WEIGHT}
        if self.deferred and weight_grads is None:
            raise ValueError("the table has W actions (a zero-bubble schedule): pass weight_grads, "
                             "the WeightGradDeferral attached to the model chunks")
        self.weight_grads = weight_grads
        self.shared = {id(p) for p in shared_params}
        self.last_weight_of_mb = {a.microbatch: i for i, a in enumerate(self.actions) if a.kind == WEIGHT}
        self.consumer = {a.recv: i for i, a in enumerate(self.actions) if a.recv is not None}
        self.producer = {a.send: i for i, a in enumerate(self.actions) if a.send is not None}
        self.trace: List[Tuple[str, int, float]] = []
        self.bubble_s = 0.0
        self.steps_run = 0

    @property
    def p2p_calls_per_run(self) -> int:
        """send_recv calls (= "pp" handles in the ledger) one run() issues."""
        return sum(len(b) + len(c) for b, c in (a.batches(self.overlap) for a in self.actions))

    # ---- one step ------------------------------------------------------------------------
    def run(self, num_microbatches: int) -> List[torch.Tensor]:
        if num_microbatches != self.num_microbatches:
            raise ValueError(f"the table was built for {self.num_microbatches} microbatches, "
                             f"run() got {num_microbatches}")
        self.trace = []
        self.bubble_s = 0.0
        self.p2p.calls = 0
        self._inputs: Dict[Tuple[int, int], Optional[torch.Tensor]] = {}
        self._outputs: Dict[Tuple[int, int], torch.Tensor] = {}
        self._to_send: Dict[Message, torch.Tensor] = {}
        self._received: Dict[Message, Tuple[torch.Tensor, CommHandle]] = {}
        self._in_flight: List[CommHandle] = []
        self._weight_queues: Dict[Tuple[int, int], object] = {}
        self._shared_grads: Dict[int, Tuple[torch.nn.Parameter, torch.Tensor]] = {}
        losses: Dict[int, torch.Tensor] = {}
        try:
            index = 0
            while index < len(self.actions):
                action = self.actions[index]
                partner = self.actions[index + 1] if action.paired else None
                before, after = action.batches(self.overlap)
                if partner is not None:  # the pair's posts: before its F, after its B
                    after = partner.batches(self.overlap)[1]
                # A pair: both actions' ranges span it (the timeline draws the F and the B overlapped).
                with named_range("pp", action, cuda=self._nvtx), \
                        (named_range("pp", partner, cuda=self._nvtx) if partner is not None else nullcontext()):
                    for batch in before:
                        self._post(batch)
                    if partner is None:
                        self._compute(index, action, losses)
                    else:
                        self._compute_pair(index, action, partner, losses)
                    for batch in after:
                        self._post(batch)
                self._reap_sends()
                index += 1 if partner is None else 2
            for handle in self._in_flight:
                handle.wait()
        finally:
            self._in_flight = []
            self.steps_run += 1
        if self._received or self._to_send or self._outputs:
            raise RuntimeError(f"stage {self.stage}: unconsumed p2p after the step: received "
                               f"{list(self._received)}, unsent {list(self._to_send)}")
        if self._weight_queues or self._shared_grads:
            raise RuntimeError(f"stage {self.stage}: weight gradients never run: {list(self._weight_queues)}"
                               f"{' and shared parameters ones' if self._shared_grads else ''}")
        return [losses[mb] for mb in sorted(losses)] if self.is_last_stage else []

    # ---- p2p -----------------------------------------------------------------------------
    def _post(self, batch: Batch) -> None:
        tensors = []
        for op in batch:
            if op.op == SEND:
                tensors.append(self._to_send.pop(op.message))
                self.trace.append(("post_send", self.producer[op.message], now()))
            else:
                tensors.append(torch.empty(self.tensor_shape, dtype=self.dtype, device=self.device))
                self.trace.append(("post_recv", self.consumer[op.message], now()))
        handle = self.p2p.post(batch, tensors, self.steps_run)
        if not self.overlap:
            self._timed_wait(handle, any(op.op == RECV for op in batch))
        self._in_flight.append(handle)
        for op, tensor in zip(batch, tensors):
            if op.op == RECV:
                self._received[op.message] = (tensor, handle)

    def _take_received(self, index: int, message: Message) -> torch.Tensor:
        if message in self.local:
            return self._to_send.pop(message)
        tensor, handle = self._received.pop(message)
        self.trace.append(("wait_recv", index, now()))
        self._timed_wait(handle, True)
        return tensor

    def _timed_wait(self, handle: CommHandle, has_recv: bool) -> None:
        """Wait; a wait on a receive not yet complete counts as bubble."""
        if not has_recv or handle.waited:
            handle.wait()
            return
        start = now()
        handle.wait()
        self.bubble_s += now() - start

    def _reap_sends(self) -> None:
        """Wait (free) the handles already complete; the rest stay in flight."""
        still = []
        for handle in self._in_flight:
            if handle.waited or handle.is_completed():
                handle.wait()
            else:
                still.append(handle)
        self._in_flight = still

    # ---- compute -------------------------------------------------------------------------
    def _check_sendable(self, tensor: torch.Tensor, what: str) -> torch.Tensor:
        if tuple(tensor.shape) != self.tensor_shape or tensor.dtype != self.dtype:
            raise ValueError(f"stage {self.stage}: {what} has shape {tuple(tensor.shape)} dtype "
                             f"{tensor.dtype}; the pipeline sends {self.tensor_shape} {self.dtype}")
        return tensor.detach().contiguous()

    def _fold_shared(self, queue, last: bool) -> None:
        """Shared parameters (see the module docstring): in a microbatch's earlier W compute
        their share now into the running sum; in its last W hand the sum to the queue."""
        if last:
            for param, grad in self._shared_grads.values():
                queue.entries.append((param, lambda grad=grad: grad))
            self._shared_grads = {}
            return
        kept = []
        for param, compute in queue.entries:
            if id(param) not in self.shared:
                kept.append((param, compute))
                continue
            grad = compute().to(param.dtype)
            held = self._shared_grads.get(id(param))
            self._shared_grads[id(param)] = (param, grad if held is None else held[1] + grad)
        queue.entries = kept

    def _compute_pair(self, index: int, forward: Action, backward: Action, losses: Dict[int, torch.Tensor]) -> None:
        """A paired F (at `index`) and the B after it as one overlapped action."""
        inp, run = self._begin_forward(index, forward)
        grad, bwd_run, bwd_inp = self._begin_backward(index + 1, backward)
        self.paired.run(run, self._paired_backward(backward, bwd_run, grad))
        self._end_forward(forward, inp, run, losses)
        self._end_backward(backward, bwd_inp, bwd_run)

    def _begin_forward(self, index: int, action: Action):
        """(input, ChunkRun) of a forward on the paired path (its steps not run yet)."""
        inp = None
        if action.recv is not None:
            inp = self._take_received(index, action.recv).requires_grad_()
        self.trace.append(("compute", index, now()))
        return inp, self.paired.forward(action.vchunk, action.microbatch, inp)

    def _end_forward(self, action: Action, inp, run, losses) -> None:
        key = (action.vchunk, action.microbatch)
        self._inputs[key], self._outputs[key] = inp, run
        if action.chunk == self.last_chunk:
            losses[action.microbatch] = run.output
        if action.send is not None:
            self._to_send[action.send] = self._check_sendable(run.output, f"{action} output")

    def _begin_backward(self, index: int, action: Action):
        """(received gradient, ChunkRun, input) of a backward on the paired path."""
        grad = self._take_received(index, action.recv) if action.recv is not None else None
        if self.backward_hook is not None:
            self.backward_hook(action.vchunk, action.microbatch, self.last_backward[action.vchunk] == index)
        self.trace.append(("compute", index, now()))
        key = (action.vchunk, action.microbatch)
        return grad, self._outputs.pop(key), self._inputs.pop(key)

    def _paired_backward(self, action: Action, run, grad):
        """The sub-step backward of a paired table's B; where the B has a W (the paired V, the
        paired zb1p table), each of its steps runs inside the deferral region of the
        (vchunk, microbatch)'s queue, so its linears compute only input gradients and queue
        their weight GEMMs for the W (the pair's forward steps, run between them, stay outside
        the region)."""
        key = (action.vchunk, action.microbatch)
        if key not in self.deferred:
            return self.paired.backward(run, grad)
        from mpoverlap.wgrad import WeightGradQueue

        self._weight_queues[key] = queue = WeightGradQueue()
        return self.paired.backward(run, grad, each_step=lambda: self.weight_grads.deferring(queue))

    def _end_backward(self, action: Action, inp, run) -> None:
        if action.send is not None:
            if run.input_grad is None:
                raise RuntimeError(f"stage {self.stage}: {action}: the chunk's output does not "
                                   "depend on its input, no input gradient to send")
            self._to_send[action.send] = self._check_sendable(run.input_grad, f"{action} input grad")

    def _compute(self, index: int, action: Action, losses: Dict[int, torch.Tensor]) -> None:
        key = (action.vchunk, action.microbatch)
        if self.paired is not None and action.kind == FORWARD:  # a lone F of a paired table
            inp, run = self._begin_forward(index, action)
            self.paired.run(run, None)
            self._end_forward(action, inp, run, losses)
            return
        if self.paired is not None and action.kind == BACKWARD:  # a lone B of a paired table
            grad, run, inp = self._begin_backward(index, action)
            self.paired.run(None, self._paired_backward(action, run, grad))
            self._end_backward(action, inp, run)
            return
        if action.kind == FORWARD:
            inp = None
            if action.recv is not None:
                inp = self._take_received(index, action.recv).requires_grad_()
            self.trace.append(("compute", index, now()))
            out = self.forward_step(action.vchunk, action.microbatch, inp)
            self._inputs[key], self._outputs[key] = inp, out
            if action.chunk == self.last_chunk:
                if out.numel() != 1:
                    raise ValueError("the last model chunk must return the scalar loss, "
                                     f"got shape {tuple(out.shape)}")
                losses[action.microbatch] = out.detach()
            if action.send is not None:
                self._to_send[action.send] = self._check_sendable(out, f"{action} output")
            return
        if action.kind == WEIGHT:
            if self.backward_hook is not None:
                self.backward_hook(action.vchunk, action.microbatch, self.last_weight[action.vchunk] == index)
            self.trace.append(("compute", index, now()))
            queue = self._weight_queues.pop(key)
            if self.shared:
                self._fold_shared(queue, last=self.last_weight_of_mb[action.microbatch] == index)
            queue.run()
            if self.paired is not None:
                self.paired.weights_done()
            return
        grad = self._take_received(index, action.recv) if action.recv is not None else None
        if self.backward_hook is not None:
            self.backward_hook(action.vchunk, action.microbatch, self.last_backward[action.vchunk] == index)
        self.trace.append(("compute", index, now()))
        out, inp = self._outputs.pop(key), self._inputs.pop(key)
        if key in self.deferred:
            from mpoverlap.wgrad import WeightGradQueue

            with self.weight_grads.deferring(WeightGradQueue()) as queue:
                torch.autograd.backward(out, grad_tensors=grad)
            self._weight_queues[key] = queue
        else:
            torch.autograd.backward(out, grad_tensors=grad)
        if action.send is not None:
            if inp is None or inp.grad is None:
                raise RuntimeError(f"stage {self.stage}: {action}: the chunk's output does not "
                                   "depend on its input, no input gradient to send")
            self._to_send[action.send] = self._check_sendable(inp.grad, f"{action} input grad")
