"""DP overlap: mpoverlap's data-parallel modes against torch DDP, 2 gloo ranks, one run.

Two spawned workers (OMP_NUM_THREADS=1, one intra-op thread each) build every variant once
and step them alternately in blocks (rotating order), in the same processes:

  mpo_overlap     Trainer, parallel.dp=2 overlap.dp=true  train.distributed_optimizer=false
  mpo_no_overlap  Trainer, parallel.dp=2 overlap.dp=false train.distributed_optimizer=false
  torch_ddp       torch DistributedDataParallel around the same GPT, no_sync() on all but the
                  last microbatch, bucket_cap_mb = overlap.dp_bucket_mb, torch.optim.AdamW
  mpo_zero1       Trainer, overlap.dp=true train.distributed_optimizer=true
                  overlap.dp_param_gather=true (reduce-scatter + overlapped param all-gather)
  local_no_comm   the bare model, same loop, no gradient reduction: the compute-only floor

Wire formats (not in the default set; --variants picks them, --formats all of them at once):

  mpo_bf16             mpo_overlap with train.grad_reduce_dtype=bf16
  mpo_int8_ef          ... int8 with error feedback (train.grad_error_feedback=auto)
  mpo_fp8_ef           ... fp8 (e4m3) with error feedback
  torch_ddp_bf16_hook  torch_ddp with DDP's bf16_compress_hook (called through a wrapper: DDP
                       refuses to register it by name without CUDA/NCCL; gloo runs its bf16 all-reduce)
  mpo_delay1           mpo_overlap with overlap.dp_delay=1 (--delay: beside mpo_overlap and
                       local_no_comm, with each side's memory and a fresh --curve-steps loss curve)
  torch_ddp_powersgd   torch_ddp with DDP's powerSGD_hook (rank 4, error feedback, warm start,
                       compressing from the second iteration), its buckets' collectives issued in
                       bucket order (`bucket_ordered`: gloo runs the hook's chained all-reduces
                       from completion callbacks, which interleave across buckets otherwise)

Per variant: the median step time (slowest rank of each step), CPU time per step (both ranks'
processes, all threads, plus the machine's irq/softirq time), bytes on the loopback per step,
and for mpoverlap the ledger's per-step figures (mode "dp": ops, bytes, in-flight time_s,
exposed_s = time compute sat blocked in wait()). Also: forward and backward time of one
microbatch without communication, to tell whether backward is longer than the all-reduce,
and the per-handle issue/complete/blocked clocks of one step of each mpoverlap variant.

The machine is shared: every block records how much CPU other processes took meanwhile, and
the run adds rounds (up to --max-repeats / --time-budget) until every variant has --min-quiet
quiet blocks; results come both over all blocks and over the quiet ones.

Run it inside `bench/netns.sh` so the loopback is a rate-limited link; on a bare loopback
the communication is nearly free on the wire and costs CPU instead (docs/benchmarks.md).

    python -m bench.dp_overlap [--block 5] [--repeats 6] [--layers 8] [--json F] [--link TEXT]
    python -m bench.dp_overlap --formats --layers 8 --hidden 256 --heads 8 --ffn 1024 --seq 128 \
        --micro-batch 2 --global-batch 4
    python -m bench.dp_overlap --delay --curve-steps 200 --layers 8 --hidden 256 --heads 8 --ffn 1024 \
        --seq 128 --micro-batch 2 --global-batch 4
    python -m bench.dp_overlap --buckets --bucket-rates 300mbit,3gbit ...   (bench/dp_buckets.py: bucket
        sizes 1, 4, 16, 64 MiB and overlap.dp_bucket_mb=auto at two link rates, auto against the best)
"""
from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path
from typing import Any, Dict, List

from bench.common import add_block_args, block_clocks, block_figures, gathered_foreign_cores, \
    close_trainers, init_bench_worker, json_cli, log_round, rounds_done, spawn_ranks, stats
from bench.ddp_peer import TORCH_SIDES, DDPLoop, bucket_ordered  # noqa: F401 - bucket_ordered: the bench's API
from bench.dp_buckets import bucket_variants, prepare_inner, run_rates

