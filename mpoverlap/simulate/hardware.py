"""The machine the simulator predicts for: compute rate, links, memory (from `hardware=<preset>`).

Ranks are placed as the grid orders them (mpoverlap/parallel/grid.py: tp fastest, then cp,
dp, pp), `gpus_per_node` consecutive ranks per node. A group whose ranks all sit in one node
runs on the intra-node link; a group that spans nodes runs on the slowest link it spans, the
inter-node one.
"""
from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any, Dict, Optional, Sequence, Tuple


COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")


@dataclass(frozen=True)
class Link:
    bandwidth: float  # bytes/s each way, per GPU
    latency: float  # seconds per step of a collective (or per message)
    name: str = "intra"
    # (op, fraction of `bandwidth` the collective reaches) for the ops that do not reach all of
    # it (hardware.collective_efficiency); an op not listed reaches 1.0
    efficiency: Tuple[Tuple[str, float], ...] = ()

    def op_bandwidth(self, op: str) -> float:
        """Bytes/s a rank sends at in collective `op` on this link."""
        return self.bandwidth * dict(self.efficiency).get(op, 1.0)


@dataclass(frozen=True)
class Hardware:
    name: str
    gpus_per_node: int
    peak_flops: float
    gemm_efficiency: float
    hbm_bytes: float
    intra: Link
    inter: Link
    # Seconds per parameter of a rank's work after the last backward (gradient norm, clip,
    # AdamW, zeroing the gradient buffer): charged once per step; 0 = not modelled (the GPU
    # presets, where it is a small part of the step).
    update_s_per_param: float = 0.0
    # CPU seconds a rank spends per byte it sends when its collectives run on the cores that
    # compute (gloo on CPU ranks): communication hidden under compute still takes this CPU time
    # from it. 0 = communication takes no compute time (GPUs: NCCL on its own SMs).
    comm_cpu_s_per_byte: float = 0.0
    # FLOP/s a rank's routed experts run at on one dispatch chunk's rows (many small GEMMs):
    # how long the experts hide the token exchanges under EP overlap. 0 = `flops`.
    expert_flops: float = 0.0
    # HBM bytes/s (hardware.hbm_bw): the rate of the memory-bound time (memory.py: norms,
    # activations, casts, the fp32 loss, the update). 0 = not modelled: the preset's
    # gemm_efficiency covers the whole step (fitted end to end, or measured on the model).
    hbm_bw: float = 0.0
    # CPU cores the ranks of a measured machine share (`measured_rates`: this machine's); 0 =
    # every rank computes on a device of its own (the GPU presets). With more ranks than cores
    # the simulator stretches compute by how many ranks want a core at once (core.simulate).
    cores: int = 0
    # dense FP8 tensor-core FLOP/s (hardware.fp8_peak_flops): the peak of the GEMMs
    # train.precision=fp8 covers, reached at the same gemm_efficiency; 0 = no FP8 GEMMs
    fp8_peak_flops: float = 0.0

    def memory_seconds(self, nbytes: float) -> float:
        """Seconds `nbytes` of elementwise traffic take at the HBM bandwidth (0 when not modelled)."""
        return nbytes / self.hbm_bw if self.hbm_bw > 0 else 0.0

    @property
    def flops(self) -> float:
        """The rate compute runs at: peak x the fraction a large GEMM reaches."""
        return self.peak_flops * self.gemm_efficiency

    def group_link(self, stride: int, size: int, first: int = 0) -> Link:
        """The link of a group of `size` ranks `stride` apart starting at rank `first`: intra-node
        when every member shares the first one's node, else the inter-node link."""
        if size <= 1:
            return self.intra
        g = self.gpus_per_node
        return self.intra if first // g == (first + (size - 1) * stride) // g else self.inter


def from_config(cfg: Any, rates: Optional[Sequence[Dict[str, float]]] = None) -> Hardware:
    """The Hardware of `cfg.hardware`; a `measure: true` preset is measured here first, or, given
    `rates` (`measured_rates` results taken earlier, e.g. before and after a benchmark), takes
    their mean (`with_rates`)."""
    h = cfg.hardware
    eff = collective_efficiency(h)
    hw = Hardware(name=str(h.name), gpus_per_node=int(h.gpus_per_node), peak_flops=float(h.peak_flops),
                  gemm_efficiency=float(h.gemm_efficiency), hbm_bytes=float(h.hbm_gb) * 1e9,
                  intra=Link(float(h.intra_bw), float(h.intra_latency), "intra", eff),
                  inter=Link(float(h.inter_bw), float(h.inter_latency), "inter", eff),
                  hbm_bw=float(h.get("hbm_bw", 0.0) or 0.0),
                  fp8_peak_flops=float(h.get("fp8_peak_flops", 0.0) or 0.0))
    if bool(h.measure):
        hw = with_rates(hw, cfg, rates or [measured_rates(cfg)])
    return hw


