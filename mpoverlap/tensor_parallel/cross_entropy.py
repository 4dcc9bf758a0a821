"""Vocab-parallel cross entropy: per-token loss from logits split over the vocabulary.

logits_BSv: this rank's vocab slice [B, S, v], v = Vpad / tp, rank r owning vocab ids
[r*v, (r+1)*v) (the column-parallel output head's layout). Never gathers the full logits:

    m_BS   = all-reduce MAX of the local row max
    z_BS   = all-reduce SUM of sum_v exp(logit - m)          } one all-reduce of a
    t_BS   = all-reduce SUM of (target logit - m, owner only)  } stacked [2, B, S] tensor
    loss   = log z - t

Backward: grad_logits_BSv = (softmax - onehot(target)) * grad_loss, local, no communication,
written in the logits' dtype. Computed in fp32 from logits of any float dtype; matches
F.cross_entropy(full_logits.float(), reduction="none") on all Vpad columns.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from mpoverlap.tensor_parallel.comm_spec import TPComm, make_comm
from mpoverlap.tensor_parallel.mappings import all_reduce_async


class VocabParallelCrossEntropyFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_BSv, targets_BS, comm: TPComm):
        ctx.in_dtype = logits_BSv.dtype
        logits_BSv = logits_BSv.float()
        v = logits_BSv.shape[-1]
        max_BS = all_reduce_async(logits_BSv.amax(dim=-1), comm, op=dist.ReduceOp.MAX).wait()
        shifted_BSv = logits_BSv - max_BS.unsqueeze(-1)
        start = comm.rank * v
        outside_BS = (targets_BS < start) | (targets_BS >= start + v)
        local_BS = (targets_BS - start).masked_fill(outside_BS, 0)
        target_BS = shifted_BSv.gather(-1, local_BS.unsqueeze(-1)).squeeze(-1).masked_fill(outside_BS, 0.0)
        exp_BSv = shifted_BSv.exp_()
        stats_2BS = all_reduce_async(torch.stack([exp_BSv.sum(dim=-1), target_BS]), comm).wait()
        sum_exp_BS, target_BS = stats_2BS[0], stats_2BS[1]
        loss_BS = sum_exp_BS.log() - target_BS
        softmax_BSv = exp_BSv.div_(sum_exp_BS.unsqueeze(-1))
        ctx.save_for_backward(softmax_BSv, local_BS, outside_BS)
        return loss_BS

    @staticmethod
    def backward(ctx, grad_loss_BS):
        softmax_BSv, local_BS, outside_BS = ctx.saved_tensors
        onehot_BS1 = (~outside_BS).unsqueeze(-1).to(softmax_BSv.dtype)
        grad_BSv = softmax_BSv.scatter_add(-1, local_BS.unsqueeze(-1), -onehot_BS1)
        # the product written in the logits' dtype (bf16 logits: no fp32 result to cast back)
        out_BSv = grad_BSv if ctx.in_dtype == grad_BSv.dtype else torch.empty_like(grad_BSv, dtype=ctx.in_dtype)
        return torch.mul(grad_BSv, grad_loss_BS.unsqueeze(-1), out=out_BSv), None, None


def vocab_parallel_cross_entropy(logits_BSv: torch.Tensor, targets_BS: torch.Tensor, *,
                                 tp_group=None, tp_rank: int = 0, tp_size: int = 1,
                                 ledger=None) -> torch.Tensor:
    """logits_BSv [B, S, Vpad/tp] (full sequence), targets_BS int64 -> per-token loss_BS fp32."""
    if targets_BS.shape != logits_BSv.shape[:-1]:
        raise ValueError(f"targets {tuple(targets_BS.shape)} must match logits "
                         f"{tuple(logits_BSv.shape)} without the vocab dim")
    comm = make_comm(tp_group, tp_rank, tp_size, ledger=ledger)
    return VocabParallelCrossEntropyFn.apply(logits_BSv, targets_BS, comm)
