"""The host time the batch built ahead (training/prefetch.py) takes off the step, on CPU.

One process (world 1), a tiny model and a large global batch, where building the batch (a
Python loop over this rank's samples) is a visible part of the step. Two sides in alternating
blocks of steps on the same Trainer: `ahead` (the Trainer's prefetcher, the next batch built
on its thread while the step runs) and `inline` (the same prefetcher with ahead=False: every
batch built in the step's thread, as before the prefetcher). Each step is timed around the
whole `train_step` call, the batch's wait included (`median_ms`), and the step thread's wait for
its batch alone (`batch_wait_ms`: the host time building takes on the critical path; the
first step of each `ahead` block waits for a whole build); `build_ms` is one batch built alone.

    python -m bench.data_ahead [--global-batch 256] [--micro-batch 2] [--layers 1] [--hidden 64]
                               [--seq 64] [--steps 10] [--blocks 3] [--json F]

In `make bench` (bench/run.py) at its defaults; `--skip-data-ahead` leaves it out.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

from bench.common import json_cli, stats


def measure(args: argparse.Namespace) -> Dict[str, Any]:
    from mpoverlap.config import compose
    from mpoverlap.parallel import ParallelState
    from mpoverlap.training.loop import Trainer
    from mpoverlap.training.prefetch import BatchPrefetcher

    run_dir = Path(tempfile.mkdtemp(prefix="data-ahead-"))
    steps_total = 2 + 2 * args.blocks * args.steps + 1
    overrides = ["model=gpt_tiny", f"model.num_layers={args.layers}", f"model.hidden_size={args.hidden}",
                 f"model.ffn_hidden_size={4 * args.hidden}", "model.num_attention_heads=2",
                 f"model.seq_length={args.seq}", f"train.global_batch_size={args.global_batch}",
                 f"train.micro_batch_size={args.micro_batch}", "data=stdlib", "train.device=cpu",
                 f"train.steps={steps_total}", f"run.dir={run_dir}"]
    trainer = Trainer(compose(overrides), ParallelState.single(), run_dir)
    ahead = trainer.batches
    inline = BatchPrefetcher(trainer._rank_batch, trainer.state.device, ahead=False)
    times: Dict[str, List[float]] = {"ahead": [], "inline": []}
    waits: Dict[str, List[float]] = {"ahead": [], "inline": []}

    def timed(side: str, prefetcher: BatchPrefetcher):
        get = prefetcher.get

        def wrapped(step, next_step=None):
            t0 = time.perf_counter()
            try:
                return get(step, next_step)
            finally:
                waits[side].append(time.perf_counter() - t0)
        prefetcher.get = wrapped
        return prefetcher

    timed("ahead", ahead)
    timed("inline", inline)
    try:
        for _ in range(2):  # warm-up: allocator, the epoch permutation
            trainer.train_step()
        waits["ahead"].clear()
        for block in range(2 * args.blocks):
            side = ("inline", "ahead")[block % 2]
            trainer.batches = ahead if side == "ahead" else inline
            ahead.close()  # each block starts with nothing built ahead: its first step waits
            for _ in range(args.steps):
                t0 = time.perf_counter()
                trainer.train_step()
                times[side].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        trainer._rank_batch(trainer.step)
        build_s = time.perf_counter() - t0
    finally:
        trainer.batches = ahead
        trainer.close()
    out = {"overrides": overrides, "build_ms": 1e3 * build_s}
    for side, xs in times.items():
        st = stats(xs)
        out[side] = {"n": st.pop("n"), **{k[:-2] + "_ms": 1e3 * v for k, v in st.items()}}
        out[side]["batch_wait_ms"] = {k[:-2] + "_ms": 1e3 * v for k, v in stats(waits[side]).items() if k != "n"}
    out["saved_ms_per_step"] = out["inline"]["median_ms"] - out["ahead"]["median_ms"]
    out["batch_wait_saved_ms"] = out["inline"]["batch_wait_ms"]["median_ms"] - out["ahead"]["batch_wait_ms"]["median_ms"]
    return out


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--global-batch", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--blocks", type=int, default=3)


def render(results: Dict[str, Any]) -> str:
    """results.md's section of `measure`'s result ("" when the run has none)."""
    res = results.get("data_ahead")
    if not res:
        return ""
    lines = ["## Batch built ahead (training/prefetch.py), world 1", "",
             f"Overrides: `{' '.join(o for o in res['overrides'] if not o.startswith('run.dir='))}`; "
             f"one batch built alone: {res['build_ms']:.1f} ms.", "",
             "| side | median step (ms) | IQR (ms) | steps | batch wait, median (ms) | batch wait IQR (ms) |",
             "|---|---:|---:|---:|---:|---:|"]
    for side in ("inline", "ahead"):
        r, w = res[side], res[side]["batch_wait_ms"]
        lines.append(f"| {side} | {r['median_ms']:.1f} | {r['q1_ms']:.1f}-{r['q3_ms']:.1f} | {r['n']} | "
                     f"{w['median_ms']:.2f} | {w['q1_ms']:.2f}-{w['q3_ms']:.2f} |")
    lines += ["", f"inline - ahead: {res['saved_ms_per_step']:.1f} ms a step, {res['batch_wait_saved_ms']:.2f} ms "
              "of batch wait.", ""]
    return "\n".join(lines)


def main() -> None:
    json_cli(__doc__, add_args, measure)


if __name__ == "__main__":
    main()
