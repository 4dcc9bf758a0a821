"""TP, CP and PP overlap on 2 gloo ranks, against torch's own implementations, one run each.

One scenario per spawn (each needs its own layout); inside it every variant is built once and
stepped in rotating blocks in the same two processes (`bench.common.rotating_blocks`, the
dp_overlap method: warmup, quiet-block filtering, slowest rank per step).

  tp      parallel.tp=2 parallel.sequence_parallel=true, overlap.tp=true (collective matmul)
          vs overlap.tp=false; the same without SP (mpo_tp_nosp_*: each column-parallel
          backward's input-gradient all-reduce under its wgrad GEMM, vs waited at once); vs
          torch DTensor: the same GPT built single-process with the
          same seed, `parallelize_module` with ColwiseParallel on attn.qkv / mlp.gate_up and
          RowwiseParallel on attn.proj / mlp.down (no SP; local heads), torch.optim.AdamW.
  cp      parallel.cp=2 (ring attention), overlap.cp=true vs false, long sequence.
  pp      parallel.pp=2 parallel.vpp=2, overlap.pp=true vs false, vs torch.distributed.pipelining
          ScheduleInterleaved1F1B over the same 4 chunks (model.tie_embeddings=false on both).
          The mpoverlap variants also record the bubble (below).
  bubble  parallel.pp=2, vpp 1 and 2, several microbatch counts, overlap.pp=true: per stage
          the idle fraction of the executor's run (time outside forward/backward compute).
  ep      model=moe_tiny reshaped (every layer MoE, 8 experts, top-2, expert width --ffn),
          parallel.ep=2 (dp 2, so edp 1), overlap.ep=true vs false, each with and without a
          shared expert. No peer: torch has no expert-parallel MoE to compare against.

Bubble probe: the executor appends ("compute", i, t) to its trace right before action i's
forward/backward (after waiting its input); wrapping `executor._compute` on the instance
gives the end, so busy = sum(end - start) over the step's actions; wrapping `executor.run`
gives the step's pipeline window. idle = 1 - busy / window. mpoverlap is not modified.

Run it inside `bench/netns.sh` (see docs/benchmarks.md):

    python -m bench.modes --scenario tp [--block 4] [--repeats 5] [--json F]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any, Dict, List

from bench.common import TrainerSide, add_block_args, adamw_groups, close_trainers, init_bench_worker, json_cli, \
    rotating_blocks, spawn_ranks, stats, plain_microbatches, step_with_lr

COMMON = ["train.steps=100000", "train.progress=false", "checkpoint.interval=0", "checkpoint.resume=none",
          "data.max_bytes=2000000", "overlap.dp=false"]


def _model_overrides(args) -> List[str]:
    """The model shape and micro batch every scenario sets from its options."""
    return [f"model.hidden_size={args.hidden}", f"model.ffn_hidden_size={args.ffn}", f"model.seq_length={args.seq}",
            f"model.num_layers={args.layers}", f"model.num_attention_heads={args.heads}",
            f"train.micro_batch_size={args.micro_batch}"]


def scenario_overrides(args) -> Dict[str, Any]:
    """(base overrides, {variant: extra overrides or None for a peer}) of a scenario."""
    s = args.scenario
    model = _model_overrides(args)
    global_batch = [f"train.global_batch_size={args.micro_batch * args.microbatches}"]
    if s == "tp":
        base = ["parallel.tp=2", "parallel.sequence_parallel=true"] + model + global_batch
        nosp = ["parallel.sequence_parallel=false"]
        return {"base": base, "variants": {"mpo_tp_overlap": ["overlap.tp=true"], "mpo_tp_off": ["overlap.tp=false"],
                                           "mpo_tp_nosp_overlap": [*nosp, "overlap.tp=true"],
                                           "mpo_tp_nosp_off": [*nosp, "overlap.tp=false"], "dtensor_tp": None}}
    if s == "cp":
        base = ["parallel.cp=2"] + model + global_batch
        return {"base": base, "variants": {"mpo_cp_overlap": ["overlap.cp=true"], "mpo_cp_off": ["overlap.cp=false"]}}
    if s == "pp":
        base = ["parallel.pp=2", "parallel.vpp=2", "model.tie_embeddings=false"] + model + global_batch
        return {"base": base, "variants": {"mpo_pp_overlap": ["overlap.pp=true"], "mpo_pp_off": ["overlap.pp=false"],
                                           "torch_interleaved_1f1b": None}}
    if s == "ep":
        model = [m for m in model if not m.startswith("model.ffn_hidden_size")]
        base = ["model=moe_tiny", "parallel.ep=2", f"model.moe_ffn_hidden_size={args.ffn}",
                f"overlap.ep_chunks={args.ep_chunks}",
                f"train.global_batch_size={args.micro_batch * args.microbatches * 2}"] + model
        variants = {}
        for shared in (False, True):
            tag = "_shared" if shared else ""
            for on in (True, False):
                variants[f"mpo_ep_{'overlap' if on else 'off'}{tag}"] = [
                    f"overlap.ep={'true' if on else 'false'}", f"model.shared_expert={'true' if shared else 'false'}"]
        return {"base": base, "variants": variants}
    if s == "bubble":
        base = ["parallel.pp=2", "model.tie_embeddings=false", "overlap.pp=true"] + model
        variants = {}
        for vpp in (1, 2):
            for m in args.bubble_microbatches:
                variants[f"vpp{vpp}_m{m}"] = [f"parallel.vpp={vpp}", f"train.global_batch_size={args.micro_batch * m}"]
        return {"base": base, "variants": variants}
    raise SystemExit(f"unknown scenario {s!r}")


# ---- sides -------------------------------------------------------------------------------------
class MpoSide(TrainerSide):
    """A Trainer; per step the ledger's figures and, when pipelined, the bubble probe's."""

    def __init__(self, trainer) -> None:
        super().__init__(trainer, BubbleProbe(trainer.pipeline.executor) if trainer.pipeline is not None else None)

    def collect(self, keep: bool) -> Dict[str, Any]:
        out = super().collect(keep)
        if self.probe:
            out["bubble"] = self.probe.take()
        return out


class BubbleProbe:
    """Wraps one executor's `_compute` and `run` on the instance (see the module docstring)."""

    def __init__(self, executor) -> None:
        from mpoverlap.comm.handle import now

        self.busy, self.window, self.n_compute = 0.0, 0.0, 0
        compute, run = executor._compute, executor.run

        def timed_compute(index, action, losses):
            n = len(executor.trace)
            compute(index, action, losses)
            end = now()
            starts = [t for ev, i, t in executor.trace[n:] if ev == "compute" and i == index]
            if starts:
                self.busy += end - starts[-1]
                self.n_compute += 1

        def timed_run(m):
            t0 = now()
            out = run(m)
            self.window += now() - t0
            return out

        executor._compute = timed_compute
        executor.run = timed_run

    def take(self) -> Dict[str, float]:
        out = {"busy_s": self.busy, "window_s": self.window, "actions": self.n_compute}
        self.busy, self.window, self.n_compute = 0.0, 0.0, 0
        return out