VARIANTS = {
    "mpo_overlap": ["overlap.dp=true", "train.distributed_optimizer=false"],
    "mpo_no_overlap": ["overlap.dp=false", "train.distributed_optimizer=false"],
    "torch_ddp": None,
    "mpo_zero1": ["overlap.dp=true", "train.distributed_optimizer=true", "overlap.dp_param_gather=true"],
    "local_no_comm": None,
}
DEFAULT_VARIANTS = tuple(VARIANTS)
_PLAIN = ["overlap.dp=true", "train.distributed_optimizer=false"]
FORMAT_VARIANTS = {
    "mpo_overlap": VARIANTS["mpo_overlap"],
    "mpo_bf16": [*_PLAIN, "train.grad_reduce_dtype=bf16"],
    "mpo_int8_ef": [*_PLAIN, "train.grad_reduce_dtype=int8"],
    "mpo_fp8_ef": [*_PLAIN, "train.grad_reduce_dtype=fp8"],
    "torch_ddp": None,
    "torch_ddp_bf16_hook": None,
    "torch_ddp_powersgd": None,
    "local_no_comm": None,
}
VARIANTS.update(FORMAT_VARIANTS)
# --delay: overlap.dp_delay 0 against 1 (one-step-delayed reduction, docs/dp_delay.md), with the
# no-communication floor; each also trains a fresh --curve-steps loss curve after the timing.
DELAY_VARIANTS = {
    "mpo_overlap": VARIANTS["mpo_overlap"],
    "mpo_delay1": [*_PLAIN, "overlap.dp_delay=1"],
    "local_no_comm": None,
}
VARIANTS.update(DELAY_VARIANTS)
# The torch DDP sides (TORCH_SIDES, DDPLoop): bench/ddp_peer.py


def _base_overrides(args) -> List[str]:
    shape = [f"model.{key}={value}" for key, value in (("hidden_size", getattr(args, "hidden", 0)),
                                                       ("num_attention_heads", getattr(args, "heads", 0)),
                                                       ("ffn_hidden_size", getattr(args, "ffn", 0)),
                                                       ("seq_length", getattr(args, "seq", 0))) if value]
    return ["parallel.dp=2", f"model.num_layers={args.layers}", *shape, f"overlap.dp_bucket_mb={args.bucket_mb}",
            f"train.micro_batch_size={args.micro_batch}", f"train.global_batch_size={args.global_batch}",
            "train.steps=100000", "train.progress=false", "checkpoint.interval=0",
            "checkpoint.resume=none", f"data.max_bytes={args.data_bytes}"]



class SpanRecorder:
    """Wraps one Trainer's `ledger.record` (on the instance, mpoverlap is not modified) to keep
    every handle's issue/complete/blocked clocks for the per-bucket diagnostics."""

    def __init__(self, ledger) -> None:
        self.handles: List[Any] = []
        inner = ledger.record

        def record(handle) -> None:
            self.handles.append((handle.op, handle.nbytes, handle.issued_at, handle.completed_at,
                                 handle.blocked_s))
            inner(handle)

        ledger.record = record

    def take(self, t0: float) -> List[Dict[str, Any]]:
        """The handles recorded since the last take, as offsets in ms from `t0` (a step's start)."""
        out = [{"op": op, "mib": round(nbytes / 2**20, 3), "issue_ms": round((issued - t0) * 1e3, 2),
                "done_ms": round(((done or issued) - t0) * 1e3, 2), "blocked_ms": round(blocked * 1e3, 2)}
               for op, nbytes, issued, done, blocked in self.handles]
        self.handles.clear()
        return out


