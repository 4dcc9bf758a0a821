"""A rank's pieces of one full tensor, and the DCP planners that write and read them.

`ShardedEntry(global_shape, chunks)`: the full tensor's shape and this rank's chunks, each a
box of it (offsets) and a tensor holding exactly that box's elements (a view into the rank's
own storage). In a state dict handed to `Checkpointer.save/load` with `ShardedSavePlanner` /
`ShardedLoadPlanner`:

- save: each chunk becomes one DCP write item at its global offsets (no rank gathers anything;
  DCP's global plan check refuses overlapping chunks and chunks that do not cover the tensor);
- load: each chunk is filled in place from whatever boxes the checkpoint holds, whatever layout
  wrote them (DCP's resharding reads the overlaps), so the same checkpoint loads at any
  tp/pp/cp/dp/ep and sharding level; a checkpoint holding full tensors (written before sharded
  saves) is a checkpoint of one box per tensor and loads the same way.

Why planners and not DTensor: a rank's data-parallel shard is a flat range of the flattened
local tensor, which is not a DTensor placement (it cuts rows), so it is described as a few boxes
per tensor instead (boxes.py). The planners are DCP's documented extension point.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch.distributed.checkpoint.default_planner import (DefaultLoadPlanner, DefaultSavePlanner,
                                                          create_default_local_load_plan,
                                                          create_default_local_save_plan)
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list


class ShardedEntry:
    """This rank's chunks of a tensor of `global_shape`: [(offsets, tensor of the box's sizes)]."""

    def __init__(self, global_shape: Sequence[int], chunks: Sequence[Tuple[Sequence[int], torch.Tensor]]) -> None:
        self.global_shape = torch.Size(global_shape)
        self.chunks: List[Tuple[torch.Size, torch.Tensor]] = [(torch.Size(o), t) for o, t in chunks]
        for offsets, t in self.chunks:
            if len(offsets) != len(self.global_shape) or any(
                    o + n > g for o, n, g in zip(offsets, t.shape, self.global_shape)):
                raise ValueError(f"chunk at {tuple(offsets)} of shape {tuple(t.shape)} is outside "
                                 f"{tuple(self.global_shape)}")

    def staged(self, copy_tensor: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> "ShardedEntry":
        """The same chunks copied to host memory (what an asynchronous save writes while training
        goes on changing the originals); `copy_tensor` makes each copy (the checkpointer's
        stager: pinned, non-blocking from CUDA), a plain host copy by default."""
        copy_tensor = copy_tensor or (lambda t: t.detach().to("cpu", copy=True))
        return ShardedEntry(self.global_shape, [(o, copy_tensor(t)) for o, t in self.chunks])

    @property
    def numel(self) -> int:
        return sum(t.numel() for _, t in self.chunks)

    def chunk_at(self, index: MetadataIndex) -> torch.Tensor:
        if index.index is not None and index.index < len(self.chunks) and self.chunks[index.index][0] == index.offset:
            return self.chunks[index.index][1]
        for offsets, t in self.chunks:
            if offsets == index.offset:
                return t
        raise ValueError(f"{index.fqn}: no chunk at {tuple(index.offset or ())}")

    def write_items(self, fqn: str) -> List[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, offsets, i), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=offsets, sizes=t.shape),
                                                      properties=TensorProperties.create_from_tensor(t),
                                                      size=self.global_shape))
                for i, (offsets, t) in enumerate(self.chunks)]

    def chunk_list(self) -> List[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=o, sizes=t.shape) for o, t in self.chunks]


def _split(state_dict: dict) -> Tuple[dict, dict]:
    sharded = {k: v for k, v in state_dict.items() if isinstance(v, ShardedEntry)}
    return sharded, {k: v for k, v in state_dict.items() if k not in sharded}


class ShardedSavePlanner(DefaultSavePlanner):
    """DefaultSavePlanner that writes each ShardedEntry chunk at its global offsets."""

    def create_local_plan(self) -> SavePlan:
        sharded, plain = _split(self.state_dict)
        plan = create_default_local_save_plan(plain, self.is_coordinator)
        items = list(plan.items)
        for fqn, entry in sharded.items():
            items += entry.write_items(fqn)
        plan = SavePlan(items)
        if self.flatten_state_dict:
            plan = dataclasses.replace(plan, planner_data=self.mappings)
        self.plan = plan
        return plan

    def create_global_plan(self, all_plans: List[SavePlan]):
        global_plan, metadata = super().create_global_plan(all_plans)
        # DCP refuses overlapping chunks, but checks that they cover the tensor only when more
        # than one rank saves: an element no rank wrote would load as garbage, so check always.
        holes = [f"{fqn} ({sum(math.prod(c.sizes) for c in md.chunks)} of {math.prod(md.size)} elements)"
                 for fqn, md in metadata.state_dict_metadata.items()
                 if isinstance(md, TensorStorageMetadata) and len(md.size)
                 and sum(math.prod(c.sizes) for c in md.chunks) != math.prod(md.size)]
        if holes:
            raise ValueError(f"the ranks' chunks do not cover these tensors: {', '.join(holes[:5])}")
        return global_plan, metadata

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict.get(index.fqn)
        if isinstance(obj, ShardedEntry):
            t = obj.chunk_at(index)
            # DCP serialises the tensor's whole storage unless it clones a view first; a
            # contiguous chunk is written as it is.
            return t if t.is_contiguous() else t.contiguous()
        return super().lookup_object(index)


class ShardedLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that fills each ShardedEntry chunk from the saved boxes overlapping it."""

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # The default set-up rewrites every leaf it does not know (meta-tensor initialisation
        # maps them to None, in place): it gets a copy of the nesting with placeholders, and
        # the entries go back under their flattened names. Plain values (loaded by value, not
        # in place) still land in the caller's dicts through `original_state_dict`.
        entries: Dict[tuple, ShardedEntry] = {}

        def shadow(node: dict, path: tuple) -> dict:
            out = {}
            for key, value in node.items():
                if isinstance(value, ShardedEntry):
                    entries[path + (key,)], out[key] = value, None
                else:
                    out[key] = shadow(value, path + (key,)) if isinstance(value, dict) else value
            return out

        super().set_up_planner(shadow(state_dict, ()), metadata, is_coordinator)
        self.original_state_dict = state_dict
        for fqn, path in self.mappings.items():
            if tuple(path) in entries:
                self.state_dict[fqn] = entries[tuple(path)]

    def create_local_plan(self) -> LoadPlan:
        sharded, plain = _split(self.state_dict)
        plan = create_default_local_load_plan(plain, self.metadata, not self.allow_partial_load)
        items = list(plan.items)
        for fqn, entry in sharded.items():
            md = self.metadata.state_dict_metadata.get(fqn)
            if not isinstance(md, TensorStorageMetadata):
                raise RuntimeError(f"Missing key in checkpoint state_dict: {fqn}.")
            if md.size != entry.global_shape:
                raise ValueError(f"Size mismatch between saved {tuple(md.size)} and current "
                                 f"{tuple(entry.global_shape)} for {fqn}")
            items += create_read_items_for_chunk_list(fqn, md, entry.chunk_list())
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict.get(index.fqn)
        if isinstance(obj, ShardedEntry):
            return obj.chunk_at(index)
        return super().lookup_tensor(index)