def _clip_(sharded: List[Any], replicated: List[Any], max_norm: float, group=None) -> float:
    """Global-norm clipping for a peer: grads of `sharded` parameters differ per rank (their
    squares are summed over `group`), those of `replicated` are the same on every rank."""
    import torch
    import torch.distributed as dist

    def local(g):
        return g.to_local() if hasattr(g, "to_local") else g

    grads_s = [local(p.grad) for p in sharded if p.grad is not None]
    grads_r = [local(p.grad) for p in replicated if p.grad is not None]
    sq = torch.zeros((), dtype=torch.float64)
    for g in grads_s:
        sq += g.double().pow(2).sum()
    dist.all_reduce(sq, group=group)
    for g in grads_r:
        sq += g.double().pow(2).sum()
    norm = float(sq.sqrt())
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        torch._foreach_mul_(grads_s + grads_r, coef)
    return norm


class _Peer:
    def settle(self) -> None:
        pass

    def collect(self, keep: bool) -> Dict[str, Any]:
        return {}


class DTensorTP(_Peer):
    """The same GPT (single-process build, same seed) under DTensor tensor parallelism."""

    def __init__(self, cfg, dataset) -> None:
        import torch
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        from mpoverlap.models.gpt import GPT
        from mpoverlap.training.lr import LRSchedule

        t = cfg.train
        self.cfg, self.dataset, self.step = cfg, dataset, 0
        self.model = GPT(cfg.model, seed=t.seed)
        mesh = init_device_mesh("cpu", (2,))
        plan = {}
        for i, block in self.model.layers.items():
            # ColwiseParallel leaves each rank 3H/2 contiguous qkv rows: attention views local
            # heads. Reordering the fused rows [q|k|v] -> [q0|k0|v0|q1|k1|v1] (and [gate|up] ->
            # [gate0|up0|gate1|up1]) first makes each rank's contiguous shard its own heads' q, k,
            # v (and its own F/2 of gate and up), matching the row-parallel shards of proj/down:
            # the same function as mpoverlap's per-block split, at the same FLOPs and traffic.
            block.attn.num_heads //= 2
            block.attn.num_groups //= 2  # K/V groups (= heads here: the model is MHA)
            with torch.no_grad():
                for lin, blocks in ((block.attn.qkv, 3), (block.mlp.gate_up, 2)):
                    w = lin.weight
                    w.copy_(w.reshape(blocks, 2, w.shape[0] // (2 * blocks), w.shape[1]).transpose(0, 1)
                            .reshape(w.shape))
            plan.update({f"layers.{i}.attn.qkv": ColwiseParallel(), f"layers.{i}.mlp.gate_up": ColwiseParallel(),
                         f"layers.{i}.attn.proj": RowwiseParallel(), f"layers.{i}.mlp.down": RowwiseParallel()})
        parallelize_module(self.model, mesh, plan)
        params = list(self.model.parameters())
        self.sharded = [p for p in params if isinstance(p, DTensor)]
        self.replicated = [p for p in params if not isinstance(p, DTensor)]
        # foreach kernels cannot mix DTensor and Tensor lists: one param group per kind.
        groups = []
        for g in adamw_groups(self.model, t.weight_decay):
            for kind in (True, False):
                ps = [p for p in g["params"] if isinstance(p, DTensor) == kind]
                if ps:
                    groups.append({"params": ps, "weight_decay": g["weight_decay"]})
        self.optimizer = torch.optim.AdamW(groups, lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps,
                                           foreach=True)
        self.schedule = LRSchedule.from_config(t)

    def train_step(self):

        from mpoverlap.training.data import global_batch, rank_microbatches

        t = self.cfg.train
        lr = self.schedule(self.step)
        micro = rank_microbatches(global_batch(self.dataset, self.step, t.global_batch_size, t.seed), 0, 1,
                                  t.micro_batch_size)
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = plain_microbatches(self.model, micro)
        _clip_(self.sharded, self.replicated, t.grad_clip)
        step_with_lr(self.optimizer, lr)
        self.step += 1
        return {"loss_local": loss_sum}


def with_positions(chunk, seq_length: int):
    """A GPT chunk as a torch.distributed.pipelining stage module: stages pass one tensor, so
    the position ids (0..seq_length-1, the same for every microbatch) live in a buffer."""
    import torch
    from torch import nn

    class WithPositions(nn.Module):
        def __init__(self):
            super().__init__()
            self.chunk = chunk
            self.register_buffer("pos", torch.arange(seq_length), persistent=False)

        def forward(self, x):
            return self.chunk(x, position_ids=self.pos)

    return WithPositions()


class TorchInterleaved(_Peer):
    """torch.distributed.pipelining ScheduleInterleaved1F1B over mpoverlap's 4 chunks."""

    def __init__(self, cfg, dataset, rank: int, pp: int, vpp: int) -> None:
        import torch
        import torch.nn.functional as F
        from torch import nn
        from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

        from mpoverlap.models.init import padded_vocab_size
        from mpoverlap.training.lr import LRSchedule
        from mpoverlap.training.pipeline_glue import build_chunks

        t, m = cfg.train, cfg.model
        self.cfg, self.dataset, self.rank, self.step = cfg, dataset, rank, 0
        self.chunks = build_chunks(m, pp, vpp, rank, t.seed)

        stages = [PipelineStage(with_positions(c, m.seq_length), stage_index=v * pp + rank, num_stages=pp * vpp,
                                device=torch.device("cpu")) for v, c in enumerate(self.chunks)]
        V = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by)

        def loss_fn(logits, targets):  # unscaled mean: scale_grads=True (default) divides by m
            return F.cross_entropy(logits.float().reshape(-1, V), targets.reshape(-1))

        self.num_microbatches = t.global_batch_size // t.micro_batch_size
        self.schedule_pp = ScheduleInterleaved1F1B(stages, n_microbatches=self.num_microbatches, loss_fn=loss_fn)
        self.first = any(c.pre_process for c in self.chunks)
        self.last = any(c.post_process for c in self.chunks)
        params = [p for c in self.chunks for p in c.parameters()]
        self.params = params
        model_like = nn.ModuleList(self.chunks)
        self.optimizer = torch.optim.AdamW(adamw_groups(model_like, t.weight_decay), lr=t.lr,
                                           betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps, foreach=True)
        self.schedule = LRSchedule.from_config(t)

    def train_step(self):
        import torch

        from mpoverlap.training.data import global_batch

        t = self.cfg.train
        lr = self.schedule(self.step)
        batch = global_batch(self.dataset, self.step, t.global_batch_size, t.seed)
        self.optimizer.zero_grad(set_to_none=True)
        kwargs: Dict[str, Any] = {}
        if self.last:
            losses: List[Any] = []
            kwargs = {"target": batch[:, 1:], "losses": losses}
        if self.first:
            self.schedule_pp.step(batch[:, :-1], **kwargs)
        else:
            self.schedule_pp.step(**kwargs)
        loss = torch.stack(kwargs["losses"]).mean().detach() if self.last else torch.zeros(())
        # Every stage's gradients differ: the squares sum over the pipeline.
        _clip_(self.params, [], t.grad_clip)
        step_with_lr(self.optimizer, lr)
        self.step += 1
        return {"loss_local": loss}


