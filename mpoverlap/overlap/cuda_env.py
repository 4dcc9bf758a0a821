"""What the machine offers a CUDA run: visible GPUs against ranks per node, and the
CUDA_DEVICE_MAX_CONNECTIONS setting TP/CP overlap depends on.

One place decides, so the rule engine (before any worker starts), the self-launcher and each
worker's device choice agree:
- `train.device=auto` runs on CUDA only when every rank on this machine gets a GPU of its own
  (rank i uses cuda:i); with fewer GPUs than ranks it runs on CPU and says why in the plan.
  `train.device=cuda` with too few GPUs is refused (rule `train.device_available`).
- `CUDA_DEVICE_MAX_CONNECTIONS` must be 1 for TP/CP overlap on CUDA (one hardware queue keeps
  a GEMM issued after a collective from running ahead of it). Unset, the self-launcher sets it
  for its workers and a torchrun worker sets it for itself before CUDA starts, only when TP or
  CP overlap is on. A value the user set to something else wins: `auto` turns the mode off
  with that reason, `true` is refused (rule `cuda.max_connections`).
"""
from __future__ import annotations

import os
from typing import Any, Optional, Tuple

ENV_MAX_CONNECTIONS = "CUDA_DEVICE_MAX_CONNECTIONS"


def visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def ranks_per_node(world: Optional[int]) -> Optional[int]:
    """Processes on this machine: torchrun's LOCAL_WORLD_SIZE, else (self-launch) the world."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local is not None and local.strip().isdigit():
        return int(local)
    return world


def device_choice(requested: str, world: Optional[int]) -> Tuple[str, str]:
    """train.device -> ("cuda" | "cpu", why). `world` is the run's world size (None: unknown)."""
    if requested == "cpu":
        return "cpu", "train.device=cpu"
    if requested == "cuda":
        return "cuda", "train.device=cuda"
    gpus = visible_gpus()
    if gpus == 0:
        return "cpu", "train.device=auto: no GPU visible"
    ranks = ranks_per_node(world)
    if ranks is not None and ranks > gpus:
        return "cpu", (f"train.device=auto: {ranks} ranks on this machine but {gpus} visible GPU(s), one "
                       f"needed per rank; running on CPU (gloo). To use the GPUs run at most {gpus} ranks "
                       f"per node, or set train.device=cpu to silence this")
    return "cuda", f"train.device=auto: {gpus} visible GPU(s) for {ranks or '?'} rank(s) on this machine"


def user_max_connections() -> Optional[str]:
    """The user's CUDA_DEVICE_MAX_CONNECTIONS when it is set to something other than 1."""
    value = os.environ.get(ENV_MAX_CONNECTIONS)
    return value if value is not None and value.strip() != "1" else None


def max_connections_conflict(cfg: Any, world: Optional[int]) -> Optional[str]:
    """The conflicting value when the run is on CUDA and the user set CUDA_DEVICE_MAX_CONNECTIONS
    to something other than 1; None otherwise (CPU runs do not care)."""
    value = user_max_connections()
    if value is None or cfg.train.device == "cpu":
        return None
    if device_choice(cfg.train.device, world)[0] != "cuda":
        return None
    return value


def max_connections_reason(value: str) -> str:
    return (f"{ENV_MAX_CONNECTIONS}={value} in the environment: with more than one hardware queue the GPU "
            f"may run a GEMM issued after a collective ahead of it and the overlap is lost; unset it or "
            f"export {ENV_MAX_CONNECTIONS}=1 to overlap")


def apply_max_connections(overlap: Any) -> bool:
    """Set CUDA_DEVICE_MAX_CONNECTIONS=1 in this process's environment when TP or CP overlap is
    on and the user did not set it (before CUDA starts: the driver reads it when the context is
    created; the self-launcher calls this before spawning, so its workers inherit it). Returns
    True when it set it."""
    if (overlap.tp.enabled or overlap.cp.enabled) and ENV_MAX_CONNECTIONS not in os.environ:
        os.environ[ENV_MAX_CONNECTIONS] = "1"
        return True
    return False
