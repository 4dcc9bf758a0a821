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
    """`hw` measured on this machine for `cfg`:
    - peak_flops: one thread's matmul rate at the model's MLP shape (each benchmark worker runs
      one thread), gemm_efficiency: the rate one thread runs this model's forward + backward at
      (its FLOPs as `flops_per_token` counts them, over the best time), over that peak;
    - bandwidth: the loopback's tbf rate in this namespace (`tc qdisc show dev lo`; else the
      preset's inter_bw), divided by the world size: the loopback is one queue that every
      rank's sends pass through, and the symmetric collectives send from every rank at once."""
    m, t = cfg.model, cfg.train
    bf16 = str(t.precision) == "bf16"
    peak = matmul_rate(t.micro_batch_size * m.seq_length, m.hidden_size, m.ffn_hidden_size, bf16=bf16)
    rate = model_rate(cfg)
    from mpoverlap.overlap.layout import build_layout

    world = build_layout(cfg).world or 1
    link = (tc_rate() or hw.inter.bandwidth) / world
    return replace(hw, peak_flops=peak, gemm_efficiency=min(1.0, rate / peak),
                   intra=replace(hw.intra, bandwidth=link), inter=replace(hw.inter, bandwidth=link))


def matmul_rate(rows: int, hidden: int, ffn: int, bf16: bool = False, repeats: int = 10) -> float:
    """FLOP/s of one thread on an (rows x hidden) @ (hidden x ffn) matmul, best of `repeats`.
    Timed in the thread's CPU time (one torch thread computes in the caller's thread), so other
    processes' load on the machine does not enter the rate."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        dtype = torch.bfloat16 if bf16 else torch.float32
        a, b = torch.randn(rows, hidden, dtype=dtype), torch.randn(hidden, ffn, dtype=dtype)
        a @ b
        best = float("inf")
        for _ in range(repeats):
            t0 = time.thread_time()
            a @ b
            best = min(best, time.thread_time() - t0)
    finally:
        torch.set_num_threads(threads)
    return 2.0 * rows * hidden * ffn / best


def model_rate(cfg: Any, repeats: int = 5) -> float:
    """FLOP/s of one thread running forward + backward of the whole model (one process, one
    microbatch of random tokens), best of `repeats` after a warm-up."""
    import torch

    from mpoverlap.models.gpt import GPT, flops_per_token

    m, t = cfg.model, cfg.train
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = GPT(m, seed=0)
        tokens = torch.randint(0, m.vocab_size, (t.micro_batch_size, m.seq_length + 1))
        autocast = torch.autocast("cpu", torch.bfloat16, enabled=str(t.precision) == "bf16")
        best = float("inf")
        for i in range(repeats + 1):
            t0 = time.thread_time()
            with autocast:
                loss = model.loss(model(tokens[:, :-1]), tokens[:, 1:])
            loss.backward()
            if i:
                best = min(best, time.thread_time() - t0)
    finally:
        torch.set_num_threads(threads)
    return flops_per_token(m) * t.micro_batch_size * m.seq_length / best


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