def _worker(rank: int, port: int, args, tmp: str) -> None:
    init_bench_worker(rank, port)
    import torch.distributed as dist

    from mpoverlap.config import compose
    from mpoverlap.training.loop import Trainer
    from mpoverlap.training.setup import init_distributed

    trainers: Dict[str, Any] = {}
    if getattr(args, "buckets", False):
        VARIANTS.update(bucket_variants(args.auto_mb))  # this process imported the module afresh
    try:
        base = _base_overrides(args)
        recorders: Dict[str, SpanRecorder] = {}
        state = None
        for name, extra in VARIANTS.items():
            if extra is None or name not in args.variants:
                continue
            cfg = compose(base + extra + [f"run.dir={tmp}/{name}"])
            if state is None:
                state = init_distributed(cfg)
            run_dir = Path(tmp) / name
            run_dir.mkdir(parents=True, exist_ok=True)
            trainers[name] = Trainer(cfg, state, run_dir)
            recorders[name] = SpanRecorder(trainers[name].ledger)
        any_trainer = next(iter(trainers.values()))
        sides: Dict[str, Any] = dict(trainers)
        for name, (wrap, hook) in TORCH_SIDES.items():
            if name in args.variants:
                sides[name] = DDPLoop(any_trainer.cfg, any_trainer.train_data, any_trainer.dp_rank,
                                      any_trainer.dp_size, args.bucket_mb, wrap=wrap, hook=hook)
        order = [v for v in VARIANTS if v in sides]
        losses: Dict[str, List[float]] = {k: [] for k in order}
        blocks: List[Dict[str, Any]] = []

        def settle(name: str) -> None:
            # Leave no collective in flight across a variant switch (outside timing).
            if name in trainers:
                trainers[name].optimizer.finish_param_sync()
                trainers[name].ddp.wait_delayed()
                trainers[name].ledger.reset()
                recorders[name].take(0.0)
            dist.barrier()

        def one(name: str, block: Dict[str, Any], keep: bool) -> None:
            side = sides[name]
            t0 = time.perf_counter()
            out = side.train_step()
            dt = time.perf_counter() - t0
            losses[name].append(float(out["loss_local"]))
            if name in trainers:
                spans = recorders[name].take(t0)
                c = side.ledger.reset().get("dp", {"ops": 0, "bytes": 0, "time_s": 0.0, "exposed_s": 0.0})
                if keep:
                    block["comm"].append(c)
                    block["spans"] = spans
            if keep:
                block["times"].append(dt)

        ddp = sides.get("torch_ddp")
        for name in order:
            scratch = {"times": [], "comm": []}
            for _ in range(args.warmup):
                one(name, scratch, keep=False)
            settle(name)
        for side in sides.values():
            if isinstance(side, DDPLoop):
                side.fwd_s.clear()
                side.bwd_s.clear()
        # Rounds of one block per variant (rotating order) until every variant has
        # --min-quiet blocks during which other processes left the cores alone, at least
        # --repeats and at most --max-repeats rounds, within --time-budget seconds. Every rank
        # decides from the same gathered numbers, so both run the same number of rounds.
        quiet_blocks = dict.fromkeys(order, 0)
        start, r = time.perf_counter(), 0
        while not rounds_done(args, r, quiet_blocks, start):
            rot = r % len(order)
            for name in order[rot:] + order[:rot]:
                gc.collect()
                settle(name)
                block = {"name": name, "times": [], "comm": [], "spans": []}
                clocks = block_clocks()
                for i in range(args.block):
                    one(name, block, keep=i >= args.block_warmup)
                settle(name)
                block.update(block_figures(clocks, args.block))
                block["foreign_cores"] = gathered_foreign_cores(block)
                if block["foreign_cores"] <= args.quiet_cores:
                    quiet_blocks[name] += 1
                if name in ("torch_ddp", "local_no_comm"):
                    side = sides[name]
                    block["fwd_s"], block["bwd_s"] = list(side.fwd_s), list(side.bwd_s)
                    side.fwd_s.clear()
                    side.bwd_s.clear()
                blocks.append(block)
            r += 1
            if rank == 0:
                log_round("dp_overlap", r, quiet_blocks)

        curves = {name: _curve(compose, Trainer, base + VARIANTS[name] + [f"run.dir={tmp}/{name}_curve"],
                               state, Path(tmp) / f"{name}_curve", args.curve_steps)
                  for name in trainers if args.curve_steps and args.delay}
        local = {"blocks": blocks, "losses": losses, "curves": curves,
                 "memory": {k: _memory(t) for k, t in trainers.items()},
                 "buckets": {k: [round(b.numel * 4 / 2**20, 3) for b in t.ddp.buffer.buckets]
                             for k, t in trainers.items()},
                 "ddp_buckets": ddp.bucket_sizes_mb() if ddp is not None else []}
        gathered: List[Any] = [None, None]
        dist.all_gather_object(gathered, local)
        if rank == 0:
            res = summarize(gathered, order, args)
            Path(args.json_tmp).write_text(json.dumps(res, indent=2))
    finally:
        close_trainers(trainers.values())


def _memory(trainer) -> Dict[str, float]:
    """MiB this rank holds: the gradient buffer, overlap.dp_delay's second buffer and scratch
    (data_parallel/delayed.py), and the whole estimate's figure for the layout."""
    from mpoverlap.overlap.estimate import estimate

    ddp = trainer.ddp
    second = sum(s.numel() * s.element_size() for s in ddp._send if s is not None) if ddp.delay else 0
    second += ddp._scratch.numel() * ddp._scratch.element_size() if ddp._scratch is not None else 0
    est = estimate(trainer.cfg, trainer.state.world).stages[0].memory_bytes
    return {"grad_buffer_mib": ddp.buffer.numel * 4 / 2**20, "second_buffer_mib": second / 2**20,
            "estimate_total_mib": sum(est.values()) / 2**20,
            "estimate_second_buffer_mib": est.get("dp_delay_grads", 0) / 2**20}


