"""ZeRO-3 / FSDP: mpoverlap's per-unit parameter gathers with and without prefetch, against
torch's own FSDP2 (`fully_shard`) on the same model and batch, 2 gloo ranks, one run.

  zero3_prefetch     Trainer, parallel.dp=2 train.dp_sharding=optim_grads_params overlap.dp=true
                     (the next unit's all-gather in flight under the current one, forward and
                     backward; reduce-scatters under the rest of backward)
  zero3_no_prefetch  the same with overlap.dp_prefetch=0 (each unit's gather waited when it is
                     needed; the reduce-scatters still overlap)
  torch_fsdp2        the same GPT with fully_shard on every block and on the root (embedding,
                     tied head, final norm), reshard_after_forward=True, explicit prefetch of
                     the next block in forward and backward, torch.optim.AdamW
  local_no_comm      the bare model, same loop, no communication: the compute-only floor

With `--gathers` the sides are instead what ZeRO-3's unit gathers carry, all under
train.precision=bf16 (train.param_gather_dtype; the model's width set by --hidden/--heads/--ffn/
--seq, e.g. the layout whose gathers outlast the compute they hide under):

  gathers_fp32       train.param_gather_dtype=fp32 (every parameter in fp32)
  gathers_bf16       auto: the GEMM weights in bf16, what the forward reads as it is in fp32
                     (bitwise the fp32 gathers' losses)
  gathers_int8       the GEMM weights int8, one fp32 scale per 2,048 elements
  local_no_comm      the bare model under bf16 autocast, no communication: the floor

Sides are stepped in rotating blocks in the same processes (bench.common.rotating_blocks).
Per side: median step time (slowest rank), `exposed_vs_floor_ms` = step minus the floor (what
communication and sharding cost on top of compute), state memory per rank from the buffers'
sizes (parameters incl. the gathered working set, gradients, optimizer), and for mpoverlap
the ledger's dp figures and, per op kind, how much of the in-flight time was hidden.

Run it inside `bench/netns.sh` (rate-limited loopback), as `make bench` does.

    python -m bench.zero [--block 4] [--repeats 4] [--layers 8] [--json F] [--link TEXT]
    python -m bench.zero --gathers --layers 8 --hidden 256 --heads 8 --ffn 1024 --seq 128 \
        --micro-batch 2 --global-batch 4
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any, Dict, List

from bench.common import (adamw_groups, add_block_args, close_trainers, init_bench_worker, json_cli, rotating_blocks, spawn_ranks,
                          stats, step_with_lr)

MPO = {"zero3_prefetch": ["overlap.dp=true", "overlap.dp_prefetch=1"],
       "zero3_no_prefetch": ["overlap.dp=true", "overlap.dp_prefetch=0"]}
GATHERS = {f"gathers_{fmt}": ["overlap.dp=true", f"train.param_gather_dtype={fmt}"] for fmt in ("fp32", "bf16", "int8")}
SIDES = (*MPO, "torch_fsdp2", "local_no_comm")


def _mpo_sides(args) -> Dict[str, List[str]]:
    return GATHERS if args.gathers else MPO


def _base(args) -> List[str]:
    shape = []
    for key, value in (("hidden_size", args.hidden), ("num_attention_heads", args.heads),
                       ("ffn_hidden_size", args.ffn), ("seq_length", args.seq)):
        if value:
            shape.append(f"model.{key}={value}")
    if args.gathers:
        shape.append("train.precision=bf16")
    return ["parallel.dp=2", "train.dp_sharding=optim_grads_params", f"model.num_layers={args.layers}", *shape,
            f"train.micro_batch_size={args.micro_batch}", f"train.global_batch_size={args.global_batch}",
            f"overlap.dp_bucket_mb={args.bucket_mb}", "train.steps=100000", "train.progress=false",
            "checkpoint.interval=0", "checkpoint.resume=none", f"data.max_bytes={args.data_bytes}"]


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class MpoSide:
    def __init__(self, trainer) -> None:
        self.trainer = trainer
        self.spans: List[tuple] = []
        inner = trainer.ledger.record

        def record(handle) -> None:  # per-op clocks, on the instance (mpoverlap unchanged)
            self.spans.append((handle.op, handle.issued_at, handle.completed_at, handle.blocked_s))
            inner(handle)

        trainer.ledger.record = record

    def train_step(self) -> None:
        self.trainer.train_step()

    def settle(self) -> None:
        self.trainer.ledger.reset()
        self.spans.clear()

    def collect(self, keep: bool) -> Dict[str, Any]:
        dp = self.trainer.ledger.reset().get("dp", {})
        ops: Dict[str, List[float]] = {}
        for op, issued, done, blocked in self.spans:
            row = ops.setdefault(op, [0.0, 0.0])
            row[0] += max(0.0, (done or issued) - issued)
            row[1] += blocked
        self.spans.clear()
        return {"dp": dp, "ops": ops} if keep else {}

    def memory(self) -> Dict[str, int]:
        return self.trainer.optimizer.memory_bytes()


class TorchSide:
    """torch FSDP2 (shard=True) or the bare model (shard=False) on the same GPT, batch and AdamW."""

    def __init__(self, cfg, dataset, dp_rank: int, dp_size: int, shard: bool) -> None:
        import torch

        from mpoverlap.models.gpt import GPT
        from mpoverlap.training.lr import LRSchedule

        t = cfg.train
        self.cfg, self.dataset, self.dp_rank, self.dp_size = cfg, dataset, dp_rank, dp_size
        self.model = GPT(cfg.model, seed=t.seed)
        if shard:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (dp_size,))
            blocks = list(self.model.layers.values())
            for block in blocks:
                fully_shard(block, mesh=mesh, reshard_after_forward=True)
            fully_shard(self.model, mesh=mesh, reshard_after_forward=True)
            for a, b in zip(blocks, blocks[1:]):  # the same prefetch depth as zero3_prefetch
                a.set_modules_to_forward_prefetch([b])
                b.set_modules_to_backward_prefetch([a])
        self.optimizer = torch.optim.AdamW(adamw_groups(self.model, t.weight_decay), lr=t.lr,
                                           betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps, foreach=True)
        self.schedule = LRSchedule.from_config(t)
        self.step = 0

    def train_step(self) -> None:
        import torch

        from mpoverlap.precision import autocast_context
        from mpoverlap.training.data import global_batch, rank_microbatches

        t = self.cfg.train
        batch = global_batch(self.dataset, self.step, t.global_batch_size, t.seed)
        micro = rank_microbatches(batch, self.dp_rank, self.dp_size, t.micro_batch_size)
        self.optimizer.zero_grad(set_to_none=True)
        for mb in micro:
            with autocast_context(t.precision, torch.device("cpu")):  # the Trainer's precision (bf16: --gathers)
                logits = self.model(mb[:, :-1])
            loss = self.model.loss(logits, mb[:, 1:]) / len(micro)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.grad_clip, foreach=True)
        step_with_lr(self.optimizer, self.schedule(self.step))
        self.step += 1

    def settle(self) -> None:
        pass

    def collect(self, keep: bool) -> Dict[str, Any]:
        return {}

    def memory(self) -> Dict[str, int]:
        """Persistent per-rank state (local shards of DTensors); FSDP2's gathered working set
        is not measured here."""
        def local(t):
            return t.to_local() if hasattr(t, "to_local") else t

        params = [local(p) for p in self.model.parameters()]
        grads = [local(p.grad) for p in self.model.parameters() if p.grad is not None]
        optim = [local(v) for st in self.optimizer.state.values() for k, v in st.items() if k != "step"]
        return {"params": _bytes(params), "grads": _bytes(grads), "optimizer": _bytes(optim)}


def _worker(rank: int, port: int, args, tmp: str) -> None:
    init_bench_worker(rank, port)
    import torch.distributed as dist

    from mpoverlap.config import compose
    from mpoverlap.training.loop import Trainer
    from mpoverlap.training.setup import init_distributed

    sides: Dict[str, Any] = {}
    try:
        state = None
        for name, extra in _mpo_sides(args).items():
            cfg = compose(_base(args) + extra + [f"run.dir={tmp}/{name}"])
            state = state or init_distributed(cfg)
            Path(tmp, name).mkdir(parents=True, exist_ok=True)
            sides[name] = MpoSide(Trainer(cfg, state, Path(tmp) / name))
        any_trainer = next(iter(sides.values())).trainer
        notes = {}
        if not args.gathers:
            try:
                sides["torch_fsdp2"] = TorchSide(any_trainer.cfg, any_trainer.train_data, any_trainer.dp_rank,
                                                 any_trainer.dp_size, shard=True)
            except Exception as e:  # noqa: BLE001 - reported: FSDP2 may not run on CPU/gloo
                notes["torch_fsdp2"] = f"fully_shard could not be built on CPU/gloo: {type(e).__name__}: {e}"
        sides["local_no_comm"] = TorchSide(any_trainer.cfg, any_trainer.train_data, any_trainer.dp_rank,
                                           any_trainer.dp_size, shard=False)
        blocks = rotating_blocks(sides, args, log_prefix="zero")
        memory = {name: side.memory() for name, side in sides.items()}
        gathered: List[Any] = [None, None]
        dist.all_gather_object(gathered, {"blocks": blocks, "memory": memory})
        if rank == 0:
            Path(args.json_tmp).write_text(json.dumps(summarize(gathered, list(sides), notes), indent=2))
    finally:
        close_trainers(side.trainer for side in sides.values() if isinstance(side, MpoSide))


def summarize(per_rank: List[Dict[str, Any]], order: List[str], notes: Dict[str, str]) -> Dict[str, Any]:
    b0, b1 = per_rank[0]["blocks"], per_rank[1]["blocks"]
    out: Dict[str, Any] = {"variants": {}, "notes": notes}
    for name in order:
        idx = [i for i, x in enumerate(b0) if x["name"] == name]
        step = [max(a, b) for i in idx for a, b in zip(b0[i]["times"], b1[i]["times"])]
        row: Dict[str, Any] = {"step": stats(step), "blocks": len(idx),
                               "state_bytes_per_rank": per_rank[0]["memory"][name]}
        extras = [e for i in idx for e in b0[i]["extras"] + b1[i]["extras"] if e]
        if extras:
            t_in = sum(e["dp"].get("time_s", 0.0) for e in extras)
            exposed = sum(e["dp"].get("exposed_s", 0.0) for e in extras)
            row["dp_comm"] = {"mib_per_step": sum(e["dp"].get("bytes", 0) for e in extras) / len(extras) / 2**20,
                              "link_mib_per_step": sum(e["dp"].get("link_bytes", 0) for e in extras) / len(extras) / 2**20,
                              "time_ms_per_step": t_in / len(extras) * 1e3,
                              "exposed_ms_per_step": exposed / len(extras) * 1e3,
                              "exposed_share": exposed / t_in if t_in else 0.0}
            for op in ("all_gather", "reduce_scatter"):
                fl = sum(e["ops"].get(op, [0, 0])[0] for e in extras)
                bl = sum(e["ops"].get(op, [0, 0])[1] for e in extras)
                if fl:
                    row["dp_comm"][f"{op}_in_flight_ms_per_step"] = fl / len(extras) * 1e3
                    row["dp_comm"][f"{op}_hidden_share"] = 1 - bl / fl
        out["variants"][name] = row
    floor = out["variants"]["local_no_comm"]["step"]["median_s"]
    for row in out["variants"].values():
        row["exposed_vs_floor_ms"] = (row["step"]["median_s"] - floor) * 1e3
    v = out["variants"]
    if "gathers_fp32" in v:  # --gathers: each format's step against the fp32 gathers'
        base = v["gathers_fp32"]["step"]["median_s"]
        out["over_fp32_gathers_step"] = {name: row["step"]["median_s"] / base for name, row in v.items()}
        return out
    if "torch_fsdp2" in v:
        out["zero3_prefetch_over_fsdp2_step"] = v["zero3_prefetch"]["step"]["median_s"] / v["torch_fsdp2"]["step"]["median_s"]
    out["prefetch_over_no_prefetch_step"] = (v["zero3_prefetch"]["step"]["median_s"]
                                             / v["zero3_no_prefetch"]["step"]["median_s"])
    return out


def add_args(p: argparse.ArgumentParser) -> None:
    add_block_args(p, block=4, repeats=4, max_repeats=12, min_quiet=3, time_budget=150.0, warmup=2)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--bucket-mb", type=float, default=4.0)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--global-batch", type=int, default=32, help="over both ranks (default: 2 microbatches per rank)")
    p.add_argument("--data-bytes", type=int, default=2_000_000)
    p.add_argument("--gathers", action="store_true",
                   help="compare the unit gathers' formats (fp32, bf16, int8) under bf16 instead of prefetch and FSDP2")
    for name in ("hidden", "heads", "ffn", "seq"):
        p.add_argument(f"--{name}", type=int, default=0, help=f"the model's {name} (default: gpt_tiny's)")


def run(args) -> Dict[str, Any]:
    res, t0 = spawn_ranks(_worker, args, prefix="mpo-bench-zero-")
    res.update(benchmark="zero", link=args.link, wall_s=time.perf_counter() - t0,
               setup={"ranks": 2, "threads_per_rank": 1, "base_overrides": _base(args), "block": args.block})
    return res


def run_in_bench(prefix: List[str], link: str, out: Path, budget: float) -> Dict[str, Any]:
    """For bench/run.py: this benchmark in a subprocess, inside bench/netns.sh when `prefix` has it."""
    import subprocess
    import sys

    from bench.common import ROOT

    path = out / "zero.json"
    cmd = prefix + [sys.executable, "-m", "bench.zero", "--json", str(path), "--link", link,
                    "--time-budget", str(budget)]
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise SystemExit(f"bench.zero failed with exit status {proc.returncode}")
    return json.loads(path.read_text())


def render(results: Dict[str, Any]) -> str:
    res = results.get("zero")
    if not res:
        return ""
    if "over_fp32_gathers_step" in res:
        return render_gathers(res)
    lines = [f"ZeRO-3 (train.dp_sharding=optim_grads_params, dp 2) vs torch FSDP2, link: {res.get('link')}",
             "| side | step ms (median) | over compute floor ms | dp in flight ms | dp exposed share | "
             "all-gather hidden | params+grads+optim MiB per rank |",
             "|---|---|---|---|---|---|---|"]
    for name, row in res["variants"].items():
        dp = row.get("dp_comm", {})
        mem = row["state_bytes_per_rank"]
        state = (mem["params"] + mem["grads"] + mem["optimizer"]) / 2**20
        ag = dp.get("all_gather_hidden_share")
        lines.append(f"| {name} | {row['step']['median_s'] * 1e3:.1f} | {row['exposed_vs_floor_ms']:.1f} | "
                     f"{dp.get('time_ms_per_step', float('nan')):.1f} | {dp.get('exposed_share', float('nan')):.2f} | "
                     f"{'' if ag is None else f'{ag:.2f}'} | {state:.2f} |")
    if "zero3_prefetch_over_fsdp2_step" in res:
        lines.append(f"zero3_prefetch / torch_fsdp2 step time: {res['zero3_prefetch_over_fsdp2_step']:.2f}; "
                     f"prefetch / no prefetch: {res['prefetch_over_no_prefetch_step']:.2f}")
    for name, note in res.get("notes", {}).items():
        lines.append(f"{name}: {note}")
    lines.append("(FSDP2's state excludes its gathered working set; mpoverlap's params include its peak.)")
    return "\n".join(lines)


def render_gathers(res: Dict[str, Any]) -> str:
    lines = [f"ZeRO-3 unit gathers by format (train.param_gather_dtype, bf16, dp 2), link: {res.get('link')}",
             "| side | step ms (median) | / fp32 gathers | over floor ms | dp MiB a step (buffers / link) | "
             "dp exposed share |", "|---|---|---|---|---|---|"]
    for name, row in res["variants"].items():
        dp = row.get("dp_comm", {})
        mib = (f"{dp['mib_per_step']:.1f} / {dp['link_mib_per_step']:.1f}" if dp else "-")
        share = f"{dp['exposed_share']:.2f}" if dp else "-"
        lines.append(f"| {name} | {row['step']['median_s'] * 1e3:.1f} | {res['over_fp32_gathers_step'][name]:.2f} | "
                     f"{row['exposed_vs_floor_ms']:.1f} | {mib} | {share} |")
    return "\n".join(lines)


def main() -> None:
    json_cli(__doc__, add_args, run, link=True)


if __name__ == "__main__":
    main()
