"""FP8 ZeRO-3 gathers (`train.param_gather_dtype=fp8`, train.precision=fp8, tensorwise recipe).

The weights of the FP8 GEMMs (precision/fp8_select.py marks them) travel as float8 e4m3, one
byte a parameter, with one scale per weight, and the GEMMs take the gathered FP8 weight as it
is (precision.fp8.Fp8Gemms `gathered`): no second cast. As torchao's
`precompute_float8_dynamic_scale_for_fsdp`, the scale of a weight is the tensorwise scale of
the whole weight: once a step (the shards change only in the optimizer step), each rank takes
the amax of its shards' part of every FP8 weight (one segmented reduction per bucket), and ONE
all-reduce (MAX) over the data-parallel group gives every weight's global amax, hence its scale
(torchao's amax_to_scale). Each rank casts its shard with those scales (the bf16 value times
the scale, saturated to e4m3: the single process's cast of the step's bf16 weight), so the
gathered FP8 weight is bit for bit the single process's tensorwise cast of the full weight.

Everything else of a bucket (norm weights, biases) travels exactly in fp32 beside the FP8 part
(unit_gather.BucketGather's layout, its FP8 part here); buckets without an FP8 GEMM weight (the
embedding, the head) use the bf16 gather. The full fp32 bucket receives the dequantized values
(what anything but the FP8 GEMMs reads of these weights); the gathered e4m3 bucket is held
beside it until the bucket is freed. The rowwise recipe is refused (one scale per row of the
GEMM operand cannot be shared before the gather): rule fp8.param_gather.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from mpoverlap.comm.collectives import all_reduce

# One weight's place in its bucket: [lo, hi) bucket elements, its shape.
Span = Tuple[int, int, torch.Size]


def fp8_weights(module: torch.nn.Module) -> dict:
    """{weight: its module} for the linears whose GEMMs run in FP8 (fp8_recipe set) with the
    tensorwise cast a gathered weight carries. The grouped experts (w_in / w_out, no `weight`)
    quantize per row for torchao's rowwise grouped recipe, which a shared per-weight scale
    cannot serve: their weights travel in the bucket's exact part and the experts cast them."""
    return {sub.weight: sub for sub in module.modules()
            if getattr(sub, "fp8_recipe", None) is not None and isinstance(getattr(sub, "weight", None), torch.Tensor)}


def _segments(numel: int, spans: Sequence[Span], first: int) -> Tuple[List[int], List[int]]:
    """The bucket [0, numel) cut into runs: (lengths, scale index of each run), the FP8 weights'
    runs indexed first, first + 1, ... in `spans` order (sorted), the runs between them 0."""
    lengths, index, at = [], [], 0
    for i, (lo, hi, _) in enumerate(spans):
        if lo > at:
            lengths.append(lo - at)
            index.append(0)
        lengths.append(hi - lo)
        index.append(first + i)
        at = hi
    if numel > at:
        lengths.append(numel - at)
        index.append(0)
    return lengths, index


class Fp8Scales:
    """The step's scale of every FP8-gathered weight: `ext` = [1, scale_0, scale_1, ...] (fp32,
    the leading 1 for the runs that are no FP8 weight), None until `ensure` computes it."""

    def __init__(self, group, ledger) -> None:
        self.group, self.ledger = group, ledger
        self.parts: List[Tuple["Fp8Shards", int]] = []  # (a bucket's FP8 part, its bucket index)
        self.count = 0
        self.ext: Optional[torch.Tensor] = None

    def add(self, shards: "Fp8Shards", bucket: int) -> int:
        """Register a bucket's FP8 part; returns the scale index of its first weight."""
        first = self.count + 1
        self.parts.append((shards, bucket))
        self.count += len(shards.spans)
        return first

    def invalidate(self) -> None:
        self.ext = None

    @torch.no_grad()
    def ensure(self, shard_of) -> None:
        """This step's scales from every FP8 weight's amax over the group (one all-reduce MAX);
        `shard_of(bucket)`: this rank's fp32 shard of the bucket."""
        if self.ext is not None:
            return
        from torchao.float8.float8_utils import amax_to_scale

        from mpoverlap.precision.fp8 import E4M3

        amax = torch.cat([part.local_amax(shard_of(b)) for part, b in self.parts])
        if self.group is not None and dist.get_world_size(self.group) > 1:
            all_reduce(amax, self.group, mode="dp", ledger=self.ledger, op=dist.ReduceOp.MAX).wait()
        self.ext = torch.cat([amax.new_ones(1), amax_to_scale(amax, E4M3)])


