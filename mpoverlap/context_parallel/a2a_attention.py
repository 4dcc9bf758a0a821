"""All-to-all (Ulysses) context-parallel attention: trade the sequence shard for a head shard.

Inputs q, k, v [B, N, S_local, D] in the load-balanced layout of split_for_cp; N divisible by
cp. An all_to_all (mode "cp") turns them into [B, N/cp, S, D]: this rank's heads over the full
sequence, chunks put back in natural order; local causal F.scaled_dot_product_attention; a
second all_to_all brings the output back to [B, N, S_local, D].

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

Backward reuses the autograd graph of each group's SDPA built in forward (no recompute).
"""
from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from mpoverlap.comm.collectives import all_to_all
from mpoverlap.context_parallel.a2a_layout import (pack_head_to_seq, pack_seq_to_head,
                                                    unpack_head_to_seq, unpack_seq_to_head)
from mpoverlap.context_parallel.ring_comm import CPRing
from mpoverlap.context_parallel.stats import CPStats, NullStats
from mpoverlap.recompute import in_recompute_region


def default_head_chunks(num_heads: int, cp_size: int) -> int:
    """2 head groups when each rank's N/cp heads split evenly in two, else 1."""
    return 2 if (num_heads // cp_size) % 2 == 0 else 1


def _issue(ring: CPRing, send: torch.Tensor, stats: CPStats, phase: str, g: int):
    """Issue one all_to_all of `send` [cp, ...]; returns (handle, recv buffer)."""
    recv = torch.empty_like(send)
    handle = all_to_all(recv, send, ring.cp_group, mode="cp", ledger=ring.ledger)
    stats.event(phase, "issue", g)
    return handle, recv


def _wait(handle, stats: CPStats, phase: str, g: int) -> None:
    handle.wait()
    stats.event(phase, "wait", g)


def _exchange_groups(ring: CPRing, x_TBNSD: torch.Tensor, groups: int, stats: CPStats,
                     phase: str, compute):
    """Shared driver of forward and backward.

    x_TBNSD [T, B, N, S_local, D] goes to head-sharded groups; compute(g, y_TBnSD) returns the
    group's result [T', B, Ng, S, D]; the results come back as [T', B, N, S_local, D]."""
    cp = ring.cp_size
    pending_in = {}
    if ring.overlap:
        for g in range(groups):
            pending_in[g] = _issue(ring, pack_seq_to_head(x_TBNSD, cp, groups, g), stats, phase, g)
    pending_out = []
    for g in range(groups):
        if not ring.overlap:
            pending_in[g] = _issue(ring, pack_seq_to_head(x_TBNSD, cp, groups, g), stats, phase, g)
        handle, recv = pending_in.pop(g)
        _wait(handle, stats, phase, g)
        stats.event(phase, "compute_begin", g)
        result_TBnSD = compute(g, unpack_seq_to_head(recv, cp))
        stats.event(phase, "compute_end", g)
        handle, recv = _issue(ring, pack_head_to_seq(result_TBnSD, cp), stats, phase, g)
        if not ring.overlap:
            _wait(handle, stats, phase, g)
        pending_out.append((g, handle, recv))
    T_out = pending_out[0][2].shape[1]
    B, N, S_local, D = x_TBNSD.shape[1:]
    out_TBNSD = torch.empty((T_out, B, N, S_local, D), dtype=pending_out[0][2].dtype,
                            device=x_TBNSD.device)
    for g, handle, recv in pending_out:
        _wait(handle, stats, phase, g)
        unpack_head_to_seq(recv, out_TBNSD, groups, g)
    return out_TBNSD


class A2AAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_BNSD, k_BNSD, v_BNSD, ring: CPRing, scale: float, groups: int,
                stats: CPStats):
        graphs = []

        def attend(g, qkv_3BnSD):
            leaves = [t.detach().requires_grad_() for t in qkv_3BnSD.unbind(0)]
            # Inside an activation-recomputation region this inner graph keeps its own tensors
            # (identity hooks): the region's hooks would drop them and replay the whole block
            # once per torch.autograd.grad call in backward (each is a graph task of its own).
            keep = (torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
                    if in_recompute_region() else nullcontext())
            with torch.enable_grad(), keep:
                y_BnSD = F.scaled_dot_product_attention(*leaves, is_causal=True, scale=scale)
            graphs.append((leaves, y_BnSD))
            B, Ng, S, D = y_BnSD.shape
            stats.count_dense("fwd", B, Ng, S, D)
            return y_BnSD.detach().unsqueeze(0)

        qkv_3BNSD = torch.stack([q_BNSD, k_BNSD, v_BNSD])
        out_1BNSD = _exchange_groups(ring, qkv_3BNSD, groups, stats, "fwd", attend)
        ctx.graphs, ctx.ring, ctx.groups, ctx.stats = graphs, ring, groups, stats
        return out_1BNSD[0]

    @staticmethod
    def backward(ctx, dout_BNSD):
        graphs, stats = ctx.graphs, ctx.stats

        def attend_backward(g, dout_1BnSD):
            leaves, y_BnSD = graphs[g]
            grads = torch.autograd.grad(y_BnSD, leaves, dout_1BnSD[0])
            graphs[g] = None  # free the group's graph as soon as it is used
            B, Ng, S, D = y_BnSD.shape
            stats.count_dense("bwd", B, Ng, S, D)
            return torch.stack(grads)

        dqkv_3BNSD = _exchange_groups(ctx.ring, dout_BNSD.unsqueeze(0), ctx.groups, stats,
                                      "bwd", attend_backward)
        ctx.graphs = None
        return dqkv_3BNSD[0], dqkv_3BNSD[1], dqkv_3BNSD[2], None, None, None, None


def a2a_attention(q_BNSD: torch.Tensor, k_BNSD: torch.Tensor, v_BNSD: torch.Tensor, *,
                  cp_group, cp_ranks: Sequence[int], cp_rank: int, cp_size: int,
                  overlap: bool, ledger=None, stats: Optional[CPStats] = None,
                  softmax_scale: Optional[float] = None,
                  head_chunks: Optional[int] = None) -> torch.Tensor:
    """Causal attention over the global sequence via head sharding: out_BNSD [B, N, S_local, D].

    Same contract as ring_attention (layout of split_for_cp, RoPE at global positions, equal
    to full-sequence causal SDPA split the same way, collective over the cp group), plus:
    N divisible by cp * head_chunks. `cp_ranks` is accepted for a uniform signature."""
    if not (q_BNSD.shape == k_BNSD.shape == v_BNSD.shape) or q_BNSD.dim() != 4:
        raise ValueError(f"q, k, v must share one [B, N, S_local, D] shape; got "
                         f"{tuple(q_BNSD.shape)}, {tuple(k_BNSD.shape)}, {tuple(v_BNSD.shape)}")
    B, N, S_local, D = q_BNSD.shape
    groups = head_chunks if head_chunks is not None else default_head_chunks(N, cp_size)
    if N % (cp_size * groups):
        raise ValueError(f"all-to-all attention needs heads N={N} divisible by cp={cp_size} x "
                         f"head_chunks={groups}")
    if S_local % 2:
        raise ValueError(f"S_local={S_local} must be even (two chunks per cp rank)")
    ring = CPRing.make(cp_group, cp_ranks, cp_rank, cp_size, overlap, ledger)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    return A2AAttentionFunction.apply(q_BNSD, k_BNSD, v_BNSD, ring, float(scale), groups,
                                      stats if stats is not None else NullStats())