# ---- worker ------------------------------------------------------------------------------------
def _worker(rank: int, port: int, args, tmp: str) -> None:
    init_bench_worker(rank, port)
    import torch.distributed as dist

    from mpoverlap.config import compose
    from mpoverlap.training.loop import Trainer
    from mpoverlap.training.setup import init_distributed

    sides: Dict[str, Any] = {}
    try:
        spec = scenario_overrides(args)
        state, any_cfg, any_trainer = None, None, None
        for name, extra in spec["variants"].items():
            if extra is None:
                continue
            cfg = compose(COMMON + spec["base"] + extra + [f"run.dir={tmp}/{name}"])
            if state is None:
                state = init_distributed(cfg)
            (Path(tmp) / name).mkdir(parents=True, exist_ok=True)
            trainer = Trainer(cfg, state, Path(tmp) / name)
            sides[name] = MpoSide(trainer)
            any_cfg, any_trainer = cfg, trainer
        for name, extra in spec["variants"].items():
            if extra is not None:
                continue
            if name == "dtensor_tp":
                sides[name] = DTensorTP(any_cfg, any_trainer.train_data)
            elif name == "torch_interleaved_1f1b":
                sides[name] = TorchInterleaved(any_cfg, any_trainer.train_data, rank, 2, int(any_cfg.parallel.vpp))
        sides = {k: sides[k] for k in spec["variants"]}
        losses0 = {}
        for name, side in sides.items():  # first-step losses, for a same-model check
            losses0[name] = float(side.train_step()["loss_local"])
            side.collect(False)
            side.settle()
        # The simulator's model rate, timed in these rounds for each machine the variants run
        # on (bench/rate_probe.py); the bubble scenario is not predicted.
        probes: Dict[str, Any] = {}
        if args.scenario != "bubble":
            from bench.rate_probe import ModelRateSide, machine_of

            machines: Dict[str, List[str]] = {}
            for name, side in sides.items():
                if isinstance(side, MpoSide):
                    machines.setdefault(machine_of(side.t.cfg), []).append(name)
            for i, names in enumerate(machines.values()):
                probes[f"model_rate_{i}"] = (ModelRateSide(sides[names[0]].t.cfg), names)
        blocks = rotating_blocks({**sides, **{p: side for p, (side, _) in probes.items()}}, args,
                                 log_prefix=f"modes[{args.scenario}]")
        gathered: List[Any] = [None, None]
        dist.all_gather_object(gathered, {"blocks": blocks, "first_loss": losses0})
        if rank == 0:
            res = summarize(gathered, list(sides), args)
            res["base_overrides"] = COMMON + spec["base"]
            res["variant_overrides"] = spec["variants"]
            if probes:
                from bench import rate_probe

                res["model_rate_probe"] = {}
                for p, (side, names) in probes.items():
                    row = rate_probe.summarize([g["blocks"] for g in gathered], p, side, args.quiet_cores)
                    res["model_rate_probe"].update({n: row for n in names})
            Path(args.json_tmp).write_text(json.dumps(res, indent=2))
    finally:
        close_trainers(side.t for side in sides.values() if isinstance(side, MpoSide))


