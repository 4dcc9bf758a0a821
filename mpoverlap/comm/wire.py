"""Wire formats: blockwise quantization of a flat tensor into one byte buffer (values and scales).

A format (`int8`, `fp8` = float8 e4m3) splits each flat shard into blocks of `block` elements
(the last block zero-padded), keeps one fp32 scale per block (the block's absolute maximum over
the format's largest value; 1 for an all-zero block) and stores `round(x / scale)` in one byte.
One shard packs into `packed_bytes(n, fmt, block)` bytes, laid out as

    [ values: blocks x block bytes | scales: blocks x 4 bytes (fp32) ]

so a collective carries values and scales in one buffer and the receiver needs nothing else.
`block` is a multiple of 4: every shard's scales then start 4-byte aligned inside a [g, P]
buffer of g packed shards, and view as fp32 where they lie.

Everything here is math on tensors, no communication (comm/quantized.py posts the collectives),
and every step is one operator over all shards at once: the operator count of a bucket does not
grow with its size or the group's. Dequantization always produces fp32, and sums of dequantized
shards are fp32 sums (`dequantize_sum`): a lossy format is never summed in its own dtype.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class WireFormat:
    name: str
    dtype: torch.dtype
    qmax: float  # the largest magnitude a quantized value takes
    rounds: bool  # int8 rounds to the nearest integer itself; fp8's cast rounds to its own grid


FORMATS = {
    "int8": WireFormat("int8", torch.int8, 127.0, True),
    "fp8": WireFormat("fp8", torch.float8_e4m3fn, float(torch.finfo(torch.float8_e4m3fn).max), False),
}


def wire_format(name: str) -> WireFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown wire format {name!r}; one of {sorted(FORMATS)}") from None


def check_block(block: int) -> None:
    if not isinstance(block, int) or block < 4 or block % 4:
        raise ValueError(f"a wire block is a positive multiple of 4 elements (its scales stay 4-byte aligned), "
                         f"got {block!r}")


def num_blocks(n: int, block: int) -> int:
    return -(-n // block)


def packed_bytes(n: int, fmt: WireFormat, block: int) -> int:
    """Bytes one packed shard of `n` elements takes: one byte a (padded) element, 4 a block."""
    blocks = num_blocks(n, block)
    return blocks * block + 4 * blocks


def quantize(x_GN: torch.Tensor, fmt: WireFormat, block: int) -> torch.Tensor:
    """g shards of n elements each ([g, n], any floating dtype) -> packed uint8 [g, P].

    Each shard is quantized on its own (its own blocks and scales), so shard r of the result is
    what rank r of a group sends or what goes to rank r of it."""
    check_block(block)
    g, n = x_GN.shape
    blocks = num_blocks(n, block)
    x = x_GN.float()
    if blocks * block != n:
        x = torch.nn.functional.pad(x, (0, blocks * block - n))
    x_GBK = x.view(g, blocks, block)
    amax_GB = x_GBK.abs().amax(dim=2)
    scale_GB = torch.where(amax_GB > 0, amax_GB / fmt.qmax, torch.ones_like(amax_GB))
    q = (x_GBK / scale_GB.unsqueeze(2))
    if fmt.rounds:
        q = q.round_()
    q = q.clamp_(-fmt.qmax, fmt.qmax).to(fmt.dtype)
    values = q.view(torch.uint8).view(g, blocks * block)
    scales = scale_GB.view(torch.uint8)  # [g, blocks * 4]
    return torch.cat((values, scales), dim=1)


def dequantize(packed_GP: torch.Tensor, n: int, fmt: WireFormat, block: int) -> torch.Tensor:
    """packed uint8 [g, P] (from `quantize` of [g, n]) -> fp32 [g, n]."""
    g = packed_GP.shape[0]
    blocks = num_blocks(n, block)
    if packed_GP.shape[1] != packed_bytes(n, fmt, block):
        raise ValueError(f"a packed shard of {n} elements in blocks of {block} takes "
                         f"{packed_bytes(n, fmt, block)} bytes, got {packed_GP.shape[1]}")
    values = packed_GP[:, :blocks * block].contiguous().view(fmt.dtype).view(g, blocks, block)
    scale_GB = packed_GP[:, blocks * block:].contiguous().view(torch.float32)
    x_GBK = values.float() * scale_GB.unsqueeze(2)
    return x_GBK.view(g, blocks * block)[:, :n]


def dequantize_sum(packed_GP: torch.Tensor, n: int, fmt: WireFormat, block: int) -> torch.Tensor:
    """The fp32 sum over the g packed shards (one reduction over the shards) -> fp32 [n]. The
    collectives and their single-process emulation both sum through here, so the order is the same."""
    return dequantize(packed_GP, n, fmt, block).sum(dim=0)
