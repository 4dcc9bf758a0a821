"""Data parallelism: flat bucketed buffers, the DataParallel wrapper, ZeRO-1 AdamW."""
from mpoverlap.data_parallel.buffer import Bucket, ParamAndGradBuffer, build_buffer
from mpoverlap.data_parallel.ddp import DataParallel
from mpoverlap.data_parallel.optimizer import DataParallelAdamW

__all__ = ["Bucket", "ParamAndGradBuffer", "build_buffer", "DataParallel", "DataParallelAdamW"]
