"""Ring attention: causal attention over a context-parallel sequence, K/V passed around the ring.

Layout: q is [B, N, S_local, D], k and v [B, G, S_local, D] (G K/V groups: grouped-query
attention, G = N without it), S_local = S / cp holding global chunks (r, 2cp-1-r) of length
c = S / (2 cp) (see split.py). The output has q's layout. Only the G groups travel the ring (and
their dK/dV): a step moves N / G times fewer bytes than multi-head attention; each block expands
its groups to the N heads locally (query head n reads group n // (N / G)).

Forward, at ring step s = 0 .. cp-1 rank r holds the K/V block of rank (r - s) mod cp:
  1. issue the exchange that brings the next block (send this block on, receive the next one
     into the second buffer): double buffering;
  2. attend the two local query chunks to the two key chunks of the block, pair by pair:
     key chunk after query chunk -> skipped; same chunk -> causal mask; before -> no mask;
     each pair's (out, lse) merges into the query chunk's accumulator (online softmax, fp32);
  3. wait the exchange (overlap.cp: it ran under step 2; without: it was waited in step 1).
Backward recomputes each pair from the saved q, k, v, out, lse. K/V circulate again; the dK/dV
accumulator of each block travels with it (each rank adds its share, then sends it on); after
cp exchanges every accumulator is back home, complete. dQ accumulates locally.

Overlap changes only when handles are waited, never the arithmetic: on and off are bitwise
identical.

Mixed precision: q, k, v arrive in the compute dtype (bf16 under autocast) and K/V travel the
ring in it; the block math runs with autocast OFF, in fp32 (attention_math upcasts). Left on,
autocast would run the forward's score GEMMs in bf16 while the backward (where autocast is off)
recomputes them in fp32 against an lse of the bf16 scores: the gradient would not be the
gradient of the forward. Each rank's dK/dV share accumulates in fp32 and travels in the
inputs' dtype.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from mpoverlap.context_parallel.attention_math import (SKIP, acc_dtype, block_backward,
                                                        block_forward, check_qkv_shapes,
                                                        chunk_relation, merge_partial, repeat_kv,
                                                        softmax_delta, sum_kv_groups)
from mpoverlap.context_parallel.ring_comm import CPRing
from mpoverlap.context_parallel.split import cp_chunks_of_rank
from mpoverlap.context_parallel.stats import CPStats, NullStats
from mpoverlap.precision import no_autocast


def _pairs(ring: CPRing, src: int):
    """(i, j, relation) for query chunk i of this rank and key chunk j of rank `src`'s block,
    i, j in {0, 1} (local chunk positions), in a fixed order."""
    q_chunks = cp_chunks_of_rank(ring.cp_rank, ring.cp_size)
    k_chunks = cp_chunks_of_rank(src, ring.cp_size)
    return [(i, j, chunk_relation(qc, kc)) for i, qc in enumerate(q_chunks)
            for j, kc in enumerate(k_chunks)]


def _kv_double_buffer(k_BNSD: torch.Tensor, v_BNSD: torch.Tensor, ring: CPRing) -> list:
    """[kv_2BNSD in hand, buffer the next block is received into (None when cp == 1)]."""
    held = torch.stack([k_BNSD, v_BNSD])
    return [held, torch.empty_like(held) if ring.cp_size > 1 else None]


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


def ring_forward(q_BNSD: torch.Tensor, k_BNSD: torch.Tensor, v_BNSD: torch.Tensor, ring: CPRing,
                 scale: float, stats: CPStats):
    """(out_BNSD in q's dtype, lse_BNS fp32) of causal attention over the global sequence."""
    B, N, S_local, D = q_BNSD.shape
    c, rep = S_local // 2, N // k_BNSD.shape[1]
    q_chunks = q_BNSD.chunk(2, dim=2)
    out_acc = [None, None]
    lse_acc = [None, None]
    # kv_2BNSD: the block in hand; the other buffer receives the next one.
    buffers = _kv_double_buffer(k_BNSD, v_BNSD, ring)
    for step in range(ring.cp_size):
        kv_2BNSD = buffers[step % 2]
        handle = _issue_next_kv(ring, buffers, step, stats, "fwd")
        stats.event("fwd", "compute_begin", step)
        k_chunks = kv_2BNSD[0].chunk(2, dim=2)
        v_chunks = kv_2BNSD[1].chunk(2, dim=2)
        for i, j, rel in _pairs(ring, ring.source_of_step(step)):
            stats.count_pair("fwd", rel, B, N, c, c, D)
            if rel == SKIP:
                continue
            o, l = block_forward(q_chunks[i], repeat_kv(k_chunks[j], rep),
                                 repeat_kv(v_chunks[j], rep), scale=scale, causal=(rel != "full"))
            out_acc[i], lse_acc[i] = merge_partial(out_acc[i], lse_acc[i], o, l)
        stats.event("fwd", "compute_end", step)
        if handle is not None and ring.overlap:
            handle.wait()
            stats.event("fwd", "wait", step + 1)
    out_BNSD = torch.cat(out_acc, dim=2).to(q_BNSD.dtype)
    lse_BNS = torch.cat(lse_acc, dim=2)
    return out_BNSD, lse_BNS


def ring_backward(dout_BNSD, q_BNSD, k_BNSD, v_BNSD, out_BNSD, lse_BNS, ring: CPRing,
                  scale: float, stats: CPStats):
    """(dq [B, N, S_local, D], dk, dv [B, G, S_local, D]) in the inputs' dtypes; fp32 (fp64 for fp64) accumulation,
    also of the dK/dV that travel the ring."""
    B, N, S_local, D = q_BNSD.shape
    c, rep = S_local // 2, N // k_BNSD.shape[1]
    delta_BNS = softmax_delta(out_BNSD, dout_BNSD)
    q_chunks, dout_chunks = q_BNSD.chunk(2, dim=2), dout_BNSD.chunk(2, dim=2)
    lse_chunks, delta_chunks = lse_BNS.chunk(2, dim=2), delta_BNS.chunk(2, dim=2)
    dq_BNSD = torch.zeros(q_BNSD.shape, dtype=acc_dtype(q_BNSD.dtype), device=q_BNSD.device)
    dq_chunks = dq_BNSD.chunk(2, dim=2)
    buffers = _kv_double_buffer(k_BNSD, v_BNSD, ring)
    dkv_handle, dkv_recv_2BNSD = None, None
    for step in range(ring.cp_size):
        kv_2BNSD = buffers[step % 2]
        kv_handle = _issue_next_kv(ring, buffers, step, stats, "bwd")
        stats.event("bwd", "compute_begin", step)
        k_chunks = kv_2BNSD[0].chunk(2, dim=2)
        v_chunks = kv_2BNSD[1].chunk(2, dim=2)
        # This rank's share of the gradient of the block in hand (chunk views write into it).
        dkv_2BNSD = torch.zeros(kv_2BNSD.shape, dtype=acc_dtype(q_BNSD.dtype),
                                device=q_BNSD.device)
        dk_chunks, dv_chunks = dkv_2BNSD[0].chunk(2, dim=2), dkv_2BNSD[1].chunk(2, dim=2)
        for i, j, rel in _pairs(ring, ring.source_of_step(step)):
            stats.count_pair("bwd", rel, B, N, c, c, D)
            if rel == SKIP:
                continue
            dq, dk, dv = block_backward(q_chunks[i], repeat_kv(k_chunks[j], rep),
                                        repeat_kv(v_chunks[j], rep), dout_chunks[i],
                                        lse_chunks[i], delta_chunks[i], scale=scale,
                                        causal=(rel != "full"))
            dq_chunks[i].add_(dq)
            dk_chunks[j].add_(sum_kv_groups(dk, rep))
            dv_chunks[j].add_(sum_kv_groups(dv, rep))
        stats.event("bwd", "compute_end", step)
        if dkv_handle is not None:
            # The accumulator of this block from the ranks before, sent at the previous step:
            # with overlap it travelled under this step's compute.
            if not dkv_handle.waited:
                dkv_handle.wait()
                stats.event("bwd", "wait_dkv", step)
            dkv_2BNSD.add_(dkv_recv_2BNSD)
        if ring.cp_size > 1:
            # Sent in the inputs' dtype (bf16 under autocast: half the bytes; fp32 unchanged).
            dkv_send_2BNSD = dkv_2BNSD.to(k_BNSD.dtype)
            dkv_recv_2BNSD = torch.empty_like(dkv_send_2BNSD)
            dkv_handle = ring.exchange(dkv_send_2BNSD, dkv_recv_2BNSD)
            stats.event("bwd", "issue_dkv", step + 1)
            if not ring.overlap:
                dkv_handle.wait()
                stats.event("bwd", "wait_dkv", step + 1)
        else:
            dkv_recv_2BNSD = dkv_2BNSD
        if kv_handle is not None and ring.overlap:
            kv_handle.wait()
            stats.event("bwd", "wait", step + 1)
    if dkv_handle is not None and not dkv_handle.waited:
        dkv_handle.wait()  # the last hop brings each rank its own, complete dK/dV
        stats.event("bwd", "wait_dkv", ring.cp_size)
    return (dq_BNSD.to(q_BNSD.dtype), dkv_recv_2BNSD[0].to(k_BNSD.dtype),
            dkv_recv_2BNSD[1].to(v_BNSD.dtype))


class RingAttentionFunction(torch.autograd.Function):
    """autograd wrapper: forward saves q, k, v, out, lse; backward runs the ring again."""

    @staticmethod
    def forward(ctx, q_BNSD, k_BNSD, v_BNSD, ring: CPRing, scale: float, stats: CPStats):
        with no_autocast(q_BNSD):  # fp32 block math: see the module docstring
            out_BNSD, lse_BNS = ring_forward(q_BNSD, k_BNSD, v_BNSD, ring, scale, stats)
        ctx.save_for_backward(q_BNSD, k_BNSD, v_BNSD, out_BNSD, lse_BNS)
        ctx.ring, ctx.scale, ctx.stats = ring, scale, stats
        return out_BNSD

    @staticmethod
    def backward(ctx, dout_BNSD):
        q_BNSD, k_BNSD, v_BNSD, out_BNSD, lse_BNS = ctx.saved_tensors
        with no_autocast(q_BNSD):
            dq, dk, dv = ring_backward(dout_BNSD, q_BNSD, k_BNSD, v_BNSD, out_BNSD, lse_BNS,
                                       ctx.ring, ctx.scale, ctx.stats)
        return dq, dk, dv, None, None, None


def ring_attention(q_BNSD: torch.Tensor, k_BNSD: torch.Tensor, v_BNSD: torch.Tensor, *,
                   cp_group, cp_ranks: Sequence[int], cp_rank: int, cp_size: int,
                   overlap: bool, ledger=None, stats: Optional[CPStats] = None,
                   softmax_scale: Optional[float] = None) -> torch.Tensor:
    """Causal attention over the global sequence, ring-parallel: out_BNSD [B, N, S_local, D].

    q: [B, N, S_local, D]; k, v: [B, G, S_local, D] (G divides N; G < N is grouped-query
    attention), in the load-balanced layout of split_for_cp (chunks r and 2cp-1-r), RoPE
    already applied at the global positions. Equals
    F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=G < N) on the full sequence,
    split the same way. Collective over the cp group: every cp rank calls it, also backward.
    softmax_scale defaults to 1/sqrt(D). `stats` (optional) collects work and event counters.
    """
    check_qkv_shapes(q_BNSD, k_BNSD, v_BNSD)
    if q_BNSD.shape[2] % 2:
        raise ValueError(f"S_local={q_BNSD.shape[2]} must be even (two chunks per cp rank)")
    ring = CPRing.make(cp_group, cp_ranks, cp_rank, cp_size, overlap, ledger)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q_BNSD.shape[-1])
    return RingAttentionFunction.apply(q_BNSD, k_BNSD, v_BNSD, ring, float(scale),
                                       stats if stats is not None else NullStats())
