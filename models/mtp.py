"""Multi-token prediction (DeepSeek-V3's MTP, Megatron's `mtp_num_layers`): model.mtp_num_layers
extra depths, each predicting one token further ahead, their loss added to the LM loss times
model.mtp_loss_scale.

Depth d = 1..D at position t (h_0 = the main model's last block output, before its final norm):
    e_d   = embedding(token t + d)                               (the model's own embedding)
    h_d   = Block_d(eh_proj_d([hidden_norm_d(h_{d-1}) ; embed_norm_d(e_d)]))   eh_proj: 2H -> H
    loss_d = mean over the valid positions of CE(head(final_norm_d(h_d)), token t + d + 1)
with the model's own output head (tied or not). A position whose target lies past the window
(t + d + 1 > S) is masked: it has no loss, and causal attention keeps what it holds away from
every valid position. The MTP loss is the mean of the depths' losses (Megatron: the sum times
mtp_loss_scaling_factor / mtp_num_layers); the trained loss is LM + mtp_loss_scale * MTP.

Where the depths run: in the model (chunk) with the head, which hands them h_0 in its forward
(GPT.run_mtp); with parallel.mtp_stage=0 in a loop pipeline schedule in a chunk of their own on
stage 0 (models/mtp_chunk.py), h_0 sent there by the head's stage.

Token ids come in with the targets: `mtp_targets` [B, S, 1 + D] holds, in column j, the token
t + 1 + j of the window (-1 past its end), built from the whole window before any context-
parallel split (Trainer._split, `mtp_targets`). Depth d's input tokens are column d - 1 and
its targets column d, so a shift that crosses a context-parallel shard (the zig-zag halves of
context_parallel/split.py) needs no communication. Under sequence parallelism the token ids are
the whole (cp-local) sequence on every tp rank, as the embedding and the vocab-parallel loss
take them.

Normalisation: a rank holds S_local of the S positions of its B sequences (S_local = S under
tp alone). loss_d(rank) = sum of its valid CE / (B S_local) * S / (S - d), so the mean over the
context-parallel ranks (which the dp x cp gradient average takes, as for the LM loss) is the
single process's mean over the B (S - d) valid positions; no count is exchanged.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from mpoverlap.models import layers
from mpoverlap.wgrad.functions import Linear


def mtp_targets(window_BS1: torch.Tensor, depths: int) -> torch.Tensor:
    """Windows [B, S + 1] -> [B, S, 1 + depths]: column j = window[:, t + 1 + j], -1 past the end."""
    B, S1 = window_BS1.shape
    pad = window_BS1.new_full((B, depths), -1)
    padded = torch.cat([window_BS1, pad], dim=1)  # [B, S + 1 + D]
    return padded.unfold(1, 1 + depths, 1)[:, 1:S1]  # [B, S, 1 + D]: rows t = 1 .. S of the windows


def masked_token_loss_sum(logits_BSV: torch.Tensor, targets_BS: torch.Tensor, tp: Optional[dict]) -> torch.Tensor:
    """Sum of the token cross entropy (fp32) over the targets >= 0 (vocab-parallel under TP)."""
    valid = targets_BS >= 0
    safe = targets_BS.clamp_min(0)
    if layers.tp_size(tp) == 1:
        V = logits_BSV.shape[-1]
        per = F.cross_entropy(logits_BSV.float().reshape(-1, V), safe.reshape(-1), reduction="none")
    else:
        from mpoverlap.tensor_parallel import vocab_parallel_cross_entropy

        per = vocab_parallel_cross_entropy(logits_BSV, safe, tp_group=tp["tp_group"], tp_rank=tp["tp_rank"],
                                           tp_size=tp["tp_size"], ledger=tp.get("ledger")).reshape(-1)
    return (per * valid.reshape(-1).to(per.dtype)).sum()


class HeadCall(nn.Module):
    """The model's output head applied to a depth's normed hidden state, as a module call of
    the depth (no parameters of its own): a depth's use ends with it, so a ZeRO-3 unit
    (data_parallel/fsdp.py, `mtp_units`) holds the depth, the embedding and the head weights it
    reads from the depth's forward to its logits, and its output's gradient hook gathers them
    again before the head's backward."""

    def forward(self, x_BSH: torch.Tensor, project) -> torch.Tensor:
        return project(x_BSH)


class MTPDepth(nn.Module):
    """One depth: the two norms, the 2H -> H projection, one Block and the depth's final norm.
    `block` is the model's Block class built with the main layers' arguments (its layer index
    cfg.num_layers + d - 1 decides dense or MoE as for a main layer). `logits(h, project)`
    gives the depth's logits through the model's head `project`."""

    def __init__(self, cfg, make_norm, block: nn.Module) -> None:
        super().__init__()
        H = cfg.hidden_size
        self.hidden_norm, self.embed_norm = make_norm(cfg), make_norm(cfg)
        self.eh_proj = Linear(2 * H, H, bias=False)
        self.block = block
        self.final_norm = make_norm(cfg)
        self.head_call = HeadCall()

    def logits(self, h_BSH, project):
        return self.head_call(self.final_norm(h_BSH), project)

    def forward(self, h_BSH, tokens_BS, embed, cos_SD, sin_SD):
        e_BSH = embed(tokens_BS)
        x_BSH = self.eh_proj(torch.cat([self.hidden_norm(h_BSH), self.embed_norm(e_BSH).to(h_BSH.dtype)], dim=-1))
        return self.block(x_BSH, cos_SD, sin_SD)


def mtp_loss(depths: nn.ModuleDict, h_BSH: torch.Tensor, targets_BSJ: torch.Tensor, cos_SD, sin_SD, *,
             embed, project, tp: Optional[dict], seq_length: int) -> torch.Tensor:
    """The mean over the depths of each depth's masked mean token loss (see the module
    docstring). `embed(tokens)` is the model's embedding lookup, called inside each depth's
    forward (so a ZeRO-3 unit holding the depth holds the embedding it reads), `project(x)` its
    output head (logits without a final norm)."""
    B, S_local = targets_BSJ.shape[:2]
    total = None
    for j, depth in enumerate(depths.values(), start=1):  # one entry per depth (model.mtp_num_layers)
        h_BSH = depth(h_BSH, targets_BSJ[..., j - 1].clamp_min(0), embed, cos_SD, sin_SD)
        loss_sum = masked_token_loss_sum(depth.logits(h_BSH, project), targets_BSJ[..., j], tp)
        loss_d = loss_sum * (seq_length / ((seq_length - j) * B * S_local))
        total = loss_d if total is None else total + loss_d
    return total / len(depths)


def mtp_parameters(cfg, block_params: int) -> int:
    """Parameters of one depth beside its block (block_params): three norms and eh_proj
    (2 H^2); the embedding and head are the model's own."""
    H = cfg.hidden_size
    norm = H if cfg.norm == "rmsnorm" else 2 * H
    return 3 * norm + 2 * H * H + block_params
