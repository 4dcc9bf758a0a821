"""One microbatch's forward recorded as sub-steps whose backward can run one at a time.

A `Tape` holds, in forward order, the entries of one microbatch:

    Segment     an autograd island: its inputs are detached leaves (`boundary`), so running
                its backward (`torch.autograd.backward(outputs, grads)`) stops at them and
                leaves the gradients of its inputs in their `.grad`; the tape hands those to
                the entries that produced the inputs.
    Exchange    a collective of the ep group between two segments (the all-to-all, or the
                all-gather dispatcher's gather and reduce-scatter), as two entries: the
                issue and the wait. Its backward is the reverse all-to-all, issued where the
                forward waited and waited where the forward issued (the tape mirrors itself).
    YIELD       a point where an exchange is in flight: the executor runs the other
                microbatch until it reaches one of its own (forward and backward alike: the
                reversed tape yields at the mirrored places).
    UnitUse     a ZeRO-3 unit in use from `enter` to `exit` (see executor.UnitPins): forward
                gathers at enter and may free at exit; the backward gathers at the mirror of
                exit and releases at the mirror of enter.

Gradients between entries travel through `Tape.add_grad/take_grad`, keyed by the producing
tensor (the tape keeps every such tensor alive, so the keys stay unique). The math of each
segment is the unpaired model's: only the places where autograd is cut differ, so gradients
equal the unpaired path's up to the summation order of accumulated weight gradients.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch

from mpoverlap.comm.collectives import all_gather, all_to_all, reduce_scatter

YIELD = "yield"


def stepwise(steps, context: Callable):
    """The sub-step program `steps` (a generator) with each of its steps inside `context()`,
    and not the other program's steps that run at its yields; returns what `steps` returns.
    A full-recompute replay runs its forward's steps under no_grad or autocast this way
    (steps.py), a zero-bubble table's paired B its steps in the deferral region of its W
    (pipeline.py)."""
    while True:
        with context():
            try:
                next(steps)
            except StopIteration as stop:
                return stop.value
        yield


def boundary(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A segment's view of an input: a fresh leaf when a gradient flows through it."""
    if t is None or not t.requires_grad:
        return t
    return t.detach().requires_grad_()


class Tape:
    def __init__(self, microbatch: int, log: Optional[Callable] = None) -> None:
        self.microbatch = microbatch
        self.entries: List[Any] = []
        self._grads: Dict[int, torch.Tensor] = {}
        self._log = log

    def log(self, direction: str, kind: str, name: str) -> None:
        """Trace (microbatch, "F"|"B", "compute"|"issue"|"wait", name) for the wiring tests."""
        if self._log is not None:
            self._log((self.microbatch, direction, kind, name))

    def segment(self, name: str, inputs: List[Optional[torch.Tensor]]) -> "Segment":
        return Segment(self, name, inputs)

    def add_grad(self, t: torch.Tensor, g: torch.Tensor) -> None:
        key = id(t)
        prev = self._grads.get(key)
        self._grads[key] = g if prev is None else prev + g

    def take_grad(self, t: torch.Tensor) -> Optional[torch.Tensor]:
        return self._grads.pop(id(t), None)

    def backward_steps(self):
        """The backward as a generator: runs the entries in reverse, yields at each YIELD."""
        for entry in reversed(self.entries):
            if entry is YIELD:
                yield
            elif hasattr(entry, "backward_steps"):  # an entry with yields of its own (steps._Replayed)
                yield from entry.backward_steps(self)
            else:
                entry.backward(self)
        self.entries.clear()
        self._grads.clear()


class Segment:
    """Use: `seg = tape.segment(name, [x, ...]); a, ... = seg.leaves; ...; seg.close([y, ...])`."""

    def __init__(self, tape: Tape, name: str, inputs: List[Optional[torch.Tensor]]) -> None:
        self.name = name
        self.sources = list(inputs)
        self.leaves = [boundary(t) for t in inputs]
        self.outputs: List[torch.Tensor] = []
        tape.log("F", "compute", name)

    def input(self, t: torch.Tensor) -> torch.Tensor:
        """One more input, known only part way through the segment's forward."""
        self.sources.append(t)
        self.leaves.append(boundary(t))
        return self.leaves[-1]

    def close(self, tape: Tape, outputs: List[Optional[torch.Tensor]]) -> None:
        self.outputs = [o for o in outputs if o is not None]
        tape.entries.append(self)

    def backward(self, tape: Tape) -> None:
        tape.log("B", "compute", self.name)
        outs, grads = [], []
        for o in self.outputs:
            g = tape.take_grad(o)
            if g is not None and o.requires_grad:
                outs.append(o)
                grads.append(g)
        if outs:
            torch.autograd.backward(outs, grads)
        for src, leaf in zip(self.sources, self.leaves):
            if leaf is not src and leaf.grad is not None:
                tape.add_grad(src, leaf.grad)
        self.sources, self.leaves, self.outputs = [], [], []


