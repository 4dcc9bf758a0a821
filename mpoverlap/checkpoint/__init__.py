"""Sharded checkpoints: each rank writes only what it holds, at its place in the full tensors,
and reads back whatever part its layout needs (boxes.py: the arithmetic; sharded.py: the DCP
planners; train_state.py: a training run's parameters and AdamW moments)."""
from mpoverlap.checkpoint.sharded import ShardedEntry, ShardedLoadPlanner, ShardedSavePlanner
from mpoverlap.checkpoint.train_state import TrainStateChunks

__all__ = ["ShardedEntry", "ShardedLoadPlanner", "ShardedSavePlanner", "TrainStateChunks"]
