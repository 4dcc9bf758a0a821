"""The model's projections, built plain on one process or tensor-parallel when the model is
handed a TP context (the keyword arguments of `mpoverlap.tensor_parallel.tp_kwargs`).

The model code calls these and never branches on the layout itself; tensor-parallel layers
name their parameters exactly as the plain model does, so both start from the same weights.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from mpoverlap.models.loss import token_loss as eager_token_loss
# nn.Linear / nn.Embedding (same forward) whose weight gradient a zero-bubble pipeline can defer
from mpoverlap.wgrad.functions import Embedding, Linear, linear


def tp_size(tp: Optional[dict]) -> int:
    return 1 if tp is None else int(tp["tp_size"])


def column(name: str, in_features: int, out_features: int, cfg, seed: int, tp: Optional[dict],
           blocks: int = 1, bias: bool = False) -> nn.Module:
    """x [B, S(/tp with SP), in] -> y [B, S, out/tp]; `blocks` equal output blocks (qkv: 3) or
    their sizes; a bias is split over TP with its rows."""
    if tp_size(tp) == 1:
        return Linear(in_features, out_features, bias=bias)
    from mpoverlap.tensor_parallel import ColumnParallelLinear

    return ColumnParallelLinear(in_features, out_features, name=name, cfg=cfg, seed=seed, blocks=blocks, bias=bias,
                                **tp)


def row(name: str, in_features: int, out_features: int, cfg, seed: int, tp: Optional[dict]) -> nn.Module:
    """x [B, S, in/tp] -> y [B, S(/tp with SP), out], reduced over the TP group."""
    if tp_size(tp) == 1:
        return Linear(in_features, out_features, bias=False)
    from mpoverlap.tensor_parallel import RowParallelLinear

    return RowParallelLinear(in_features, out_features, name=name, cfg=cfg, seed=seed, **tp)


def embedding(vocab_padded: int, hidden: int, cfg, seed: int, tp: Optional[dict]) -> nn.Module:
    """tokens [B, S] -> x [B, S(/tp with SP), H]; rows split over TP."""
    if tp_size(tp) == 1:
        return Embedding(vocab_padded, hidden)
    from mpoverlap.tensor_parallel import VocabParallelEmbedding

    return VocabParallelEmbedding(vocab_padded, hidden, name="embedding", cfg=cfg, seed=seed, **tp)


def tied_head(x_BSH: torch.Tensor, embedding_module: nn.Module, tp: Optional[dict]) -> torch.Tensor:
    """Logits through the embedding matrix: [B, S, V] (or [B, S, V/tp] under TP)."""
    if tp_size(tp) == 1:
        return linear(x_BSH, embedding_module.weight, None, getattr(embedding_module, "wgrad", None))
    from mpoverlap.tensor_parallel import column_parallel_linear

    return column_parallel_linear(x_BSH, embedding_module.weight, None, embedding_module.comm)


def token_loss(logits_BSV: torch.Tensor, targets_BS: torch.Tensor, tp: Optional[dict], single=None) -> torch.Tensor:
    """Mean token cross entropy (fp32) from logits of any float dtype; under TP the logits stay
    split over the vocabulary. `single`: the one-rank loss (models/fused.py's `loss` region,
    compiled under train.compile), default eager."""
    if tp_size(tp) == 1:
        return (single or eager_token_loss)(logits_BSV, targets_BS)
    from mpoverlap.tensor_parallel import vocab_parallel_cross_entropy

    return vocab_parallel_cross_entropy(logits_BSV, targets_BS, tp_group=tp["tp_group"],
                                        tp_rank=tp["tp_rank"], tp_size=tp["tp_size"],
                                        ledger=tp.get("ledger")).mean()


def moe_ffn(cfg) -> int:
    """Each expert's hidden size: model.moe_ffn_hidden_size, default model.ffn_hidden_size."""
    return cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size


def shared_expert_ffn(cfg) -> int:
    """The shared expert's hidden size: model.moe_shared_expert_ffn_hidden_size, default the
    expert width (N shared experts of width F are one MLP of width N * F)."""
    return getattr(cfg, "moe_shared_expert_ffn_hidden_size", None) or moe_ffn(cfg)


def router_options(cfg) -> dict:
    """The router's scoring keys (see mpoverlap.moe.router.TopKRouter)."""
    return {"score": cfg.moe_router_score, "order": cfg.moe_router_order, "norm_topk": cfg.moe_router_norm_topk,
            "bias_update_rate": cfg.moe_router_bias_update_rate,
            "force_load_balancing": cfg.moe_router_force_load_balancing,
            "num_groups": cfg.moe_router_num_groups, "group_topk": cfg.moe_router_group_topk,
            "scaling_factor": cfg.moe_router_scaling_factor}


def moe_mlp(name: str, cfg, seed: int, moe: Optional[dict], shared_expert: Optional[nn.Module]) -> nn.Module:
    """x [B, S, H] -> (y [B, S, H], router output): a mixture of experts over the
    expert-parallel group of `moe` (one process when None). The layer's aux-loss gradient
    scale starts at 1 (the trainer sets 1 / microbatches)."""
    from mpoverlap.moe import build_moe_layer

    ctx = dict(moe or {"ep_group": None, "ep_size": 1, "ep_rank": 0, "overlap": False})
    layer = build_moe_layer(cfg.hidden_size, moe_ffn(cfg), cfg.num_experts, cfg.moe_top_k, name=name,
                            cfg=cfg, seed=seed, activation=cfg.activation, dispatcher=cfg.moe_dispatcher,
                            aux_loss_coeff=cfg.moe_aux_loss_coeff, z_loss_coeff=cfg.moe_z_loss_coeff,
                            capacity_factor=cfg.moe_capacity_factor, shared_expert=shared_expert,
                            router_options=router_options(cfg),
                            grouped_gemm=getattr(cfg, "moe_grouped_gemm", True), **ctx)
    layer.aux_loss_scale = 1.0
    return layer
