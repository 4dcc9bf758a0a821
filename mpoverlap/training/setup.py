"""Per-process start-up: device, process group, ParallelState, run directory."""
from __future__ import annotations

import gc
import os
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional, Tuple

import torch
import torch.distributed as dist

from mpoverlap.config import world_size_from_env
from mpoverlap.overlap.cuda_env import device_choice, visible_gpus
from mpoverlap.overlap.layout import build_layout
from mpoverlap.overlap.priority import high_priority_kinds
from mpoverlap.parallel import ParallelState, RankGrid

# Group kinds the training loop never uses (checked with grep: only tests build DDP over "dp").
TRAINER_UNUSED_GROUPS = ("dp", "mp")


def unused_group_kinds(router_spans_tp_and_cp: bool, expert_grads_span_tp: bool = False) -> tuple:
    """The kinds the trainer does not create: TRAINER_UNUSED_GROUPS, "tp_cp" unless the
    MoE router's statistics need it (SP and CP both split the sequences), and "tp_edp" unless
    expert gradients are reduced over it (`RankGrid.expert_grad_kind`)."""
    return (TRAINER_UNUSED_GROUPS + (() if router_spans_tp_and_cp else ("tp_cp",))
            + (() if expert_grads_span_tp else ("tp_edp",)))


def resolve_device(requested: str, world: Optional[int] = None) -> Tuple[torch.device, str]:
    """train.device -> (device, backend). auto: cuda+nccl when every rank on this machine gets
    a GPU of its own, else cpu+gloo (see overlap/cuda_env.py; the rule engine refused an
    explicit cuda without enough GPUs before this runs)."""
    choice, _ = device_choice(requested, world)
    if choice == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank), "nccl"
    return torch.device("cpu"), "gloo"


def init_distributed(cfg: Any) -> ParallelState:
    """Join the process group the launcher set up (env://) and build every parallel group."""
    world = world_size_from_env()
    choice, why = device_choice(cfg.train.device, world)
    if cfg.train.device == "auto" and choice == "cpu" and visible_gpus() > 0 and os.environ.get("RANK", "0") == "0":
        print(f"mpoverlap: {why}", flush=True)  # a GPU machine running on CPU: say why, once
    device, backend = resolve_device(cfg.train.device, world)
    timeout = timedelta(seconds=float(cfg.train.comm_timeout_s))
    if not dist.is_initialized():
        kwargs = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(backend=backend, timeout=timeout, **kwargs)
    lo = build_layout(cfg, dist.get_world_size())
    # parallel.mtp_stage on a middle stage: the groups its MTP chunk's copies sum over (grid.py)
    mtp_stage = int(cfg.parallel.mtp_stage) if cfg.model.mtp_num_layers > 0 else -1
    grid = RankGrid(tp=lo.tp, cp=lo.cp, dp=lo.dp, pp=lo.pp, ep=lo.ep, etp=int(cfg.parallel.etp), mtp_stage=mtp_stage)
    # The trainer reduces dense gradients over dp x cp ("dp_cp") and never talks over "dp"
    # alone or the model-parallel "mp" group: creating them would only cost communicators.
    # "tp_cp" carries only the MoE router's statistics when SP and CP both split sequences.
    moe_sp = cfg.model.num_experts > 0 and bool(cfg.parallel.sequence_parallel)
    skip = unused_group_kinds(moe_sp and lo.tp > 1 and lo.cp > 1,
                              moe_sp and grid.expert_grad_kind(True) == "tp_edp")
    return ParallelState.create(grid, device, timeout_s=float(cfg.train.comm_timeout_s), skip=skip,
                                high_priority=high_priority_kinds(cfg, dist.get_world_size()))


def shutdown_distributed() -> None:
    """Destroy every process group, then free them while the interpreter is fully alive.
    `destroy_process_group` only forgets the groups; each one's gloo threads (and the store's)
    end when the last reference to it goes. Call it after every Trainer of the process was
    closed (Trainer.close breaks the cycles Python's collector cannot see) and dropped: the
    collection here frees the rest of their reference cycles, so every group is destroyed, its
    threads joined, before interpreter exit. Left to interpreter exit, a gloo thread can need
    the GIL of a finalizing interpreter, which ends it inside a destructor: "terminate called
    without an active exception"."""
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


def shared_run_dir(cfg: Any) -> Path:
    """All ranks adopt rank 0's run directory (a timestamp in the default could differ)."""
    chosen = [str(Path(cfg.run.dir).resolve())]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(chosen, src=0)
    run_dir = Path(chosen[0])
    if not dist.is_initialized() or dist.get_rank() == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def agreed_bucket(cfg: Any, state: ParallelState):
    """overlap.dp_bucket_mb for this run (simulate/bucket_size.py: a number as given, auto as the
    simulator chooses for hardware.*). Every rank must build the same buckets (data-parallel
    peers reduce them together; tensor-parallel peers sum sequence-parallel gradient shards of
    the same layout). A preset's choice is a function of the config, the same everywhere; a
    measured machine (hardware.measure) times itself on each rank, so there the largest choice
    is taken over dp x cp, tp and pp (together every rank)."""
    from mpoverlap.simulate.bucket_size import BucketChoice, resolve_bucket_mb

    choice = resolve_bucket_mb(cfg, world_size=state.world)
    if choice.requested != "auto" or not bool(cfg.hardware.measure):
        return choice
    value = torch.tensor([choice.mb], dtype=torch.float64, device=state.device)
    for kind in ("dp_cp", "tp", "pp"):
        if state.size(kind) > 1:
            dist.all_reduce(value, op=dist.ReduceOp.MAX, group=state.group(kind))
    mb = float(value.item())  # once, at start-up
    if mb == choice.mb:
        return choice
    return BucketChoice(mb, "auto", f"{choice.reason}; the largest of the ranks' measured choices: {mb:g} MiB",
                        choice.predicted)
