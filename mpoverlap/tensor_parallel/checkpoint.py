"""Full (unsharded) tensors -> this rank's tensor-parallel slices (initialising from a Hugging
Face directory, whose files hold full tensors).

A tensor-parallel parameter carries `partition_dim` and `partition_blocks` (see layers.py); its
shard on rank r is `shard_tensor(full, dim, r, tp, blocks)`. Checkpoints never go through here:
they write and read each rank's slice in place (mpoverlap/checkpoint/).
"""
from __future__ import annotations

from typing import Dict

import torch
from torch import nn

from mpoverlap.tensor_parallel.layers import shard_tensor


def _is_sharded(p: nn.Parameter) -> bool:
    return bool(getattr(p, "tensor_model_parallel", False))


def reshard(full: torch.Tensor, p: nn.Parameter, tp_rank: int, tp_size: int) -> torch.Tensor:
    if tp_size == 1 or not _is_sharded(p):
        return full
    return shard_tensor(full, p.partition_dim, tp_rank, tp_size, p.partition_blocks)


def reshard_named(values: Dict[str, torch.Tensor], params: Dict[str, nn.Parameter], tp_rank: int,
                  tp_size: int) -> Dict[str, torch.Tensor]:
    return {name: reshard(values[name], params[name], tp_rank, tp_size) for name in values}