def _curve(compose, trainer_cls, overrides: List[str], state, run_dir: Path, steps: int) -> List[float]:
    """A fresh trainer's `steps` losses (the replicas' mean), untimed."""
    run_dir.mkdir(parents=True, exist_ok=True)
    trainer = trainer_cls(compose(overrides), state, run_dir)
    try:
        return [float(trainer._mean_over_replicas(trainer.train_step()["loss_local"])) for _ in range(steps)]
    finally:
        trainer.close()


def _variant_summary(name: str, blocks0: List[dict], blocks1: List[dict], per_rank, args_block: int) -> Dict[str, Any]:
    # A step ends when its slowest rank ends.
    step = [max(a, b) for b0, b1 in zip(blocks0, blocks1) for a, b in zip(b0["times"], b1["times"])]
    row: Dict[str, Any] = {"blocks": len(blocks0), "step": stats(step),
                           # Both ranks' traffic on the loopback, per step (rank 0's reading).
                           "wire_mib_per_step": stats([b["wire_bytes_per_step"] / 2**20 for b in blocks0])["median_s"],
                           # CPU per step: both ranks' process time (all threads, gloo's included),
                           # and the machine's irq+softirq time (loopback/tc work), per block step.
                           "cpu_ms_per_step": stats([(x["own_cpu_s"] + y["own_cpu_s"]) * 1e3 / args_block
                                                     for x, y in zip(blocks0, blocks1)])["median_s"],
                           "irq_ms_per_step": stats([x["irq_s"] * 1e3 / args_block for x in blocks0])["median_s"]}
    rows = [c for b in blocks0 + blocks1 for c in b["comm"]]
    if rows:
        t_in = [r["time_s"] for r in rows]
        exp = [r["exposed_s"] for r in rows]
        row["dp_comm"] = {
            "ops_per_step": sum(r["ops"] for r in rows) / len(rows),
            "mib_per_step": sum(r["bytes"] for r in rows) / len(rows) / 2**20,
            "time_s_median": stats(t_in)["median_s"], "exposed_s_median": stats(exp)["median_s"],
            "exposed_share": sum(exp) / sum(t_in) if sum(t_in) > 0 else 0.0,
        }
    fwd = [x for b in blocks0 + blocks1 for x in b.get("fwd_s", [])]
    bwd = [x for b in blocks0 + blocks1 for x in b.get("bwd_s", [])]
    if fwd:
        row["microbatch_compute"] = {"forward_s": stats(fwd)["median_s"], "backward_s": stats(bwd)["median_s"]}
    return row


def summarize(per_rank: List[Dict[str, Any]], order: List[str], args) -> Dict[str, Any]:
    b0, b1 = per_rank[0]["blocks"], per_rank[1]["blocks"]
    out: Dict[str, Any] = {"rounds": len(b0) // max(1, len(order)),
                           "variants": {}, "variants_quiet": {}, "quiet_threshold_cores": args.quiet_cores,
                           "block_foreign_cores": [{"variant": x["name"], "foreign_cores": round(x["foreign_cores"], 3)}
                                                   for x in b0]}
    for name in order:
        idx = [i for i, x in enumerate(b0) if x["name"] == name]
        quiet = [i for i in idx if b0[i]["foreign_cores"] <= args.quiet_cores]
        row = _variant_summary(name, [b0[i] for i in idx], [b1[i] for i in idx], per_rank, args.block)
        row["overrides"] = VARIANTS[name]
        if name in per_rank[0]["buckets"]:
            row["buckets_mib"] = per_rank[0]["buckets"][name]
        if name in per_rank[0].get("memory", {}):
            row["memory"] = per_rank[0]["memory"][name]
        if name in per_rank[0].get("curves", {}):
            row["loss_curve"] = per_rank[0]["curves"][name]
        if name == "torch_ddp":
            row["buckets_mib"] = per_rank[0]["ddp_buckets"]
        # The per-handle clocks of the last step of the quietest block (rank 0 and rank 1).
        best = min(idx, key=lambda i: b0[i]["foreign_cores"])
        if b0[best]["spans"]:
            row["sample_step_spans"] = {"rank0": b0[best]["spans"], "rank1": b1[best]["spans"],
                                        "block_foreign_cores": round(b0[best]["foreign_cores"], 3)}
        out["variants"][name] = row
        if quiet:
            out["variants_quiet"][name] = _variant_summary(name, [b0[i] for i in quiet], [b1[i] for i in quiet],
                                                           per_rank, args.block)
    for name in ("local_no_comm", "torch_ddp"):
        if "microbatch_compute" in out["variants"].get(name, {}):
            out["microbatch_compute"] = out["variants"][name]["microbatch_compute"]
            break
    # Overlap on vs off is the same math: their losses must agree exactly.
    la, lb = per_rank[0]["losses"].get("mpo_overlap"), per_rank[0]["losses"].get("mpo_no_overlap")
    if la and lb:
        n = min(len(la), len(lb))
        out["overlap_vs_off_max_loss_diff"] = max(abs(a - b) for a, b in zip(la[:n], lb[:n]))
    return out


