"""Tensor and sequence parallelism: column/row/vocab-parallel layers, SP mappings, collective
matmul, vocab-parallel cross entropy. SP layout: [B, S/tp, H] (sequence on dim 1)."""
from mpoverlap.tensor_parallel.comm_spec import TPComm, make_comm, tp_kwargs
from mpoverlap.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from mpoverlap.tensor_parallel.layers import (
    ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, shard_tensor)
from mpoverlap.tensor_parallel.linear_functions import column_parallel_linear, row_parallel_linear
from mpoverlap.tensor_parallel.mappings import (
    allreduce_sequence_parallel_grads, copy_to_tensor_parallel_region,
    gather_from_sequence_parallel, reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel, scatter_to_sequence_parallel)

__all__ = [
    "TPComm", "make_comm", "tp_kwargs", "vocab_parallel_cross_entropy", "ColumnParallelLinear",
    "RowParallelLinear", "VocabParallelEmbedding", "shard_tensor", "column_parallel_linear",
    "row_parallel_linear", "allreduce_sequence_parallel_grads", "copy_to_tensor_parallel_region",
    "gather_from_sequence_parallel", "reduce_from_tensor_parallel_region",
    "reduce_scatter_to_sequence_parallel", "scatter_to_sequence_parallel",
]
