"""Ring attention: causal attention over a context-parallel sequence, K/V passed around the ring.

Layout: q is [B, N, S_local, D], k and v [B, G, S_local, D] (G K/V groups: grouped-query
attention, G = N without it), S_local = S / cp holding global chunks (r, 2cp-1-r) of length
c = S / (2 cp) (see split.py). The output has q's layout. Only the G groups travel the ring (and
their dK/dV): a step moves N / G times fewer bytes than multi-head attention; each block expands
its groups to the N heads locally (query head n reads group n // (N / G)).

Forward, at ring step s = 0 .. cp-1 rank r holds the K/V block of rank (r - s) mod cp:
  1. issue the exchange that brings the next block (send this block on, receive the next one
     into the second buffer): double buffering;
  2. attend the local queries to the block (`_blocks`), each block through the attention
     kernel (block_kernels.py), which returns the block's log-sum-exp; each block's (out, lse)
     merges into the fp32 accumulators of its query rows (online softmax);
  3. wait the exchange (overlap.cp: it ran under step 2; without: it was waited in step 1).
With the load-balanced split a step is one kernel call (the load-balanced halves):
  step 0 (own block)   all 2c queries x all 2c keys, causal: the two local chunks (r, 2cp-1-r)
                       in local order ARE causal as one sequence (chunk r sees none of 2cp-1-r,
                       2cp-1-r sees all of r), so one top-left causal call covers both diagonal
                       blocks and the full one between them;
  source < r           all 2c queries x the block's first chunk, no mask (its second chunk is
                       later than both query chunks);
  source > r           the second query chunk x all 2c keys of the block, no mask (the first
                       query chunk is earlier than both key chunks).
The explicit fallback keeps the chunk pairs (c x c blocks, the skipped ones skipped), the
memory it always had.
Backward runs every block's kernel backward with the FINAL lse and output of its query rows
(so the blocks' gradients sum to the gradient of the forward). K/V circulate again; the dK/dV
accumulator of each block travels with it (each rank adds its share, then sends it on); after
cp exchanges every accumulator is back home, complete. dQ accumulates locally (fp32).

Overlap changes only when handles are waited, never the arithmetic: on and off are bitwise
identical.

Mixed precision: q, k, v arrive in the compute dtype (bf16 under autocast); K/V travel the ring
in it and the fused kernels compute in it (bf16 tensor cores), returning an fp32 lse; outputs
merge in fp32. Autocast is off inside the function (explicit dtypes: the kernels are called
with what the function was given, forward and backward alike); the explicit fallback
upcasts to fp32 itself. Each rank's dK/dV share accumulates in fp32 and travels in the
inputs' dtype.
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import torch

from mpoverlap.context_parallel.attention_math import (SKIP, acc_dtype, check_qkv_shapes,
                                                        chunk_relation, merge_into)
from mpoverlap.context_parallel.block_kernels import BlockKernel, select_block_kernel
from mpoverlap.context_parallel.ring_comm import CPRing
from mpoverlap.context_parallel.split import cp_chunks_of_rank
from mpoverlap.context_parallel.stats import CPStats, NullStats
from mpoverlap.precision import no_autocast

# A block: (query rows, key rows of the block in hand, causal), rows as local slices.
Block = Tuple[slice, slice, bool]


def _pairs(ring: CPRing, src: int):
    """(i, j, relation) for query chunk i of this rank and key chunk j of rank `src`'s block,
    i, j in {0, 1} (local chunk positions), in a fixed order."""
    q_chunks = cp_chunks_of_rank(ring.cp_rank, ring.cp_size)
    k_chunks = cp_chunks_of_rank(src, ring.cp_size)
    return [(i, j, chunk_relation(qc, kc)) for i, qc in enumerate(q_chunks)
            for j, kc in enumerate(k_chunks)]


def _blocks(ring: CPRing, src: int, c: int, fused: bool) -> List[Block]:
    """The kernel calls of one ring step against rank `src`'s K/V (see the module doc): one
    load-balanced half for a fused kernel, the unskipped c x c chunk pairs for the explicit
    math. Either way they cover exactly the unmasked (query, key) pairs."""
    if not fused:
        return [(slice(i * c, (i + 1) * c), slice(j * c, (j + 1) * c), rel != "full")
                for i, j, rel in _pairs(ring, src) if rel != SKIP]
    every, first, second = slice(0, 2 * c), slice(0, c), slice(c, 2 * c)
    if src == ring.cp_rank:
        return [(every, every, True)]
    return [(every, first, False)] if src < ring.cp_rank else [(second, every, False)]


def _count(ring: CPRing, src: int, stats: CPStats, phase: str, B: int, N: int, c: int, D: int) -> None:
    for _i, _j, rel in _pairs(ring, src):
        stats.count_pair(phase, rel, B, N, c, c, D)


def _kv_double_buffer(k_BGSD: torch.Tensor, v_BGSD: torch.Tensor, ring: CPRing) -> list:
    """[kv in hand, buffer the next block is received into (None when cp == 1)]: k and v
    stacked [2, B, G, S, D], or, when their head widths differ (latent attention), side by side
    [B, G, S, D + Dv] (`kv_views` reads either)."""
    held = (torch.stack([k_BGSD, v_BGSD]) if k_BGSD.shape == v_BGSD.shape
            else torch.cat([k_BGSD, v_BGSD], dim=-1))
    return [held, torch.empty_like(held) if ring.cp_size > 1 else None]


def kv_views(held: torch.Tensor, D: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(k, v) of a buffer made like `_kv_double_buffer`'s (D: k's head width)."""
    if held.dim() == 5:
        return held[0], held[1]
    return held[..., :D], held[..., D:]


