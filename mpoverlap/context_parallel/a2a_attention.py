"""All-to-all (Ulysses) context-parallel attention: trade the sequence shard for a head shard.

Inputs q [B, N, S_local, D], k, v [B, G, S_local, D] (G K/V groups of grouped-query attention,
G = N without it) in the load-balanced layout of split_for_cp; N and G divisible by cp. An
all_to_all (mode "cp") turns them into [B, N/cp, S, D] and [B, G/cp, S, D]: this rank's heads
and the groups they read over the full sequence, chunks put back in natural order (only the G
groups of k, v travel: with GQA q and k, v share one buffer per head group); local causal
attention through the block kernel (block_kernels.py: a fused flash kernel, K/V groups read
unexpanded where the kernel can); a second all_to_all brings the output back to
[B, N, S_local, D]. Backward: d(out) goes, dq and the groups' dk, dv come back.

The local heads are processed in G head groups (`head_chunks`; default 2 when N/cp is even,
else 1), each with its own all_to_alls, so communication of one group can run under the
attention of another. What `overlap` (overlap.cp) does here:
  forward:  every group's q/k/v all_to_all is issued up front; group g+1's inputs and group
            g's output travel while group g+1 / g computes attention.
  backward: every group's d(out) all_to_all is issued up front; group g's dq/dk/dv travel
            back while group g+1 runs its attention backward.
  With G == 1 there is no other group's compute to hide under (q, k and v already travel in
  one all_to_all, and the single SDPA needs all of it): overlap=True then changes nothing.
  Engine rule: overlap.cp=true with a2a needs N / (tp * cp) even (auto: on only then).
overlap=False waits every all_to_all right after issuing it. G never depends on overlap, so
on and off compute bitwise identical results.

Backward calls the kernel's backward with each group's saved q, k, v, output and log-sum-exp
(no [S, S] tensor is kept; the explicit fallback recomputes its scores).
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from mpoverlap.comm.collectives import all_to_all
from mpoverlap.context_parallel.a2a_layout import (pack_head_to_seq, pack_seq_to_head,
                                                    unpack_head_to_seq, unpack_seq_to_head)
from mpoverlap.context_parallel.attention_math import check_qkv_shapes
from mpoverlap.context_parallel.block_kernels import BlockKernel, select_block_kernel
from mpoverlap.context_parallel.ring_comm import CPRing
from mpoverlap.context_parallel.stats import CPStats, NullStats
from mpoverlap.precision import no_autocast


def default_head_chunks(num_heads: int, cp_size: int, num_groups: Optional[int] = None) -> int:
    """2 head groups when each rank's N/cp heads (and its G/cp K/V groups) split evenly in two,
    else 1."""
    kv = num_heads if num_groups is None else num_groups
    return 2 if (num_heads // cp_size) % 2 == 0 and (kv // cp_size) % 2 == 0 else 1


def _stacked(tensors) -> list:
    """Runs of consecutive tensors of one shape, each stacked [T, ...]: q, k, v as one [3, ...]
    (multi-head attention), q alone and k, v as [2, ...] (grouped-query: fewer K/V heads), q, k
    as [2, ...] and v alone (latent attention: a narrower value head), or all three apart."""
    runs = []
    for t in tensors:
        if runs and runs[-1][-1].shape == t.shape:
            runs[-1].append(t)
        else:
            runs.append([t])
    return [torch.stack(run) for run in runs]


def _concat(buffers) -> tuple:
    """Several send buffers [cp, ...] as one [cp, X] (one buffer: itself); returns (buffer,
    shapes for _split, None for one)."""
    if len(buffers) == 1:
        return buffers[0], None
    return torch.cat([t.reshape(t.shape[0], -1) for t in buffers], dim=1), [t.shape for t in buffers]


def _split(recv: torch.Tensor, shapes) -> list:
    """The inverse of _concat on the received buffer [cp, X]."""
    if shapes is None:
        return [recv]
    sizes = [math.prod(s[1:]) for s in shapes]
    return [t.reshape(s) for t, s in zip(recv.split(sizes, dim=1), shapes)]


def _issue(ring: CPRing, send: torch.Tensor, stats: CPStats, phase: str, g: int):
    """Issue one all_to_all of `send` [cp, ...]; returns (handle, recv buffer)."""
    recv = torch.empty_like(send)
    handle = all_to_all(recv, send, ring.cp_group, mode="cp", ledger=ring.ledger)
    stats.event(phase, "issue", g)
    return handle, recv


def _wait(handle, stats: CPStats, phase: str, g: int) -> None:
    handle.wait()
    stats.event(phase, "wait", g)


def _exchange_groups(ring: CPRing, xs, groups: int, stats: CPStats, phase: str, compute):
    """Shared driver of forward and backward.

    xs: tensors [T_i, B, N_i, S_local, D] (q, k, v stacked as one [3, ...] without GQA; with
    it q [1, B, N, ...] and k, v [2, B, G, ...]) go to head-sharded groups, one all_to_all per
    group for all of them; compute(g, [y_i [T_i, B, N_i/(cp G), S, D]]) returns the group's
    results [[T'_j, B, n_j, S, D]]; they come back as [[T'_j, B, N_j, S_local, D]], where
    N_j = n_j cp groups."""
    cp = ring.cp_size

    def issue_in(g):
        send, shapes = _concat([pack_seq_to_head(x, cp, groups, g) for x in xs])
        return (*_issue(ring, send, stats, phase, g), shapes)

    pending_in = {g: issue_in(g) for g in range(groups)} if ring.overlap else {}
    pending_out = []
    for g in range(groups):
        if not ring.overlap:
            pending_in[g] = issue_in(g)
        handle, recv, shapes = pending_in.pop(g)
        _wait(handle, stats, phase, g)
        stats.event(phase, "compute_begin", g)
        results = compute(g, [unpack_seq_to_head(r, cp) for r in _split(recv, shapes)])
        stats.event(phase, "compute_end", g)
        send, out_shapes = _concat([pack_head_to_seq(y, cp) for y in results])
        handle, recv = _issue(ring, send, stats, phase, g)
        if not ring.overlap:
            _wait(handle, stats, phase, g)
        pending_out.append((g, handle, recv, out_shapes))
    B, S_local = xs[0].shape[1], xs[0].shape[3]
    outs = None
    for g, handle, recv, out_shapes in pending_out:
        _wait(handle, stats, phase, g)
        parts = _split(recv, out_shapes)  # each [cp, T', B, n, S_local, D]
        if outs is None:
            outs = [torch.empty((p.shape[1], B, p.shape[3] * cp * groups, S_local, p.shape[-1]), dtype=p.dtype,
                                device=xs[0].device) for p in parts]
        for part, out in zip(parts, outs):
            unpack_head_to_seq(part, out, groups, g)
    return outs


class A2AAttentionFunction(torch.autograd.Function):
    """Each head group's causal attention over the full sequence is one call of the block
    kernel (fused: O(S) memory, its log-sum-exp kept for backward); autocast is off inside,
    the kernel computes in the inputs' dtype."""

    @staticmethod
    def forward(ctx, q_BNSD, k_BGSD, v_BGSD, ring: CPRing, scale: float, groups: int,
                stats: CPStats, kernel: BlockKernel):
        saved = []
        k_BGSD, v_BGSD = k_BGSD.to(q_BNSD.dtype), v_BGSD.to(q_BNSD.dtype)

        def attend(g, received):
            # received: q, k, v in the runs `_stacked` made (e.g. [3, B, n, S, D] all three)
            q, k, v = [t for r in received for t in r.unbind(0)]
            y_BnSD, lse_BnS = kernel.forward(q, k, v, scale, True)
            saved.append((q, k, v, y_BnSD, lse_BnS))
            B, Ng, S, D = y_BnSD.shape
            stats.count_dense("fwd", B, Ng, S, D)
            return [y_BnSD.to(q.dtype).unsqueeze(0)]

        # q, k, v travel in one all_to_all per head group: one stacked tensor when they share a
        # shape, else their runs of one shape packed side by side.
        xs = _stacked([q_BNSD, k_BGSD, v_BGSD])
        with no_autocast(q_BNSD):
            (out_1BNSD,) = _exchange_groups(ring, xs, groups, stats, "fwd", attend)
        # Saved through autograd (not as ctx attributes): saved-tensor hooks (activation
        # recomputation, memory accounting) see them.
        ctx.save_for_backward(*[t for group in saved for t in group])
        ctx.ring, ctx.groups, ctx.stats = ring, groups, stats
        ctx.scale, ctx.kernel = scale, kernel
        return out_1BNSD[0]

    @staticmethod
    def backward(ctx, dout_BNSD):
        flat, stats = ctx.saved_tensors, ctx.stats

        def attend_backward(g, received):
            q, k, v, y_BnSD, lse_BnS = flat[5 * g:5 * g + 5]
            dq, dk, dv = ctx.kernel.backward(received[0][0].to(q.dtype), q, k, v, y_BnSD, lse_BnS,
                                             ctx.scale, True)
            B, Ng, S, D = y_BnSD.shape
            stats.count_dense("bwd", B, Ng, S, D)
            return _stacked([dq, dk, dv])

        with no_autocast(dout_BNSD):
            outs = _exchange_groups(ctx.ring, [dout_BNSD.unsqueeze(0)], ctx.groups, stats, "bwd",
                                    attend_backward)
        dq, dk, dv = [t for o in outs for t in o.unbind(0)]
        return dq, dk, dv, None, None, None, None, None


