"""Framework overhead at dp=1: mpoverlap's real training step against a plain PyTorch loop.

Both sides train the same model class (`GPT(cfg.model, seed)`) on the same batches (same
micro batch, same number of microbatches, same sequence length), with AdamW(foreach=True),
the same weight-decay split, gradient clipping and the same learning rate, in ONE process:

  framework: `Trainer(cfg, state, run_dir).train_step()` after a 1-rank gloo process group
             and `init_distributed(cfg)` (DataParallel + DataParallelAdamW, ledger, schedule)
  plain:     zero_grad, forward/backward per microbatch, clip_grad_norm_, AdamW.step

They alternate in blocks (`--block` steps each, the side that goes first alternating) so
clock drift and other load on the machine hit both; warmup steps and the first step of every
block are discarded; medians are reported. Every timed step is the wall time of the whole
call, batch assembly included (both sides use the same `global_batch`). The machine is
shared: each block records how much CPU other processes took meanwhile, and rounds are added
(at least `--repeats`, up to `--max-repeats` / `--time-budget`) until both sides have
`--min-quiet` quiet blocks; results come over all blocks and over the quiet ones.

    python -m bench.overhead [--block 5] [--repeats 8] [--warmup 3] [--threads 1] [--json F]
                             [--model gpt_tiny] [--layers 4] [--hidden H] [--heads A] [--ffn F] [--seq S]
                             [--grad-clip 1.0] [--plain-optimizer foreach|fused]

`launch_bound_args()` is the launch-bound line of `make bench`: 32 layers of hidden 32,
the plain loop on torch's fused AdamW; its ratio is the framework's per-operator overhead.
"""
from __future__ import annotations

import argparse
import gc
import os
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Dict, List

import torch
import torch.distributed as dist

from bench.common import add_block_args, adamw_groups, free_port, json_cli, log_round, machine_busy_s, \
    plain_microbatches, stats, step_with_lr


def _overrides(args) -> List[str]:
    shape = [f"model.{key}={value}" for key, value in (("hidden_size", args.hidden), ("num_attention_heads", args.heads),
                                                        ("ffn_hidden_size", args.ffn), ("seq_length", args.seq))
             if value is not None]
    return ["parallel.dp=1", f"model={args.model}", f"model.num_layers={args.layers}", *shape,
            f"train.micro_batch_size={args.micro_batch}", f"train.global_batch_size={args.global_batch}",
            f"train.grad_clip={args.grad_clip}", "train.steps=100000", "train.progress=false",
            "checkpoint.interval=0", "checkpoint.resume=none", f"data.max_bytes={args.data_bytes}"]


def launch_bound_args() -> List[str]:
    """The launch-bound configuration of `make bench`: many thin layers, so the step
    is mostly per-operator host work, as a GPU step is when the framework launches too much."""
    return ["--layers", "32", "--hidden", "32", "--heads", "4", "--ffn", "64", "--seq", "16",
            "--micro-batch", "2", "--global-batch", "8", "--plain-optimizer", "fused"]


class PlainLoop:
    """The same training step written as an ordinary single-process PyTorch loop. `device`
    (default CPU): where the model and the microbatches live; on CUDA the AdamW is torch's fused
    one and the forward runs under train.precision's autocast, as the Trainer's does."""

    def __init__(self, cfg: Any, dataset, device: Any = "cpu", optimizer_kind: str = "") -> None:
        from mpoverlap.models.gpt import GPT
        from mpoverlap.precision import autocast_context
        from mpoverlap.training.lr import LRSchedule

        t = cfg.train
        self.cfg, self.dataset, self.device = cfg, dataset, torch.device(device)
        self.model = GPT(cfg.model, seed=t.seed).to(self.device)
        self.autocast = autocast_context(t.precision, self.device)
        cuda = self.device.type == "cuda"
        self.optimizer = torch.optim.AdamW(adamw_groups(self.model, t.weight_decay), lr=t.lr,
                                           betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps,
                                           **{optimizer_kind or ("fused" if cuda else "foreach"): True})
        self.schedule = LRSchedule.from_config(t)
        self.step = 0

    def train_step(self) -> Dict[str, Any]:
        from mpoverlap.training.data import global_batch

        t = self.cfg.train
        lr = self.schedule(self.step)
        batch = global_batch(self.dataset, self.step, t.global_batch_size, t.seed)
        micro = batch.split(t.micro_batch_size)
        t0 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = plain_microbatches(self.model, micro, self.autocast, self.device)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.grad_clip, foreach=True)
        step_with_lr(self.optimizer, lr)
        self.step += 1
        return {"loss_local": loss_sum, "grad_norm": float(grad_norm),
                "step_time_s": time.perf_counter() - t0}


