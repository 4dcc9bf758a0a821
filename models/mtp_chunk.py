"""The multi-token prediction depths as a pipeline chunk of their own (the loop_mtp layout,
pipeline/actions.py: parallel.mtp_stage=0 in a loop schedule, the head on the last stage).

MTPChunk takes h_0, the head chunk's last block output before its final norm (what GPT.run_mtp
takes), received from the head's stage, and returns the MTP loss (models/mtp.py). It holds the
depths and copies of what they read from the main model: the embedding (the depths look their
input tokens up in it) and, for an untied head, the output layer; a tied head is the embedding
copy. The copies have the main model's names, so they start equal to the originals, and are
marked `pipeline_duplicate` (counted once in norms and checkpoints); the trainer sums each copy's
gradient with its original's (training/pipeline_ties.py). The depths' weights are drawn by their
global names (`mtp.<d>.…`), as on the single process.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from mpoverlap.models import layers
from mpoverlap.models.gpt import MLP, Block, causal_sdpa, make_norm
from mpoverlap.models.init import init_tensor, padded_vocab_size
from mpoverlap.models.mla import rope_dim
from mpoverlap.models.mtp import MTPDepth, mtp_loss
from mpoverlap.models.rope import rope_cos_sin, rope_scaling_of


class MTPChunk(nn.Module):
    """The MTP depths with their copies of the embedding (and an untied output layer)."""

    pre_process, post_process = False, False
    is_mtp_chunk = True

    def __init__(self, cfg, seed: int = 1234, core_attention=causal_sdpa, tp: Optional[dict] = None,
                 moe: Optional[dict] = None, compile_backend: Optional[str] = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp = tp if layers.tp_size(tp) > 1 else None
        self.vocab_size = padded_vocab_size(cfg.vocab_size, cfg.make_vocab_size_divisible_by)
        self.embedding = layers.embedding(self.vocab_size, cfg.hidden_size, cfg, seed, self.tp)
        self.output = (None if cfg.tie_embeddings
                       else layers.column("output", cfg.hidden_size, self.vocab_size, cfg, seed, self.tp))
        self.layers = nn.ModuleDict()  # none of the main model's (code walking chunks' blocks reads it)
        L = cfg.num_layers
        self.mtp = nn.ModuleDict({str(d): MTPDepth(cfg, make_norm, Block(
            cfg, f"mtp.{d}.block", seed, core_attention, self.tp, moe, L + d, compile_backend))
            for d in range(cfg.mtp_num_layers)})
        self.init_weights(seed)
        for module in (self.embedding, self.output):
            for p in (module.parameters() if module is not None else ()):
                p.pipeline_duplicate = True  # counted once, where the main model holds it

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """As GPT.init_weights: every parameter from its name (the copies equal the originals)."""
        for name, p in self.named_parameters():
            if not hasattr(p, "tensor_model_parallel") and not hasattr(p, "expert_names"):
                p.copy_(init_tensor(name, p.shape, self.cfg, seed))

    def project(self, x_BSH: torch.Tensor) -> torch.Tensor:
        """The output head (tied: the embedding copy), as GPT.project."""
        if self.output is None:
            return layers.tied_head(x_BSH, self.embedding, self.tp)
        return self.output(x_BSH)

    def forward(self, h_BSH: torch.Tensor, position_ids: torch.Tensor, mtp_targets: torch.Tensor) -> torch.Tensor:
        """The MTP loss (the mean over the depths, unscaled) of h_0 = `h_BSH`."""
        cos_SD, sin_SD = rope_cos_sin(position_ids, rope_dim(self.cfg), self.cfg.rope_base, rope_scaling_of(self.cfg))
        return mtp_loss(self.mtp, h_BSH, mtp_targets, cos_SD.to(h_BSH.dtype), sin_SD.to(h_BSH.dtype),
                        embed=self.embedding.forward, project=self.project, tp=self.tp,
                        seq_length=self.cfg.seq_length)

    def foreign_reads(self) -> list:
        """As GPT.foreign_reads: each depth reads the embedding copy."""
        return [(depth, list(self.embedding.parameters())) for depth in self.mtp.values()]

    def moe_layers(self) -> list:
        return [d.block.mlp for d in self.mtp.values() if not isinstance(d.block.mlp, MLP)]

    def sequence_parallel_params(self) -> list:
        """As GPT.sequence_parallel_params, for the depths and copies."""
        if self.tp is None:
            return []
        if not self.tp["sequence_parallel"]:
            return [p for d in self.mtp.values() if getattr(d.block.attn, "q_norm", None) is not None
                    for p in (*d.block.attn.q_norm.parameters(), *d.block.attn.k_norm.parameters())]
        return [p for p in self.parameters() if not getattr(p, "tensor_model_parallel", False)]
