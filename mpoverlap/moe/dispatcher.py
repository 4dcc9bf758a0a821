"""Token dispatchers over the expert-parallel group: the communication half of the MoE layer.

Both dispatchers split each exchange into `*_start` (issues, returns a Pending holding the
CommHandle) and `*_finish` (waits, returns tensors), so the layer decides what runs while a
handle is in flight. `dispatch`/`combine` are start+finish back to back. All handles: mode "ep".

Counts and host reads. The split sizes of uneven exchanges are host integers, and reading a
device tensor on the host waits for the GPU (ending any overlap in flight). So
`exchange_counts` exchanges every chunk's per-expert counts in ONE collective, waited at once,
and copies all of them to the host in ONE read per layer and microbatch; `ChunkCounts`
carries each chunk's figures to `dispatch_start`/`dispatch_finish`, and nothing else in a
dispatch or combine reads the device. The grouped experts (moe/grouped.py) take the rows per
local expert as a device tensor (`ChunkCounts.device_counts`), so with one ep rank
(`host_counts=False`, the default) nothing is read at all: every slot, dropped ones included
(sorted last), travels as a row, the sizes being T*k, known on the host; the experts give the
rows past the last expert's zeros. The per-expert loop (model.moe_grouped_gemm=false) splits
its rows by host integers (`host_counts=True`). With a capacity at ep > 1 the all-to-all pads
every expert's queue to it (`capacity_padding`, moe/padded.py): no read either.

AllToAllDispatcher (R = ep_size, L = num_experts / R local experts, T tokens, k = top_k):
    exchange_counts: one all_to_all of every chunk's per-expert counts [chunks, R, L]; then
    `dispatch_start(..., counts=)` issues its token exchange at once.
    dispatch: permute slots by expert -> all_to_all of counts [R, L] (waited at once: it sizes
    the next exchange) -> all_to_all of tokens, uneven splits -> regroup rows from [src rank]
    [local expert] to [local expert][src rank]. Returns tokens [N_recv, H], counts [L], context.
    combine: undo the regroup -> reverse all_to_all -> unpermute with the router weights -> [T, H].
AllGatherDispatcher: all_gather x [T, H], ids, weights over ep (T equal on every rank); each
    rank runs the slots of its own experts; the weighted partial sums [R*T, H] go back by a
    reduce_scatter. Its tokens are [N_local, H] grouped by local expert. exchange_counts: one
    all_gather of every chunk's per-expert counts [R, chunks, E].

Tokens travel in the compute dtype: under autocast the layer casts them before dispatch.

Autograd: a token exchange is issued on detached tensors; once waited, `_Link` joins the
received buffer to the sent tensor in the graph, and its backward runs the reverse collective
(all_to_all with swapped splits; all_gather <-> reduce_scatter).
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
from mpoverlap.moe.padded import PaddedChunk, assemble_padded, capacity_chunks, to_experts, to_senders
from mpoverlap.moe.permute import expert_counts, inverse_index, permute, regroup, unpermute

MODE = "ep"


@dataclass
class ChunkCounts:
    """One chunk's slot counts: host integers (read once per layer for all chunks) and, for
    the all-to-all regroup, the device tensor they came from."""
    num_kept: int  # slots this rank sorts for the exchange (the all-gather: for its own experts)
    local_counts: Optional[List[int]]  # [L] rows each local expert computes (None: not read)
    device_counts: Optional[torch.Tensor] = None  # [L] the same on the device
    in_splits: List[int] = None  # [R] rows sent to each rank (all-to-all)
    out_splits: List[int] = None  # [R] rows received from each rank (all-to-all)
    recv_counts: Optional[torch.Tensor] = None  # [R, L] device (all-to-all)


@dataclass
class Pending:
    handles: List[Optional[CommHandle]]  # None: an identity exchange (one rank)
    links: List[tuple]  # (input with autograd history, buffer being written, backward fn)
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
        return [x if buf is None else _Link.apply(x, [buf], fn) for x, buf, fn in self.links]


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


class _Exchange:
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


def _a2a(x, group, out_splits, in_splits, ledger, ex: _Exchange):
    """Issue all_to_all of x (no autograd); returns (handle, link)."""
    if group is None:  # one rank: the identity, no copy in either direction
        return None, (x, None, None)
    x = ex.prepare(x)
    buf = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    h = all_to_all(buf, x.detach().contiguous(), group, mode=MODE, ledger=ledger,
                   output_split_sizes=out_splits, input_split_sizes=in_splits)

    def back(g):
        def issue():
            out = g.new_empty((sum(in_splits),) + tuple(g.shape[1:]))
            return all_to_all(out, g, group, mode=MODE, ledger=ledger, output_split_sizes=in_splits,
                              input_split_sizes=out_splits), out
        return ex.reverse(issue)
    return h, (x, buf, back)


def _gather(x, group, size, ledger, ex: _Exchange):
    """Issue all_gather [T, ...] -> [R*T, ...]; backward reduce-scatters."""
    if group is None:  # one rank: the identity, no copy in either direction
        return None, (x, None, None)
    x = ex.prepare(x)
    buf = x.new_empty((size * x.shape[0],) + tuple(x.shape[1:]))
    h = all_gather(buf, x.detach().contiguous(), group, mode=MODE, ledger=ledger)

    def back(g):
        def issue():
            out = g.new_empty((g.shape[0] // size,) + tuple(g.shape[1:]))
            return reduce_scatter(out, g, group, mode=MODE, ledger=ledger), out
        return ex.reverse(issue)
    return h, (x, buf, back)


def _scatter(x, group, size, ledger, ex: _Exchange):
    """Issue reduce_scatter [R*T, ...] -> [T, ...]; backward all-gathers."""
    if group is None:  # one rank: the identity, no copy in either direction
        return None, (x, None, None)
    x = ex.prepare(x)
    buf = x.new_empty((x.shape[0] // size,) + tuple(x.shape[1:]))
    h = reduce_scatter(buf, x.detach().contiguous(), group, mode=MODE, ledger=ledger)

    def back(g):
        def issue():
            out = g.new_empty((size * g.shape[0],) + tuple(g.shape[1:]))
            return all_gather(out, g, group, mode=MODE, ledger=ledger), out
        return ex.reverse(issue)
    return h, (x, buf, back)


class _Base:
    def __init__(self, ep_group, ep_size: int, ep_rank: int, num_experts: int, overlap: bool = False,
                 ledger=None, host_counts: bool = False, capacity_padding: bool = False) -> None:
        if num_experts % ep_size:
            raise ValueError(f"num_experts={num_experts} not divisible by ep={ep_size}")
        if (ep_group is None) != (ep_size == 1):
            raise ValueError(f"ep_group must be None exactly when ep_size == 1 (ep_size={ep_size})")
        self.group, self.size, self.rank = ep_group, ep_size, ep_rank
        self.num_experts, self.num_local = num_experts, num_experts // ep_size
        self.first_expert = ep_rank * self.num_local
        # Backward: `overlap` makes the reverse exchanges asynchronous (module docstring). One
        # member: the "exchanges" are local copies, kept out of the ledger (comm.ep: real traffic).
        self.overlap, self.ledger = overlap, (ledger if ep_group is not None else None)
        self.backward_trace = None
        self._exchanges = 0
        # Rows per expert as host ints (the per-expert loop), else device counts; ep > 1 reads
        # the split sizes on the host unless the queues are padded to a capacity.
        self.host_counts = host_counts
        self.pads_capacity = capacity_padding and ep_size > 1 and not host_counts
        self.reads_host = host_counts or (ep_size > 1 and not self.pads_capacity)

    def rows_per_expert(self, counts: ChunkCounts):
        """What the experts take: host ints for the per-expert loop, else the device counts."""
        return counts.local_counts if self.host_counts else counts.device_counts

    def _unread_counts(self, expert_ids_per_chunk: List[torch.Tensor], known=None) -> List[ChunkCounts]:
        """One rank, no host read: each slot a row (T*k, dropped last); device counts (`known`: a lone chunk's)."""
        out = []
        for ids in expert_ids_per_chunk:
            n = ids.numel()
            c = expert_counts(ids, self.num_experts) if known is None or len(expert_ids_per_chunk) > 1 else known
            out.append(ChunkCounts(num_kept=n, local_counts=None, device_counts=c, in_splits=[n], out_splits=[n],
                                   recv_counts=None))
        return out

    def _exchange(self) -> _Exchange:
        self._exchanges += 1
        return _Exchange(self.group, self.ledger, self.overlap, self.backward_trace, self._exchanges)

    def exchange_counts(self, expert_ids_per_chunk: List[torch.Tensor], known=None) -> List[ChunkCounts]:
        """Every chunk's counts: one collective and one host read for all chunks."""
        raise NotImplementedError

    def assemble(self, outputs: List[torch.Tensor], counts) -> torch.Tensor:
        """The chunks' combined outputs -> y [T, H]: token chunks are concatenated."""
        return torch.cat(outputs, dim=0)

    def dispatch(self, x_TH, expert_ids_Tk, weights_Tk):
        counts = self.exchange_counts([expert_ids_Tk])[0]
        return self.dispatch_finish(self.dispatch_start(x_TH, expert_ids_Tk, weights_Tk, counts))

    def combine(self, expert_out_NH, ctx):
        return self.combine_finish(self.combine_start(expert_out_NH, ctx))


class AllToAllDispatcher(_Base):
    def exchange_counts(self, expert_ids_per_chunk: List[torch.Tensor], known=None) -> List[ChunkCounts]:
        """Slots each source rank sends to each of this rank's experts, per chunk: one
        all_to_all and one host read for all chunks."""
        if not self.reads_host:
            return self._unread_counts(expert_ids_per_chunk, known)
        n, R, L = len(expert_ids_per_chunk), self.size, self.num_local
        send = torch.stack([expert_counts(ids, self.num_experts) for ids in expert_ids_per_chunk])  # [n, E]
        send_RnL = send.view(n, R, L).transpose(0, 1).contiguous()
        recv_RnL = torch.empty_like(send_RnL)  # block r holds source rank r's counts
        all_to_all(recv_RnL, send_RnL, self.group, mode=MODE, ledger=self.ledger).wait()
        host = torch.cat([send_RnL.reshape(-1), recv_RnL.reshape(-1)]).tolist()  # the one host read
        sent = [[host[(r * n + i) * L:(r * n + i + 1) * L] for r in range(R)] for i in range(n)]
        got = [[host[R * n * L + (r * n + i) * L:R * n * L + (r * n + i + 1) * L] for r in range(R)]
               for i in range(n)]
        return [ChunkCounts(num_kept=sum(map(sum, sent[i])),
                            local_counts=[sum(got[i][r][l] for r in range(R)) for l in range(L)],
                            in_splits=[sum(c) for c in sent[i]], out_splits=[sum(c) for c in got[i]],
                            recv_counts=recv_RnL[:, i, :], device_counts=recv_RnL[:, i, :].sum(0))
                for i in range(n)]

    def capacity_chunks(self, x_TH, r, num_chunks: int) -> List[PaddedChunk]:
        """With a capacity: the chunks of a dispatch padded to it (moe/padded.py), nothing read."""
        return capacity_chunks(x_TH, r, num_chunks, self.num_experts, self.num_local, self.size)

    def assemble(self, outputs: List[torch.Tensor], counts) -> torch.Tensor:
        if counts and isinstance(counts[0], PaddedChunk):
            return assemble_padded(outputs, counts, self.num_experts)
        return torch.cat(outputs, dim=0)

    # The math around the two exchanges, shared with the forward/backward pairing
    # (mpoverlap/pairing), which issues the exchanges itself between autograd segments.
    def sort_for_dispatch(self, x_TH, expert_ids_Tk, weights_Tk, counts: ChunkCounts):
        """-> (x_perm [num_kept, H] sorted by destination expert, ctx)."""
        T, k = expert_ids_Tk.shape
        x_perm, order, _ = permute(x_TH, expert_ids_Tk, self.num_experts, counts.num_kept, counts=False)
        return x_perm, dict(order=order, weights=weights_Tk, T=T, k=k, counts=counts,
                            in_splits=counts.in_splits, out_splits=counts.out_splits)

    def received_to_experts(self, recv_NH, ctx):
        """Received rows [src rank][local expert] -> (tokens [N, H] grouped by local expert,
        rows per local expert (host ints))."""
        if "padded" in ctx:  # [src rank][local expert][c] -> [local expert][src rank][c]: fixed sizes
            ctx["index"] = None
            return to_experts(recv_NH, ctx["padded"], self.size, self.num_local), ctx["padded"].device_counts
        counts = ctx["counts"]
        if self.size == 1:  # one source rank: the rows are grouped by expert already
            ctx["index"] = None
            return recv_NH, self.rows_per_expert(counts)
        tokens, index = regroup(recv_NH, counts.recv_counts)
        ctx["index"] = index
        return tokens, self.rows_per_expert(counts)

    def experts_to_send(self, expert_out_NH, ctx):
        """Expert outputs back in the received row order (the combine exchange's input)."""
        if "padded" in ctx:
            return to_senders(expert_out_NH, ctx["padded"], self.size, self.num_local)
        if ctx["index"] is None:
            return expert_out_NH
        return expert_out_NH.index_select(0, inverse_index(ctx["index"]))

    def combined_tokens(self, out_NH, ctx):
        """Combined rows -> y [T, H], each token's k copies folded with its router weights."""
        return unpermute(out_NH, ctx["order"], ctx["T"], ctx["k"], ctx["weights"])

    def dispatch_start(self, x_TH, expert_ids_Tk, weights_Tk, counts) -> Pending:
        if isinstance(counts, PaddedChunk):
            x_perm = counts.x_ext.index_select(0, counts.src)  # [E * c, H] by expert, padded
            ctx = dict(padded=counts, in_splits=counts.in_splits, out_splits=counts.out_splits)
        else:
            x_perm, ctx = self.sort_for_dispatch(x_TH, expert_ids_Tk, weights_Tk, counts)
        h, link = _a2a(x_perm, self.group, ctx["out_splits"], ctx["in_splits"], self.ledger, self._exchange())
        return Pending([h], [link], ctx)

    def dispatch_finish(self, p: Pending):
        """-> (tokens [N, H] grouped by local expert, rows per local expert (host ints), ctx)."""
        recv, = p.wait()
        tokens, local_counts = self.received_to_experts(recv, p.ctx)
        return tokens, local_counts, p.ctx

    def combine_start(self, expert_out_NH, ctx) -> Pending:
        back = self.experts_to_send(expert_out_NH, ctx)
        h, link = _a2a(back, self.group, ctx["in_splits"], ctx["out_splits"], self.ledger, self._exchange())
        return Pending([h], [link], ctx)

    def combine_finish(self, p: Pending):
        out, = p.wait()
        if "padded" in p.ctx:  # this chunk's rows, [E * c, H]: `assemble` folds them in
            return out
        return self.combined_tokens(out, p.ctx)


class AllGatherDispatcher(_Base):
    def exchange_counts(self, expert_ids_per_chunk: List[torch.Tensor], known=None) -> List[ChunkCounts]:
        """Every rank's per-expert counts of every chunk: one all_gather and one host read."""
        if not self.reads_host:
            return self._unread_counts(expert_ids_per_chunk, known)
        n, R, L, lo = len(expert_ids_per_chunk), self.size, self.num_local, self.first_expert
        mine = torch.stack([expert_counts(ids, self.num_experts) for ids in expert_ids_per_chunk])  # [n, E]
        every = mine.new_empty((R * n, self.num_experts))
        all_gather(every, mine, self.group, mode=MODE, ledger=self.ledger).wait()
        local = every[:, lo:lo + L].reshape(R, n, L).sum(0)  # [n, L]
        host = local.tolist()  # the one host read: [n][L]
        return [ChunkCounts(num_kept=sum(host[i]), local_counts=host[i], device_counts=local[i]) for i in range(n)]

    def dispatch_start(self, x_TH, expert_ids_Tk, weights_Tk, counts: ChunkCounts) -> Pending:
        T, k = expert_ids_Tk.shape
        hx, lx = _gather(x_TH, self.group, self.size, self.ledger, self._exchange())
        hw, lw = _gather(weights_Tk, self.group, self.size, self.ledger, self._exchange())
        ids = expert_ids_Tk.new_empty((self.size * T, k))
        hi = all_gather(ids, expert_ids_Tk.contiguous(), self.group, mode=MODE, ledger=self.ledger)
        return Pending([hx, hw, hi], [lx, lw], dict(ids=ids, T=T, k=k, counts=counts))

    def dispatch_finish(self, p: Pending):
        """-> (tokens [N_local, H] grouped by local expert, rows per local expert, ctx)."""
        xs, ws = p.wait()
        tokens, local_counts = self.gathered_to_experts(xs, ws, p.ctx)
        return tokens, local_counts, p.ctx

    def gathered_to_experts(self, xs_RTH, ws_RTk, ctx):
        """The group's tokens [R*T, H] and weights -> (this rank's experts' slots [N_local, H]
        grouped by local expert, rows per local expert). (Shared with mpoverlap/pairing.)"""
        lo = self.first_expert
        ids = ctx["ids"]
        mine = (ids >= lo) & (ids < lo + self.num_local)
        local_ids = torch.where(mine, ids - lo, torch.full_like(ids, -1))
        tokens, order, _ = permute(xs_RTH, local_ids, self.num_local, ctx["counts"].num_kept, counts=False)
        ctx.update(order=order, weights=ws_RTk)
        return tokens, self.rows_per_expert(ctx["counts"])

    def experts_to_partial_sums(self, expert_out_NH, ctx):
        """Weighted partial sums of the group's tokens [R*T, H] (the reduce-scatter's input)."""
        return unpermute(expert_out_NH, ctx["order"], self.size * ctx["T"], ctx["k"], ctx["weights"])

    def combine_start(self, expert_out_NH, ctx) -> Pending:
        partial = self.experts_to_partial_sums(expert_out_NH, ctx)
        h, link = _scatter(partial, self.group, self.size, self.ledger, self._exchange())
        return Pending([h], [link], ctx)

    def combine_finish(self, p: Pending):
        out, = p.wait()
        return out
