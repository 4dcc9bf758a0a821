"""Tensor-parallel modules: column-, row- and vocab-parallel, Megatron semantics.

Every module takes its communication explicitly (never global state):

    tp_group: ProcessGroup | None (None = a group of one), tp_rank, tp_size,
    tp_ranks: the group's global ranks in group order (p2p peers of collective matmul),
    sequence_parallel: bool, overlap: bool (overlap.tp), ledger: CommLedger | None

`tp_kwargs(state, sequence_parallel=..., overlap=..., ledger=...)` builds them from a
ParallelState. Initial weights do not depend on tp: each shard is sliced from the full
tensor `init_tensor(f"{name}.weight", full_shape, cfg, seed)`; `name` is the module's
parameter prefix in the reference GPT (e.g. "layers.0.attn.qkv").

Sequence-parallel layout: [B, S/tp, H], sequence on dim 1 (rank r holds positions
r*S/tp .. (r+1)*S/tp - 1).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from mpoverlap.models.init import init_tensor
from mpoverlap.precision.fp8_select import fp8_gemms
from mpoverlap.tensor_parallel.comm_spec import make_comm
from mpoverlap.tensor_parallel.linear_functions import column_parallel_linear, row_parallel_linear
from mpoverlap.tensor_parallel.mappings import (
    reduce_from_tensor_parallel_region, reduce_scatter_to_sequence_parallel)
from mpoverlap.wgrad.functions import embedding  # F.embedding unless a W deferral is attached


def block_sizes(n: int, blocks) -> tuple:
    """The sizes of the fused sub-blocks of a dimension of size n: `blocks` equal ones (an int),
    or the given sizes (a tuple, e.g. GQA's (N*D, G*D, G*D) for [q | k | v])."""
    if isinstance(blocks, int):
        if n % blocks:
            raise ValueError(f"dimension of size {n} does not split into {blocks} equal blocks")
        return (n // blocks,) * blocks
    sizes = tuple(int(b) for b in blocks)
    if sum(sizes) != n:
        raise ValueError(f"blocks {sizes} do not add up to the dimension's size {n}")
    return sizes


def shard_tensor(full: torch.Tensor, dim: int, rank: int, size: int, blocks=1) -> torch.Tensor:
    """Rank's part of `full` along `dim`. With several blocks the dim is made of sub-blocks
    (e.g. [q | k | v]; `blocks` a count of equal ones or a tuple of sizes); each is split over
    `size` ranks and the rank's pieces concatenated."""
    sizes = block_sizes(full.shape[dim], blocks)
    if any(b % size for b in sizes):
        raise ValueError(f"dimension {dim} of size {full.shape[dim]} does not split into blocks "
                         f"{sizes} x tp_size={size}")
    pieces, start = [], 0
    for b in sizes:
        pieces.append(full.narrow(dim, start + rank * (b // size), b // size))
        start += b
    return torch.cat(pieces, dim=dim).contiguous()


def _divide(n: int, size: int, what: str) -> int:
    if n % size:
        raise ValueError(f"{what}={n} is not divisible by tp_size={size}")
    return n // size


class _TPModule(nn.Module):
    def __init__(self, tp_group, tp_rank, tp_size, tp_ranks, sequence_parallel, overlap, ledger,
                 trace) -> None:
        super().__init__()
        self.comm = make_comm(tp_group, tp_rank, tp_size, tp_ranks, sequence_parallel, overlap,
                              ledger, trace)

    def _param(self, full: torch.Tensor, dim: Optional[int], blocks=1, **attrs) -> nn.Parameter:
        t = full if dim is None else shard_tensor(full, dim, self.comm.rank, self.comm.size, blocks)
        p = nn.Parameter(t)
        p.tensor_model_parallel = dim is not None  # sharded (else replicated over tp)
        p.partition_dim, p.partition_blocks = dim, blocks
        for k, v in attrs.items():
            setattr(p, k, v)
        return p


class ColumnParallelLinear(_TPModule):
    """y = x W^T (+ b), W [out, in] split by rows: local weight [out/tp, in].

    forward(x) -> y_BSo, o = out / tp:
        no SP: x_BSH replicated; backward all-reduces the input gradient.
        SP:    x_BsH sequence shard; forward all-gathers the sequence (or, with overlap, a
               collective-matmul ring), backward reduce-scatters the input gradient.
    `blocks` = the fused sub-blocks of the output dim: a count of equal ones (2 for gate_up
    [gate|up]) or their sizes (qkv [q|k|v]: (N*D, G*D, G*D), equal without GQA); the local
    output is then [q_r | k_r | v_r], each block's size / tp.
    forward(x, weight=...) uses another [out/tp, in] weight (the tied output head).
    `fp8_recipe` / `fp8_emulate`: its GEMMs in FP8 (precision/fp8_select.py; None = bf16).
    """

    fp8_recipe = None
    fp8_emulate = False

    def __init__(self, in_features: int, out_features: int, *, name: str, cfg, seed: int,
                 blocks=1, bias: bool = False, tp_group=None, tp_rank: int = 0,
                 tp_size: int = 1, tp_ranks=None, sequence_parallel: bool = False,
                 overlap: bool = False, ledger=None, trace=None) -> None:
        super().__init__(tp_group, tp_rank, tp_size, tp_ranks, sequence_parallel, overlap, ledger, trace)
        self.in_features, self.out_features, self.blocks = in_features, out_features, blocks
        self.out_features_per_rank = sum(_divide(b, tp_size, "out_features block")
                                         for b in block_sizes(out_features, blocks))
        full_w = init_tensor(f"{name}.weight", (out_features, in_features), cfg, seed)
        self.weight = self._param(full_w, 0, blocks)
        self.bias = (self._param(init_tensor(f"{name}.bias", (out_features,), cfg, seed), 0, blocks)
                     if bias else None)

    def forward(self, x: torch.Tensor, weight: Optional[torch.Tensor] = None) -> torch.Tensor:
        return column_parallel_linear(x, self.weight if weight is None else weight, self.bias, self.comm,
                                      fp8_gemms(self))

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features} (local {self.out_features_per_rank}), "
                f"blocks={self.blocks}, tp={self.comm.size}, sp={self.comm.sequence_parallel}, "
                f"overlap={self.comm.overlap}")


class RowParallelLinear(_TPModule):
    """y = x W^T (+ b), W [out, in] split by columns: local weight [out, in/tp].

    forward(x_BSi) with x partitioned on the last dim (i = in / tp, the column-parallel
    output) -> no SP: y_BSO all-reduced; SP: y_BsO reduce-scattered along the sequence (with
    overlap, a GEMM + reduce-scatter ring). The bias is replicated and added after the
    reduction; under SP its gradient is per-chunk (attribute `sequence_parallel=True`): sum
    it with allreduce_sequence_parallel_grads. `fp8_recipe` / `fp8_emulate`: as the column's.
    """

    fp8_recipe = None
    fp8_emulate = False

    def __init__(self, in_features: int, out_features: int, *, name: str, cfg, seed: int,
                 bias: bool = False, tp_group=None, tp_rank: int = 0, tp_size: int = 1,
                 tp_ranks=None, sequence_parallel: bool = False, overlap: bool = False,
                 ledger=None, trace=None) -> None:
        super().__init__(tp_group, tp_rank, tp_size, tp_ranks, sequence_parallel, overlap, ledger, trace)
        self.in_features, self.out_features = in_features, out_features
        self.in_features_per_rank = _divide(in_features, tp_size, "in_features")
        full_w = init_tensor(f"{name}.weight", (out_features, in_features), cfg, seed)
        self.weight = self._param(full_w, 1)
        self.bias = (self._param(init_tensor(f"{name}.bias", (out_features,), cfg, seed), None,
                                 sequence_parallel=sequence_parallel) if bias else None)

    def forward(self, x_BSi: torch.Tensor) -> torch.Tensor:
        return row_parallel_linear(x_BSi, self.weight, self.bias, self.comm, fp8_gemms(self))

    def extra_repr(self) -> str:
        return (f"in={self.in_features} (local {self.in_features_per_rank}), out={self.out_features}, "
                f"tp={self.comm.size}, sp={self.comm.sequence_parallel}, overlap={self.comm.overlap}")


class VocabParallelEmbedding(_TPModule):
    """Embedding [Vpad, H] split by rows: rank r owns tokens [r*Vpad/tp, (r+1)*Vpad/tp).

    forward(tokens_BS) -> no SP: x_BSH (all-reduced); SP: x_BsH (reduce-scattered).
    Tokens outside the local range look up row 0 and are zeroed before the reduction.
    The local weight [Vpad/tp, H] is also the tied output head's column-parallel weight.
    The output is fp32 under bf16 autocast too (the residual stream's dtype in every layout,
    as at tp 1): the reduction, and its gradient's in backward, run in fp32.
    """

    def __init__(self, num_embeddings_padded: int, hidden: int, *, name: str, cfg, seed: int,
                 tp_group=None, tp_rank: int = 0, tp_size: int = 1, tp_ranks=None,
                 sequence_parallel: bool = False, overlap: bool = False, ledger=None,
                 trace=None) -> None:
        super().__init__(tp_group, tp_rank, tp_size, tp_ranks, sequence_parallel, overlap, ledger, trace)
        self.num_embeddings, self.hidden = num_embeddings_padded, hidden
        per = _divide(num_embeddings_padded, tp_size, "num_embeddings_padded")
        self.vocab_start, self.vocab_end = tp_rank * per, (tp_rank + 1) * per
        full_w = init_tensor(f"{name}.weight", (num_embeddings_padded, hidden), cfg, seed)
        self.weight = self._param(full_w, 0)

    def forward(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        if self.comm.size == 1:
            x_BSH = embedding(tokens_BS, self.weight, self.comm.wgrad)
        else:
            outside_BS = (tokens_BS < self.vocab_start) | (tokens_BS >= self.vocab_end)
            local_BS = (tokens_BS - self.vocab_start).masked_fill(outside_BS, 0)
            x_BSH = embedding(local_BS, self.weight, self.comm.wgrad).masked_fill(outside_BS[..., None], 0.0)
        if self.comm.sequence_parallel:
            return reduce_scatter_to_sequence_parallel(x_BSH, self.comm)
        return reduce_from_tensor_parallel_region(x_BSH, self.comm)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.hidden}, local rows [{self.vocab_start}, "
                f"{self.vocab_end}), tp={self.comm.size}, sp={self.comm.sequence_parallel}")
