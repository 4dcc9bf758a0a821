"""Zero-bubble pipeline schedules on 2 gloo ranks, against torch.distributed.pipelining.

Scenario `schedules`: pp 2 (one rank per core), m = 4 and 8 microbatches, one GPT
(hidden 384, ffn 1536, 8 layers, seq 64, micro batch 2: F, B and W of a 4-layer stage each
14-28 ms on one thread, and nearly equal: see DEFAULTS for why this shape). Sides, all built once in the same two processes and stepped in rotating blocks
(`bench.common.rotating_blocks`):

- mpoverlap, one side per schedule kind in `mpoverlap.pipeline.schedules.SCHEDULE_KINDS`
  (zbv too once it is there, no edit needed), each at the smallest vpp in (1, 2) its
  constraints and the config rules accept (1f1b, zb1p: 1; interleaved: 2), overlap.pp=true;
- torch.distributed.pipelining on the same weights (plain nn.Module stages built from
  mpoverlap's GPT chunks at tp 1, same seed: `GPT(layer_ids=...)` seeds every layer by its
  name) and the same batch: `Schedule1F1B` (anchor), `ScheduleInterleavedZeroBubble` (ZB-H1,
  one stage per rank, the same kind as our zb1p) and `ScheduleZBVZeroBubble` (two stages per
  rank in a V: rank r holds model chunks r and 3-r).

Per mpoverlap step each rank records the executor's `bubble_s` (what metrics.jsonl reports as
`pp_bubble_s`: blocked on a receive inside the schedule), the pipeline window (`executor.run`)
and the compute time of every F, B and W action (from the action's start after its receive to
its end: the BubbleProbe method of bench/modes.py). The report (bench/zero_bubble_report.py)
puts the measured bubble beside the closed forms and a timed run of the very table with the
measured per-action costs.

Scenario `tp_wgrad` (4 ranks, 2 per core): tp 2 + SP with collective matmul (overlap.tp=true)
at pp 2, 1f1b against zb1p: the exposed tp communication (the ledger's `comm.tp.exposed_s`)
with and without W deferral.

Activation memory (`bench.run` runs it after the scenarios, `memory_runs` in
bench/zero_bubble_report.py): one short `mpoverlap-train` per schedule kind at m = 4 and 8 and
its near-empty baseline, bench/memory.py's method, beside the estimate.

    python -m bench.zero_bubble --scenario schedules [--block 3] [--repeats 4] [--json F]
    python -m bench.zero_bubble --memory-only 4,8 [--json F]      # the activation-memory runs alone
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from bench.common import TrainerSide, add_block_args, adamw_groups, close_trainers, free_port, init_bench_worker, \
    json_cli, rotating_blocks
from bench.modes import BubbleProbe, TorchInterleaved, with_positions

COMMON = ["train.steps=100000", "train.progress=false", "checkpoint.interval=0", "checkpoint.resume=none",
          "data.max_bytes=2000000", "overlap.dp=false", "overlap.pp=true", "model.tie_embeddings=false"]
TORCH_KINDS = {"torch_1f1b": "Schedule1F1B", "torch_zb1p": "ScheduleInterleavedZeroBubble",
               "torch_zbv": "ScheduleZBVZeroBubble"}
# Which of our kinds each torch schedule is compared with.
TORCH_PEER_OF = {"1f1b": "torch_1f1b", "zb1p": "torch_zb1p", "zbv": "torch_zbv"}


def model_overrides(args) -> List[str]:
    return [f"model.hidden_size={args.hidden}", f"model.ffn_hidden_size={args.ffn}", f"model.seq_length={args.seq}",
            f"model.num_layers={args.layers}", f"model.num_attention_heads={args.heads}",
            f"train.micro_batch_size={args.micro_batch}"]


def schedule_vpp(kind: str, pp: int, m: int, layers: int) -> Optional[int]:
    """The smallest vpp in (1, 2) the schedule's constraints and the config rules accept at
    this pp and m (None: neither)."""
    from mpoverlap.config import compose
    from mpoverlap.overlap.rules import validate
    from mpoverlap.pipeline.schedules import schedule_constraints

    for vpp in (1, 2):
        if layers % (pp * vpp) or schedule_constraints(kind, pp, vpp, m):
            continue
        cfg = compose(COMMON + [f"parallel.pp={pp}", f"parallel.vpp={vpp}", f"parallel.pp_schedule={kind}",
                                f"model.num_layers={layers}", f"train.global_batch_size={m}",
                                "train.micro_batch_size=1"])
        if not validate(cfg, pp):
            return vpp
    return None


def scenario_overrides(args) -> Dict[str, Any]:
    """(base overrides, {side: extra overrides, or the torch schedule's class name for a peer})."""
    from mpoverlap.pipeline.schedules import SCHEDULE_KINDS

    model = model_overrides(args)
    if args.scenario == "tp_wgrad":
        base = ["parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true", "overlap.tp=true"] + model \
            + [f"train.global_batch_size={args.micro_batch * args.microbatches[0]}"]
        return {"base": base, "variants": {f"mpo_{k}": [f"parallel.pp_schedule={k}"] for k in ("1f1b", "zb1p")},
                "world": 4}
    variants: Dict[str, Any] = {}
    for m in args.microbatches:
        batch = f"train.global_batch_size={args.micro_batch * m}"
        for kind in SCHEDULE_KINDS:
            vpp = schedule_vpp(kind, 2, m, args.layers)
            if vpp is not None:
                variants[f"mpo_{kind}_m{m}"] = [f"parallel.pp_schedule={kind}", f"parallel.vpp={vpp}", batch]
        for name, cls in TORCH_KINDS.items():
            if name in args.torch:
                variants[f"{name}_m{m}"] = cls
    return {"base": ["parallel.pp=2"] + model, "variants": variants, "world": 2}


# ---- mpoverlap sides ---------------------------------------------------------------------------
class ActionProbe(BubbleProbe):
    """Per run of one executor: each action kind's compute seconds (F, B, W: from its trace
    "compute" stamp, after its receive, to its end: bench.modes.BubbleProbe's busy time, split
    by kind, and by kind and local chunk), the window of `run`, `bubble_s`, and the p2p stamps
    of the run (`messages`: per message this rank sent, when the send was posted; per message
    it received, when its wait started and when the consumer's compute started; the clock is
    perf_counter, one monotonic clock for every process on the machine, so the report can
    pair the two ends). Wraps the instance; mpoverlap is unchanged."""

    def __init__(self, executor) -> None:
        from mpoverlap.comm.handle import now

        super().__init__(executor)
        self.ex = executor
        self.spent: Dict[str, List[float]] = {}
        self.spent_chunk: Dict[str, List[float]] = {}
        self.messages: List[Dict[str, Any]] = []
        timed, run = executor._compute, executor.run  # BubbleProbe's: adds each compute to self.busy

        def by_kind(index, action, losses):
            before = self.busy
            timed(index, action, losses)
            if self.busy > before:
                self.spent.setdefault(action.kind, []).append(self.busy - before)
                self.spent_chunk.setdefault(f"{action.kind}{action.vchunk}", []).append(self.busy - before)

        def stamped(m):
            started = now()
            out = run(m)
            self.messages.append(dict(p2p_stamps(executor), started=started))
            return out

        executor._compute = by_kind
        executor.run = stamped

    def take(self) -> Dict[str, Any]:
        out = {"window_s": super().take()["window_s"], "bubble_s": self.ex.bubble_s,
               "actions": {k: [sum(v), len(v)] for k, v in self.spent.items()},
               "chunk_actions": {k: [sum(v), len(v)] for k, v in self.spent_chunk.items()},
               "messages": self.messages[-1] if self.messages else {}}
        self.spent, self.spent_chunk, self.messages = {}, {}, []
        return out


def p2p_stamps(executor) -> Dict[str, Any]:
    """{"sent": {message: post time}, "recv": {message: [wait start, consumer compute start]}}
    of the executor's last run (its trace), messages as str (local hand-overs left out)."""
    acts = executor.actions
    sent, waits, starts = {}, {}, {}
    for event, index, t in executor.trace:
        if event == "post_send" and acts[index].send not in executor.local:
            sent[str(acts[index].send)] = t
        elif event == "wait_recv":
            waits[index] = t
        elif event == "compute" and index in waits:
            starts[index] = t
    recv = {str(acts[i].recv): [waits[i], starts[i]] for i in waits if i in starts}
    return {"sent": sent, "recv": recv}


class MpoSide(TrainerSide):
    """A Trainer; per step the ledger's figures and the action probe's."""

    def __init__(self, trainer) -> None:
        super().__init__(trainer, ActionProbe(trainer.pipeline.executor))

    def collect(self, keep: bool) -> Dict[str, Any]:
        return {**super().collect(keep), "pipe": self.probe.take()}


# ---- torch.distributed.pipelining peers --------------------------------------------------------
def _stage_indices(cls_name: str, rank: int, pp: int) -> List[int]:
    """The model chunks (torch stage indices) rank `rank` holds under the schedule."""
    if cls_name == "ScheduleZBVZeroBubble":
        return [rank, 2 * pp - 1 - rank]  # the V
    return [rank]


class TorchPipeline(TorchInterleaved):
    """A torch.distributed.pipelining schedule over plain nn.Module stages: mpoverlap's GPT
    chunks (tp 1, the same seed, so the same weights as the mpoverlap sides), AdamW. The step
    is bench.modes.TorchInterleaved's (batch, schedule step, clip over the stages, AdamW)."""

    def __init__(self, cfg, dataset, rank: int, pp: int, cls_name: str, group=None) -> None:
        import torch
        import torch.nn.functional as F
        from torch import nn
        from torch.distributed import pipelining

        from mpoverlap.models.gpt import GPT
        from mpoverlap.models.init import padded_vocab_size
        from mpoverlap.training.lr import LRSchedule

        t, m = cfg.train, cfg.model
        self.cfg, self.dataset, self.step = cfg, dataset, 0
        indices = _stage_indices(cls_name, rank, pp)
        total = pp * len(indices)
        per = m.num_layers // total

        self.chunks = [GPT(m, seed=t.seed, layer_ids=list(range(k * per, (k + 1) * per)), pre_process=k == 0,
                           post_process=k == total - 1) for k in indices]
        stages = [pipelining.PipelineStage(with_positions(c, m.seq_length), stage_index=k, num_stages=total,
                                           device=torch.device("cpu"), group=group)
                  for k, c in zip(indices, self.chunks)]
        V = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by)

        def loss_fn(logits, targets):  # unscaled mean: scale_grads=True (default) divides by m
            return F.cross_entropy(logits.float().reshape(-1, V), targets.reshape(-1))

        n = t.global_batch_size // t.micro_batch_size
        cls = getattr(pipelining, cls_name)
        self.schedule_pp = cls(stages[0] if cls_name == "Schedule1F1B" else stages, n_microbatches=n,
                               loss_fn=loss_fn)
        self.first = 0 in indices
        self.last = total - 1 in indices
        self.params = [p for c in self.chunks for p in c.parameters()]
        self.optimizer = torch.optim.AdamW(adamw_groups(nn.ModuleList(self.chunks), t.weight_decay), lr=t.lr,
                                           betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps, foreach=True)
        self.schedule = LRSchedule.from_config(t)


# ---- worker ------------------------------------------------------------------------------------
def _worker(rank: int, port: int, args, tmp: str) -> None:
    spec = scenario_overrides(args)
    init_bench_worker(rank, port, spec["world"])
    import torch.distributed as dist

    from mpoverlap.config import compose
    from mpoverlap.training.loop import Trainer
    from mpoverlap.training.setup import init_distributed

    sides: Dict[str, Any] = {}
    try:
        state, any_trainer = None, None
        for name, extra in spec["variants"].items():
            if isinstance(extra, str):
                continue
            cfg = compose(COMMON + spec["base"] + extra + [f"run.dir={tmp}/{name}"])
            if state is None:
                state = init_distributed(cfg)
            (Path(tmp) / name).mkdir(parents=True, exist_ok=True)
            sides[name] = MpoSide(Trainer(cfg, state, Path(tmp) / name))
            any_trainer = sides[name].t
        for name, cls_name in spec["variants"].items():
            if isinstance(cls_name, str):
                m = int(name.rsplit("_m", 1)[1])
                mpo = next(s.t for n, s in sides.items() if n.endswith(f"_m{m}"))
                sides[name] = TorchPipeline(mpo.cfg, any_trainer.train_data, rank, 2, cls_name)
        sides = {k: sides[k] for k in spec["variants"]}
        losses0 = {}
        for name, side in sides.items():  # first-step loss on the last stage: the same model and batch
            losses0[name] = float(side.train_step()["loss_local"])
            side.collect(False)
            side.settle()
        blocks = rotating_blocks(sides, args, log_prefix=f"zero_bubble[{args.scenario}]")
        gathered: List[Any] = [None] * spec["world"]
        dist.all_gather_object(gathered, {"blocks": blocks, "first_loss": losses0, "coords": (
            state.coords.pp, state.coords.tp)})
        if rank == 0:
            from bench.zero_bubble_report import summarize

            res = summarize(gathered, list(sides), args)
            res["base_overrides"] = COMMON + spec["base"]
            res["variant_overrides"] = spec["variants"]
            Path(args.json_tmp).write_text(json.dumps(res, indent=2))
    finally:
        close_trainers(s.t for s in sides.values() if isinstance(s, MpoSide))


def spawn(args) -> Dict[str, Any]:
    """`_worker` on the scenario's world of spawned ranks; rank 0's result."""
    import torch.multiprocessing as mp

    from bench.common import _worker_then_free

    os.environ["OMP_NUM_THREADS"] = "1"
    world = scenario_overrides(args)["world"]
    with tempfile.TemporaryDirectory(prefix=f"mpo-bench-zb-{args.scenario}-") as tmp:
        args.json_tmp = str(Path(tmp) / "result.json")
        mp.start_processes(_worker_then_free, args=(_worker, free_port(), args, tmp), nprocs=world, start_method="spawn", join=True)
        return json.loads(Path(args.json_tmp).read_text())


# `schedules`' model: the two stages balanced (the vocabulary is 256, the head a small GEMM) and
# F, B, W the compute the schedules move. At hidden 256, ffn 1024, seq 128 the input-gradient B
# (attention backward, norms, SwiGLU and RoPE backward: memory-bound on one CPU thread at hidden
# 256) is 1.8x W, so the zero-bubble schedules' bubble (p-1)(F+B-W) stays large; at hidden 384,
# seq 64 (128 tokens per microbatch instead of 256, 2.25x the GEMM work per token: a GEMM share
# closer to a larger model's) F : B : W is 28 : 27 : 20.5 ms per 4-layer stage (docs/benchmarks.md,
# "Where the step goes"). Every side, ours and torch's, runs this one model.
DEFAULTS = {  # scenario: hidden, ffn, seq, layers, heads, micro batch, microbatches
    "schedules": dict(hidden=384, ffn=1536, seq=64, layers=8, heads=8, micro_batch=2, microbatches="4,8"),
    "tp_wgrad": dict(hidden=256, ffn=1024, seq=128, layers=4, heads=8, micro_batch=2, microbatches="4"),
}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scenario", choices=list(DEFAULTS), default="schedules")
    add_block_args(p, block=3, repeats=4, max_repeats=12, min_quiet=3, time_budget=200.0, warmup=2)
    for k in ("hidden", "ffn", "seq", "layers", "heads", "micro_batch"):
        p.add_argument("--" + k.replace("_", "-"), type=int, default=None, help="scenario default: see DEFAULTS")
    p.add_argument("--microbatches", default=None, help="comma-separated microbatch counts (schedules: 4,8)")
    p.add_argument("--memory-only", default=None, metavar="M,M",
                   help="only the activation-memory runs (bare loopback), at these microbatch counts; prints "
                        "the peak over the ranks against 1F1B's")
    p.add_argument("--torch", default=",".join(TORCH_KINDS),
                   help=f"torch schedules to run beside ours (default {','.join(TORCH_KINDS)}; 'none': none)")


def fill_defaults(args) -> None:
    for k, v in DEFAULTS[args.scenario].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if isinstance(args.microbatches, str):
        args.microbatches = [int(x) for x in args.microbatches.split(",") if x.strip()]
    if args.scenario == "tp_wgrad":
        # 4 ranks: the blocks' "quiet" test counts ranks 2 and 3 as other processes, so no
        # block is quiet; run --repeats rounds (every block is reported, medians and IQR).
        args.min_quiet = 0
    if isinstance(args.torch, str):
        args.torch = [x.strip() for x in args.torch.split(",") if x.strip() in TORCH_KINDS]


def run(args) -> Dict[str, Any]:
    fill_defaults(args)
    t0 = time.perf_counter()
    if args.memory_only:
        from bench.zero_bubble_report import memory_runs, peak_line

        out = Path(tempfile.mkdtemp(prefix="mpo-bench-zb-memory-"))
        memory = [{"m": int(m), "runs": memory_runs(args, out, int(m))} for m in args.memory_only.split(",")]
        for mem in memory:
            print(f"m = {mem['m']}: " + peak_line(mem["runs"]["layouts"], mem["m"]), flush=True)
        return {"benchmark": "zero_bubble", "memory": memory, "wall_s": time.perf_counter() - t0}
    res = spawn(args)
    res.update(benchmark="zero_bubble", scenario=args.scenario, link=args.link, wall_s=time.perf_counter() - t0,
               setup={k: getattr(args, k) for k in ("block", "warmup", "block_warmup", "hidden", "ffn", "seq",
                                                   "layers", "heads", "micro_batch", "microbatches")})
    return res


def run_in_bench(prefix: List[str], link: str, out: Path, budget: float, scenarios: List[str],
                 memory_ms: Sequence[int] = (4, 8)) -> Dict[str, Any]:
    """For bench/run.py: each scenario in a subprocess (inside bench/netns.sh when `prefix` has
    it), then the activation-memory runs at each of `memory_ms` microbatch counts (bare
    loopback; empty: none)."""
    import subprocess
    import sys

    from bench.common import ROOT

    res: Dict[str, Any] = {}
    for scenario in scenarios:
        path = out / f"zero_bubble_{scenario}.json"
        cmd = prefix + [sys.executable, "-m", "bench.zero_bubble", "--scenario", scenario, "--json", str(path),
                        "--link", link, "--time-budget", str(budget)]
        if scenario == "tp_wgrad":
            cmd += ["--repeats", "8"]  # no block counts as quiet at 4 ranks: a fixed number of rounds
        print("$ " + " ".join(cmd), flush=True)
        proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL)
        if proc.returncode != 0:
            raise SystemExit(f"bench.zero_bubble --scenario {scenario} failed with exit status {proc.returncode}")
        res[scenario] = json.loads(path.read_text())
    if memory_ms:
        from bench.zero_bubble_report import memory_runs

        p = argparse.ArgumentParser()
        add_args(p)
        args = p.parse_args(["--scenario", "schedules"])
        fill_defaults(args)
        res["memory"] = [{"m": m, "runs": memory_runs(args, out, m)} for m in memory_ms]
    return res


def main() -> None:
    json_cli(__doc__, add_args, run, link=True)


if __name__ == "__main__":
    main()
