"""Quantized collectives: a reduce-scatter and an all-gather that carry a wire format.

Both return a CommHandle at once (the collective is in flight); waiting it runs the receiving
side's dequantization (and sum) into `output`, so the caller overlaps them as it overlaps the
plain collectives.

- `quantized_reduce_scatter`: each rank quantizes each of its g shards on its own (shard r goes
  to rank r), one all-to-all exchanges the packed shards, and each rank dequantizes the g shards
  it received and sums them in fp32 (wire.dequantize_sum): never in the wire dtype. One
  quantization hop.
- `quantized_all_gather`: each rank quantizes its shard once, one all-gather carries the packed
  shards, and each rank dequantizes all of them into `output`.

Plain data parallelism (an all-reduce) is the pair of them: the reduced shard is quantized again
for the gather, two hops at most. `emulate_*` are the single-process emulations the tests hold the
collectives to, bit for bit: the same quantization of each rank's tensor, the same fp32 sum.
The handle's `nbytes` is what the collective carries (the packed buffers, scales included).

Error feedback (`residual`, fp32, the input's size): the residual is added to the input before
it is quantized, and replaced by what this send lost, `(input + residual) - dequantize(quantize(
input + residual))`, computed at the issue (the sender's own packed buffer): the next send of the
same buffer carries it again. The emulations take the same residuals and update them alike.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from mpoverlap.comm.collectives import all_gather, all_to_all
from mpoverlap.comm.handle import CommHandle
from mpoverlap.comm.ledger import CommLedger
from mpoverlap.comm.wire import WireFormat, dequantize, dequantize_sum, packed_bytes, quantize


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _shard_numel(n: int, g: int) -> int:
    if n % g:
        raise ValueError(f"a quantized reduce-scatter splits {n} elements into {g} equal shards: pad the "
                         f"buffer to a multiple of the group size")
    return n // g


def _quantize_fed(x_GN: torch.Tensor, fmt: WireFormat, block: int, residual: Optional[torch.Tensor]) -> torch.Tensor:
    """quantize(x + residual); the residual (fp32, x's numel) becomes what the packing lost."""
    if residual is None:
        return quantize(x_GN, fmt, block)
    g, n = x_GN.shape
    if residual.numel() != g * n or residual.dtype != torch.float32:
        raise ValueError(f"an error-feedback residual is fp32 of the input's {g * n} elements, got "
                         f"{residual.dtype} of {residual.numel()}")
    res_GN = residual.view(g, n)
    fed = res_GN.add(x_GN)  # fp32, the residual's dtype: the input is never rounded first
    packed = quantize(fed, fmt, block)
    torch.sub(fed, dequantize(packed, n, fmt, block), out=res_GN)
    return packed


def quantized_reduce_scatter(output: torch.Tensor, input: torch.Tensor, group, *, fmt: WireFormat, block: int,
                             mode: str, ledger: Optional[CommLedger],
                             residual: Optional[torch.Tensor] = None) -> CommHandle:
    """output[n/g] (any floating dtype) = the fp32 sum over the group of each rank's quantized
    shard `rank` of input[n] (plus `residual`, see the module docstring); written when the
    handle is waited."""
    g = _size(group)
    s = _shard_numel(input.numel(), g)
    if output.numel() != s:
        raise ValueError(f"the reduce-scatter's output holds {output.numel()} elements, its shard {s}")
    send_GP = _quantize_fed(input.reshape(g, s), fmt, block, residual)
    recv_GP = torch.empty_like(send_GP)

    def reduce() -> None:
        output.view(-1).copy_(dequantize_sum(recv_GP, s, fmt, block))
    return all_to_all(recv_GP, send_GP, group, mode=mode, ledger=ledger, on_done=reduce)


def quantized_all_gather(output: torch.Tensor, input: torch.Tensor, group, *, fmt: WireFormat, block: int,
                         mode: str, ledger: Optional[CommLedger],
                         residual: Optional[torch.Tensor] = None) -> CommHandle:
    """output[g*n] (any floating dtype) = concat over the group of each rank's dequantized
    quantization of input[n] (plus `residual`); written when the handle is waited. Every rank,
    the shard's owner too, writes the dequantized values, so all copies agree."""
    g = _size(group)
    n = input.numel()
    if output.numel() != g * n:
        raise ValueError(f"the all-gather's output holds {output.numel()} elements, the group's shards {g * n}")
    send_1P = _quantize_fed(input.reshape(1, n), fmt, block, residual)
    recv_GP = torch.empty((g, send_1P.shape[1]), dtype=torch.uint8, device=input.device)

    def unpack() -> None:
        output.view(g, n).copy_(dequantize(recv_GP, n, fmt, block))
    return all_gather(recv_GP, send_1P, group, mode=mode, ledger=ledger, on_done=unpack)


def wire_bytes(numel: int, fmt: WireFormat, block: int, shards: int) -> int:
    """What the collective's buffer holds for `numel` elements in `shards` packed shards."""
    return shards * packed_bytes(numel // shards, fmt, block)


def emulate_reduce_scatter(inputs: Sequence[torch.Tensor], fmt: WireFormat, block: int,
                           residuals: Optional[Sequence[torch.Tensor]] = None) -> List[torch.Tensor]:
    """Single process: what each rank's `quantized_reduce_scatter` writes, from every rank's input
    (fp32); `residuals` (one per rank) are used and updated as the ranks' own."""
    g = len(inputs)
    s = _shard_numel(inputs[0].numel(), g)
    residuals = residuals if residuals is not None else [None] * g
    packed = [_quantize_fed(x.reshape(g, s), fmt, block, r) for x, r in zip(inputs, residuals)]  # [src][dst]
    return [dequantize_sum(torch.stack([p[dst] for p in packed]), s, fmt, block) for dst in range(g)]


def emulate_all_gather(inputs: Sequence[torch.Tensor], fmt: WireFormat, block: int,
                       residuals: Optional[Sequence[torch.Tensor]] = None) -> torch.Tensor:
    """Single process: what every rank's `quantized_all_gather` writes (fp32), from every rank's
    shard; `residuals` as in `emulate_reduce_scatter`."""
    n = inputs[0].numel()
    residuals = residuals if residuals is not None else [None] * len(inputs)
    packed = torch.cat([_quantize_fed(x.reshape(1, n), fmt, block, r) for x, r in zip(inputs, residuals)])
    return dequantize(packed, n, fmt, block).reshape(-1)
