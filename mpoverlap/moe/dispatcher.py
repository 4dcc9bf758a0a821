"""Token dispatchers over the expert-parallel group: the communication half of the MoE layer.

Both dispatchers split each exchange into `*_start` (issues, returns a Pending holding the
CommHandle) and `*_finish` (waits, returns tensors), so the layer decides what runs while a
handle is in flight. `dispatch`/`combine` are start+finish back to back. All handles: mode "ep".

AllToAllDispatcher (R = ep_size, L = num_experts / R local experts, T tokens, k = top_k):
    dispatch: permute slots by expert -> all_to_all of counts [R, L] (waited at once: it sizes
    the next exchange) -> all_to_all of tokens, uneven splits -> regroup rows from [src rank]
    [local expert] to [local expert][src rank]. Returns tokens [N_recv, H], counts [L], context.
    combine: undo the regroup -> reverse all_to_all -> unpermute with the router weights -> [T, H].
AllGatherDispatcher: all_gather x [T, H], ids, weights over ep (T equal on every rank); each
    rank runs the slots of its own experts; the weighted partial sums [R*T, H] go back by a
    reduce_scatter. Its tokens are [N_local, H] grouped by local expert.

Autograd: a token exchange is issued on detached tensors; once waited, `_Link` joins the
received buffer to the sent tensor in the graph, and its backward runs the reverse collective
(all_to_all with swapped splits; all_gather <-> reduce_scatter), waited at once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List

import torch

from mpoverlap.comm.collectives import all_gather, all_to_all, reduce_scatter
from mpoverlap.comm.handle import CommHandle
from mpoverlap.moe.permute import inverse_index, permute, regroup, unpermute

MODE = "ep"


@dataclass
class Pending:
    handles: List[CommHandle]
    links: List[tuple]  # (input with autograd history, buffer being written, backward fn)
    ctx: Dict[str, Any]

    def wait(self) -> List[torch.Tensor]:
        """Wait every handle, then attach each buffer to its input's autograd graph.

        The link is made only after the wait: some backends (gloo's reduce-scatter) finish by
        copying into the output inside wait(), which would otherwise overwrite the output's
        autograd history."""
        for h in self.handles:
            h.wait()
        return [_Link.apply(x, [buf], fn) for x, buf, fn in self.links]


class _Link(torch.autograd.Function):
    """Identity edge x -> received buffer; backward runs `fn` (the reverse collective,
    waited at once) on the gradient."""

    @staticmethod
    def forward(ctx, x, box, fn):
        ctx.fn = fn
        return box[0]

    @staticmethod
    def backward(ctx, grad):
        return ctx.fn(grad.contiguous()), None, None


def _a2a(x, group, out_splits, in_splits, ledger):
    """Issue all_to_all of x (no autograd); returns (handle, link)."""
    buf = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    h = all_to_all(buf, x.detach().contiguous(), group, mode=MODE, ledger=ledger,
                   output_split_sizes=out_splits, input_split_sizes=in_splits)

    def back(g):
        out = g.new_empty((sum(in_splits),) + tuple(g.shape[1:]))
        all_to_all(out, g, group, mode=MODE, ledger=ledger, output_split_sizes=in_splits,
                   input_split_sizes=out_splits).wait()
        return out
    return h, (x, buf, back)


def _gather(x, group, size, ledger):
    """Issue all_gather [T, ...] -> [R*T, ...]; backward reduce-scatters."""
    buf = x.new_empty((size * x.shape[0],) + tuple(x.shape[1:]))
    h = all_gather(buf, x.detach().contiguous(), group, mode=MODE, ledger=ledger)

    def back(g):
        out = g.new_empty((g.shape[0] // size,) + tuple(g.shape[1:]))
        reduce_scatter(out, g, group, mode=MODE, ledger=ledger).wait()
        return out
    return h, (x, buf, back)


def _scatter(x, group, size, ledger):
    """Issue reduce_scatter [R*T, ...] -> [T, ...]; backward all-gathers."""
    buf = x.new_empty((x.shape[0] // size,) + tuple(x.shape[1:]))
    h = reduce_scatter(buf, x.detach().contiguous(), group, mode=MODE, ledger=ledger)

    def back(g):
        out = g.new_empty((size * g.shape[0],) + tuple(g.shape[1:]))
        all_gather(out, g, group, mode=MODE, ledger=ledger).wait()
        return out
    return h, (x, buf, back)


class _Base:
    def __init__(self, ep_group, ep_size: int, ep_rank: int, num_experts: int, overlap: bool = False,
                 ledger=None) -> None:
        if num_experts % ep_size:
            raise ValueError(f"num_experts={num_experts} not divisible by ep={ep_size}")
        if (ep_group is None) != (ep_size == 1):
            raise ValueError(f"ep_group must be None exactly when ep_size == 1 (ep_size={ep_size})")
        self.group, self.size, self.rank = ep_group, ep_size, ep_rank
        self.num_experts, self.num_local = num_experts, num_experts // ep_size
        self.first_expert = ep_rank * self.num_local
        # `overlap` is recorded for the layer/plan; the dispatcher itself never blocks early.
        self.overlap, self.ledger = overlap, ledger

    def dispatch(self, x_TH, expert_ids_Tk, weights_Tk):
        return self.dispatch_finish(self.dispatch_start(x_TH, expert_ids_Tk, weights_Tk))

    def combine(self, expert_out_NH, ctx):
        return self.combine_finish(self.combine_start(expert_out_NH, ctx))


class AllToAllDispatcher(_Base):
    def dispatch_start(self, x_TH, expert_ids_Tk, weights_Tk) -> Pending:
        T, k = expert_ids_Tk.shape
        x_perm, order, counts = permute(x_TH, expert_ids_Tk, self.num_experts)
        send_counts = counts.view(self.size, self.num_local).contiguous()
        recv_counts = torch.empty_like(send_counts)
        all_to_all(recv_counts, send_counts, self.group, mode=MODE, ledger=self.ledger).wait()
        in_splits = send_counts.sum(1).tolist()
        out_splits = recv_counts.sum(1).tolist()
        h, link = _a2a(x_perm, self.group, out_splits, in_splits, self.ledger)
        ctx = dict(order=order, weights=weights_Tk, T=T, k=k, recv_counts=recv_counts,
                   in_splits=in_splits, out_splits=out_splits)
        return Pending([h], [link], ctx)

    def dispatch_finish(self, p: Pending):
        recv, = p.wait()
        tokens, index = regroup(recv, p.ctx["recv_counts"])
        p.ctx["index"] = index
        return tokens, p.ctx["recv_counts"].sum(0), p.ctx

    def combine_start(self, expert_out_NH, ctx) -> Pending:
        back = expert_out_NH.index_select(0, inverse_index(ctx["index"]))
        h, link = _a2a(back, self.group, ctx["in_splits"], ctx["out_splits"], self.ledger)
        return Pending([h], [link], ctx)

    def combine_finish(self, p: Pending):
        out, = p.wait()
        c = p.ctx
        return unpermute(out, c["order"], c["T"], c["k"], c["weights"])


class AllGatherDispatcher(_Base):
    def dispatch_start(self, x_TH, expert_ids_Tk, weights_Tk) -> Pending:
        T, k = expert_ids_Tk.shape
        hx, lx = _gather(x_TH, self.group, self.size, self.ledger)
        hw, lw = _gather(weights_Tk, self.group, self.size, self.ledger)
        ids = expert_ids_Tk.new_empty((self.size * T, k))
        hi = all_gather(ids, expert_ids_Tk.contiguous(), self.group, mode=MODE, ledger=self.ledger)
        return Pending([hx, hw, hi], [lx, lw], dict(ids=ids, T=T, k=k))

    def dispatch_finish(self, p: Pending):
        xs, ws = p.wait()
        c, lo = p.ctx, self.first_expert
        ids = c["ids"]
        mine = (ids >= lo) & (ids < lo + self.num_local)
        local_ids = torch.where(mine, ids - lo, torch.full_like(ids, -1))
        tokens, order, counts = permute(xs, local_ids, self.num_local)
        c.update(order=order, weights=ws)
        return tokens, counts, c

    def combine_start(self, expert_out_NH, ctx) -> Pending:
        partial = unpermute(expert_out_NH, ctx["order"], self.size * ctx["T"], ctx["k"], ctx["weights"])
        h, link = _scatter(partial, self.group, self.size, self.ledger)
        return Pending([h], [link], ctx)

    def combine_finish(self, p: Pending):
        out, = p.wait()
        return out