def fp8_speedup(cfg: Any, hw: Hardware) -> float:
    """How many times faster than at the bf16 rate the GEMMs train.precision=fp8 covers run on
    `hw` (its FP8 peak over its bf16 peak); 1.0 under any other precision. Raises ConfigError
    where the preset has no FP8 rate (A100, the measured CPU)."""
    from mpoverlap.config import ConfigError

    if str(cfg.train.precision) != "fp8":
        return 1.0
    if not hw.fp8_peak_flops > 0:
        raise ConfigError(f"train.precision=fp8 with hardware={hw.name}: the preset has no FP8 GEMM rate "
                          f"(hardware.fp8_peak_flops={hw.fp8_peak_flops:g}; A100 has no FP8 tensor cores, the measured "
                          "CPU times none), so the step cannot be predicted; fix: hardware=h100_sxm (or "
                          "hardware=h200_sxm), or train.precision=bf16")
    return hw.fp8_peak_flops / hw.peak_flops


def collective_efficiency(h: Any) -> Tuple[Tuple[str, float], ...]:
    """`hardware.collective_efficiency` as Link.efficiency; each fraction must be positive."""
    from mpoverlap.config import ConfigError

    out = []
    for op in COLLECTIVES:
        value = float(h.collective_efficiency[op])
        if not value > 0:
            raise ConfigError(f"hardware.collective_efficiency.{op}={value}: the fraction of the link's bandwidth "
                              f"a collective reaches must be positive; fix: hardware.collective_efficiency.{op}=1.0")
        if value != 1.0:
            out.append((op, value))
    return tuple(out)


def measured_rates(cfg: Any) -> Dict[str, float]:
    """This machine timed now for `cfg` (the rates in measure.py, thread CPU time, one torch
    thread as each benchmark worker runs); plain floats, to keep beside a measurement:
    - peak_flops: one thread's matmul rate at the model's MLP shape (best of its repeats);
    - model_flops: the median rate one thread runs this model's forward + backward at (its
      FLOPs as `flops_per_token` counts them) while as many copies run at once as the layout
      has ranks on this machine (at most one per core), run as a rank runs its share (the
      pipeline's chunks when pp x vpp > 1; each cp rank's tokens through ring attention when
      cp > 1 over the p2p ring);
    - update_s_per_param: the step's work after the last backward, per parameter;
    - expert_flops (models with experts, else 0): the median rate one thread runs this rank's
      experts at, forward + backward, on one dispatch chunk's rows (`expert_rate`);
    - comm_cpu_s_per_byte: CPU seconds (process time, gloo's threads and the kernel's
      loopback included) per byte a rank sends, from `loopback_rate`'s probe of `world` ranks;
    - cores: the cores this process may run on (the ranks of a benchmark share them);
    - link_bytes_s, link_latency, link_efficiency: what that probe's ranks moved together in an
      all-reduce, its latency per collective step and each collective's rate over the
      all-reduce's, or 0 (and {}) outside a namespace whose loopback carries a tbf rate;
    - at: when (Unix seconds)."""
    import time

    from mpoverlap.overlap.layout import build_layout
    from mpoverlap.simulate.measure import expert_rate, matmul_rate, model_rate, update_seconds_per_param

    m, t = cfg.model, cfg.train
    bf16 = str(t.precision) == "bf16"
    at = time.time()
    peak = matmul_rate(t.micro_batch_size * m.seq_length, m.hidden_size, m.ffn_hidden_size, bf16=bf16)
    lo = build_layout(cfg)
    world = lo.world or 1
    copies = min(world, os.cpu_count() or 1)  # the ranks that compute at once on this machine
    ring = lo.cp if str(cfg.parallel.cp_comm) == "p2p" else 1
    rate = model_rate(cfg, copies=copies, pp=lo.pp, vpp=lo.vpp, cp=ring)
    probe = loopback_probe(max(2, world))
    shaped = tc_rate() is not None
    return {"peak_flops": peak, "model_flops": rate,
            "update_s_per_param": update_seconds_per_param(cfg, copies=copies),
            "expert_flops": expert_rate(cfg, lo, copies=copies) if m.num_experts else 0.0,
            "comm_cpu_s_per_byte": probe["cpu_s_per_byte"], "cores": available_cores(),
            "link_bytes_s": probe["bytes_s"] if shaped else 0.0,
            "link_latency": probe["latency"] if shaped else 0.0,
            "link_efficiency": dict(probe["efficiency"]) if shaped else {}, "at": at}