def add_args(p: argparse.ArgumentParser) -> None:
    add_block_args(p, block=5, repeats=6, max_repeats=30, min_quiet=5, time_budget=180.0, warmup=3)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--bucket-mb", type=float, default=0.5)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--global-batch", type=int, default=32, help="over both ranks (default 32: 2 microbatches per rank)")
    p.add_argument("--data-bytes", type=int, default=2_000_000)
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help="comma-separated subset of " + ",".join(VARIANTS))
    p.add_argument("--formats", action="store_true",
                   help="the wire-format variants: " + ",".join(FORMAT_VARIANTS) + " (instead of --variants)")
    p.add_argument("--delay", action="store_true",
                   help="overlap.dp_delay 0 vs 1: " + ",".join(DELAY_VARIANTS) + " (instead of --variants)")
    p.add_argument("--buckets", action="store_true",
                   help="overlap.dp_bucket_mb 1, 4, 16, 64 and auto (instead of --variants; bench/dp_buckets.py)")
    p.add_argument("--bucket-rates", default="300mbit,3gbit",
                   help="with --buckets: the tc rates, one inner run each inside bench/netns.sh ('': this run only)")
    p.add_argument("--curve-steps", type=int, default=200,
                   help="with --delay: steps of each side's fresh loss curve after the timing (0: none)")
    for name in ("hidden", "heads", "ffn", "seq"):
        p.add_argument(f"--{name}", type=int, default=0, help=f"the model's {name} (default: gpt_tiny's)")


def planned(argv: List[str]):
    """(base overrides, {variant: overrides, None for a peer}) of a run with `argv`, before it
    runs (bench/run.py times the machine for them)."""
    p = argparse.ArgumentParser()
    add_args(p)
    args = p.parse_known_args(argv)[0]
    chosen = FORMAT_VARIANTS if args.formats else DELAY_VARIANTS if args.delay else [v.strip() for v in args.variants.split(",") if v.strip()]
    return _base_overrides(args), {v: VARIANTS[v] for v in chosen}


def run(args) -> Dict[str, Any]:
    if getattr(args, "buckets", False) and args.bucket_rates:
        return run_rates(args)  # the outer run: one inner run per rate
    if getattr(args, "buckets", False):
        args.variants = prepare_inner(args, _base_overrides(args), VARIANTS)
    if getattr(args, "formats", False):
        args.variants = ",".join(FORMAT_VARIANTS)
    if getattr(args, "delay", False):
        args.variants = ",".join(DELAY_VARIANTS)
    args.variants = [v.strip() for v in (args.variants if isinstance(args.variants, str) else ",".join(args.variants)).split(",") if v.strip()]
    unknown = set(args.variants) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"unknown variant(s) {sorted(unknown)}; choose from {list(VARIANTS)}")
    res, t0 = spawn_ranks(_worker, args, prefix="mpo-bench-dp-")
    res["benchmark"] = "dp_overlap"
    res["link"] = args.link
    res["wall_s"] = time.perf_counter() - t0
    if getattr(args, "buckets", False):
        res["auto_mb"], res["auto_reason"] = args.auto_mb, args.auto_reason
    res["setup"] = {"ranks": 2, "threads_per_rank": 1, "base_overrides": _base_overrides(args),
                    "block": args.block, "repeats": res["rounds"], "warmup": args.warmup,
                    "block_warmup": args.block_warmup, "ddp_bucket_cap_mb": args.bucket_mb}
    return res


def main() -> None:
    json_cli(__doc__, add_args, run, link=True)


if __name__ == "__main__":
    main()
