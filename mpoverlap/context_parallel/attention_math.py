"""Block attention math with log-sum-exp, by hand: the explicit fallback of the block kernels
(block_kernels.py, parallel.cp_attention_backend=explicit) and the online-softmax merge every
kernel's blocks use (no communication).

One "block" is the attention of a query chunk against one key/value chunk. Blocks of the same
query chunk merge exactly with their log-sum-exp (online softmax); the backward recomputes the
probabilities of each block from the saved q, k and the final lse (flash-attention style), so no
[Q, K] probability matrix is kept between forward and backward.

Everything is computed in fp32 (inputs are upcast; outputs are fp32); fp64 inputs stay fp64.

Shape letters: B batch, N heads, G K/V groups (grouped-query attention; G = N without it),
Q query rows of the block, K key rows of the block, D head dim (of q and k; v's may differ, as
in latent attention: the output then has v's).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

SKIP, DIAG, FULL = "skip", "diag", "full"


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulation dtype for inputs of `dtype`: fp32, or fp64 for fp64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def _up(x: torch.Tensor) -> torch.Tensor:
    return x.to(acc_dtype(x.dtype))


def check_qkv_shapes(q_BNSD: torch.Tensor, k_BGSD: torch.Tensor, v_BGSD: torch.Tensor) -> int:
    """N / G, the query heads per K/V group, after checking q [B, N, S, D], k [B, G, S, D] and
    v [B, G, S, Dv] (same B, S; q and k share D; v's head width Dv may differ, as in latent
    attention; G divides N)."""
    if q_BNSD.dim() != 4 or k_BGSD.shape[:3] != v_BGSD.shape[:3] or k_BGSD.dim() != 4 or v_BGSD.dim() != 4:
        raise ValueError(f"q must be [B, N, S, D], k [B, G, S, D] and v [B, G, S, Dv]; got "
                         f"{tuple(q_BNSD.shape)}, {tuple(k_BGSD.shape)}, {tuple(v_BGSD.shape)}")
    (B, N, S, D), G = q_BNSD.shape, k_BGSD.shape[1]
    if (k_BGSD.shape[0], k_BGSD.shape[2], k_BGSD.shape[3]) != (B, S, D) or N % G:
        raise ValueError(f"k {tuple(k_BGSD.shape)} must share q's B, S, D {tuple(q_BNSD.shape)} "
                         f"with K/V groups G dividing the heads N")
    return N // G


def repeat_kv(x_BGKD: torch.Tensor, rep: int) -> torch.Tensor:
    """[B, G, K, D] -> [B, G*rep, K, D]: query head n reads group n // rep (as SDPA's enable_gqa)."""
    if rep == 1:
        return x_BGKD
    B, G, K, D = x_BGKD.shape
    return x_BGKD[:, :, None].expand(B, G, rep, K, D).reshape(B, G * rep, K, D)


