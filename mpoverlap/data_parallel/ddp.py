"""DataParallel: bucketed gradient reduction issued from autograd hooks (not torch DDP).

The wrapper (this file): the module's parameters laid out in the flat buffer (`buffer.py`),
each bucket's scratch tensors, the module-like surface and the per-step protocol
(`start_step`, `set_last_microbatch`/`no_sync`, `finish_grad_sync`, `close`). When and how
each bucket's collective is issued from the gradient hooks and completed: bucket_issue.py.

Expert weights (parameters marked `expert_parallel`) sit in buckets of their own, reduced
over the expert-data-parallel group instead of dp x cp (`reduce_groups.py`).

Sharding levels (`levels.py`; the ZeRO-2/3 methods live in `sharded_grads.py`). `optim` is
ZeRO-1 (one reduce-scatter per bucket, bucket_issue.py). With `optim_grads` (ZeRO-2) and
`optim_grads_params` (ZeRO-3) only this rank's shard of each bucket's reduced gradient persists
(`grad_shard(b)`): a bucket's full gradient is a storage of its own, allocated by the first
gradient that reaches it (a pre-accumulate hook), reduce-scattered as soon as every parameter of
the bucket has its gradient, in EVERY microbatch (the reduce-scatter is linear, so accumulating
shards equals reducing the accumulated sum), added into the shard when its handle is waited, and
freed. A bucket in flight is waited before the next gradient accumulates into it. Under ZeRO-3
the parameters are sharded too (`param_shard(b)`), and a `UnitGatherer` (fsdp.py) gathers them
around each unit's use; the bucket's parameters are freed when its reduce-scatter is issued.
"""
from __future__ import annotations

import contextlib
from functools import partial
from typing import Dict, Iterator, List, Optional, Sequence, Set

import torch
import torch.nn as nn

from mpoverlap.comm.handle import CommHandle
from mpoverlap.comm.ledger import CommLedger
from mpoverlap.data_parallel.bucket_issue import BucketIssue
from mpoverlap.data_parallel.buffer import ParamAndGradBuffer, build_buffer
from mpoverlap.data_parallel.delayed import DelayedGrads
from mpoverlap.data_parallel.grad_wire import GradWire, QuantizedBuckets
from mpoverlap.data_parallel.levels import resolve_level, shards_grads, shards_params
from mpoverlap.data_parallel.reduce_groups import ReduceGroup, expert_key, reduce_group
from mpoverlap.data_parallel.sharded_grads import ShardedGrads
from mpoverlap.data_parallel.unused import UnusedParams
from mpoverlap.parallel.state import ParallelState