def _collective(kind: str, send: torch.Tensor, group, ledger, out_splits=None, in_splits=None, size: int = 1):
    """Issue one ep collective of `send` [N, ...] -> (handle, receive buffer): "a2a" (rows
    `in_splits` to each rank, `out_splits` from each), "gather" (all_gather, [size N, ...]) or
    "scatter" (reduce_scatter, [N / size, ...])."""
    rest = tuple(send.shape[1:])
    if kind == "a2a":
        recv = send.new_empty((sum(out_splits),) + rest)
        return all_to_all(recv, send, group, mode="ep", ledger=ledger, output_split_sizes=out_splits,
                          input_split_sizes=in_splits), recv
    if kind == "gather":
        recv = send.new_empty((size * send.shape[0],) + rest)
        return all_gather(recv, send, group, mode="ep", ledger=ledger), recv
    recv = send.new_empty((send.shape[0] // size,) + rest)
    return reduce_scatter(recv, send, group, mode="ep", ledger=ledger), recv


REVERSE = {"a2a": "a2a", "gather": "scatter", "scatter": "gather"}


class Exchange:
    """One ep collective of `send` between two segments (`kind`: see `_collective`; an a2a
    takes `splits=(out_splits, in_splits)`, a gather or scatter the group `size`); the received
    buffer is the next segment's input. Its backward runs the reverse collective (a2a with the
    splits swapped, gather <-> scatter), unless `send` carries no gradient (routing ids).
    `wire` (moe/dispatch_wire.py, a dispatch's token rows only): the rows travel as
    `wire.depart(send)` and the received buffer is `wire.arrive(...)` in send's dtype once
    waited; the reverse exchange carries the gradient as it is (straight-through)."""

    def __init__(self, tape: Tape, name: str, send: torch.Tensor, group, ledger, *, kind: str = "a2a",
                 splits=(None, None), size: int = 1, record: bool = True, wire=None) -> None:
        self.name, self.send, self.group, self.ledger = name, send, group, ledger
        self.kind, self.size, self.wire = kind, size, wire
        self.out_splits, self.in_splits = splits
        sent = send.detach().contiguous()
        self.handle, self.recv = _collective(kind, sent if wire is None else wire.depart(sent), group, ledger,
                                             self.out_splits, self.in_splits, size)
        self._grad_out = self._grad_handle = None
        tape.log("F", "issue", name)
        if record:
            tape.entries.append(self.issued_entry())

    def wait(self, tape: Tape, record: bool = True) -> torch.Tensor:
        """The received buffer. `record=False`: the caller puts `waited_entry()` on the tape
        itself (where the backward should issue the reverse exchange)."""
        self.handle.wait()
        self.handle = None
        if self.wire is not None:  # the rows in the dtype they were sent in
            self.recv = self.wire.arrive(self.recv, self.send.shape[1], self.send.dtype)
        tape.log("F", "wait", self.name)
        if record:
            tape.entries.append(self.waited_entry())
        return self.recv.requires_grad_(self.send.requires_grad)

    def issued_entry(self) -> "_Issued":
        return _Issued(self)

    def waited_entry(self) -> "_Waited":
        return _Waited(self)

    # ---- backward: the reverse exchange -----------------------------------------------------
    def backward_issue(self, tape: Tape) -> None:
        if not self.send.requires_grad:  # the same on every rank: nothing to send back
            return
        g = tape.take_grad(self.recv)
        if g is None:  # every rank issues the reverse exchange, used or not
            g = torch.zeros_like(self.recv)
        self._grad_handle, self._grad_out = _collective(REVERSE[self.kind], g.contiguous(), self.group, self.ledger,
                                                        self.in_splits, self.out_splits, self.size)
        tape.log("B", "issue", self.name)

    def backward_wait(self, tape: Tape) -> None:
        if self._grad_handle is None:
            return
        self._grad_handle.wait()
        tape.log("B", "wait", self.name)
        if self.send.requires_grad:
            tape.add_grad(self.send, self._grad_out)
        self._grad_out = self._grad_handle = self.send = self.recv = None


class _Issued:
    def __init__(self, ex: Exchange) -> None:
        self.ex = ex

    def backward(self, tape: Tape) -> None:
        self.ex.backward_wait(tape)


class _Waited:
    def __init__(self, ex: Exchange) -> None:
        self.ex = ex

    def backward(self, tape: Tape) -> None:
        self.ex.backward_issue(tape)


class UnitUse:
    """A ZeRO-3 unit used between two tape points (`pins`: executor.UnitPins, or None)."""

    def __init__(self, pins, unit: str, enter: bool) -> None:
        self.pins, self.unit, self.enter = pins, unit, enter

    @staticmethod
    def mark(tape: Tape, pins, unit: str, enter: bool) -> None:
        if pins is None:
            return
        if enter:
            pins.pin(unit, forward=True)
        else:
            pins.unpin(unit, forward=True)
        tape.entries.append(UnitUse(pins, unit, enter))

    def backward(self, tape: Tape) -> None:
        if self.enter:
            self.pins.unpin(self.unit, forward=False)
        else:
            self.pins.pin(self.unit, forward=False)
