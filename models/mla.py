"""Multi-head latent attention (DeepSeek-V2/V3, `model.attention=mla`): keys and values are
up-projected per head from one small latent per token, beside one RoPE key shared by all heads.

Shape letters: B batch, S sequence, H hidden, N heads (local under TP), r the query latent
(model.q_lora_rank), c the key/value latent (model.kv_lora_rank), n = model.qk_nope_head_dim,
p = model.qk_rope_head_dim, v = model.v_head_dim; a query or key head is n + p wide, a value
head v wide.

  c_q   = q_a_layernorm(q_a_proj(x))                   [B, S, r]   (q_lora_rank 0: no latent,
  q     = q_b_proj(c_q) -> per head [q_nope | q_rope]  [B, S, N(n+p)]   q = q_proj(x))
  kv_a  = kv_a_proj_with_mqa(x) = [c_kv | k_rope]      [B, S, c + p]
  kv    = kv_b_proj(kv_a_layernorm(c_kv)) -> per head [k_nope | v]   [B, S, N(n+v)]
  q_h = [q_nope_h | RoPE(q_rope_h)], k_h = [k_nope_h | RoPE(k_rope)] (k_rope shared by every
  head), softmax scale 1 / sqrt(n + p) (SDPA's default for that width), y = proj(attn(q, k, v)).

The names and row layouts follow Hugging Face's DeepseekV3Attention (q_a_proj, q_a_layernorm,
q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj; `proj` is its o_proj, as attn.proj is
every other family's), but RoPE rotates halves (x[i], x[i + p/2]) where Hugging Face's DeepSeek-V3
rotates interleaved pairs: an imported checkpoint permutes the p rope rows of q_b_proj and
kv_a_proj_with_mqa once. YaRN's logit scale (mscale) is not applied.

Tensor parallelism: the down-projections (q_a_proj, kv_a_proj_with_mqa) and their norms are
replicated; q_b_proj (or q_proj) and kv_b_proj are column-parallel by heads (each head's rows
are contiguous), proj is row-parallel. With sequence parallelism the down-projections run on
this rank's S/tp positions of the hidden state, so what is all-gathered over the sequence is
only what the heads consume: the two latents (inside the column-parallel up-projections, as a
collective matmul under overlap.tp) and the shared RoPE key k_rope (p channels, here). The
replicated weights then see S/tp positions each and their gradients are summed over TP like
the norms' (GPT.sequence_parallel_params). Without SP every rank computes the same latents and
k_rope's gradient (a partial sum over this rank's heads) is all-reduced over TP.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from mpoverlap.models import layers
from mpoverlap.models.init import head_dim_of
from mpoverlap.models.rope import apply_rope_qk
from mpoverlap.recompute import recomputed


class LatentAttention(nn.Module):
    def __init__(self, cfg, prefix: str = "attn", seed: int = 1234, core_attention=None,
                 tp: Optional[dict] = None, math: Optional[dict] = None):
        super().__init__()
        self.math = math  # train.compile: the compiled regions (models/fused.py), else None
        H, N = cfg.hidden_size, cfg.num_attention_heads
        if N % layers.tp_size(tp):
            raise ValueError(f"model.num_attention_heads={N} must be divisible by parallel.tp={layers.tp_size(tp)}")
        self.num_heads = N // layers.tp_size(tp)
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_rank = cfg.kv_lora_rank
        qk = self.nope + self.rope
        # q [B, N, S, n+p], k [B, N, S, n+p], v [B, N, S, v] -> y [B, N, S, v] (context
        # parallelism hands in ring or all-to-all attention here).
        self.core_attention = core_attention
        self.recompute_core = getattr(cfg, "recompute", "none") == "selective"
        if cfg.q_lora_rank:
            self.q_a_proj = layers.Linear(H, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = nn.RMSNorm(cfg.q_lora_rank, eps=cfg.norm_eps)
            self.q_b_proj = layers.column(f"{prefix}.q_b_proj", cfg.q_lora_rank, N * qk, cfg, seed, tp)
        else:
            self.q_proj = layers.column(f"{prefix}.q_proj", H, N * qk, cfg, seed, tp)
        self.kv_a_proj_with_mqa = layers.Linear(H, self.kv_rank + self.rope, bias=False)
        self.kv_a_layernorm = nn.RMSNorm(self.kv_rank, eps=cfg.norm_eps)
        self.kv_b_proj = layers.column(f"{prefix}.kv_b_proj", self.kv_rank, N * (self.nope + self.v_dim),
                                       cfg, seed, tp)
        self.proj = layers.row(f"{prefix}.proj", N * self.v_dim, H, cfg, seed, tp)
        self.tp = tp if layers.tp_size(tp) > 1 else None

    def forward(self, x_BSH: torch.Tensor, cos_Sp: torch.Tensor, sin_Sp: torch.Tensor) -> torch.Tensor:
        """x_BSH -> y_BSH (under SP x and y hold S/tp positions, the heads all S)."""
        if hasattr(self, "q_a_proj"):
            q_BSq = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_BSH)))
        else:
            q_BSq = self.q_proj(x_BSH)
        c_kv_BSc, k_rope_BSp = self.kv_a_proj_with_mqa(x_BSH).split([self.kv_rank, self.rope], dim=-1)
        kv_BSk = self.kv_b_proj(self.kv_a_layernorm(c_kv_BSc))
        k_rope_BSp = self._shared_rope_key(k_rope_BSp)
        B, S, _ = q_BSq.shape
        N = self.num_heads
        q_nope_BSNn, q_rope_BSNp = q_BSq.view(B, S, N, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        k_nope_BSNn, v_BSNv = kv_BSk.view(B, S, N, self.nope + self.v_dim).split([self.nope, self.v_dim], dim=-1)
        rope = self.math["rope"] if self.math is not None else apply_rope_qk
        q_rope_BNSp, k_rope_B1Sp = rope(q_rope_BSNp.transpose(1, 2), k_rope_BSp.view(B, S, 1, self.rope).transpose(1, 2),
                                        cos_Sp, sin_Sp)
        q_BNSd = torch.cat([q_nope_BSNn.transpose(1, 2), q_rope_BNSp], dim=-1)
        k_BNSd = torch.cat([k_nope_BSNn.transpose(1, 2), k_rope_B1Sp.expand(B, N, S, self.rope)], dim=-1)
        v_BNSv = v_BSNv.transpose(1, 2)
        if self.recompute_core:
            y_BNSv = recomputed(self.core_attention, q_BNSd, k_BNSd, v_BNSv)
        else:
            y_BNSv = self.core_attention(q_BNSd, k_BNSd, v_BNSv)
        return self.proj(y_BNSv.transpose(1, 2).reshape(B, S, N * self.v_dim))

    def _shared_rope_key(self, k_rope_BSp: torch.Tensor) -> torch.Tensor:
        """k_rope for every position the heads attend over: all-gathered over the sequence under
        SP (its gradient reduce-scattered), else the replicated tensor whose gradient (this rank's
        heads only) is all-reduced over TP."""
        if self.tp is None:
            return k_rope_BSp
        from mpoverlap.tensor_parallel import copy_to_tensor_parallel_region, gather_from_sequence_parallel

        comm = self.kv_b_proj.comm
        if comm.sequence_parallel:
            return gather_from_sequence_parallel(k_rope_BSp, comm, grad_is_partial=True)
        return copy_to_tensor_parallel_region(k_rope_BSp, comm)


def rope_dim(cfg) -> int:
    """The width RoPE rotates per head: model.qk_rope_head_dim under MLA, else the head dim."""
    return cfg.qk_rope_head_dim if getattr(cfg, "attention", "mha") == "mla" else head_dim_of(cfg)


def latent_attention_matmul_params(cfg) -> int:
    """Weights of one MLA layer's GEMMs (its norms excluded)."""
    H, N = cfg.hidden_size, cfg.num_attention_heads
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    q = (H * cfg.q_lora_rank + cfg.q_lora_rank * N * qk) if cfg.q_lora_rank else H * N * qk
    kv = H * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank * N * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    return q + kv + N * cfg.v_head_dim * H
