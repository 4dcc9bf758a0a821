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
