"""What a ZeRO-3 unit gather carries (`train.param_gather_dtype`), bucket by bucket.

A unit gather's result is a compute copy of the unit's parameters, so part of it may travel
rounded: the weights the forward reads only through a cast to the compute dtype
(precision.compute_cast_weights: the linears' and the grouped experts' weights) go in the
gather's format, everything else (norm weights, biases, embedding tables, the router) in fp32.
Under train.precision=bf16 the bf16 format then changes no value the model computes with: the
GEMM casts its weight to bf16 anyway (the cast of a bf16 value is itself), and the parameters
it reads as they are arrive exactly. int8 sends those weights blockwise (comm/wire.py, one fp32
scale per GATHER_BLOCK elements; the exact elements zeroed first, so no norm weight sets a
block's scale). fp8 (train.precision=fp8) sends the FP8 GEMMs' weights in e4m3 with one scale per
weight, everything else of their buckets in fp32, the other buckets as bf16 (fp8_gather.py).

Each rank's shard of a bucket is a contiguous run of it, and its exact elements form a run of
the bucket's exact elements in the same order, so each rank sends one buffer:

    [ exact: its exact elements, fp32, padded to the bucket's most per rank | lossy: its shard
      in the format (bf16, or int8 values and scales) ]

and one all-gather carries the bucket; the wait widens the lossy part into the bucket and
writes the exact elements over it (index tensors built once, of the exact elements only: a few
norms and biases per unit). A bucket with nothing to round (the embedding's unit) is gathered
in fp32, one with nothing exact in the format alone. The operators per bucket do not depend on
its size.
"""
from __future__ import annotations

from functools import partial
from typing import Sequence, Tuple

import torch

from mpoverlap.comm.collectives import all_gather
from mpoverlap.comm.handle import CommHandle
from mpoverlap.comm.wire import dequantize, packed_bytes, quantize, wire_format

# Elements per int8 scale (qwZ-like blocks: 4 bytes of scale per 2,048 bytes of values).
GATHER_BLOCK = 2048
FORMATS = ("fp32", "bf16", "int8", "fp8")