def available_cores() -> int:
    """The cores this process may run on (its affinity; the machine's where that is unknown)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def with_rates(hw: Hardware, cfg: Any, rates: Sequence[Dict[str, float]]) -> Hardware:
    """`hw` with the mean of `rates` (`measured_rates` results) for `cfg`:
    - peak_flops the mean peak, gemm_efficiency the mean model rate over it (the peak is at
      least that rate: a noisy peak below the model's own rate would cap the efficiency and
      slow the model);
    - update_s_per_param, expert_flops, comm_cpu_s_per_byte: their means; cores the fewest
      (0 where a result predates the key);
    - bandwidth, latency and each collective's efficiency: the probe's (inside a namespace whose
      loopback carries a tbf rate, as bench/netns.sh sets it), else the preset's inter_bw,
      inter_latency and collective_efficiency (bench/predict.py sets them to that probe's
      results inside bench/netns.sh, or to the nominal rate); the
      bandwidth divided by the world size: the loopback is one queue that every rank's sends
      pass through, and the symmetric collectives send from every rank at once."""
    from mpoverlap.overlap.layout import build_layout

    if not rates:
        raise ValueError("with_rates needs at least one measured_rates result")

    def mean(key: str) -> float:
        return sum(float(r[key]) for r in rates) / len(rates)

    world = build_layout(cfg).world or 1
    rate = mean("model_flops")
    peak = max(mean("peak_flops"), rate)
    shaped = all(r["link_bytes_s"] > 0 for r in rates)
    link = (mean("link_bytes_s") if shaped else hw.inter.bandwidth) / world
    latency = mean("link_latency") if shaped else hw.inter.latency
    efficiency = hw.inter.efficiency
    if shaped and all(r.get("link_efficiency") for r in rates):
        efficiency = tuple((op, sum(r["link_efficiency"][op] for r in rates) / len(rates)) for op in COLLECTIVES)
    # the model's measured rate covers its whole forward and backward, elementwise work included:
    # no separate memory-bound time (hbm_bw 0)
    return replace(hw, peak_flops=peak, gemm_efficiency=rate / peak, update_s_per_param=mean("update_s_per_param"),
                   hbm_bw=0.0,
                   expert_flops=mean("expert_flops"), comm_cpu_s_per_byte=mean("comm_cpu_s_per_byte"),
                   cores=min(int(r.get("cores", 0) or 0) for r in rates),
                   intra=replace(hw.intra, bandwidth=link, latency=latency, efficiency=efficiency),
                   inter=replace(hw.inter, bandwidth=link, latency=latency, efficiency=efficiency))


@lru_cache(maxsize=None)
def loopback_probe(world: int, prefix: Tuple[str, ...] = ()) -> Dict[str, Any]:
    """loopback.loopback_rate(world), once per process and `prefix`, run as `python -m
    mpoverlap.simulate.loopback` (its ranks are spawned from that module's own __main__) after
    the command `prefix` (e.g. bench/netns.sh, to run it on a shaped loopback)."""
    import json
    import sys

    proc = subprocess.run(list(prefix) + [sys.executable, "-W", "ignore", "-m", "mpoverlap.simulate.loopback",
                                          "--world", str(world)], capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"loopback probe failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_rate(text: str) -> Optional[float]:
    """Bytes/s of the first `rate <n><unit>bit` (tc's notation) in `text`, else None."""
    found = re.search(r"rate (\d+(?:\.\d+)?)([kmgt]?)bit", text, re.IGNORECASE)
    if not found:
        return None
    return float(found.group(1)) * _UNITS[found.group(2).lower()] / 8


def tc_rate(device: str = "lo") -> Optional[float]:
    """The tbf rate on `device` in this network namespace (bytes/s), or None."""
    try:
        out = subprocess.run(["tc", "qdisc", "show", "dev", device], capture_output=True, text=True,
                             timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_rate(out)


def describe(hw: Hardware) -> str:
    return (f"{hw.name}: {hw.gpus_per_node} GPUs/node, {hw.peak_flops / 1e12:,.4g} TFLOP/s peak x "
            f"{hw.gemm_efficiency:.2f}, HBM {hw.hbm_bytes / 1e9:,.0f} GB"
            + (f" at {hw.hbm_bw / 1e12:,.4g} TB/s" if hw.hbm_bw > 0 else "") + f", intra {hw.intra.bandwidth / 1e9:,.4g} GB/s "
            f"({hw.intra.latency * 1e6:g} us), inter {hw.inter.bandwidth / 1e9:,.4g} GB/s ({hw.inter.latency * 1e6:g} us)"
            + (f", update {hw.update_s_per_param * 1e9:.2f} ns/parameter" if hw.update_s_per_param > 0 else "")
            + (f", communication CPU {hw.comm_cpu_s_per_byte * 1e9:.2f} ns/byte" if hw.comm_cpu_s_per_byte > 0 else "")
            + (f", experts {hw.expert_flops / 1e12:,.4g} TFLOP/s" if hw.expert_flops > 0 else "")
            + ("".join(f", {op} at {x:.2f} of the link" for op, x in hw.inter.efficiency)))