def _issue_next_kv(ring: CPRing, buffers: list, step: int, stats: CPStats, phase: str):
    """Send the K/V block in hand on and receive the next one into the other buffer (double
    buffering). Without overlap the transfer is waited at once; with it, the caller waits
    after computing on the block in hand. None at the last step."""
    if step + 1 >= ring.cp_size:
        return None
    handle = ring.exchange(buffers[step % 2], buffers[(step + 1) % 2])
    stats.event(phase, "issue", step + 1)
    if not ring.overlap:
        handle.wait()
        stats.event(phase, "wait", step + 1)
    return handle


def ring_forward(q_BNSD: torch.Tensor, k_BGSD: torch.Tensor, v_BGSD: torch.Tensor, ring: CPRing,
                 scale: float, stats: CPStats, kernel: BlockKernel):
    """(out_BNSD in q's dtype, lse_BNS fp32) of causal attention over the global sequence."""
    B, N, S_local, D = q_BNSD.shape
    c = S_local // 2
    acc = acc_dtype(q_BNSD.dtype)
    # The online-softmax accumulators of every local query row (fp32): an empty row has
    # lse -inf and out 0, and merges with its first block exactly. (out has v's head width.)
    out_acc_BNSD = torch.zeros((B, N, S_local, v_BGSD.shape[-1]), dtype=acc, device=q_BNSD.device)
    lse_acc_BNS = torch.full((B, N, S_local), float("-inf"), dtype=acc, device=q_BNSD.device)
    # kv_2BGSD: the block in hand; the other buffer receives the next one.
    buffers = _kv_double_buffer(k_BGSD, v_BGSD, ring)
    for step in range(ring.cp_size):
        k_held, v_held = kv_views(buffers[step % 2], D)
        handle = _issue_next_kv(ring, buffers, step, stats, "fwd")
        stats.event("fwd", "compute_begin", step)
        src = ring.source_of_step(step)
        _count(ring, src, stats, "fwd", B, N, c, D)
        for rows, keys, causal in _blocks(ring, src, c, kernel.fused):
            o, l = kernel.forward(q_BNSD[:, :, rows], k_held[:, :, keys], v_held[:, :, keys], scale, causal)
            merge_into(out_acc_BNSD[:, :, rows], lse_acc_BNS[:, :, rows], o, l)
        stats.event("fwd", "compute_end", step)
        if handle is not None and ring.overlap:
            handle.wait()
            stats.event("fwd", "wait", step + 1)
    return out_acc_BNSD.to(q_BNSD.dtype), lse_acc_BNS


def ring_backward(dout_BNSD, q_BNSD, k_BGSD, v_BGSD, out_BNSD, lse_BNS, ring: CPRing,
                  scale: float, stats: CPStats, kernel: BlockKernel):
    """(dq [B, N, S_local, D], dk [B, G, S_local, D], dv [B, G, S_local, Dv]) in the inputs'
    dtypes; fp32 (fp64 for fp64) accumulation, also of the dK/dV that travel the ring."""
    B, N, S_local, D = q_BNSD.shape
    c = S_local // 2
    acc = acc_dtype(q_BNSD.dtype)
    dout_BNSD = dout_BNSD.to(q_BNSD.dtype)
    dq_BNSD = torch.zeros(q_BNSD.shape, dtype=acc, device=q_BNSD.device)
    buffers = _kv_double_buffer(k_BGSD, v_BGSD, ring)
    dkv_handle, dkv_recv_2BGSD = None, None
    for step in range(ring.cp_size):
        k_held, v_held = kv_views(buffers[step % 2], D)
        kv_handle = _issue_next_kv(ring, buffers, step, stats, "bwd")
        stats.event("bwd", "compute_begin", step)
        # This rank's share of the gradient of the block in hand.
        dkv_2BGSD = torch.zeros(buffers[step % 2].shape, dtype=acc, device=q_BNSD.device)
        dk_held, dv_held = kv_views(dkv_2BGSD, D)
        src = ring.source_of_step(step)
        _count(ring, src, stats, "bwd", B, N, c, D)
        for rows, keys, causal in _blocks(ring, src, c, kernel.fused):
            dq, dk, dv = kernel.backward(dout_BNSD[:, :, rows], q_BNSD[:, :, rows], k_held[:, :, keys],
                                         v_held[:, :, keys], out_BNSD[:, :, rows], lse_BNS[:, :, rows],
                                         scale, causal)
            dq_BNSD[:, :, rows].add_(dq)
            dk_held[:, :, keys].add_(dk)
            dv_held[:, :, keys].add_(dv)
        stats.event("bwd", "compute_end", step)
        if dkv_handle is not None:
            # The accumulator of this block from the ranks before, sent at the previous step:
            # with overlap it travelled under this step's compute.
            if not dkv_handle.waited:
                dkv_handle.wait()
                stats.event("bwd", "wait_dkv", step)
            dkv_2BGSD.add_(dkv_recv_2BGSD)
        if ring.cp_size > 1:
            # Sent in the inputs' dtype (bf16 under autocast: half the bytes; fp32 unchanged).
            dkv_send_2BGSD = dkv_2BGSD.to(k_BGSD.dtype)
            dkv_recv_2BGSD = torch.empty_like(dkv_send_2BGSD)
            dkv_handle = ring.exchange(dkv_send_2BGSD, dkv_recv_2BGSD)
            stats.event("bwd", "issue_dkv", step + 1)
            if not ring.overlap:
                dkv_handle.wait()
                stats.event("bwd", "wait_dkv", step + 1)
        else:
            dkv_recv_2BGSD = dkv_2BGSD
        if kv_handle is not None and ring.overlap:
            kv_handle.wait()
            stats.event("bwd", "wait", step + 1)
    if dkv_handle is not None and not dkv_handle.waited:
        dkv_handle.wait()  # the last hop brings each rank its own, complete dK/dV
        stats.event("bwd", "wait_dkv", ring.cp_size)
    dk_home, dv_home = kv_views(dkv_recv_2BGSD, D)
    return dq_BNSD.to(q_BNSD.dtype), dk_home.to(k_BGSD.dtype), dv_home.to(v_BGSD.dtype)