class BucketGather:
    """The gather of one sharded bucket of `numel` elements over `size` ranks (this one `rank`);
    `exact`: [lo, hi) element ranges of the bucket that travel in fp32; `fp8` (format fp8): the
    FP8 part's casts (data_parallel/fp8_gather.py Fp8Shards), `exact` then everything else."""

    def __init__(self, fmt: str, numel: int, exact: Sequence[Tuple[int, int]], *, size: int, rank: int,
                 device: torch.device, fp8=None) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"a unit gather's format is one of {FORMATS}, got {fmt!r}")
        if (fmt == "fp8") != (fp8 is not None):
            raise ValueError("an fp8 unit gather needs its FP8 part (fp8_gather.Fp8Shards), no other format one")
        self.fp8 = fp8
        self.shard = numel // size
        self.size = size
        # Built once on the host at start-up, the index tensors moved to the bucket's device below.
        mask = torch.zeros(numel, dtype=torch.bool)
        for lo, hi in exact:
            mask[lo:hi] = True
        positions = mask.nonzero().flatten()  # init only: built once per bucket
        if fmt == "fp32" or len(positions) == numel:
            self.fmt = "fp32"
            return
        self.fmt = fmt
        self.wire = wire_format("int8") if fmt == "int8" else None
        owner = positions // self.shard
        counts = torch.bincount(owner, minlength=size)
        self.side = int(counts.max()) if len(positions) else 0
        mine = positions[owner == rank] - rank * self.shard
        self.fill = mine.to(device)  # zeroed before the lossy part is made (int8) and written over
        self.take = torch.cat([mine, mine.new_zeros(self.side - len(mine))]).to(device)
        ordinal = torch.arange(len(positions)) - (torch.cumsum(counts, 0) - counts)[owner]
        self.src = (owner * self.side + ordinal).to(device)
        self.dst = positions.to(device)

    def lossy_bytes(self) -> int:
        if self.fp8 is not None:
            return self.shard
        return packed_bytes(self.shard, self.wire, GATHER_BLOCK) if self.wire is not None else 2 * self.shard

    def wire_bytes(self) -> dict:
        """{wire dtype: bytes} one gather of the bucket receives (the ledger's bytes, split): the
        exact part in fp32, the rest in the format (int8: its values and scales)."""
        if self.fmt == "fp32":
            return {"fp32": 4 * self.size * self.shard}
        out = {self.fmt: self.size * self.lossy_bytes()}
        if self.side:
            out["fp32"] = 4 * self.size * self.side
        return out

    def issue(self, full: torch.Tensor, shard: torch.Tensor, group, *, mode: str, ledger) -> CommHandle:
        """Gather `shard` of every rank into `full` (fp32 [size * shard]); written by the wait."""
        if self.fmt == "fp32":
            return all_gather(full, shard, group, mode=mode, ledger=ledger)
        parts = []
        if self.side:
            parts.append(shard.index_select(0, self.take).view(torch.uint8))
        if self.fp8 is not None:
            parts.append(self.fp8.pack(shard))
        elif self.wire is not None:
            values = shard.index_fill(0, self.fill, 0.0) if len(self.fill) else shard
            parts.append(quantize(values.view(1, -1), self.wire, GATHER_BLOCK).view(-1))
        else:
            parts.append(shard.to(torch.bfloat16).view(torch.uint8))
        send = torch.cat(parts) if len(parts) > 1 else parts[0]
        recv = torch.empty(self.size * send.numel(), dtype=torch.uint8, device=shard.device)
        return all_gather(recv, send, group, mode=mode, ledger=ledger, on_done=partial(self._unpack, full, recv))

    def _unpack(self, full: torch.Tensor, recv: torch.Tensor) -> None:
        recv = recv.view(self.size, -1)
        at = 4 * self.side
        lossy = recv[:, at:]
        if self.fp8 is not None:
            self.fp8.unpack(full, lossy)
        elif self.wire is not None:
            full.view(self.size, self.shard).copy_(dequantize(lossy, self.shard, self.wire, GATHER_BLOCK))
        else:
            full.view(self.size, self.shard).copy_(lossy.view(torch.bfloat16))
        if self.side:
            exact = recv[:, :at].contiguous().view(torch.float32).view(-1)
            full.index_copy_(0, self.dst, exact.index_select(0, self.src))


def exact_ranges(bucket, index, cast: set) -> list:
    """[lo, hi) ranges of `bucket` (buffer.Bucket) holding parameters not in `cast`; `index`:
    the buffer's param -> (start, end, bucket index) (global offsets)."""
    out = []
    for p, (start, end, b) in index.items():
        if b == bucket.index and p not in cast:
            out.append((start - bucket.offset, end - bucket.offset))
    return out


def gather_bytes(fmt: str, cast_numel: int, exact_numel: int) -> float:
    """Bytes a unit gather carries for `cast_numel` compute-cast and `exact_numel` other elements,
    padding left out (the estimate's figure)."""
    if fmt == "fp32":
        return 4.0 * (cast_numel + exact_numel)
    per = {"bf16": 2.0, "fp8": 1.0}.get(fmt, 1.0 + 4.0 / GATHER_BLOCK)
    return per * cast_numel + 4.0 * exact_numel


def describe(fmt: str) -> str:
    if fmt == "fp32":
        return "fp32"
    if fmt == "fp8":
        return ("fp8 (e4m3, one scale per weight from one amax all-reduce a step: the FP8 GEMMs' weights, handed "
                "to the GEMMs uncast; an untied head's weight in bf16; norms, biases and embeddings in fp32)")
    return f"{fmt} (the weights the GEMMs cast; norms, biases, embeddings and the router in fp32)"
