"""Context-parallel attention's working memory: what one attention layer holds while it runs,
beyond the activations every layer saves (activations.py), per rank.

With fused block kernels (context_parallel/block_kernels.py) nothing here grows with the square
of the sequence: every term is O(S_local) per head. Ring (p2p), forward and backward of one
layer, with T = micro batch x S/cp tokens, N = heads / tp and G = K/V groups / tp on this
rank, D the head dim, c the compute dtype's bytes and a = 4 (fp32 accumulation):

  forward   K/V double buffer (the block in hand + the one arriving)   2 x 2 G T D c
            output and lse accumulators (fp32)                          N T (D + 1) a
            one block's output and lse, upcast for the merge            N T (D c + D a + a)
  backward  K/V double buffer                                            2 x 2 G T D c
            dQ accumulator and this block's dK/dV share (fp32)          (N + 2 G) T D a
            the dK/dV travelling (sent and received, compute dtype)     2 x 2 G T D c
            the kernel's dq, dk, dv of one block                        (N + 2 G) T D c
            the kernel's workspace: flash backward's fp32 dq
            accumulator and per-row softmax statistics                  N T (D + 1) a
  The larger of the two is alive at once (backward).

All-to-all: one head group (N / head groups heads, G / head groups K/V groups) over the full
sequence (T cp tokens) at a time, but every group's q, k, v exchange issued up front: the send
and receive buffers of q, k, v (2 (N + 2 G) T D c), the group's kernel output and lse and its
backward workspace as above (N / groups heads, cp T tokens).

The explicit fallback (parallel.cp_attention_backend=explicit) adds its scores and
probabilities: 3 c' x c' fp32 per head of a chunk pair (c' = S / 2cp), the O(S^2) term the
fused kernels remove; counted here so that the estimate says what it costs.
"""
from __future__ import annotations

from typing import Any

from mpoverlap.models.init import query_groups
from mpoverlap.overlap.estimate.latent import is_latent
from mpoverlap.overlap.layout import Layout

ACC = 4  # fp32 accumulators and softmax statistics


def cp_attention_work_bytes(cfg: Any, lo: Layout, compute_bytes: int, micro_batch: int) -> int:
    """Peak transient bytes of one context-parallel attention layer per rank (0 without cp)."""
    if lo.cp is None or lo.cp < 2:
        return 0
    m, p = cfg.model, cfg.parallel
    heads, groups = m.num_attention_heads // lo.tp, max(1, query_groups(m) // lo.tp)
    D = m.hidden_size // m.num_attention_heads
    if is_latent(m):
        # latent attention: K/V per head, q/k n + p wide and v narrower; counted at the wider
        # width (what the flash kernels compute on: v padded to it)
        groups, D = heads, m.qk_nope_head_dim + m.qk_rope_head_dim
    T = micro_batch * (m.seq_length // lo.cp)
    c, a = compute_bytes, ACC
    explicit = getattr(p, "cp_attention_backend", "auto") == "explicit"
    if p.cp_comm == "a2a":
        from mpoverlap.context_parallel.a2a_attention import default_head_chunks

        hg = default_head_chunks(heads, lo.cp, groups)
        n, g, tokens = heads // lo.cp, groups // lo.cp, T * lo.cp  # this rank's heads, full sequence
        buffers = 2 * (n + 2 * g) * tokens * D * c
        per_group = (n // hg) * tokens * (D * c + a + (D + 1) * a)
        scores = 3 * (n // hg) * tokens * tokens * a if explicit else 0
        return buffers + per_group + scores
    kv_buffers = 2 * 2 * groups * T * D * c
    forward = kv_buffers + heads * T * (D + 1) * a + heads * T * (D * c + D * a + a)
    backward = (kv_buffers + (heads + 2 * groups) * T * D * a + 2 * 2 * groups * T * D * c
                + (heads + 2 * groups) * T * D * c + heads * T * (D + 1) * a)
    chunk = T // (2 * micro_batch)
    scores = 3 * micro_batch * heads * chunk * chunk * a if explicit else 0
    return max(forward, backward) + scores
