"""The wire format of the MoE dispatch's forward exchange (train.ep_dispatch_dtype).

The dispatch sends token rows [N, H] (each a token's hidden vector, in the activation dtype:
bf16 under train.precision=bf16, fp32 otherwise). A `DispatchWire` turns those rows into what
the exchange carries and back, all rows of an exchange in one call (no loop over tokens or
experts):

  fp8   each row quantized on its own in blocks of 128 (float8 e4m3 values, one fp32 scale a
        block: comm/wire.py's `quantize` with the rows as its shards), values and scales packed
        in one uint8 row of `packed_bytes(H)` = H (padded to whole blocks) + 4 per block bytes,
        so ONE exchange carries both; dequantized on arrival into the activation dtype.
  bf16  the rows cast to bf16 (a no-op under train.precision=bf16), back to the activation
        dtype on arrival.

An exchange moves rows without arithmetic (all-to-all and all-gather), so a received row is
`arrive(depart(row))` of the row sent: the round trip `round_trip` computes in one process.

Only the dispatch's forward exchange takes the format. The combine and the dispatch's backward
stay in the activation dtype (DeepEP's split: the expert outputs and every gradient are summed
after they arrive, where a coarse format would add error on every step). The gradient with
respect to the dispatched rows is the straight-through one: the round trip counts as the
identity, so the gradient of the received rows goes back by the reverse exchange unchanged.
"""
from __future__ import annotations

from typing import Optional

import torch

from mpoverlap.comm.wire import dequantize, packed_bytes, quantize, wire_format

DISPATCH_DTYPES = ("auto", "bf16", "fp8")
BLOCK = 128  # elements a scale covers: DeepEP's per-128 scales


class DispatchWire:
    def __init__(self, name: str) -> None:
        if name not in ("bf16", "fp8"):
            raise ValueError(f"a dispatch wire format is bf16 or fp8, got {name!r}")
        self.name = name
        self.fmt = wire_format(name) if name == "fp8" else None

    def depart(self, rows_NH: torch.Tensor) -> torch.Tensor:
        """The rows to send -> what the exchange carries ([N, P] uint8 for fp8, [N, H] bf16)."""
        if self.fmt is None:
            return rows_NH.to(torch.bfloat16).contiguous()
        return quantize(rows_NH, self.fmt, BLOCK)

    def arrive(self, wire_NP: torch.Tensor, hidden: int, dtype: torch.dtype) -> torch.Tensor:
        """What arrived -> the rows [N, H] in `dtype` (the activation dtype they were sent in)."""
        if self.fmt is None:
            return wire_NP.to(dtype)
        return dequantize(wire_NP, hidden, self.fmt, BLOCK).to(dtype).contiguous()

    def round_trip(self, rows_NH: torch.Tensor) -> torch.Tensor:
        """What the rows become on the other side of an exchange, computed in one process."""
        return self.arrive(self.depart(rows_NH), rows_NH.shape[1], rows_NH.dtype)

    def row_bytes(self, hidden: int) -> int:
        """Bytes one row takes on the wire."""
        return 2 * hidden if self.fmt is None else packed_bytes(hidden, self.fmt, BLOCK)

    def describe(self) -> str:
        if self.fmt is None:
            return "bf16"
        return f"fp8 e4m3, one fp32 scale per {BLOCK} elements"


def resolve_dispatch_wire(asked: str, precision: str) -> Optional[DispatchWire]:
    """train.ep_dispatch_dtype under train.precision -> the wire (None: the rows travel as they
    are, in the activation dtype). auto = the activation dtype (bf16 under bf16); bf16 under
    bf16 is the same; bf16 under fp32 casts the rows for the exchange."""
    if asked not in DISPATCH_DTYPES:
        raise ValueError(f"train.ep_dispatch_dtype={asked!r}: one of {'|'.join(DISPATCH_DTYPES)}")
    if asked == "auto" or (asked == "bf16" and precision == "bf16"):
        return None
    return DispatchWire(asked)


def dispatch_row_bytes(asked: str, precision: str, hidden: int, c: int) -> int:
    """Bytes a dispatched row takes on the wire (`c`: bytes of the activation dtype)."""
    wire = resolve_dispatch_wire(asked, precision)
    return hidden * c if wire is None else wire.row_bytes(hidden)
