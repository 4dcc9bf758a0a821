"""Where a step's host time goes (the throughput part of `make gpu-check`, bench/gpu_throughput.py).

A step whose GPU idles (step time well above its kernels' time) is host-bound: the GPU waits for
launches, or for the host to come back from a synchronizing call. Two profiles of one call each
tell which:

  python_top   cProfile of the step: the Python functions (and the C functions they call, torch's
               operators among them) with most self time. A launch is asynchronous, so on a GPU an
               operator's self time is its host cost (dispatch, autograd, the launch), not its kernel.
  runtime      torch.profiler with CUDA activity: the CUDA runtime and driver calls the step made,
               with their count and host time. Launches (cudaLaunchKernel, cuLaunchKernel*) count
               the kernels; any synchronizing call (cudaStreamSynchronize, cudaDeviceSynchronize,
               cudaEventSynchronize, a device-to-host cudaMemcpy) or allocator call (cudaMalloc,
               cudaFree) with much time is where the host waited.
  aten_top     the same profile's aten operators by self CPU time (host time, launches included).

On CPU `runtime` is empty and the aten times include the kernels' (CPU) work.
"""
from __future__ import annotations

import cProfile
import os
import pstats
import re
from typing import Any, Callable, Dict, List

import torch

_RUNTIME = re.compile(r"^(cuda|cu)[A-Z]")


def _where(filename: str, line: int, name: str) -> str:
    """`file:line(function)` with the file from its package (mpoverlap/..., torch/...) on."""
    if filename == "~":  # a built-in (C) function: pstats names it by itself
        return name
    parts = filename.replace(os.sep, "/").split("/")
    if "site-packages" in parts:  # an installed package: from its name on
        return "/".join(parts[parts.index("site-packages") + 1:]) + f":{line}({name})"
    for anchor in ("mpoverlap", "models", "torch", "bench"):
        if anchor in parts:
            filename = "/".join(parts[len(parts) - 1 - parts[::-1].index(anchor):])
            break
    return f"{filename}:{line}({name})"


def python_top(step: Callable[[], Any], sync: Callable[[], None], n: int = 15) -> List[Dict[str, Any]]:
    """The n functions with most self time over one call of `step` (cProfile), in ms."""
    prof = cProfile.Profile()
    prof.enable()
    step()
    sync()
    prof.disable()
    rows = [{"function": _where(*key), "calls": nc, "self_ms": 1e3 * tt, "cum_ms": 1e3 * ct}
            for key, (_, nc, tt, ct, _) in pstats.Stats(prof).stats.items()]
    return sorted(rows, key=lambda r: -r["self_ms"])[:n]


def runtime_and_aten(step: Callable[[], Any], device: torch.device, sync: Callable[[], None],
                     n: int = 15) -> Dict[str, List[Dict[str, Any]]]:
    """One call of `step` under torch.profiler (CPU, and CUDA where the step runs there): the CUDA
    runtime/driver calls (all of them) and the n aten operators with most self CPU time, in ms."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
        sync()
    runtime, aten = [], []
    for e in prof.key_averages():
        if getattr(e, "device_type", DeviceType.CPU) != DeviceType.CPU:
            continue  # a kernel: bench/gpu_throughput.py top_kernels counts those
        row = {"name": e.key[:120], "calls": e.count, "self_ms": e.self_cpu_time_total / 1e3}
        if _RUNTIME.match(e.key):
            runtime.append(row)
        elif e.key.startswith("aten::"):
            aten.append(row)
    return {"runtime": sorted(runtime, key=lambda r: -r["self_ms"]),
            "aten_top": sorted(aten, key=lambda r: -r["self_ms"])[:n]}


def host_profile(step: Callable[[], Any], device: torch.device, sync: Callable[[], None]) -> Dict[str, Any]:
    """Both profiles, each over one more call of `step` (see the module docstring)."""
    return {"python_top": python_top(step, sync), **runtime_and_aten(step, device, sync)}