def sum_kv_groups(dx_BNKD: torch.Tensor, rep: int) -> torch.Tensor:
    """The gradient of repeat_kv: [B, N, K, D] -> [B, N/rep, K, D], summed over each group's heads."""
    if rep == 1:
        return dx_BNKD
    B, N, K, D = dx_BNKD.shape
    return dx_BNKD.view(B, N // rep, rep, K, D).sum(2)


def chunk_relation(q_chunk: int, k_chunk: int) -> str:
    """Causal relation between global chunk indices of equal length: key chunk after the query
    chunk -> SKIP (fully masked, nothing computed), same chunk -> DIAG (causal mask inside),
    key chunk before -> FULL (every key visible, no mask)."""
    if k_chunk > q_chunk:
        return SKIP
    return DIAG if k_chunk == q_chunk else FULL


def _scores(q_BNQD: torch.Tensor, k_BNKD: torch.Tensor, scale: float,
            causal: bool) -> torch.Tensor:
    """scores_BNQK = q k^T * scale in fp32; with `causal` (Q == K, a diagonal block) the entries
    above the diagonal are -inf."""
    scores_BNQK = torch.matmul(_up(q_BNQD), _up(k_BNKD).transpose(-1, -2)) * scale
    if causal:
        Q, K = scores_BNQK.shape[-2:]
        above_QK = torch.ones(Q, K, dtype=torch.bool, device=scores_BNQK.device).triu_(1)
        scores_BNQK = scores_BNQK.masked_fill(above_QK, float("-inf"))
    return scores_BNQK


def block_forward(q_BNQD: torch.Tensor, k_BNKD: torch.Tensor, v_BNKD: torch.Tensor, *,
                  scale: float, causal: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of one block: (out_BNQD, lse_BNQ), both fp32.

    out = softmax(q k^T * scale [+ causal mask]) v, normalised within this block only;
    lse = log sum_k exp(scores): what merge_partial needs to combine blocks exactly."""
    scores_BNQK = _scores(q_BNQD, k_BNKD, scale, causal)
    lse_BNQ = torch.logsumexp(scores_BNQK, dim=-1)
    probs_BNQK = torch.exp(scores_BNQK - lse_BNQ.unsqueeze(-1))
    out_BNQD = torch.matmul(probs_BNQK, _up(v_BNKD))
    return out_BNQD, lse_BNQ


def merge_partial(out_BNQD: Optional[torch.Tensor], lse_BNQ: Optional[torch.Tensor],
                  block_out_BNQD: torch.Tensor, block_lse_BNQ: torch.Tensor
                  ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Online-softmax merge of an accumulated (out, lse) with one more block's (out, lse).

    lse' = log(e^lse + e^lse_blk);  out' = out e^(lse - lse') + out_blk e^(lse_blk - lse').
    An accumulator of None (no block yet) takes the block as is. Every row that reaches here
    has a finite lse (a diagonal block row always sees its own key), so no -inf - -inf."""
    if out_BNQD is None:
        return block_out_BNQD, block_lse_BNQ
    new_lse_BNQ = torch.logaddexp(lse_BNQ, block_lse_BNQ)
    out_BNQD = (out_BNQD * torch.exp(lse_BNQ - new_lse_BNQ).unsqueeze(-1)
                + block_out_BNQD * torch.exp(block_lse_BNQ - new_lse_BNQ).unsqueeze(-1))
    return out_BNQD, new_lse_BNQ


def merge_into(out_BNQD: torch.Tensor, lse_BNQ: torch.Tensor, block_out_BNQD: torch.Tensor,
               block_lse_BNQ: torch.Tensor) -> None:
    """merge_partial in place into accumulators (views of the rows the block covers; fp32, or
    fp64): out is rescaled and added to, lse replaced. An empty row (lse -inf, out 0) takes the
    block as is; the block's rows always have a finite lse (no -inf - -inf)."""
    new_lse_BNQ = torch.logaddexp(lse_BNQ, block_lse_BNQ.to(lse_BNQ.dtype))
    out_BNQD.mul_(torch.exp(lse_BNQ - new_lse_BNQ).unsqueeze(-1))
    out_BNQD.add_(block_out_BNQD.to(out_BNQD.dtype) * torch.exp(block_lse_BNQ - new_lse_BNQ).unsqueeze(-1))
    lse_BNQ.copy_(new_lse_BNQ)


def softmax_delta(out_BNQD: torch.Tensor, dout_BNQD: torch.Tensor) -> torch.Tensor:
    """delta_BNQ = rowsum(dout * out) in fp32: the softmax backward's per-row correction,
    computed once from the final (merged) output."""
    return (_up(dout_BNQD) * _up(out_BNQD)).sum(dim=-1)


def block_backward(q_BNQD: torch.Tensor, k_BNKD: torch.Tensor, v_BNKD: torch.Tensor,
                   dout_BNQD: torch.Tensor, lse_BNQ: torch.Tensor, delta_BNQ: torch.Tensor, *,
                   scale: float, causal: bool
                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one block's share of the merged attention: (dq_BNQD, dk_BNKD, dv_BNKD) fp32.

    With the FINAL lse of the query rows, p = exp(scores - lse) is this block's slice of the
    global softmax, so per-block grads sum to the full gradient:
      dv = p^T dout;  dp = dout v^T;  ds = p (dp - delta);  dq = ds k scale;  dk = ds^T q scale."""
    scores_BNQK = _scores(q_BNQD, k_BNKD, scale, causal)
    probs_BNQK = torch.exp(scores_BNQK - lse_BNQ.unsqueeze(-1))
    dout_BNQD = _up(dout_BNQD)
    dv_BNKD = torch.matmul(probs_BNQK.transpose(-1, -2), dout_BNQD)
    dprobs_BNQK = torch.matmul(dout_BNQD, _up(v_BNKD).transpose(-1, -2))
    dscores_BNQK = probs_BNQK * (dprobs_BNQK - delta_BNQ.unsqueeze(-1))
    dq_BNQD = torch.matmul(dscores_BNQK, _up(k_BNKD)) * scale
    dk_BNKD = torch.matmul(dscores_BNQK.transpose(-1, -2), _up(q_BNQD)) * scale
    return dq_BNQD, dk_BNKD, dv_BNKD
