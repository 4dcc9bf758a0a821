"""Layout-independent initial values: every parameter drawn, as a full tensor, from its own
generator seeded by (seed, name). A sharded layer calls `init_tensor` with the same name and
full shape and slices its part, so initial weights never depend on the layout."""
from __future__ import annotations

import math
import zlib

import torch

# Parameters that write into the residual stream get std = init_std / sqrt(2 * num_layers).
RESIDUAL_OUT_SUFFIXES = ("attn.proj.weight", "down.weight")


def padded_vocab_size(vocab_size: int, divisible_by: int) -> int:
    """vocab_size rounded up to a multiple of divisible_by (independent of the layout)."""
    if divisible_by <= 0:
        return vocab_size
    return -(-vocab_size // divisible_by) * divisible_by


def query_groups(cfg) -> int:
    """K/V heads G of grouped-query attention: model.num_query_groups, default (null) the
    number of attention heads (MHA). Query head n attends with K/V group n // (N / G)."""
    return int(getattr(cfg, "num_query_groups", None) or cfg.num_attention_heads)


def head_dim_of(cfg) -> int:
    """D, the width of each head: model.head_dim, default (null) hidden_size / heads."""
    return int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)


def qkv_rows(cfg) -> tuple:
    """Rows of the fused attn.qkv.weight: (N*D, G*D, G*D) for [q | k | v]."""
    head_dim = head_dim_of(cfg)
    groups = query_groups(cfg)
    return cfg.num_attention_heads * head_dim, groups * head_dim, groups * head_dim


def param_seed(seed: int, name: str) -> int:
    """Stable seed for one parameter: crc32 of "<seed>/<name>"; never python hash().

    32 bits on purpose: torch's CPU generator (mt19937) ignores the upper 32 bits of a seed.
    """
    return zlib.crc32(f"{int(seed)}/{name}".encode("utf-8"))


def init_tensor(name: str, shape, cfg, seed: int) -> torch.Tensor:
    """The full fp32 CPU initial value of parameter `name` with full `shape`.

    biases: zeros; 1-D weights (norms): ones; residual-output projections:
    normal(0, init_std / sqrt(2 L)); every other weight (embedding, qkv, mlp in, head):
    normal(0, init_std).
    """
    shape = tuple(shape)
    if name.endswith(".bias"):
        return torch.zeros(shape)
    if len(shape) == 1:
        return torch.ones(shape)
    std = cfg.init_std
    if name.endswith(RESIDUAL_OUT_SUFFIXES):
        std = cfg.init_std / math.sqrt(2.0 * cfg.num_layers)
    gen = torch.Generator(device="cpu").manual_seed(param_seed(seed, name))
    return torch.empty(shape).normal_(0.0, std, generator=gen)