class DataParallel(BucketIssue, ShardedGrads, QuantizedBuckets, DelayedGrads, UnusedParams):
    """Wrap `module` for data-parallel training over `state.group(group_kind)` (expert
    weights over `state.group(expert_group_kind)`).

    The module's trainable parameters move into one flat buffer (bucketed, reverse model
    order); `.grad` of each is a view of the gradient buffer, so never set it to None.
    """

    def __init__(self, module: nn.Module, state: ParallelState, *, group_kind: str = "dp_cp",
                 expert_group_kind: str = "edp", overlap: bool, bucket_mb: float,
                 distributed_optimizer: bool = False, ledger: Optional[CommLedger],
                 reduce_dtype: Optional[torch.dtype] = None, sharding: Optional[str] = None,
                 units: Optional[list] = None, prefetch: int = 1, reshard_after_forward: bool = True,
                 param_gather_dtype: str = "fp32", grad_wire: Optional[str] = None,
                 error_feedback: bool = False, delay: int = 0, own_buckets: Sequence[nn.Parameter] = ()) -> None:
        self.reduce_groups = {"dense": reduce_group(state, group_kind),
                              "expert": reduce_group(state, expert_group_kind)}
        self.module = module
        self.group_kind = group_kind
        dense = self.reduce_groups["dense"]
        self.group = dense.group
        self.group_size = dense.size
        self.group_rank = dense.rank
        self.overlap = bool(overlap)
        self.sharding = resolve_level(sharding or "none", distributed_optimizer)
        self.distributed_optimizer = self.sharding != "none"
        self.shard_grads = shards_grads(self.sharding)
        self.shard_params = shards_params(self.sharding)
        if self.shard_params and units is None:
            raise ValueError("sharding='optim_grads_params' needs `units` (see fsdp.gpt_units)")
        if grad_wire is not None and reduce_dtype not in (None, torch.float32):
            raise ValueError(f"a quantized gradient reduction (grad_wire={grad_wire!r}) is fed from the fp32 "
                             f"buffer; reduce_dtype={reduce_dtype} would round it first")
        self.ledger = ledger
        self.bucket_mb = bucket_mb
        # Reduce-scattered buckets split into equal shards: the distributed optimizer's, and every
        # quantized one (plain data parallelism reduces it as a reduce-scatter plus an all-gather).
        splits = self.distributed_optimizer or grad_wire is not None
        pad_to = {k: (g.size if splits else 1) for k, g in self.reduce_groups.items()}
        # `own_buckets`: parameters whose gradient is summed with a copy's on another stage or
        # chunk (training/pipeline_ties.py): each alone in a bucket, so every level shards it
        # alike wherever it is held (the same size, the same split); under ZeRO-2/3 such a
        # bucket is still gathered with every unit that lists the parameter.
        own = {p: ("own", k) for k, p in enumerate(own_buckets)}
        unit_of = own.get if own else None
        if self.shard_grads and units is not None:
            from mpoverlap.data_parallel.fsdp import unit_index

            owner = unit_index(units)
            unit_of = lambda p: own.get(p, owner(p))  # noqa: E731
        self.buffer: ParamAndGradBuffer = build_buffer(module.named_parameters(), bucket_mb=bucket_mb,
                                                       pad_to=pad_to, key_of=expert_key, unit_of=unit_of,
                                                       separate=self.shard_grads)
        nb = len(self.buffer.buckets)
        self.reduce_dtype = reduce_dtype or self.buffer.buckets[0].grad_data.dtype
        communicates = [self.bucket_group(b.index).group is not None for b in self.buffer.buckets]
        self._communicates = communicates
        self.wire: Optional[GradWire] = None
        if grad_wire is not None:
            self.wire = GradWire(grad_wire, numels=[b.numel for b in self.buffer.buckets],
                                 sizes=[self.bucket_group(b.index).size if c else None
                                        for b, c in zip(self.buffer.buckets, communicates)],
                                 two_hops=not self.distributed_optimizer, error_feedback=error_feedback,
                                 device=self.buffer.buckets[0].grad_data.device)
        # A lower reduction dtype: each bucket's scratch copy that is sent (None: the buffer's
        # own slice is reduced in place, as in fp32). ZeRO-2/3 allocate theirs per issue.
        self._send = [torch.empty(b.numel, dtype=self.reduce_dtype, device=b.grad_data.device)
                      if c and self.reduce_dtype != b.grad_data.dtype and not self.shard_grads else None
                      for b, c in zip(self.buffer.buckets, communicates)]
        # Reduce-scatter output lands in a scratch shard, then is copied into the gradient
        # buffer: gloo gives no guarantee for an output that aliases its own input.
        self._rs_out = [torch.empty(b.numel // self.bucket_group(b.index).size, dtype=self.reduce_dtype,
                                    device=b.grad_data.device)
                        if (self.distributed_optimizer or self.wire is not None) and c and not self.shard_grads
                        else None
                        for b, c in zip(self.buffer.buckets, communicates)]
        # Each parameter's gradient view, built once (before ZeRO-2/3 free the full buckets: a
        # view follows its storage when it is re-allocated): the hook of every parameter in every
        # microbatch compares against it (building it there cost two operators per call).
        self._grad_views = {p: self.buffer.grad_view(p) for p in self.buffer.params}
        self._init_shards()
        self._init_delayed(delay)  # overlap.dp_delay=1: delayed.py
        self._init_unused()  # parameters a microbatch does not use: unused.py
        self._is_last = True
        self._ready: List[Set[nn.Parameter]] = [set() for _ in range(nb)]
        self._issued = [False] * nb
        self._next = 0  # lowest bucket index not yet issued
        self._handles: Dict[int, CommHandle] = {}
        self._first_hop: Dict[int, CommHandle] = {}  # plain DP, quantized: reduce-scatters before their gather
        self._synced = False
        self._warned_unused = False
        self.weight_grads = None  # a WeightGradDeferral under a zero-bubble pipeline schedule
        self._held_params: Set[nn.Parameter] = set()  # see hold_ready
        self._held: List[nn.Parameter] = []
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready)
                       for p in self.buffer.params]
        self._rs_pending: Dict[int, torch.Tensor] = {}
        self._grad_bucket_bytes = 0  # ZeRO-2/3: full gradient buckets allocated now, and the peak
        self.peak_grad_bucket_bytes = 0
        if self.shard_grads:
            self._hooks += [p.register_hook(partial(self._before_accumulate, self.buffer.index[p][2]))
                            for p in self.buffer.params if communicates[self.buffer.index[p][2]]]
        self.gatherer = None
        if self.shard_params:
            from mpoverlap.data_parallel.fsdp import UnitGatherer

            self.gatherer = UnitGatherer(self, units, prefetch=prefetch, reshard_after_forward=reshard_after_forward,
                                         overlap=self.overlap, gather_dtype=param_gather_dtype)

    def bucket_group(self, bucket_index: int) -> ReduceGroup:
        """The group bucket `bucket_index` is reduced (and sharded) over."""
        return self.reduce_groups[self.buffer.buckets[bucket_index].key]

    # ---- module-like surface -------------------------------------------------------------
    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    __call__ = forward

    def train(self, mode: bool = True) -> "DataParallel":
        self.module.train(mode)
        return self

    def eval(self) -> "DataParallel":
        return self.train(False)

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.module.parameters()

    def named_parameters(self):
        return self.module.named_parameters()

    @property
    def num_buckets(self) -> int:
        return len(self.buffer.buckets)

    def shard_range(self, bucket_index: int) -> tuple:
        """[lo, hi) in buffer elements of the part of a bucket this rank's optimizer owns:
        its shard with the distributed optimizer, else the whole bucket."""
        b = self.buffer.buckets[bucket_index]
        if self.distributed_optimizer:
            g = self.bucket_group(bucket_index)
            return b.shard_range(g.rank, g.size)
        return b.offset, b.offset + b.numel

    @property
    def inflight_handles(self) -> List[CommHandle]:
        """Gradient handles issued this step and not yet waited."""
        return [h for h in self._handles.values() if not h.waited]

    @property
    def issued_buckets(self) -> List[int]:
        return [i for i, done in enumerate(self._issued) if done]

    # ---- per-step protocol ---------------------------------------------------------------
    def start_step(self) -> None:
        """Zero the gradient buffer and reset bucket state; once per step, before the first
        microbatch. Any reduction still in flight is waited first (it writes the buffer)."""
        self._wait_all()
        self.buffer.zero_grad()
        if self.shard_grads:
            self._grad_shards.zero_()
            for b in self.buffer.buckets:
                if self._communicates[b.index]:
                    self._free_grad_bucket(b.index)
        for ready in self._ready:
            ready.clear()
        self._issued = [False] * len(self._issued)
        self._next = 0
        self._sharded_next = None
        self._handles.clear()
        self._first_hop.clear()
        self._synced = False

    zero_grad = start_step

    def set_last_microbatch(self, is_last: bool) -> None:
        """Reductions are issued only during the backward of the last microbatch."""
        self._is_last = bool(is_last)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside accumulate only (not the last microbatch)."""
        previous = self._is_last
        self._is_last = False
        try:
            yield
        finally:
            self._is_last = previous

    def finish_grad_sync(self) -> None:
        """Issue every bucket not yet issued, wait all handles; call just before the optimizer.
        Afterwards the gradient buffer holds the group average (with the distributed
        optimizer: only this rank's shard of each bucket does). Idempotent within a step."""
        if self._synced:
            return
        if self.shard_grads:
            self._finish_sharded()
            self._synced = True
            return
        if self._next < len(self._issued):
            self._note_missing_grads()
        if self.delay:
            self._finish_delayed()
        while self._next < len(self._issued):
            self._issue(self._next)
        self._wait_all()
        self._synced = True

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def close(self) -> None:
        """Wait every collective still in flight and remove the hooks (end of a run). The
        gradient hooks are bound methods that the parameters keep on their C++ side: a cycle
        (parameter -> hook -> this wrapper -> buffer -> parameter) the garbage collector cannot
        see, which kept the wrapper, its process groups and their gloo threads alive until
        interpreter exit. Idempotent."""
        self._wait_all()
        self.wait_delayed()
        if self.gatherer is not None:
            self.gatherer.wait_pending()
            self.gatherer.remove_hooks()
        self.remove_hooks()
