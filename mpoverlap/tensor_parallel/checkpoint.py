"""Full (unsharded) tensors for checkpoints, and back: checkpoints never depend on tp.

A tensor-parallel parameter carries `partition_dim` and `partition_blocks` (see layers.py);
its shard on rank r is `shard_tensor(full, dim, r, tp, blocks)`. Saving gathers the shards over
the TP group (a synchronous, once-per-save collective, not overlap-mode traffic); loading
slices this rank's shard out of the full tensor, so a checkpoint written at one tp loads at
any other.
"""
from __future__ import annotations

from typing import Dict

import torch
import torch.distributed as dist
from torch import nn

from mpoverlap.tensor_parallel.layers import block_sizes, shard_tensor


def _is_sharded(p: nn.Parameter) -> bool:
    return bool(getattr(p, "tensor_model_parallel", False))


def unshard(local: torch.Tensor, p: nn.Parameter, tp_group, tp_size: int) -> torch.Tensor:
    """This rank's shard of a value shaped like `p` -> the full tensor (every rank gets it)."""
    if tp_size == 1 or tp_group is None or not _is_sharded(p):
        return local.detach().clone()
    parts = [torch.empty_like(local) for _ in range(tp_size)]
    dist.all_gather(parts, local.detach().contiguous(), group=tp_group)
    dim = p.partition_dim
    local_sizes = [b // tp_size for b in block_sizes(local.shape[dim] * tp_size, p.partition_blocks)]
    starts = [sum(local_sizes[:i]) for i in range(len(local_sizes))]
    # shard r = [block 0 rows of r | block 1 rows of r | ...]: reassemble block by block.
    return torch.cat([parts[r].narrow(dim, start, n) for start, n in zip(starts, local_sizes)
                      for r in range(tp_size)], dim=dim)


def reshard(full: torch.Tensor, p: nn.Parameter, tp_rank: int, tp_size: int) -> torch.Tensor:
    if tp_size == 1 or not _is_sharded(p):
        return full
    return shard_tensor(full, p.partition_dim, tp_rank, tp_size, p.partition_blocks)


def unshard_named(values: Dict[str, torch.Tensor], params: Dict[str, nn.Parameter], tp_group,
                  tp_size: int) -> Dict[str, torch.Tensor]:
    """{name: local value} -> {name: full value}; collective over TP (same order on every rank)."""
    return {name: unshard(values[name], params[name], tp_group, tp_size) for name in sorted(values)}


def reshard_named(values: Dict[str, torch.Tensor], params: Dict[str, nn.Parameter], tp_rank: int,
                  tp_size: int) -> Dict[str, torch.Tensor]:
    return {name: reshard(values[name], params[name], tp_rank, tp_size) for name in values}
