"""The core-attention callable a GPT is built with under context parallelism."""
from __future__ import annotations

from typing import Optional

import torch

from mpoverlap.comm.ledger import CommLedger
from mpoverlap.context_parallel.a2a_attention import a2a_attention
from mpoverlap.context_parallel.ring_attention import ring_attention
from mpoverlap.parallel.state import ParallelState

VARIANTS = ("p2p", "a2a")


class ContextParallelAttention:
    """q [B, N, S/cp, D], k, v [B, G, S/cp, D] (load-balanced split; G K/V groups, = N without
    grouped-query attention) -> y [B, N, S/cp, D], causal over the global sequence. `variant`
    is parallel.cp_comm; `overlap` is the overlap.cp switch; `backend` is
    parallel.cp_attention_backend (the block kernel, block_kernels.py)."""

    def __init__(self, state: ParallelState, variant: str, overlap: bool,
                 ledger: Optional[CommLedger], backend: str = "auto") -> None:
        if variant not in VARIANTS:
            raise ValueError(f"parallel.cp_comm={variant!r}: use one of {VARIANTS}")
        self.fn = ring_attention if variant == "p2p" else a2a_attention
        self.kwargs = dict(cp_group=state.group("cp"), cp_ranks=state.ranks("cp"),
                           cp_rank=state.coords.cp, cp_size=state.grid.cp, overlap=overlap, ledger=ledger,
                           backend=backend)

    def __call__(self, q_BNSD: torch.Tensor, k_BGSD: torch.Tensor, v_BGSD: torch.Tensor) -> torch.Tensor:
        return self.fn(q_BNSD, k_BGSD, v_BGSD, **self.kwargs)
