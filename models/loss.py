"""The token cross entropy on one TP rank: mean over B*S tokens, in fp32, from the head's logits
as its GEMM made them (bf16 under bf16 autocast, fp32 otherwise).

Two spellings of the same math:
  - `token_loss` (eager): one autograd Function. Forward as F.cross_entropy runs it (the fp32
    upcast, log-softmax, the targets' pick); backward writes the logits' gradient
    (softmax - one-hot) x g / T straight in the logits' dtype from the saved log-softmax: exp,
    the one-hot's subtraction at T entries, one product into the output's dtype. Autograd's
    path for F.cross_entropy(logits.float()) also fills a zeroed fp32 [T, V] gradient, reads it
    in the log-softmax backward and casts the fp32 result back: at llama3_1b's 128,256-entry
    vocabulary and 8,192 tokens a microbatch, ~48 bytes moved per logit against ~36 here (the
    fp32 log-softmax is kept for backward either way).
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


class _TokenCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_TV: torch.Tensor, targets_T: torch.Tensor) -> torch.Tensor:
        logp_TV = torch.log_softmax(logits_TV.float(), dim=-1)
        ctx.save_for_backward(logp_TV, targets_T)
        ctx.logits_dtype = logits_TV.dtype
        return F.nll_loss(logp_TV, targets_T)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        logp_TV, targets_T = ctx.saved_tensors
        p_TV = torch.exp(logp_TV)
        # the one-hot's subtraction: T entries, one per row
        p_TV.scatter_add_(1, targets_T[:, None], torch.full_like(p_TV[:, :1], -1.0))
        scale = grad / logp_TV.shape[0]
        if ctx.logits_dtype == p_TV.dtype:
            return p_TV.mul_(scale), None
        return torch.mul(p_TV, scale, out=torch.empty_like(p_TV, dtype=ctx.logits_dtype)), None


def token_loss(logits_BSV: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
    """Mean token cross entropy in fp32 over B*S tokens from logits of any float dtype; the
    logits' gradient comes back in their own dtype."""
    V = logits_BSV.shape[-1]
    return _TokenCrossEntropy.apply(logits_BSV.reshape(-1, V), targets_BS.reshape(-1))
