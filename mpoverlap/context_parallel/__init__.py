"""Context parallelism: the sequence split over cp ranks, attention over the global sequence.

- split.py: load-balanced split (rank r holds chunks r and 2cp-1-r), positions, inverse gather
- ring_attention.py (+ ring_comm.py): K/V around the ring by p2p
- block_kernels.py: each attention block through a fused kernel returning its log-sum-exp
  (CPU flash; CUDA flash / efficient / cuDNN), or attention_math.py's explicit fp32 fallback
- a2a_attention.py (+ a2a_layout.py): Ulysses all-to-all, heads sharded over cp
- stats.py: per-call work and event counters
- attention.py: the core-attention callable the GPT is built with
"""
from mpoverlap.context_parallel.a2a_attention import a2a_attention
from mpoverlap.context_parallel.attention import ContextParallelAttention
from mpoverlap.context_parallel.ring_attention import ring_attention
from mpoverlap.context_parallel.split import (cp_chunk_order, gather_from_cp, positions_for_cp,
                                              split_for_cp, unsplit_from_cp)
from mpoverlap.context_parallel.stats import CPStats

__all__ = ["ContextParallelAttention", "a2a_attention", "ring_attention", "cp_chunk_order", "gather_from_cp",
           "positions_for_cp", "split_for_cp", "unsplit_from_cp", "CPStats"]