def _summary(b0: List[dict], b1: List[dict], block: int) -> Dict[str, Any]:
    step = [max(a, b) for x, y in zip(b0, b1) for a, b in zip(x["times"], y["times"])]
    row: Dict[str, Any] = {"blocks": len(b0), "step": stats(step),
                           "wire_mib_per_step": stats([b["wire_bytes_per_step"] / 2**20 for b in b0])["median_s"],
                           "cpu_ms_per_step": stats([(x["own_cpu_s"] + y["own_cpu_s"]) * 1e3 / block
                                                     for x, y in zip(b0, b1)])["median_s"]}
    comm: Dict[str, Dict[str, float]] = {}
    for rank_blocks in (b0, b1):
        for b in rank_blocks:
            for e in b["extras"]:
                for mode, c in e.get("comm", {}).items():
                    acc = comm.setdefault(mode, {"ops": 0.0, "bytes": 0.0, "time_s": 0.0, "exposed_s": 0.0, "n": 0,
                                                 "steps_time_s": [], "steps_exposed_s": []})
                    for k in ("ops", "bytes", "time_s", "exposed_s"):
                        acc[k] += c[k]
                        if k in ("time_s", "exposed_s"):
                            acc[f"steps_{k}"].append(c[k])
                    acc["n"] += 1
    row["comm"] = {mode: {"ops_per_step": a["ops"] / a["n"], "mib_per_step": a["bytes"] / a["n"] / 2**20,
                          "in_flight_ms": a["time_s"] / a["n"] * 1e3, "exposed_ms": a["exposed_s"] / a["n"] * 1e3,
                          "exposed_share": a["exposed_s"] / a["time_s"] if a["time_s"] > 0 else 0.0,
                          # the typical step's (one rank's), beside the sums over all steps above,
                          # which a few steps with a descheduled peer can dominate
                          "in_flight_ms_median": stats(a["steps_time_s"])["median_s"] * 1e3,
                          "exposed_ms_median": stats(a["steps_exposed_s"])["median_s"] * 1e3}
                   for mode, a in comm.items()}
    bub = []
    for stage, rank_blocks in enumerate((b0, b1)):
        xs = [e["bubble"] for b in rank_blocks for e in b["extras"] if "bubble" in e]
        if xs:
            idle = [1 - x["busy_s"] / x["window_s"] for x in xs if x["window_s"] > 0]
            bub.append({"stage": stage, "idle_fraction": stats(idle)["median_s"],
                        "busy_ms": stats([x["busy_s"] * 1e3 for x in xs])["median_s"],
                        "window_ms": stats([x["window_s"] * 1e3 for x in xs])["median_s"]})
    if bub:
        row["bubble"] = bub
    return row


