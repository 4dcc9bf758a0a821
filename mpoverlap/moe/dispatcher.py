"""Token dispatchers over the expert-parallel group: the communication half of the MoE layer.

Both dispatchers split each exchange into `*_start` (issues, returns a Pending holding the
CommHandle) and `*_finish` (waits, returns tensors), so the layer decides what runs while a
handle is in flight. `dispatch`/`combine` are start+finish back to back. The exchanges
themselves and their autograd (the reverse collective in backward, asynchronous with
overlap=True) are moe/exchange.py's.

Counts and host reads. The split sizes of uneven exchanges are host integers, and reading a
device tensor on the host waits for the GPU (ending any overlap in flight). So
`exchange_counts` exchanges every chunk's per-expert counts in ONE collective, waited at once,
and copies all of them to the host in ONE read per layer and microbatch; `ChunkCounts`
carries each chunk's figures to `dispatch_start`/`dispatch_finish`, and nothing else in a
dispatch or combine reads the device. The grouped experts (moe/grouped.py) take the rows per
local expert as a device tensor (`ChunkCounts.device_counts`), so with one ep rank
(`host_counts=False`, the default) nothing is read at all: every slot, dropped ones included
(sorted last), travels as a row, the sizes being T*k, known on the host; the experts give the
rows past the last expert's zeros (the grouped GEMMs' own host reads, none but on the looped
fallback, are moe/grouped_path.py's, named in the plan). The per-expert loop
(model.moe_grouped_gemm=false) splits its rows by host integers (`host_counts=True`).

AllToAllDispatcher (R = ep_size, L = num_experts / R local experts, T tokens, k = top_k) runs
one of two exchange strategies, chosen once when it is built:
  CountedQueues (below): every expert's queue as long as its slots.
    exchange_counts: one all_to_all of every chunk's per-expert counts [chunks, R, L]; then
    `dispatch_start(..., counts=)` issues its token exchange at once.
    dispatch: permute slots by expert -> all_to_all of tokens, uneven splits -> regroup rows
    from [src rank][local expert] to [local expert][src rank]. Returns tokens [N_recv, H],
    counts [L], context.
    combine: undo the regroup -> reverse all_to_all -> unpermute with the router weights -> [T, H].
  PaddedQueues (moe/padded.py): with a capacity at ep > 1 (`capacity_padding`) every expert's
    queue is padded to it, so the sizes are known on the host: no counts exchange, no read.
AllGatherDispatcher: all_gather x [T, H], ids, weights over ep (T equal on every rank); each
    rank runs the slots of its own experts; the weighted partial sums [R*T, H] go back by a
    reduce_scatter. Its tokens are [N_local, H] grouped by local expert. exchange_counts: one
    all_gather of every chunk's per-expert counts [R, chunks, E].

Tokens travel in the compute dtype: under autocast the layer casts them before dispatch.
`dispatch_wire` (train.ep_dispatch_dtype, moe/dispatch_wire.py): the format of the dispatch's
forward token exchange (both dispatchers, every exchange strategy; the pairing's dispatch
exchanges read `wire` too); the combine and every backward exchange stay in the compute dtype.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch

from mpoverlap.comm.collectives import all_gather, all_to_all
from mpoverlap.moe.exchange import (MODE, Pending, TokenExchange, issue_all_gather, issue_all_to_all,
                                    issue_reduce_scatter)
from mpoverlap.moe.padded import PaddedQueues
from mpoverlap.moe.permute import expert_counts, inverse_index, permute, regroup, unpermute


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


class _Base:
    def __init__(self, ep_group, ep_size: int, ep_rank: int, num_experts: int, overlap: bool = False,
                 ledger=None, host_counts: bool = False, capacity_padding: bool = False,
                 dispatch_wire=None) -> None:
        if num_experts % ep_size:
            raise ValueError(f"num_experts={num_experts} not divisible by ep={ep_size}")
        if (ep_group is None) != (ep_size == 1):
            raise ValueError(f"ep_group must be None exactly when ep_size == 1 (ep_size={ep_size})")
        self.group, self.size, self.rank = ep_group, ep_size, ep_rank
        if dispatch_wire is not None and ep_size == 1 and dispatch_wire.name == "fp8":
            raise ValueError("an fp8 dispatch needs an exchange to compress (ep_size > 1); with one rank "
                             "the tokens never leave it")
        self.wire = dispatch_wire  # None: the tokens travel as they are
        self.num_experts, self.num_local = num_experts, num_experts // ep_size
        self.first_expert = ep_rank * self.num_local
        # Backward: `overlap` makes the reverse exchanges asynchronous (moe/exchange.py).
        # One member: the "exchanges" are local copies, kept out of the ledger (comm.ep: real
        # traffic).
        self.overlap = overlap
        self.ledger = ledger if ep_group is not None else None
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
        """One rank, no host read: each slot a row (T*k, dropped last), the device counts
        (`known`: a lone chunk's, counted by the router already)."""
        out = []
        for ids in expert_ids_per_chunk:
            n = ids.numel()
            if known is None or len(expert_ids_per_chunk) > 1:
                c = expert_counts(ids, self.num_experts)
            else:
                c = known
            out.append(ChunkCounts(num_kept=n, local_counts=None, device_counts=c, in_splits=[n], out_splits=[n],
                                   recv_counts=None))
        return out

    def _exchange(self) -> TokenExchange:
        self._exchanges += 1
        return TokenExchange(self.group, self.ledger, self.overlap, self.backward_trace, self._exchanges)

    def exchange_counts(self, expert_ids_per_chunk: List[torch.Tensor], known=None) -> List[ChunkCounts]:
        """Every chunk's counts: one collective and one host read for all chunks."""
        raise NotImplementedError

    def token_chunks(self, num_chunks: int, num_tokens: int) -> int:
        """How many contiguous parts the layer cuts its T tokens into."""
        return max(1, min(num_chunks, num_tokens))

    def chunk_counts(self, parts, r, num_chunks: int, known=None):
        """(parts, each part's counts) for the layer's token parts [(x, ids, weights)]: every
        chunk's counts by one exchange (`known`: a lone part's per-expert counts)."""
        return parts, self.exchange_counts([ids for _, ids, _ in parts], known)

    def assemble(self, outputs: List[torch.Tensor], counts) -> torch.Tensor:
        """The chunks' combined outputs -> y [T, H]: token chunks are concatenated."""
        return torch.cat(outputs, dim=0)

    def dispatch(self, x_TH, expert_ids_Tk, weights_Tk):
        counts = self.exchange_counts([expert_ids_Tk])[0]
        return self.dispatch_finish(self.dispatch_start(x_TH, expert_ids_Tk, weights_Tk, counts))

    def combine(self, expert_out_NH, ctx):
        return self.combine_finish(self.combine_start(expert_out_NH, ctx))


class CountedQueues:
    """The all-to-all sized by the exchanged counts: every expert's queue as long as its slots,
    the slots sorted by destination expert, the received rows regrouped by local expert. The
    exchange context of a chunk holds its order, router weights, T, k, counts and splits (and
    the regroup's index)."""

    def __init__(self, dispatcher: "AllToAllDispatcher") -> None:
        self.d = dispatcher

    def token_chunks(self, num_chunks: int, num_tokens: int) -> int:
        """Contiguous token chunks, each exchanged on its own."""
        return max(1, min(num_chunks, num_tokens))

    def chunk_counts(self, parts, r, num_chunks: int, known=None):
        """Every part's counts by one exchange and one host read (none at ep 1)."""
        return parts, self.d.exchange_counts([ids for _, ids, _ in parts], known)

    def sort_for_dispatch(self, x_TH, expert_ids_Tk, weights_Tk, counts: ChunkCounts):
        """-> (x_perm [num_kept, H] sorted by destination expert, ctx)."""
        T, k = expert_ids_Tk.shape
        x_perm, order, _ = permute(x_TH, expert_ids_Tk, self.d.num_experts, counts.num_kept, counts=False)
        return x_perm, dict(order=order, weights=weights_Tk, T=T, k=k, counts=counts,
                            in_splits=counts.in_splits, out_splits=counts.out_splits)

    def received_to_experts(self, recv_NH, ctx):
        """Received rows [src rank][local expert] -> (tokens [N, H] grouped by local expert,
        rows per local expert)."""
        counts = ctx["counts"]
        if self.d.size == 1:  # one source rank: the rows are grouped by expert already
            ctx["index"] = None
            return recv_NH, self.d.rows_per_expert(counts)
        tokens, index = regroup(recv_NH, counts.recv_counts)
        ctx["index"] = index
        return tokens, self.d.rows_per_expert(counts)

    def experts_to_send(self, expert_out_NH, ctx):
        """Expert outputs back in the received row order (the combine exchange's input)."""
        if ctx["index"] is None:
            return expert_out_NH
        return expert_out_NH.index_select(0, inverse_index(ctx["index"]))

    def combined_tokens(self, out_NH, ctx):
        """Combined rows -> y [T, H], each token's k copies folded with its router weights."""
        return unpermute(out_NH, ctx["order"], ctx["T"], ctx["k"], ctx["weights"])

    def assemble(self, outputs: List[torch.Tensor], counts) -> torch.Tensor:
        return torch.cat(outputs, dim=0)


class AllToAllDispatcher(_Base):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # The exchange strategy, once: padded to the capacity (fixed sizes), or sized by counts.
        if self.pads_capacity:
            self.queues = PaddedQueues(self.num_experts, self.num_local, self.size)
        else:
            self.queues = CountedQueues(self)

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
        received = R * n * L  # where the received counts start in `host`

        def block(offset: int, r: int, i: int) -> List[int]:  # rank r's L counts of chunk i
            start = offset + (r * n + i) * L
            return host[start:start + L]

        out = []
        for i in range(n):
            sent = [block(0, r, i) for r in range(R)]
            got = [block(received, r, i) for r in range(R)]
            out.append(ChunkCounts(num_kept=sum(map(sum, sent)),
                                   local_counts=[sum(got[r][l] for r in range(R)) for l in range(L)],
                                   in_splits=[sum(c) for c in sent], out_splits=[sum(c) for c in got],
                                   recv_counts=recv_RnL[:, i, :], device_counts=recv_RnL[:, i, :].sum(0)))
        return out

    def token_chunks(self, num_chunks: int, num_tokens: int) -> int:
        return self.queues.token_chunks(num_chunks, num_tokens)

    def chunk_counts(self, parts, r, num_chunks: int, known=None):
        return self.queues.chunk_counts(parts, r, num_chunks, known)

    def assemble(self, outputs: List[torch.Tensor], counts) -> torch.Tensor:
        return self.queues.assemble(outputs, counts)

    # The math around the two exchanges, shared with the forward/backward pairing
    # (mpoverlap/pairing), which issues the exchanges itself between autograd segments.
    def sort_for_dispatch(self, x_TH, expert_ids_Tk, weights_Tk, counts):
        """-> (the rows to send [N_send, H] grouped by destination expert, ctx)."""
        return self.queues.sort_for_dispatch(x_TH, expert_ids_Tk, weights_Tk, counts)

    def received_to_experts(self, recv_NH, ctx):
        """Received rows -> (tokens [N, H] grouped by local expert, rows per local expert)."""
        return self.queues.received_to_experts(recv_NH, ctx)

    def experts_to_send(self, expert_out_NH, ctx):
        """Expert outputs back in the received row order (the combine exchange's input)."""
        return self.queues.experts_to_send(expert_out_NH, ctx)

    def combined_tokens(self, out_NH, ctx):
        """The combine exchange's rows -> this chunk's output."""
        return self.queues.combined_tokens(out_NH, ctx)

    def dispatch_start(self, x_TH, expert_ids_Tk, weights_Tk, counts) -> Pending:
        x_perm, ctx = self.sort_for_dispatch(x_TH, expert_ids_Tk, weights_Tk, counts)
        h, link = issue_all_to_all(x_perm, self.group, ctx["out_splits"], ctx["in_splits"], self.ledger,
                                   self._exchange(), wire=self.wire)
        return Pending([h], [link], ctx)

    def dispatch_finish(self, p: Pending):
        """-> (tokens [N, H] grouped by local expert, rows per local expert, ctx)."""
        recv, = p.wait()
        tokens, local_counts = self.received_to_experts(recv, p.ctx)
        return tokens, local_counts, p.ctx

    def combine_start(self, expert_out_NH, ctx) -> Pending:
        back = self.experts_to_send(expert_out_NH, ctx)
        h, link = issue_all_to_all(back, self.group, ctx["in_splits"], ctx["out_splits"], self.ledger,
                                   self._exchange())
        return Pending([h], [link], ctx)

    def combine_finish(self, p: Pending):
        out, = p.wait()
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
        hx, lx = issue_all_gather(x_TH, self.group, self.size, self.ledger, self._exchange(), wire=self.wire)
        hw, lw = issue_all_gather(weights_Tk, self.group, self.size, self.ledger, self._exchange())
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
        h, link = issue_reduce_scatter(partial, self.group, self.size, self.ledger, self._exchange())
        return Pending([h], [link], ctx)

    def combine_finish(self, p: Pending):
        out, = p.wait()
        return out
