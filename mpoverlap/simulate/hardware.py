"""The machine the simulator predicts for: compute rate, links, memory (from `hardware=<preset>`).

Ranks are placed as the grid orders them (mpoverlap/parallel/grid.py: tp fastest, then cp,
dp, pp), `gpus_per_node` consecutive ranks per node. A group whose ranks all sit in one node
runs on the intra-node link; a group that spans nodes runs on the slowest link it spans, the
inter-node one.
"""
from __future__ import annotations

import re
import subprocess
import time
from dataclasses import dataclass, replace
from typing import Any, Optional


@dataclass(frozen=True)
class Link:
    bandwidth: float  # bytes/s each way, per GPU
    latency: float  # seconds per step of a collective (or per message)
    name: str = "intra"


@dataclass(frozen=True)
class Hardware:
    name: str
    gpus_per_node: int
    peak_flops: float
    gemm_efficiency: float
    hbm_bytes: float
    intra: Link
    inter: Link

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


def from_config(cfg: Any) -> Hardware:
    """The Hardware of `cfg.hardware`; a `measure: true` preset is measured here first."""
    h = cfg.hardware
    hw = Hardware(name=str(h.name), gpus_per_node=int(h.gpus_per_node), peak_flops=float(h.peak_flops),
                  gemm_efficiency=float(h.gemm_efficiency), hbm_bytes=float(h.hbm_gb) * 1e9,
                  intra=Link(float(h.intra_bw), float(h.intra_latency), "intra"),
                  inter=Link(float(h.inter_bw), float(h.inter_latency), "inter"))
    if bool(h.measure):
        hw = measured(hw, cfg)
    return hw


def measured(hw: Hardware, cfg: Any) -> Hardware:
    """`hw` with this machine's one-thread matmul rate (at the model's GEMM shape and the
    config's precision) as its peak (efficiency 1) and, inside a tc-limited namespace, the
    loopback's rate as every link's bandwidth."""
    m, t = cfg.model, cfg.train
    rate = matmul_rate(t.micro_batch_size * m.seq_length, m.hidden_size, m.ffn_hidden_size,
                       bf16=str(t.precision) == "bf16")
    hw = replace(hw, peak_flops=rate, gemm_efficiency=1.0)
    link_rate = tc_rate()
    if link_rate:
        hw = replace(hw, intra=replace(hw.intra, bandwidth=link_rate), inter=replace(hw.inter, bandwidth=link_rate))
    return hw


def matmul_rate(rows: int, hidden: int, ffn: int, bf16: bool = False, repeats: int = 5) -> float:
    """FLOP/s of one thread on an (rows x hidden) @ (hidden x ffn) matmul, best of `repeats`
    (each worker of the benchmarks runs one thread)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        dtype = torch.bfloat16 if bf16 else torch.float32
        a, b = torch.randn(rows, hidden, dtype=dtype), torch.randn(hidden, ffn, dtype=dtype)
        a @ b
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return 2.0 * rows * hidden * ffn / best


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
            f"{hw.gemm_efficiency:.2f}, HBM {hw.hbm_bytes / 1e9:,.0f} GB, intra {hw.intra.bandwidth / 1e9:,.4g} GB/s "
            f"({hw.intra.latency * 1e6:g} us), inter {hw.inter.bandwidth / 1e9:,.4g} GB/s ({hw.inter.latency * 1e6:g} us)")
