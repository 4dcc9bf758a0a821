"""What the per-step stop agreement costs: the same dp 2 Trainer stepped with and
without it, in the same 2 gloo ranks, in rotating blocks (bench.common.rotating_blocks).

  agreement: `Trainer.train_step()` and the boundary check `Trainer.run()` makes after it, as
             `mpoverlap-train` runs them: the stop agreement's watcher and signaller threads
             running (each rank's watcher in a store wait, its signaller idle), its boundary
             check at each step's end (training/stop_agreement.py)
  none:      the same Trainer and the same check on an agreement of no store: no threads, the
             boundary reads the rank's own flag (what a world-1 run does)

Both sides train the same model on the same data (one Trainer, the sides take turns), so the
difference between their medians is the agreement's cost; the ledger's `stop` figures (none
without a signal) would show any store traffic in a step.

    python -m bench.stop_agreement [--block 8] [--repeats 6] [--layers 2] [--json F]

The closest A/B: one step per block, every step kept, many rounds (each round one step of each
side back to back, the order alternating), read as paired differences (`paired`: the rounds'
mean difference of the step and of rank 0's process CPU per step, with 95% intervals):

    python -m bench.stop_agreement --block 1 --block-warmup 0 --repeats 1500 --max-repeats 1500 \
        --min-quiet 0 --time-budget 600
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
        out = self.trainer.train_step()
        self.stop.at_boundary(self.trainer.step)  # what Trainer.run asks after each step
        return out

    def settle(self) -> None:
        pass

    def collect(self, keep: bool) -> Dict[str, Any]:
        stop = self.trainer.ledger.reset().get("stop", {})  # the ledger's figures of this one step
        return stop if keep else {}


def _worker(rank: int, port: int, args, tmp: str) -> None:
    init_bench_worker(rank, port)
    from mpoverlap.config import compose
    from mpoverlap.training.loop import Trainer
    from mpoverlap.training.stop_agreement import StopAgreement
    from mpoverlap.training.setup import init_distributed

    trainer = None
    try:
        cfg = compose(_overrides(args, tmp))
        trainer = Trainer(cfg, init_distributed(cfg), Path(tmp))
        trainer.stop.start(trainer.step)  # what Trainer.run's install starts (without the handler)
        sides = {"agreement": _Side(trainer, trainer.stop),
                 "none": _Side(trainer, StopAgreement(None, 1, trainer.state.rank, trainer.ledger))}
        blocks = rotating_blocks(sides, args, log_prefix="bench.stop_agreement")
        trainer.stop.restore()
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
            out["paired"] = paired_rounds(blocks, list(sides), args.block)
            Path(args.json_tmp).write_text(json.dumps(out))
    finally:
        close_trainers([trainer] if trainer is not None else [])


def paired_rounds(blocks: List[Dict[str, Any]], names: List[str], steps_per_block: int) -> Dict[str, Any]:
    """The A/B as paired differences: each round steps one block of each side back to back, so
    the machine's drift (other load, frequency, this VM's neighbours) is nearly the same for
    both; per round the agreement's mean step minus none's, and the same for rank 0's process
    CPU per step (its threads and gloo's included): their means over the rounds, standard
    errors and 95% intervals (mean +- 1.96 SE; the rounds independent), and relative to none."""
    a_name, n_name = names
    rounds = [blocks[i:i + 2] for i in range(0, len(blocks) - 1, 2)]

    def per_round(key):
        out = []
        for pair in rounds:
            by = {b["name"]: b for b in pair}
            if set(by) == {a_name, n_name}:
                out.append((key(by[a_name]), key(by[n_name])))
        return out

    def summary(pairs) -> Dict[str, float]:
        d = [a - n for a, n in pairs]
        mean, base = statistics.fmean(d), statistics.fmean(n for _, n in pairs)
        se = statistics.stdev(d) / len(d) ** 0.5 if len(d) > 1 else float("nan")
        return {"rounds": len(d), "mean_diff_ms": mean * 1e3, "se_ms": se * 1e3,
                "ci95_ms": [(mean - 1.96 * se) * 1e3, (mean + 1.96 * se) * 1e3],
                "none_mean_ms": base * 1e3, "relative": mean / base, "ci95_relative": [(mean - 1.96 * se) / base,
                                                                                     (mean + 1.96 * se) / base]}

    step = per_round(lambda b: statistics.fmean(b["times"]))
    cpu = per_round(lambda b: b["own_cpu_s"] / steps_per_block)
    return {"step": summary(step), "cpu_per_step": summary(cpu)} if len(step) > 1 else {}


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
