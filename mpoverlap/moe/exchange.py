"""The token exchanges of the MoE dispatchers (moe/dispatcher.py): collectives over the
expert-parallel group, issued on detached tensors and joined to the autograd graph once waited.

`issue_all_to_all`, `issue_all_gather` and `issue_reduce_scatter` issue one collective each and
return (handle, link); a `Pending` holds the handles and links of an exchange in flight, and its
`wait()` makes each received buffer the autograd successor of the sent tensor. With one rank
(group None) an exchange is the identity: nothing is copied either way, and no handle is made.
All handles: mode "ep".

`wire` (moe/dispatch_wire.py, the dispatch's forward exchange only): the rows are sent as
`wire.depart(x)` and, once waited, the received buffer becomes `wire.arrive(...)` in x's
dtype before it joins the graph; the reverse exchange carries the gradient as it is (the
straight-through gradient: the round trip counts as the identity).

Autograd: once waited, `_Link` joins the received buffer to the sent tensor in the graph, and
its backward runs the reverse collective (all_to_all with swapped splits; all_gather <->
reduce_scatter).
  overlap=False: the reverse collective is waited inside `_Link.backward`.
  overlap=True:  `_Link.backward` only issues it and returns the buffer being written; a
    `_WaitGrad` identity node, inserted in front of the link when the exchange was issued,
    waits it. Nothing reads the buffer in between, and the autograd engine runs the nodes it
    created later in forward first, so the backward of another chunk's experts (and the
    shared expert) runs while the reverse exchange is in flight: the backward mirrors the
    forward overlap. The node order is the same on every rank (same graph), so is the
    collective order.
`backward_trace` (a list, optional) receives ("bwd_exchange_issued", id) and
("bwd_exchange_waited", id) in the order backward runs them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch

from mpoverlap.comm.collectives import all_gather, all_to_all, reduce_scatter
from mpoverlap.comm.handle import CommHandle

MODE = "ep"


@dataclass
class Pending:
    handles: List[Optional[CommHandle]]  # None: an identity exchange (one rank)
    links: List[tuple]  # (input with autograd history, buffer being written, backward fn, arrival fn or None)
    ctx: Dict[str, Any]

    def wait(self) -> List[torch.Tensor]:
        """Wait every handle, then attach each buffer to its input's autograd graph.

        The link is made only after the wait: some backends (gloo's reduce-scatter) finish by
        copying into the output inside wait(), which would otherwise overwrite the output's
        autograd history."""
        for h in self.handles:
            if h is not None:
                h.wait()
        # buf None: one rank, the exchange was the identity (nothing copied, no reverse)
        return [x if buf is None else _Link.apply(x, [buf if arrive is None else arrive(buf)], fn)
                for x, buf, fn, arrive in self.links]


class _Link(torch.autograd.Function):
    """Identity edge x -> received buffer; backward runs `fn` (the reverse collective) on the
    gradient."""

    @staticmethod
    def forward(ctx, x, box, fn):
        ctx.fn = fn
        return box[0]

    @staticmethod
    def backward(ctx, grad):
        return ctx.fn(grad.contiguous()), None, None


class _WaitGrad(torch.autograd.Function):
    """Identity in forward; in backward waits the reverse exchange `box["handle"]` issued by
    the `_Link` right after it (overlap=True), so the gradient is read only once it landed."""

    @staticmethod
    def forward(ctx, x, box):
        ctx.box = box
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        box = ctx.box
        handle = box.pop("handle", None)
        if handle is not None:
            handle.wait()
            if box.get("trace") is not None:
                box["trace"].append(("bwd_exchange_waited", box["id"]))
        return grad, None


class TokenExchange:
    """Issues one token exchange and its reverse in backward (see the module docstring)."""

    def __init__(self, group, ledger, async_backward: bool, trace, exchange_id: int) -> None:
        self.group, self.ledger, self.async_backward = group, ledger, async_backward
        self.box = {"trace": trace, "id": exchange_id}

    def prepare(self, x):
        """x as the graph should see it: behind a wait node when the backward is async."""
        return _WaitGrad.apply(x, self.box) if self.async_backward and x.requires_grad else x

    def reverse(self, issue):
        """Run `issue() -> (handle, out)` as the backward collective: waited now, or left to
        the `_WaitGrad` node."""
        handle, out = issue()
        if self.box["trace"] is not None:
            self.box["trace"].append(("bwd_exchange_issued", self.box["id"]))
        if self.async_backward:
            self.box["handle"] = handle
        else:
            handle.wait()
            if self.box["trace"] is not None:
                self.box["trace"].append(("bwd_exchange_waited", self.box["id"]))
        return out


def _departing(x, wire):
    """(what the exchange sends, the arrival fn for its received buffer or None)."""
    sent = x.detach().contiguous()
    if wire is None:
        return sent, None
    return wire.depart(sent), lambda buf: wire.arrive(buf, x.shape[1], x.dtype)


def issue_all_to_all(x, group, out_splits, in_splits, ledger, ex: TokenExchange, wire=None):
    """Issue all_to_all of x (no autograd); returns (handle, link). `wire`: the rows' format on
    the wire (the dispatch's forward exchange only)."""
    if group is None:  # one rank: the identity, no copy in either direction
        return None, (x, None, None, None)
    x = ex.prepare(x)
    sent, arrive = _departing(x, wire)
    buf = sent.new_empty((sum(out_splits),) + tuple(sent.shape[1:]))
    h = all_to_all(buf, sent, group, mode=MODE, ledger=ledger,
                   output_split_sizes=out_splits, input_split_sizes=in_splits)

    def back(g):
        def issue():
            out = g.new_empty((sum(in_splits),) + tuple(g.shape[1:]))
            return all_to_all(out, g, group, mode=MODE, ledger=ledger, output_split_sizes=in_splits,
                              input_split_sizes=out_splits), out
        return ex.reverse(issue)
    return h, (x, buf, back, arrive)


def issue_all_gather(x, group, size, ledger, ex: TokenExchange, wire=None):
    """Issue all_gather [T, ...] -> [R*T, ...]; backward reduce-scatters. `wire`: as for
    `issue_all_to_all` (the gathered tokens)."""
    if group is None:  # one rank: the identity, no copy in either direction
        return None, (x, None, None, None)
    x = ex.prepare(x)
    sent, arrive = _departing(x, wire)
    buf = sent.new_empty((size * sent.shape[0],) + tuple(sent.shape[1:]))
    h = all_gather(buf, sent, group, mode=MODE, ledger=ledger)

    def back(g):
        def issue():
            out = g.new_empty((g.shape[0] // size,) + tuple(g.shape[1:]))
            return reduce_scatter(out, g, group, mode=MODE, ledger=ledger), out
        return ex.reverse(issue)
    return h, (x, buf, back, arrive)


def issue_reduce_scatter(x, group, size, ledger, ex: TokenExchange):
    """Issue reduce_scatter [R*T, ...] -> [T, ...]; backward all-gathers."""
    if group is None:  # one rank: the identity, no copy in either direction
        return None, (x, None, None, None)
    x = ex.prepare(x)
    buf = x.new_empty((x.shape[0] // size,) + tuple(x.shape[1:]))
    h = reduce_scatter(buf, x.detach().contiguous(), group, mode=MODE, ledger=ledger)

    def back(g):
        def issue():
            out = g.new_empty((size * g.shape[0],) + tuple(g.shape[1:]))
            return all_gather(out, g, group, mode=MODE, ledger=ledger), out
        return ex.reverse(issue)
    return h, (x, buf, back, None)