class Fp8Shards:
    """The FP8 part of one bucket's gather: `spans` its FP8 weights (sorted), `shard` elements a
    rank, this one `rank`. Index tensors built once; every step is one operator over the shard
    (or the bucket), none sized by its weights."""

    def __init__(self, numel: int, spans: Sequence[Span], *, size: int, rank: int, device: torch.device,
                 scales: Fp8Scales, bucket: int) -> None:
        self.spans = sorted(spans, key=lambda s: s[0])
        self.shard, self.size, self.scales = numel // size, size, scales
        first = scales.add(self, bucket)
        self.first = first
        lengths, index = _segments(numel, self.spans, first)
        self.lengths = torch.tensor(lengths, device=device)
        self.index = torch.tensor(index, device=device)
        # This rank's shard [lo, hi) cut by the same runs (empty runs kept: their amax is 0).
        lo, hi = rank * self.shard, (rank + 1) * self.shard
        starts = torch.cumsum(torch.tensor([0] + lengths[:-1]), 0)
        ends = starts + torch.tensor(lengths)
        local = (torch.minimum(ends, torch.tensor(hi)) - torch.maximum(starts, torch.tensor(lo))).clamp_(min=0)
        self.local_lengths = local.to(device)
        self.weight_runs = torch.tensor([i for i, k in enumerate(index) if k], device=device)
        self.values: Optional[torch.Tensor] = None  # the gathered e4m3 bucket while gathered

    def local_amax(self, shard: torch.Tensor) -> torch.Tensor:
        """fp32 [weights of the bucket]: the amax of this rank's part of each (0 where it has
        none), of the bf16 values the GEMMs cast (the single process's amax is of those)."""
        values = shard.to(torch.bfloat16).float().abs_()
        runs = torch.segment_reduce(values, "max", lengths=self.local_lengths, initial=0.0)
        return runs.index_select(0, self.weight_runs)

    def pack(self, shard: torch.Tensor) -> torch.Tensor:
        """This rank's shard in e4m3 (uint8 view): each weight's bf16 values times its scale,
        saturated (precision.fp8's cast); the other elements too (they travel exactly beside)."""
        from mpoverlap.precision.fp8 import E4M3, to_fp8_saturated

        scale = self.scales.ext.index_select(0, self.index).repeat_interleave(self.local_lengths,
                                                                               output_size=self.shard)
        return to_fp8_saturated(shard.to(torch.bfloat16).float() * scale, E4M3).view(torch.uint8)

    def unpack(self, full: torch.Tensor, lossy_GS: torch.Tensor) -> None:
        """Keep the gathered e4m3 bucket (`lossy_GS`: [size, shard] uint8) and write its
        dequantized values into `full` (fp32)."""
        from mpoverlap.precision.fp8 import E4M3

        self.values = lossy_GS.contiguous().view(E4M3).view(-1)
        scale = self.scales.ext.index_select(0, self.index).repeat_interleave(self.lengths, output_size=full.numel())
        full.copy_(self.values.float() / scale)

    def held_bytes(self) -> int:
        """Bytes of the gathered e4m3 bucket `unpack` keeps (one a bucket element, its padding
        included), from the gather's issue (its receive buffer) until `release`."""
        return self.size * self.shard

    def release(self) -> None:
        self.values = None


class GatheredFp8Weight:
    """One weight's FP8 gather (a parameter's `fp8_gathered`): its e4m3 values and scale while
    its bucket is gathered in FP8 (precision.fp8.Fp8Gemms reads them), else None."""

    __slots__ = ("part", "lo", "hi", "shape", "index")

    def __init__(self, part: Fp8Shards, span: Span, index: int) -> None:
        self.part, (self.lo, self.hi, self.shape), self.index = part, span, index

    def quantized(self):
        values, ext = self.part.values, self.part.scales.ext
        if values is None or ext is None:
            return None
        return values[self.lo:self.hi].view(self.shape), ext[self.index]


def attach(part: Fp8Shards, params: Sequence[torch.nn.Parameter]) -> None:
    """Set `fp8_gathered` on the bucket's FP8 weights (`params` in `part.spans` order)."""
    for i, (p, span) in enumerate(zip(params, part.spans)):
        p.fp8_gathered = GatheredFp8Weight(part, span, part.first + i)
