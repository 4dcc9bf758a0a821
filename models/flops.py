"""Training FLOPs per token of a model's keys, Megatron/PaLM style (the figure MFU and the
estimate divide by): the blocks' GEMMs, the attention core, the output head and the MTP depths."""
from __future__ import annotations

from mpoverlap.models import layers
from mpoverlap.models.gpt import is_moe_layer
from mpoverlap.models.init import padded_vocab_size, qkv_rows
from mpoverlap.models.mla import latent_attention_matmul_params


def flops_per_token(cfg) -> float:
    """Training FLOPs per token (forward + backward = 3x forward), Megatron/PaLM style.

    6 * N_matmul + 12 * L * H * S, where
      N_matmul = L * (A + m H F) + H * Vpad       (A = qkv (N + 2G) D H + proj H^2, 4H^2
                                                  without GQA; m = 3 swiglu, 2 gelu;
                                                  the output head; the embedding lookup is free)
      12 L H S: attention scores (QK^T) and values (AV), 2 * 2 S H per token and layer forward,
                times 3; the causal mask is not discounted (as Megatron reports it).
    MoE layers count the ACTIVE parameters: top_k experts of width moe_ffn (+ the shared
    expert of its own width) and the router H * E, instead of the dense m H F.
    MLA (model.attention=mla): A = its projections (models/mla.py); scores and values take
    2 * 2 S N (n + p) and 2 * 2 S N v (the query/key and value head widths differ).
    """
    H, L, S = cfg.hidden_size, cfg.num_layers, cfg.seq_length
    vpad = padded_vocab_size(cfg.vocab_size, cfg.make_vocab_size_divisible_by)
    n_matmul = sum(block_matmul_params(cfg, i) for i in range(L)) + H * vpad
    return float(6 * n_matmul + L * attention_core_flops(cfg)) + mtp_flops_per_token(cfg)


def attention_core_flops(cfg) -> float:
    """Training FLOPs per token of one layer's attention scores and values: 12 S N D (multi-head),
    or 2 * 2 S N (n + p) + 2 * 2 S N v times 3 under MLA (query/key and value widths differ)."""
    S = cfg.seq_length
    if getattr(cfg, "attention", "mha") == "mla":
        return float(6 * cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim) * S)
    return float(12 * qkv_rows(cfg)[0] * S)


def block_matmul_params(cfg, i: int) -> int:
    """The active GEMM parameters of the block at layer index i (see flops_per_token)."""
    H, Fh = cfg.hidden_size, cfg.ffn_hidden_size
    m = 3 if cfg.activation == "swiglu" else 2
    if getattr(cfg, "attention", "mha") == "mla":
        attn = latent_attention_matmul_params(cfg)
    else:
        attn = sum(qkv_rows(cfg)) * H + qkv_rows(cfg)[0] * H
    if not is_moe_layer(cfg, i):
        return attn + m * H * Fh
    shared = layers.shared_expert_ffn(cfg) if cfg.shared_expert else 0
    return attn + m * H * (layers.moe_ffn(cfg) * cfg.moe_top_k + shared) + H * cfg.num_experts


def mtp_flops_per_token(cfg) -> float:
    """Training FLOPs per token of the MTP depths (models/mtp.py), as flops_per_token counts a
    layer: each depth's block (at layer index num_layers + d), its eh_proj 2 H^2 and the output
    head H Vpad it runs again, times 6, plus its attention core."""
    H = cfg.hidden_size
    vpad = padded_vocab_size(cfg.vocab_size, cfg.make_vocab_size_divisible_by)
    depths = range(cfg.num_layers, cfg.num_layers + getattr(cfg, "mtp_num_layers", 0))
    return float(sum(6 * (block_matmul_params(cfg, i) + 2 * H * H + H * vpad) + attention_core_flops(cfg)
                     for i in depths))
