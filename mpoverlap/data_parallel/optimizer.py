"""DataParallelAdamW: AdamW over the flat buffers of a DataParallel, optionally ZeRO-1.

For every parameter the optimizer sees only the part inside this rank's range of each bucket
(the rank's shard with the distributed optimizer, the whole bucket without), as 1-D views
`param_data[lo:hi]` / `grad_data[lo:hi]`, so AdamW updates the model's storage in place and
its moments take 1/g of the memory under ZeRO-1.

After a distributed step every bucket's updated shard is all-gathered back into the full
parameter buffer, bucket by bucket in forward order (the bucket holding the first layers
first). With `param_gather_overlap=True` those handles stay in flight and each is waited by a
forward pre-hook of a module owning one of the bucket's parameters, i.e. under the next
forward; `finish_param_sync()` waits whatever is left (call it before eval or checkpointing).

The pieces are views of `ddp.param_shard(b)` / `ddp.grad_shard(b)`, which is the same memory
at every sharding level (the flat buffers' slices for none/ZeRO-1, the persistent shard
buffers under ZeRO-2/3). Under ZeRO-2 the parameters are full, so the step all-gathers them
like ZeRO-1; under ZeRO-3 nothing is gathered after the step: each unit gathers its updated
shards before its next forward (fsdp.py), and the step frees whatever was still gathered.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from mpoverlap.comm.collectives import all_gather
from mpoverlap.comm.handle import CommHandle
from mpoverlap.data_parallel.ddp import DataParallel
from mpoverlap.data_parallel.grad_norm import SquareSum, coalesce

try:  # a private helper of torch's: the device types fused AdamW has kernels for
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
except ImportError:  # pragma: no cover - a torch without it: CUDA and CPU have had them since 2.4
    def _get_fused_kernels_supported_devices() -> List[str]:
        return ["cuda", "cpu"]

# torch 2.13 renamed all_gather_into_tensor; older releases only have the old name.
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_STATE_KEYS = ("exp_avg", "exp_avg_sq")


@dataclass
class _Piece:
    """The part [a, b) (flattened) of parameter `name` that this rank optimises; it sits at
    [lo, hi) of the buffers and `main` is the 1-D view `param_data[lo:hi]` AdamW updates."""

    name: str
    ndim: int
    a: int
    b: int
    lo: int
    hi: int
    main: torch.Tensor
    # Sharded over tensor parallelism (its squares add up over the TP group); replicated
    # parameters count once.
    tp_sharded: bool = False
    # A second copy of a parameter held by another pipeline stage (the tied head's embedding
    # on the last stage): left out of the norm, which counts the first stage's copy.
    pipeline_duplicate: bool = False
    # An expert weight: its squares add up over the expert-parallel group (each rank holds
    # other experts) and, under ZeRO-1, its shards over the expert-data-parallel group.
    expert: bool = False


def param_readers(module: torch.nn.Module):
    """[(submodule, parameters its forward reads)]: every submodule with the parameters it owns,
    plus what a module declares with `foreign_reads()` (a tied head reads the embedding's weight
    without calling the embedding, so the embedding's own pre-hook never runs there)."""
    out = []
    for m in module.modules():
        own = list(m.parameters(recurse=False))
        if own:
            out.append((m, own))
        out.extend(getattr(m, "foreign_reads", lambda: [])())
    return out


class DataParallelAdamW:
    """AdamW over `ddp`'s buffers: weight decay on tensors with ndim >= 2 only.

    `param_gather_overlap` needs `ddp.distributed_optimizer` (there is nothing to gather
    otherwise); asking for it without is an error, not a silent no-op.
    """

    def __init__(self, ddp: DataParallel, *, lr: float = 1e-3, betas=(0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01,
                 param_gather_overlap: bool = False, tp_group=None, pp_group=None, ep_group=None) -> None:
        if param_gather_overlap and not ddp.distributed_optimizer:
            raise ValueError("param_gather_overlap=True needs DataParallel(distributed_optimizer="
                             "True); without it the parameters are never sharded")
        self.ddp = ddp
        self.tp_group = tp_group
        self.pp_group = pp_group
        self.ep_group = ep_group
        self.param_gather_overlap = bool(param_gather_overlap)
        buf = ddp.buffer
        self.pieces: List[_Piece] = []
        for bucket in buf.buckets:
            s_lo, s_hi = ddp.shard_range(bucket.index)
            p_shard, g_shard = ddp.param_shard(bucket.index), ddp.grad_shard(bucket.index)
            for p in bucket.params:
                start, end, _ = buf.index[p]
                lo, hi = max(start, s_lo), min(end, s_hi)
                if lo >= hi:
                    continue
                main = p_shard[lo - s_lo:hi - s_lo]
                main.grad = g_shard[lo - s_lo:hi - s_lo]
                self.pieces.append(_Piece(buf.name_of[p], p.ndim, lo - start, hi - start, lo, hi, main,
                                          bool(getattr(p, "tensor_model_parallel", False)),
                                          bool(getattr(p, "pipeline_duplicate", False)),
                                          bool(getattr(p, "expert_parallel", False))))
        groups = [{"params": [pc.main for pc in self.pieces if pc.ndim >= 2], "weight_decay": weight_decay},
                  {"params": [pc.main for pc in self.pieces if pc.ndim < 2], "weight_decay": 0.0}]
        groups = [g for g in groups if g["params"]]
        # Fused wherever torch has the kernel (CUDA and CPU): one op per group and step. The
        # foreach implementation reads every parameter's step counter on the host (a Python
        # loop over the parameters, `.item()` each) when the counters live on the CPU.
        fused = buf.buckets[0].grad_data.device.type in _get_fused_kernels_supported_devices()
        kind = {"fused": True} if fused else {"foreach": True}
        # A rank whose shards hold only padding has nothing to update (tiny buckets only).
        self.optimizer: Optional[torch.optim.AdamW] = (
            torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, **kind) if groups else None)
        self._fused = fused
        self._step = 0
        self._pending: Dict[int, CommHandle] = {}
        # Gather inputs: a copy of the shard, so the collective's input never aliases its output.
        self._gather_in = [torch.empty(b.numel // ddp.bucket_group(b.index).size, dtype=b.param_data.dtype,
                                       device=b.param_data.device) if self._bucket_gathers(b.index) else None
                           for b in buf.buckets]
        self._init_grad_norm()
        self._hooks = []
        if self.param_gather_overlap and self._gathers:
            for module, params in param_readers(ddp.module):
                owned = sorted({buf.index[p][2] for p in params if p in buf.index})
                if owned:
                    self._hooks.append(module.register_forward_pre_hook(partial(self._wait_buckets, owned)))

    def _bucket_gathers(self, bucket_index: int) -> bool:
        """Under ZeRO-1/2 a bucket reduced over a group of more than one rank is sharded and
        gathered after the step (ZeRO-3 gathers per unit before use instead)."""
        return (self.ddp.distributed_optimizer and not self.ddp.shard_params
                and self.ddp.bucket_group(bucket_index).group is not None)

    @property
    def _gathers(self) -> bool:
        return any(self._bucket_gathers(b.index) for b in self.ddp.buffer.buckets)

    @property
    def param_groups(self) -> list:
        return self.optimizer.param_groups if self.optimizer is not None else []

    @property
    def step_count(self) -> int:
        return self._step

    # ---- step -------------------------------------------------------------------------
    def step(self, lr: float) -> None:
        """Finish the gradient sync if the loop has not, set `lr`, update this rank's part,
        then all-gather the updated shards (waited now, or lazily by the next forward)."""
        self.finish_param_sync()  # a gather still writing the buffer must land before updating
        self.ddp.finish_grad_sync()
        if self.optimizer is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
        self._step += 1
        self.ddp.reshard()  # ZeRO-3: a unit still gathered holds the old values
        if self._gathers:
            self._gather_params()

    def _gather_params(self) -> None:
        ddp, buf = self.ddp, self.ddp.buffer
        for bucket in reversed(buf.buckets):  # forward order: first layers sit in the last bucket
            if not self._bucket_gathers(bucket.index):
                continue
            inp = self._gather_in[bucket.index]
            inp.copy_(ddp.param_shard(bucket.index))
            handle = all_gather(bucket.param_data, inp, ddp.bucket_group(bucket.index).group, mode="dp",
                                ledger=ddp.ledger)
            if self.param_gather_overlap:
                self._pending[bucket.index] = handle.carry_over()  # waited by the next forward
            else:
                handle.wait()

    def _wait_buckets(self, buckets: List[int], _module, _args) -> None:
        for b in buckets:
            handle = self._pending.pop(b, None)
            if handle is not None:
                handle.wait()

    def finish_param_sync(self) -> None:
        """Wait every parameter all-gather still in flight (before eval, checkpoint, step)."""
        for b in sorted(self._pending, reverse=True):
            self._pending.pop(b).wait()

    @property
    def pending_param_gathers(self) -> List[int]:
        return sorted(self._pending)

    # ---- gradient norm ------------------------------------------------------------------
    def _init_grad_norm(self) -> None:
        """The views the norm and the clip read every step, built once: this rank's gradient
        regions merged where adjacent (the whole flat buffer without sharding), and with tensor,
        pipeline or expert parallelism the pieces grouped into the four categories of
        `_sharded_square_sum`, as runs of adjacent pieces (a few per layer, none per element)."""
        ddp = self.ddp
        self._clip_regions, _ = coalesce([ddp.grad_shard(b.index) for b in ddp.buffer.buckets])
        device = ddp.buffer.buckets[0].grad_data.device
        self._sharded = not (self.tp_group is None and self.pp_group is None and self.ep_group is None)
        if not self._sharded:
            self._square_sums = SquareSum(self._clip_regions, device)
            return
        pieces = [pc for pc in self.pieces if not pc.pipeline_duplicate]
        self._square_sums = SquareSum([pc.main.grad for pc in pieces], device,
                                      keys=[(3 - int(pc.tp_sharded)) if pc.expert else int(pc.tp_sharded)
                                            for pc in pieces], num_keys=4)

    def clip_grad_norm(self, max_norm: float) -> float:
        """Global L2 norm of the full averaged gradient; scale gradients by
        max_norm / (norm + 1e-6) when that is < 1 (max_norm <= 0: only compute). A non-finite
        norm is returned without touching the gradients."""
        self.ddp.finish_grad_sync()
        if not self._sharded:
            sq = self._square_sums()[0]
            if self.ddp.distributed_optimizer and self.ddp.group is not None:
                # Each rank holds disjoint shards (expert buckets too: without expert
                # parallelism their group has the dense group's ranks): the squares add up.
                # A small synchronous reduction, not part of the overlapped dp traffic.
                dist.all_reduce(sq, group=self.ddp.group)
        else:
            sq = self._sharded_square_sum()
        norm = float(sq.sqrt())
        if max_norm > 0 and math.isfinite(norm):
            coef = max_norm / (norm + 1e-6)
            if coef < 1.0:
                torch._foreach_mul_(self._clip_regions, coef)
        return norm

    def _sharded_square_sum(self) -> torch.Tensor:
        """Squares of [replicated dense, tp-sharded dense, tp-sharded expert (etp), expert]
        gradients, each reduced over the groups that split it: ZeRO-1 shards (dense over
        dp x cp, experts over edp), TP shards (the tp-sharded two), expert-parallel ranks
        (other experts), then pipeline stages (other layers). Copies of a replicated parameter
        count once."""
        sq4 = self._square_sums()  # a few kernels per run of pieces, not one norm per piece
        if self.ddp.distributed_optimizer:
            for sl, key in ((slice(0, 2), "dense"), (slice(2, 4), "expert")):
                group = self.ddp.reduce_groups[key].group
                if group is not None:
                    dist.all_reduce(sq4[sl], group=group)
        if self.tp_group is not None:
            dist.all_reduce(sq4[1:3], group=self.tp_group)
        if self.ep_group is not None:
            dist.all_reduce(sq4[2:], group=self.ep_group)
        sq = sq4.sum()
        if self.pp_group is not None:  # each stage holds different layers: squares add up
            dist.all_reduce(sq, group=self.pp_group)
        return sq

    def memory_bytes(self) -> Dict[str, int]:
        """Bytes this rank holds for parameters, gradients and optimizer state, from the
        buffers' sizes: persistent storages, plus under ZeRO-3 the peak of gathered units since
        the last `reset_peak` (`gathered`, inside `params`) and under ZeRO-2/3 the peak of
        full gradient buckets alive during backward (`grad_buckets`, not inside `grads`)."""
        ddp = self.ddp
        seen, persistent = set(), {"params": 0, "grads": 0}
        for bucket in ddp.buffer.buckets:
            for kind, t in (("params", bucket.param_data), ("grads", bucket.grad_data)):
                key = t.untyped_storage().data_ptr()
                transient = (ddp.shard_params if kind == "params" else ddp.shard_grads) and ddp.bucket_group(
                    bucket.index).group is not None
                if not transient and key not in seen:
                    seen.add(key)
                    persistent[kind] += t.untyped_storage().nbytes()
        for kind, shards in (("params", ddp._param_shards), ("grads", ddp._grad_shards)):
            if shards is not None:
                persistent[kind] += shards.numel() * shards.element_size()
        gathered = ddp.gatherer.peak_held_bytes if ddp.gatherer is not None else 0
        optim = 0
        if self.optimizer is not None:
            optim = sum(v.numel() * v.element_size() for st in self.optimizer.state.values()
                        for k, v in st.items() if k in _STATE_KEYS)
        return {"params": persistent["params"] + gathered, "gathered": gathered, "grads": persistent["grads"],
                "grad_buckets": ddp.peak_grad_bucket_bytes, "optimizer": optim,
                "grad_residuals": ddp.wire.residual_bytes() if ddp.wire is not None else 0}

    def grad_norm(self) -> float:
        return self.clip_grad_norm(0.0)

    def grads_finite(self) -> bool:
        """True when no rank's gradient holds inf/nan (collective under ZeRO-1)."""
        return math.isfinite(self.grad_norm())

    # ---- checkpoint -----------------------------------------------------------------------
    def piece_moments(self) -> List[tuple]:
        """[(piece, {"exp_avg": 1-D [b - a], "exp_avg_sq": ...} or None before the first step)]:
        this rank's AdamW moments as they are, for a sharded checkpoint (no copy, no collective)."""
        state = self.optimizer.state if self.optimizer is not None else {}
        return [(pc, {k: state[pc.main][k] for k in _STATE_KEYS} if pc.main in state else None)
                for pc in self.pieces]

    def reset_moments(self, step: int) -> List[tuple]:
        """Start AdamW's state over at `step` with zero moments and return [(piece, moments)] to
        fill in place (a sharded checkpoint's load); at step 0 the state stays empty, as fresh."""
        self._step = int(step)
        if self.optimizer is None:
            return []
        self.optimizer.state.clear()
        if self._step == 0:
            return []
        # AdamW keeps `step` as a float tensor: on the device when fused, else on the CPU.
        scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
        out = []
        for pc in self.pieces:
            dev = pc.main.device
            st = {"step": torch.tensor(float(self._step), dtype=scalar, device=dev if self._fused else "cpu")}
            st.update({k: torch.zeros_like(pc.main) for k in _STATE_KEYS})
            self.optimizer.state[pc.main] = st
            out.append((pc, {k: st[k] for k in _STATE_KEYS}))
        return out

    def state_dict(self) -> dict:
        """Full, unsharded AdamW state keyed by parameter name:
        {"step": int, "exp_avg": {name: tensor[param.shape]}, "exp_avg_sq": {...}}.
        Collective over the dp group under the distributed optimizer (every rank calls it)."""
        buf, ddp = self.ddp.buffer, self.ddp
        ref = buf.buckets[0].grad_data
        full = {k: torch.zeros(buf.numel, dtype=ref.dtype, device=ref.device) for k in _STATE_KEYS}
        if self.optimizer is not None:
            for pc in self.pieces:
                st = self.optimizer.state.get(pc.main)
                for k in _STATE_KEYS:
                    if st and k in st:
                        full[k][pc.lo:pc.hi].copy_(st[k])
        for bucket in buf.buckets:
            if ddp.distributed_optimizer and ddp.bucket_group(bucket.index).group is not None:  # sharded state
                lo, hi = ddp.shard_range(bucket.index)
                for k in _STATE_KEYS:
                    _all_gather_tensor(full[k][bucket.offset:bucket.offset + bucket.numel],
                                       full[k][lo:hi].clone(), group=ddp.bucket_group(bucket.index).group)
        out = {"step": self._step, "exp_avg": {}, "exp_avg_sq": {}}
        for p in buf.params:
            start, end, _ = buf.index[p]
            for k in _STATE_KEYS:
                out[k][buf.name_of[p]] = full[k][start:end].view(p.shape).clone()
        return out

    def load_state_dict(self, sd: dict) -> None:
        """Load the full form of `state_dict()` (from any dp size, sharded or not); this rank
        keeps its own part. Strict: every parameter must be present with its shape."""
        buf = self.ddp.buffer
        shapes = {buf.name_of[p]: tuple(p.shape) for p in buf.params}
        for k in _STATE_KEYS:
            got = {n: tuple(t.shape) for n, t in sd[k].items()}
            if got != shapes:
                missing, extra = sorted(set(shapes) - set(got)), sorted(set(got) - set(shapes))
                wrong = sorted(n for n in set(got) & set(shapes) if got[n] != shapes[n])
                raise ValueError(f"optimizer state {k!r} does not match the model: missing {missing}, "
                                 f"unexpected {extra}, wrong shape {wrong}")
        for pc, moments in self.reset_moments(int(sd["step"])):
            for k in _STATE_KEYS:
                moments[k].copy_(sd[k][pc.name].reshape(-1)[pc.a:pc.b])
