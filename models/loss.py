"""The token cross entropy on one TP rank: mean over B*S tokens, in fp32, from the head's logits
as its GEMM made them (bf16 under bf16 autocast, fp32 otherwise).

Two spellings of the same math:
  - `token_loss` (eager): one autograd Function over row blocks of at most CHUNK_BYTES of fp32
    (`chunk_rows`), so no fp32 copy of the whole [T, V] logits exists: forward each block's
    fp32 upcast and log-sum-exp, loss = mean(lse - the targets' logits); it keeps the logits as
    they came (bf16 under bf16 autocast) and the rows' lse for backward, which writes the
    logits' gradient (softmax - one-hot) x g / T block by block straight in the logits' dtype:
    exp(logits - lse) in fp32, the one-hot's subtraction at one entry a row, one product into
    the output. At llama3_1b's 128,256-entry vocabulary and 8,192 tokens a microbatch (bf16):
    2.1 GB kept for backward (autograd's F.cross_entropy(logits.float()) keeps the 4.2 GB fp32
    log-softmax) and at most 1 GiB of fp32 at a time (autograd's: the fp32 copy, the
    log-softmax, a zeroed fp32 gradient and the log-softmax's backward, 4.2 GB each); ~34
    bytes moved per logit against autograd's ~48.
  - `cross_entropy` (F.cross_entropy of the upcast logits): what train.compile's `loss` region
    compiles (models/fused.py), where inductor fuses the upcast, log-softmax and pick into one
    reduction over the bf16 logits and the backward into one kernel (~8 bytes per logit, the
    bf16 logits kept instead of the fp32 log-softmax). Also the tests' reference.

Under TP the vocabulary-parallel loss (tensor_parallel/cross_entropy.py) is used instead.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def cross_entropy(logits_BSV: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
    """F.cross_entropy over the fp32 upcast of the logits (mean over B*S tokens)."""
    V = logits_BSV.shape[-1]
    return F.cross_entropy(logits_BSV.float().reshape(-1, V), targets_BS.reshape(-1))


# Rows of the [tokens, vocabulary] logits the eager loss upcasts to fp32 at a time: at most this
# many bytes of fp32 (1 GiB: llama3_1b's 8,192 tokens a microbatch at 128,256 entries go in 4
# row blocks, gpt_125m's in 2; a tiny model's in one).
CHUNK_BYTES = 2**30


def chunk_rows(tokens: int, vocab: int) -> int:
    """Rows of one block of the eager loss: its fp32 copy within CHUNK_BYTES (at least one row)."""
    return max(1, min(tokens, CHUNK_BYTES // (4 * vocab)))


def _blocks(T: int, rows: int):
    """Row slices of the blocks; None when one block takes every row (no views to make)."""
    return None if rows >= T else [slice(a, min(T, a + rows)) for a in range(0, T, rows)]


def _softmax_minus_onehot(out, logits, lse_1, targets_1, scale) -> None:
    """out = (softmax - one-hot) x scale for rows of logits (lse_1, targets_1: [rows, 1])."""
    p = torch.sub(logits, lse_1).exp_()  # the softmax, in fp32
    p.scatter_add_(1, targets_1, torch.full_like(lse_1, -1.0))  # one entry per row
    torch.mul(p, scale, out=out)


class _TokenCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_TV: torch.Tensor, targets_T: torch.Tensor) -> torch.Tensor:
        T, V = logits_TV.shape
        blocks = _blocks(T, chunk_rows(T, V))
        if blocks is None:
            lse_T = torch.logsumexp(logits_TV.float(), dim=-1)
        else:  # each row block's fp32 copy lives for its logsumexp only
            lse_T = torch.empty(T, dtype=torch.float32, device=logits_TV.device)
            for rows in blocks:
                torch.logsumexp(logits_TV[rows].float(), dim=-1, out=lse_T[rows])
        ctx.save_for_backward(logits_TV, lse_T, targets_T)
        # - log softmax at the targets: lse - their logits (a bf16 logit widens exactly)
        return lse_T.sub(logits_TV.gather(1, targets_T[:, None]).squeeze(1)).mean()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        logits_TV, lse_T, targets_T = ctx.saved_tensors
        T, V = logits_TV.shape
        scale = grad / T
        grad_TV = torch.empty_like(logits_TV)
        lse_T1, targets_T1 = lse_T[:, None], targets_T[:, None]
        blocks = _blocks(T, chunk_rows(T, V))
        if blocks is None:
            _softmax_minus_onehot(grad_TV, logits_TV, lse_T1, targets_T1, scale)
        else:
            for rows in blocks:
                _softmax_minus_onehot(grad_TV[rows], logits_TV[rows], lse_T1[rows], targets_T1[rows], scale)
        return grad_TV, None


def token_loss(logits_BSV: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
    """Mean token cross entropy in fp32 over B*S tokens from logits of any float dtype; the
    logits' gradient comes back in their own dtype."""
    V = logits_BSV.shape[-1]
    return _TokenCrossEntropy.apply(logits_BSV.reshape(-1, V), targets_BS.reshape(-1))