class RingAttentionFunction(torch.autograd.Function):
    """autograd wrapper: forward saves q, k, v, out, lse; backward runs the ring again.
    Autocast is off inside both halves and k, v take q's dtype, so the kernels see one dtype
    in forward and backward (the inputs' own: bf16 under autocast)."""

    @staticmethod
    def forward(ctx, q_BNSD, k_BGSD, v_BGSD, ring: CPRing, scale: float, stats: CPStats,
                kernel: BlockKernel):
        k_BGSD, v_BGSD = k_BGSD.to(q_BNSD.dtype), v_BGSD.to(q_BNSD.dtype)
        with no_autocast(q_BNSD):
            out_BNSD, lse_BNS = ring_forward(q_BNSD, k_BGSD, v_BGSD, ring, scale, stats, kernel)
        ctx.save_for_backward(q_BNSD, k_BGSD, v_BGSD, out_BNSD, lse_BNS)
        ctx.ring, ctx.scale, ctx.stats, ctx.kernel = ring, scale, stats, kernel
        return out_BNSD

    @staticmethod
    def backward(ctx, dout_BNSD):
        q_BNSD, k_BGSD, v_BGSD, out_BNSD, lse_BNS = ctx.saved_tensors
        with no_autocast(q_BNSD):
            dq, dk, dv = ring_backward(dout_BNSD, q_BNSD, k_BGSD, v_BGSD, out_BNSD, lse_BNS,
                                       ctx.ring, ctx.scale, ctx.stats, ctx.kernel)
        return dq, dk, dv, None, None, None, None


def ring_attention(q_BNSD: torch.Tensor, k_BGSD: torch.Tensor, v_BGSD: torch.Tensor, *,
                   cp_group, cp_ranks: Sequence[int], cp_rank: int, cp_size: int,
                   overlap: bool, ledger=None, stats: Optional[CPStats] = None,
                   softmax_scale: Optional[float] = None, backend: str = "auto") -> torch.Tensor:
    """Causal attention over the global sequence, ring-parallel: out_BNSD [B, N, S_local, Dv].

    q, k: [B, N, S_local, D], [B, G, S_local, D] (G divides N; G < N is grouped-query
    attention); v: [B, G, S_local, Dv] (Dv = D, or another value head width: latent attention), in the load-balanced layout of split_for_cp (chunks r and 2cp-1-r), RoPE
    already applied at the global positions. Equals
    F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=G < N) on the full sequence,
    split the same way. Collective over the cp group: every cp rank calls it, also backward.
    softmax_scale defaults to 1/sqrt(D). `stats` (optional) collects work and event counters.
    `backend`: parallel.cp_attention_backend (auto | fused | explicit | cudnn, block_kernels.py).
    """
    check_qkv_shapes(q_BNSD, k_BGSD, v_BGSD)
    if q_BNSD.shape[2] % 2:
        raise ValueError(f"S_local={q_BNSD.shape[2]} must be even (two chunks per cp rank)")
    ring = CPRing.make(cp_group, cp_ranks, cp_rank, cp_size, overlap, ledger)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q_BNSD.shape[-1])
    return RingAttentionFunction.apply(q_BNSD, k_BGSD, v_BGSD, ring, float(scale),
                                       stats if stats is not None else NullStats(),
                                       select_block_kernel(backend, q_BNSD))
