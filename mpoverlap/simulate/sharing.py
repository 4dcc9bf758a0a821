"""Ranks sharing fewer CPU cores than there are ranks (`Hardware.cores`, a measured machine: a
benchmark's 4 gloo ranks on 2 cores).

Compute runs slower by how many ranks want a core at once: a rank runnable (computing) a
fraction r of the step shares the cores with the others' expected (N - 1) r, so its compute
stretches by max(1, (1 + (N - 1) r) / cores). Waiting on an exchange takes no core, so a schedule
that hides more communication computes more of the step and is stretched more. The rates are
slowed by the stretch (`slowed`) and the step simulated again until the fraction r it gives
settles (a damped fixed point). The GPU presets leave `cores` at 0: a device per rank.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

from mpoverlap.simulate.hardware import Hardware


def slowed(hw: Hardware, stretch: float) -> Hardware:
    """`hw` with every compute rate slowed by `stretch` (the update and the CPU of hidden
    communication take `stretch` times as long); links unchanged."""
    return replace(hw, peak_flops=hw.peak_flops / stretch, expert_flops=hw.expert_flops / stretch,
                   update_s_per_param=hw.update_s_per_param * stretch,
                   comm_cpu_s_per_byte=hw.comm_cpu_s_per_byte * stretch,
                   hbm_bw=hw.hbm_bw / stretch if hw.hbm_bw > 0 else 0.0)


def _runnable(r: Any) -> float:
    return min(1.0, r.avg_compute_s / r.step_s) if r.step_s > 0 else 1.0


def with_shared_cores(simulate_on: Callable[[Hardware], Any], hw: Hardware, ranks: int) -> Any:
    """`simulate_on(hardware)` (a core.SimResult) at the fixed point of the stretch for `ranks`
    ranks on `hw.cores` cores; the result's `core_sharing` says where it settled and its MFU is
    against the machine's own peak."""
    stretch, used, r = 1.0, 1.0, None
    for _ in range(30):
        r, used = simulate_on(slowed(hw, stretch)), stretch
        want = max(1.0, (1 + (ranks - 1) * _runnable(r)) / hw.cores)
        if abs(want - stretch) < 1e-4 * stretch:
            break
        stretch = 0.5 * (stretch + want)
    r.mfu /= used  # against the machine's own peak, not the slowed one
    r.core_sharing = {"ranks": ranks, "cores": hw.cores, "stretch": used, "runnable": _runnable(r)}
    return r