def summarize(per_rank: List[Dict[str, Any]], order: List[str], args) -> Dict[str, Any]:
    b0, b1 = per_rank[0]["blocks"], per_rank[1]["blocks"]
    out: Dict[str, Any] = {"variants": {}, "variants_quiet": {}, "quiet_threshold_cores": args.quiet_cores,
                           "block_foreign_cores": [round(x["foreign_cores"], 3) for x in b0],
                           "first_loss": {k: [per_rank[0]["first_loss"][k], per_rank[1]["first_loss"][k]]
                                          for k in order}}
    for name in order:
        idx = [i for i, x in enumerate(b0) if x["name"] == name]
        quiet = [i for i in idx if b0[i]["foreign_cores"] <= args.quiet_cores]
        out["variants"][name] = _summary([b0[i] for i in idx], [b1[i] for i in idx], args.block)
        if quiet:
            out["variants_quiet"][name] = _summary([b0[i] for i in quiet], [b1[i] for i in quiet], args.block)
    return out


DEFAULTS = {  # scenario: hidden, ffn, seq, layers, heads, micro batch, microbatches
    "tp": dict(hidden=256, ffn=1024, seq=256, layers=4, heads=8, micro_batch=4, microbatches=1),
    "cp": dict(hidden=128, ffn=512, seq=2048, layers=2, heads=4, micro_batch=1, microbatches=1),
    "pp": dict(hidden=128, ffn=512, seq=128, layers=8, heads=4, micro_batch=2, microbatches=8),
    "bubble": dict(hidden=128, ffn=512, seq=128, layers=8, heads=4, micro_batch=2, microbatches=0),
    # ep: `ffn` is each expert's width; a narrow expert against a wide hidden keeps the token
    # exchange comparable to the expert compute on the capped link.
    "ep": dict(hidden=512, ffn=128, seq=256, layers=2, heads=8, micro_batch=4, microbatches=1),
}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scenario", choices=list(DEFAULTS), default="tp")
    add_block_args(p, block=4, repeats=5, max_repeats=20, min_quiet=4, time_budget=150.0, warmup=2)
    for k in ("hidden", "ffn", "seq", "layers", "heads", "micro_batch", "microbatches"):
        p.add_argument("--" + k.replace("_", "-"), type=int, default=None, help="scenario default: see DEFAULTS")
    p.add_argument("--ep-chunks", type=int, default=4, help="ep scenario: overlap.ep_chunks (default 4, as the config)")
    p.add_argument("--bubble-microbatches", default="2,4,8", help="bubble scenario: microbatch counts (default 2,4,8)")


