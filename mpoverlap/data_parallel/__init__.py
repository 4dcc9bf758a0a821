"""Data parallelism: flat bucketed buffers, the DataParallel wrapper, sharded AdamW (ZeRO-1/2/3:
train.dp_sharding), ZeRO-3 unit gathers (fsdp.py)."""
from mpoverlap.data_parallel.buffer import Bucket, ParamAndGradBuffer, build_buffer
from mpoverlap.data_parallel.ddp import DataParallel
from mpoverlap.data_parallel.optimizer import DataParallelAdamW

__all__ = ["Bucket", "ParamAndGradBuffer", "build_buffer", "DataParallel", "DataParallelAdamW"]