def run(args) -> Dict[str, Any]:
    from mpoverlap.config import compose
    from mpoverlap.training.loop import Trainer
    from mpoverlap.training.setup import init_distributed

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    owns_pg = not dist.is_initialized()
    if owns_pg:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                world_size=1, timeout=timedelta(seconds=120))
    trainer, sides = None, None
    try:
        with tempfile.TemporaryDirectory(prefix="mpo-bench-overhead-") as tmp:
            cfg = compose(_overrides(args) + [f"run.dir={tmp}"])
            state = init_distributed(cfg)
            trainer = Trainer(cfg, state, Path(tmp))
            plain = PlainLoop(cfg, trainer.train_data, optimizer_kind=args.plain_optimizer)
            sides = {"framework": trainer, "plain": plain}
            losses = {k: [] for k in sides}
            blocks: List[Dict[str, Any]] = []

            def one(name: str, block: Dict[str, Any], keep: bool) -> None:
                t0, c0 = time.perf_counter(), time.process_time()
                out = sides[name].train_step()
                dt, cpu = time.perf_counter() - t0, time.process_time() - c0
                trainer.ledger.reset()
                losses[name].append(float(out["loss_local"]))
                if keep:
                    block["wall"].append(dt)
                    block["inner"].append(out["step_time_s"])
                    block["cpu"].append(cpu)

            for _ in range(args.warmup):
                for name in sides:
                    one(name, {}, keep=False)
            # Rounds of one block per side until both sides have --min-quiet blocks during which
            # other processes left the cores alone (at least --repeats, at most --max-repeats
            # rounds, within --time-budget seconds).
            start, r = time.perf_counter(), 0
            while True:
                enough = all(sum(1 for b in blocks if b["side"] == k and b["foreign_cores"] <= args.quiet_cores)
                             >= args.min_quiet for k in sides)
                if r >= args.repeats and (enough or r >= args.max_repeats
                                          or time.perf_counter() - start > args.time_budget):
                    break
                order = ["framework", "plain"] if r % 2 == 0 else ["plain", "framework"]
                for name in order:
                    gc.collect()
                    block = {"side": name, "wall": [], "inner": [], "cpu": []}
                    busy0, own0, wall0 = machine_busy_s(), time.process_time(), time.perf_counter()
                    for i in range(args.block):
                        one(name, block, keep=i >= args.block_warmup)
                    wall = time.perf_counter() - wall0
                    foreign = machine_busy_s() - busy0 - (time.process_time() - own0)
                    block["foreign_cores"] = max(0.0, foreign) / wall
                    blocks.append(block)
                r += 1
                quiet_now = {k: sum(1 for b in blocks if b["side"] == k and b["foreign_cores"] <= args.quiet_cores)
                             for k in sides}
                log_round("overhead", r, quiet_now)

            def summary(use: List[Dict[str, Any]]) -> Dict[str, Any]:
                res = {k: {"wall": stats([x for b in use if b["side"] == k for x in b["wall"]]),
                           "inner": stats([x for b in use if b["side"] == k for x in b["inner"]]),
                           "cpu": stats([x for b in use if b["side"] == k for x in b["cpu"]]),
                           "blocks": sum(1 for b in use if b["side"] == k)} for k in sides}
                res["ratio"] = res["framework"]["wall"]["median_s"] / res["plain"]["wall"]["median_s"]
                res["ratio_inner"] = res["framework"]["inner"]["median_s"] / res["plain"]["inner"]["median_s"]
                # CPU seconds of this process per step: what other jobs on the shared cores move least
                res["ratio_cpu"] = res["framework"]["cpu"]["median_s"] / res["plain"]["cpu"]["median_s"]
                return res

            everything = summary(blocks)
            quiet_blocks = [b for b in blocks if b["foreign_cores"] <= args.quiet_cores]
            quiet = (summary(quiet_blocks) if all(any(b["side"] == k for b in quiet_blocks) for k in sides)
                     else None)
            # Same model, same data, same optimizer: the two trajectories must agree (rounding
            # differences grow over many steps, so the first steps are the check).
            n = min(len(losses["framework"]), len(losses["plain"]))
            diffs = [abs(a - b) for a, b in zip(losses["framework"][:n], losses["plain"][:n])]
            m = cfg.model
            return {
                "benchmark": "overhead",
                "setup": {"model": m.name, "num_layers": m.num_layers, "hidden_size": m.hidden_size,
                          "seq_length": m.seq_length, "micro_batch_size": cfg.train.micro_batch_size,
                          "grad_clip": cfg.train.grad_clip, "plain_optimizer": args.plain_optimizer,
                          "microbatches": cfg.train.global_batch_size // cfg.train.micro_batch_size,
                          "threads": args.threads, "block": args.block, "repeats": r,
                          "warmup": args.warmup, "block_warmup": args.block_warmup,
                          "overrides": _overrides(args)},
                "all": everything, "quiet": quiet, "quiet_threshold_cores": args.quiet_cores,
                "block_foreign_cores": [{"side": b["side"], "foreign_cores": round(b["foreign_cores"], 3)}
                                        for b in blocks],
                "max_loss_diff_first5": max(diffs[:5]), "max_loss_diff": max(diffs), "steps_compared": n,
            }
    finally:
        if trainer is not None:
            trainer.close()
        if owns_pg:
            from mpoverlap.training.setup import shutdown_distributed

            del trainer, sides
            shutdown_distributed()


def add_args(p: argparse.ArgumentParser) -> None:
    add_block_args(p, block=5, repeats=8, max_repeats=40, min_quiet=6, time_budget=60.0, warmup=3, unit="side")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads for both (default 1)")
    p.add_argument("--model", default="gpt_tiny")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=None, help="model.hidden_size (default: the model's)")
    p.add_argument("--heads", type=int, default=None, help="model.num_attention_heads (default: the model's)")
    p.add_argument("--ffn", type=int, default=None, help="model.ffn_hidden_size (default: the model's)")
    p.add_argument("--seq", type=int, default=None, help="model.seq_length (default: the model's)")
    p.add_argument("--grad-clip", type=float, default=1.0, help="train.grad_clip, both sides (default 1.0)")
    p.add_argument("--plain-optimizer", choices=("foreach", "fused"), default="fused",
                   help="the plain loop's AdamW implementation (default fused, as the Trainer's on CPU and CUDA)")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--data-bytes", type=int, default=2_000_000)


def main() -> None:
    json_cli(__doc__, add_args, run)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