def _fill_defaults(args) -> None:
    for k, v in DEFAULTS[args.scenario].items():
        if getattr(args, k) is None:
            setattr(args, k, v)


def planned(argv: List[str]):
    """(base overrides, {variant: overrides, None for a peer}) of a run with `argv`, before it
    runs (bench/run.py times the machine for them)."""
    p = argparse.ArgumentParser()
    add_args(p)
    args = p.parse_known_args(argv)[0]
    _fill_defaults(args)
    spec = scenario_overrides(args)
    return COMMON + spec["base"], spec["variants"]


def run(args) -> Dict[str, Any]:
    _fill_defaults(args)
    if isinstance(args.bubble_microbatches, str):
        args.bubble_microbatches = [int(x) for x in args.bubble_microbatches.split(",") if x.strip()]
    res, t0 = spawn_ranks(_worker, args, prefix=f"mpo-bench-{args.scenario}-")
    res.update(benchmark="modes", scenario=args.scenario, link=args.link, wall_s=time.perf_counter() - t0,
               setup={k: getattr(args, k) for k in ("block", "warmup", "block_warmup", "hidden", "ffn", "seq",
                                                   "layers", "heads", "micro_batch", "microbatches",
                                                   "bubble_microbatches")})
    return res


def main() -> None:
    json_cli(__doc__, add_args, run, link=True)


if __name__ == "__main__":
    main()
