"""The simulator's model rate timed inside a benchmark's own rounds (bench.modes).

`hardware=measured` times a rank's share of the model (`measure.model_work`) in thread CPU
time. Timed once before and once after a benchmark, that rate can miss the machine the
benchmark ran on: this machine's speed drifts by tens of percent within minutes. A
`ModelRateSide` is a side like the variants: each round runs one block of it on both ranks at
once (as `measure.concurrently` runs two copies), between the variants' blocks, and
`summarize` gives the rate of the median block step, which bench/predict.py uses as the model
rate of the variants it stands for (and, for models with experts, the experts' rate the same
way).
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Dict, List


class ModelRateSide:
    """Per step, one microbatch of forward + backward of `cfg`'s model, as a rank of its layout
    runs its share (`measure.model_work`), and for models with experts one dispatch chunk
    through this rank's experts (`measure.expert_work`), each timed on its own; no
    communication."""

    def __init__(self, cfg: Any) -> None:
        from mpoverlap.overlap.layout import build_layout
        from mpoverlap.simulate.measure import expert_work, model_work

        lo = build_layout(cfg)
        ring = lo.cp if str(cfg.parallel.cp_comm) == "p2p" else 1
        self.work, self.flops = model_work(cfg, pp=lo.pp, vpp=lo.vpp, cp=ring)
        self.expert_work, self.expert_flops = expert_work(cfg, lo) if cfg.model.num_experts else (None, 0.0)
        self._took: Dict[str, float] = {}

    def train_step(self) -> Dict[str, float]:
        t0 = time.thread_time()
        self.work()
        self._took = {"model_thread_s": time.thread_time() - t0}
        if self.expert_work is not None:
            t0 = time.thread_time()
            self.expert_work()
            self._took["expert_thread_s"] = time.thread_time() - t0
        return {}

    def settle(self) -> None:
        pass

    def collect(self, keep: bool) -> Dict[str, float]:
        return dict(self._took)


def machine_of(cfg: Any) -> str:
    """What this machine's measured rates depend on: the model, the micro batch, the precision
    and the layout (`model_work` runs a rank's share). Variants with the same one share a probe
    here, and bench/predict.py keys the rates timed before and after a benchmark by it."""
    return repr([str(cfg.model), cfg.train.micro_batch_size, str(cfg.train.precision), str(cfg.parallel)])


def summarize(per_rank_blocks: List[List[Dict[str, Any]]], probe: str, side: ModelRateSide,
              quiet_cores: float) -> Dict[str, Any]:
    """{model_flops, median_thread_s, samples[, expert_flops]} of probe side `probe` over every
    rank's kept steps in its quiet blocks (other processes used at most `quiet_cores`), as the
    variants' quiet medians are taken, or in all its blocks when none was quiet."""
    mine = [b for blocks in per_rank_blocks for b in blocks if b["name"] == probe]
    quiet = [b for b in mine if b["foreign_cores"] <= quiet_cores]
    steps = [e for b in (quiet or mine) for e in b["extras"]]
    median = statistics.median(e["model_thread_s"] for e in steps)
    out = {"model_flops": side.flops / median, "median_thread_s": median, "samples": len(steps)}
    if side.expert_work is not None:
        out["expert_flops"] = side.expert_flops / statistics.median(e["expert_thread_s"] for e in steps)
    return out


class CommCpuSide:
    """The CPU that communication hidden under compute takes from it, timed in the rounds (for
    the simulator's `comm_cpu_s_per_byte`, bench/ep_pairing.py). Per step, on every rank at
    once: the model's work of `ModelRateSide` alone, then again while one all-to-all of
    `nbytes` per rank (sized to finish inside the work) is in flight on `group`. With each rank
    pinned to its own core (bench.common.init_bench_worker(pin=True)) the work's wall time
    minus its thread CPU time is what the other threads and the kernel took from that core;
    the difference between the two runs, over the bytes this rank sent, is the CPU per byte
    the transfer stole. The idle-loopback probe (`measure.loopback_rate`) counts the process's
    CPU time instead, over every collective: 1.83-1.97 ns per byte on this machine against
    0.80-0.88 here (docs/benchmarks.md, "EP at 1:1")."""

    def __init__(self, cfg: Any, group, nbytes: int) -> None:
        import torch

        from mpoverlap.simulate.measure import model_work
        from mpoverlap.overlap.layout import build_layout

        lo = build_layout(cfg)
        self.work, _ = model_work(cfg, pp=lo.pp, vpp=lo.vpp, cp=1)
        self.group, self.world = group, lo.ep
        rows = max(self.world, nbytes // 4 // self.world * self.world)
        self.send, self.recv = torch.ones(rows), torch.empty(rows)
        # what this rank puts on the wire: all but its own block
        self.sent_bytes = 4 * rows * (self.world - 1) // self.world
        self._took: Dict[str, float] = {}

    def _stolen(self, handle=None) -> float:
        w0, c0 = time.perf_counter(), time.thread_time()
        self.work()
        stolen = (time.perf_counter() - w0) - (time.thread_time() - c0)
        if handle is not None:
            done = handle.is_completed()
            handle.wait()
            self._took["finished_inside"] = float(done)
        return stolen

    def train_step(self) -> Dict[str, float]:
        import torch.distributed as dist

        alone = self._stolen()
        dist.barrier(group=self.group)
        handle = dist.all_to_all_single(self.recv, self.send, group=self.group, async_op=True)
        self._took.update(alone_s=alone, with_comm_s=self._stolen(handle), bytes=float(self.sent_bytes))
        return {}

    def settle(self) -> None:
        pass

    def collect(self, keep: bool) -> Dict[str, float]:
        return dict(self._took)


def summarize_comm_cpu(per_rank_blocks: List[List[Dict[str, Any]]], probe: str, quiet_cores: float) -> Dict[str, Any]:
    """{comm_cpu_s_per_byte, alone_ms, with_comm_ms, finished_inside, samples} of a
    CommCpuSide over every rank's kept steps (quiet blocks when there are any): the median
    stolen time with the exchange minus the median without, over the bytes sent."""
    mine = [b for blocks in per_rank_blocks for b in blocks if b["name"] == probe]
    quiet = [b for b in mine if b["foreign_cores"] <= quiet_cores]
    steps = [e for b in (quiet or mine) for e in b["extras"] if "with_comm_s" in e]
    alone = statistics.median(e["alone_s"] for e in steps)
    with_comm = statistics.median(e["with_comm_s"] for e in steps)
    return {"comm_cpu_s_per_byte": max(0.0, with_comm - alone) / steps[0]["bytes"], "alone_ms": alone * 1e3,
            "with_comm_ms": with_comm * 1e3, "bytes": steps[0]["bytes"], "samples": len(steps),
            "finished_inside": statistics.mean(e.get("finished_inside", 0.0) for e in steps)}
