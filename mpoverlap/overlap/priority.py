"""overlap.comm_priority: which process groups run NCCL's high-priority streams.

A collective that overlaps computation runs on its communicator's stream while the compute
stream keeps the GPU busy; on a default-priority stream its kernels queue behind compute
kernels and the overlapped handle is waited late (Megatron-LM's `high_priority_stream_groups`
answers the same). With `auto` or `high` the groups of every mode whose handles are waited
under compute (the modes the overlap plan turns on) are created with
`ProcessGroupNCCL.Options(is_high_priority_stream=True)`; `normal` creates every group without
options. Gloo has no streams: the key is accepted there and the plan says it has no effect.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from mpoverlap.parallel.grid import GROUP_KINDS, RankGrid

PRIORITY_CHOICES = ("auto", "high", "normal")

def mode_groups(cfg: Any, grid: RankGrid) -> Dict[str, Tuple[str, ...]]:
    """Each overlap mode -> the group kinds its overlapped handles travel on."""
    experts = (grid.expert_grad_kind(bool(cfg.parallel.sequence_parallel)),) if cfg.model.num_experts > 0 else ()
    return {
        "dp": ("dp_cp",) + experts,  # gradient buckets: dense over dp x cp, experts over edp or tp x edp
        "dp_param_gather": ("dp_cp",) + (("edp",) if experts else ()),  # the distributed optimizer's gather
        "tp": ("tp",), "pp": ("pp",), "cp": ("cp",), "ep": ("ep",), "ep_pairing": ("ep",),
    }


def high_priority_kinds(cfg: Any, world_size: Optional[int] = None) -> Tuple[str, ...]:
    """The group kinds created with high-priority streams on NCCL, in GROUP_KINDS order:
    those of the overlap modes that are on (and that have two or more members), unless
    overlap.comm_priority=normal. Only called on a config the rule engine accepted
    (value.choice checks the value)."""
    from mpoverlap.overlap.config import CommOverlapConfig
    from mpoverlap.overlap.estimate.params import etp_size
    from mpoverlap.overlap.layout import build_layout

    if str(cfg.overlap.comm_priority) == "normal":
        return ()
    lo = build_layout(cfg, world_size)
    grid = RankGrid(tp=lo.tp, cp=lo.cp, dp=lo.dp, pp=lo.pp, ep=lo.ep, etp=etp_size(cfg))
    groups = mode_groups(cfg, grid)
    modes = CommOverlapConfig.from_config(cfg, world_size).modes()
    kinds = {kind for mode, state in modes.items() if state.enabled for kind in groups[mode]}
    return tuple(kind for kind in GROUP_KINDS if kind in kinds and len(grid.groups(kind)[0]) > 1)


def priority_line(cfg: Any, world_size: Optional[int], device_type: str) -> str:
    """The plan's line: what overlap.comm_priority does on this device and which groups."""
    asked = str(cfg.overlap.comm_priority)
    kinds = high_priority_kinds(cfg, world_size)
    which = ", ".join(kinds) if kinds else "none (no overlapped mode has a group here)"
    head = f"    overlap.{'comm_priority':<16} {asked:>5} -> "
    if asked == "normal":
        return head + "every process group on default-priority streams"
    if device_type != "cuda":
        return head + f"no effect on gloo (no streams); on CUDA/NCCL high-priority streams for: {which}"
    return head + f"NCCL high-priority streams for the groups waited under compute: {which}"