def a2a_attention(q_BNSD: torch.Tensor, k_BGSD: torch.Tensor, v_BGSD: torch.Tensor, *,
                  cp_group, cp_ranks: Sequence[int], cp_rank: int, cp_size: int,
                  overlap: bool, ledger=None, stats: Optional[CPStats] = None,
                  softmax_scale: Optional[float] = None,
                  head_chunks: Optional[int] = None, backend: str = "auto") -> torch.Tensor:
    """Causal attention over the global sequence via head sharding: out_BNSD [B, N, S_local, Dv].

    Same contract as ring_attention (layout of split_for_cp, RoPE at global positions, equal
    to full-sequence causal SDPA split the same way, collective over the cp group; k, v may
    hold G < N groups and v another head width Dv), plus: N and G divisible by cp * head_chunks (rank j then holds query
    heads j N/cp.. and the groups j G/cp.. they read). `cp_ranks` is accepted for a uniform
    signature. `backend`: parallel.cp_attention_backend (block_kernels.py)."""
    check_qkv_shapes(q_BNSD, k_BGSD, v_BGSD)
    B, N, S_local, D = q_BNSD.shape
    G = k_BGSD.shape[1]
    groups = head_chunks if head_chunks is not None else default_head_chunks(N, cp_size, G)
    if N % (cp_size * groups) or G % (cp_size * groups):
        raise ValueError(f"all-to-all attention needs heads N={N} and K/V groups G={G} divisible "
                         f"by cp={cp_size} x head_chunks={groups}")
    if S_local % 2:
        raise ValueError(f"S_local={S_local} must be even (two chunks per cp rank)")
    ring = CPRing.make(cp_group, cp_ranks, cp_rank, cp_size, overlap, ledger)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    return A2AAttentionFunction.apply(q_BNSD, k_BGSD, v_BGSD, ring, float(scale), groups,
                                      stats if stats is not None else NullStats(),
                                      select_block_kernel(backend, q_BNSD))
