"""Multi-head latent attention's shape terms for the estimate and the simulator (models/mla.py):
its GEMMs, the widths its attention core reads, and what a layer keeps for backward.

Per token, with N heads (N/tp on a rank), r = q_lora_rank, c = kv_lora_rank, n, p, v the
no-RoPE, RoPE and value head widths:
  replicated down-projections  q_a_proj H r, kv_a_proj_with_mqa H (c + p)   (each rank, its
                               S/tp positions with SP, all S without)
  split up-projections         q_b_proj r N (n + p) (q_proj H N (n + p) when r = 0),
                               kv_b_proj c N (n + v), proj N v H           (1/tp each)
  attention core               q and k N (n + p) wide (k's RoPE part is the shared key,
                               expanded to every head), v and the output N v
"""
from __future__ import annotations

from typing import Any, Tuple


def is_latent(m: Any) -> bool:
    return getattr(m, "attention", "mha") == "mla"


def core_widths(m: Any) -> Tuple[int, int, int]:
    """(q, k, v) widths per token of the attention core's inputs, all heads: N (n + p) twice and N v."""
    N = m.num_attention_heads
    qk = N * (m.qk_nope_head_dim + m.qk_rope_head_dim)
    return qk, qk, N * m.v_head_dim


def gemm_weights(m: Any) -> Tuple[int, int]:
    """(replicated, split over tp) GEMM weights of one layer."""
    H, N, r, c, p = m.hidden_size, m.num_attention_heads, m.q_lora_rank, m.kv_lora_rank, m.qk_rope_head_dim
    qk = m.qk_nope_head_dim + p
    replicated = H * r + H * (c + p)
    split = (r if r else H) * N * qk + c * N * (m.qk_nope_head_dim + m.v_head_dim) + N * m.v_head_dim * H
    return replicated, split


def gemm_flops(m: Any, tokens_tp: float, tokens_res: float, tp: int) -> float:
    """Forward FLOPs of one layer's projections on a rank: the replicated ones over its residual
    tokens (S/tp with SP), the split ones over every position, 1/tp of the heads."""
    replicated, split = gemm_weights(m)
    return 2 * tokens_res * replicated + 2 * tokens_tp * split / tp


def activation_bytes_per_token(m: Any, tp: int, c: int, f: int, selective: bool, cp_comm: str, cp: int
                               ) -> Tuple[int, int]:
    """(residual-region bytes, TP-region bytes) one layer's attention keeps per token (the
    block's norms and residual terms are counted apart, as for multi-head attention):
      residual region: each latent's RMSNorm keeps its input (q_a_proj's output r; the whole
      kv_a output c + p, which c_kv views), its normalised copy (f, as the block's RMSNorms)
      and its output (r, c: the up-projections' inputs)
      TP region: the kv_b output N (n + v) (v views it), q and k after the concatenation
      (N (n + p) each), the core's output N v and its copy for the projection N v, the
      log-sum-exp per head (f; recomputed under selective recomputation). The all-to-all
      variant keeps its head-sharded copies of q, k, v instead of the kv_b output."""
    r, lat, p = m.q_lora_rank, m.kv_lora_rank, m.qk_rope_head_dim
    q, k, v = core_widths(m)
    N = m.num_attention_heads
    residual = (2 * r + (lat + p) + lat) * c + (r + lat) * f
    kv_b = N * (m.qk_nope_head_dim + m.v_head_dim)
    core = q + k + 3 * v if cp > 1 and cp_comm == "a2a" else kv_b + q + k + 2 * v
    return residual, (core * c + (0 if selective else N * f)) // tp


def wgrad_kept_per_token(m: Any, tp: int, sp: bool) -> Tuple[int, int, int, int]:
    """What a zero-bubble W's closures keep of one layer's attention, channels a token (compute
    dtype): (TP-region kept, of it also saved as activations, residual-region kept, of it saved).
    TP region (every position): q_b_proj's input r (gathered under SP) and output gradient
    N (n + p)/tp, kv_b_proj's c and N (n + v)/tp, proj's N v/tp and H (q_proj's input H when
    q_lora_rank is 0, under SP: without it that input is the down-projection's). Residual region
    (S/tp positions with SP): the down-projections' input H (one tensor for both) and output
    gradients r and c + p."""
    H, N, r, lat, p = m.hidden_size, m.num_attention_heads, m.q_lora_rank, m.kv_lora_rank, m.qk_rope_head_dim
    qk, v = m.qk_nope_head_dim + p, m.v_head_dim
    tp_kept = (r if r else (H if sp else 0)) + N * qk // tp + lat + N * (m.qk_nope_head_dim + v) // tp \
        + N * v // tp + H
    tp_shared = N * v // tp + (0 if sp else (r + lat if r else lat))
    return tp_kept, tp_shared, H + r + lat + p, H
