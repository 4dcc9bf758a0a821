"""What the per-step stop agreement costs (issue 48): the same dp 2 Trainer stepped with and
without it, in the same 2 gloo ranks, in rotating blocks (bench.common.rotating_blocks).

  agreement: `Trainer.train_step()` as `mpoverlap-train` runs it: each step issues the stop
             flag's 4-byte MAX all-reduce over the world at its start and reads it with the
             gradient norm (training/preemption.py: StopAgreement)
  none:      the same Trainer with a StopAgreement of no group: nothing issued, the norm read
             alone (what every step did before issue 48)

Both sides train the same model on the same data (one Trainer, the sides take turns), so the
difference between their medians is the agreement's cost; the ledger's `stop` figures give its
in-flight and exposed time per step.

    python -m bench.stop_agreement [--block 8] [--repeats 6] [--layers 2] [--json F]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any, Dict, List

from bench.common import add_block_args, close_trainers, init_bench_worker, json_cli, rotating_blocks, spawn_ranks, \
    stats


def _overrides(args, run_dir: str) -> List[str]:
    return ["parallel.dp=2", "model=gpt_tiny", f"model.num_layers={args.layers}", f"model.hidden_size={args.hidden}",
            f"model.ffn_hidden_size={4 * args.hidden}", "model.seq_length=64", "train.micro_batch_size=4",
            "train.global_batch_size=16", "train.steps=100000", "train.progress=false", "checkpoint.interval=0",
            "checkpoint.resume=none", "data.max_bytes=1000000", f"run.dir={run_dir}"]


class _Side:
    def __init__(self, trainer, stop) -> None:
        self.trainer, self.stop = trainer, stop

    def train_step(self) -> Dict[str, Any]:
        self.trainer.stop = self.stop
        return self.trainer.train_step()

    def settle(self) -> None:
        pass

    def collect(self, keep: bool) -> Dict[str, Any]:
        stop = self.trainer.ledger.reset().get("stop", {})  # the ledger's figures of this one step
        return stop if keep else {}


def _worker(rank: int, port: int, args, tmp: str) -> None:
    init_bench_worker(rank, port)
    from mpoverlap.config import compose
    from mpoverlap.training.loop import Trainer
    from mpoverlap.training.preemption import StopAgreement
    from mpoverlap.training.setup import init_distributed

    trainer = None
    try:
        cfg = compose(_overrides(args, tmp))
        trainer = Trainer(cfg, init_distributed(cfg), Path(tmp))
        sides = {"agreement": _Side(trainer, trainer.stop),
                 "none": _Side(trainer, StopAgreement(None, trainer.state.device, trainer.ledger))}
        blocks = rotating_blocks(sides, args, log_prefix="bench.stop_agreement")
        if rank == 0:
            out: Dict[str, Any] = {"config": _overrides(args, "<tmp>"), "blocks": len(blocks)}
            for name in sides:
                mine = [b for b in blocks if b["name"] == name]
                times = [t for b in mine for t in b["times"]]
                quiet = [t for b in mine if b["foreign_cores"] <= args.quiet_cores for t in b["times"]]
                out[name] = {"step_s": stats(times), "step_s_quiet": stats(quiet) if quiet else None,
                             "steps": len(times), "quiet_steps": len(quiet)}
                stop = [e for b in mine for e in b["extras"] if e]
                if stop:
                    out[name]["stop_per_step"] = {k: statistics.median(e[k] for e in stop)
                                                  for k in ("ops", "bytes", "time_s", "exposed_s")}
            a, n = out["agreement"]["step_s"]["median_s"], out["none"]["step_s"]["median_s"]
            out["ratio_agreement_over_none"] = a / n
            Path(args.json_tmp).write_text(json.dumps(out))
    finally:
        close_trainers([trainer] if trainer is not None else [])


def run(args) -> Dict[str, Any]:
    result, _ = spawn_ranks(_worker, args, "mpo-bench-stop-")
    return result


def add_args(p: argparse.ArgumentParser) -> None:
    add_block_args(p, block=8, repeats=6, max_repeats=20, min_quiet=3, time_budget=60.0, warmup=3, unit="side")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)


def main() -> None:
    json_cli(__doc__, add_args, run)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
