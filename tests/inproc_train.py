"""Train several layouts inside one spawn per world size: `train_layouts(specs, root)`.

A CLI run costs a launcher, an elastic agent and a fresh torch import per rank (about 10 s on
2 cores before the first step); a Trainer built inside an already spawned gloo world costs
its groups and its model. specs: {name: (world, overrides, steps)}; the overrides are
complete (the caller adds its base overrides). Returns {name: [row per step]}, each row
{"loss": replicas' mean, "grad_norm", "comm": per-mode summary averaged over the ranks, "moe":
the router figures (None for a dense model)} and, with model.mtp_num_layers, "mtp_loss": the
figures metrics.jsonl reports at train.log_interval=1.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dist_harness import run_distributed  # noqa: E402

Spec = Tuple[int, Sequence[str], int]


def _train(rank, world, specs: Dict[str, Spec], root: str, probe: Optional[Callable] = None):
    from mpoverlap.config import compose
    from mpoverlap.training.loop import Trainer
    from mpoverlap.training.setup import init_distributed

    out = {}
    for name, (_, overrides, steps) in specs.items():
        run_dir = Path(root) / name
        cfg = compose([*overrides, f"train.steps={steps}", f"run.dir={run_dir}", "train.device=cpu"])
        trainer = Trainer(cfg, init_distributed(cfg), run_dir)
        watch = probe(trainer) if probe is not None else None
        rows = []
        for _ in range(steps):
            res = trainer.train_step()
            moe = [layer.stats_since() for layer in trainer.moe_layers]
            rows.append({"loss": trainer._mean_over_replicas(res["loss_local"]), "grad_norm": res["grad_norm"],
                         "comm": trainer.ledger.reset(),
                         "moe": {k: sum(st[k] for st in moe) for k in moe[0]} if moe else None})
            if "mtp_loss_local" in res:  # the MTP depths' loss, apart from the LM loss
                rows[-1]["mtp_loss"] = trainer._mean_over_replicas(res["mtp_loss_local"])
            if watch is not None:  # what the probe saw in the first step
                rows[-1]["probe"], watch = watch(), None
        out[name] = rows
    return out


def world_of(overrides: Sequence[str]) -> int:
    """The world size a self-launched `mpoverlap-train <overrides>` would start."""
    from mpoverlap.config import compose
    from mpoverlap.overlap.layout import build_layout

    return build_layout(compose(list(overrides)), world_size=None).world


def train_layouts(specs: Dict[str, Spec], root, timeout_s: float = 900,
                  probe: Optional[Callable] = None) -> Dict[str, List[dict]]:
    """`probe(trainer)`, a module-level function of a test module, runs on every rank after each
    Trainer is built and returns None or a function that, after the first step, returns what
    it saw (picklable): the first row's "probe" is then the list of those, one per rank."""
    from mpoverlap.comm.ledger import mean_over_ranks
    from mpoverlap.training.metrics import moe_summary

    results: Dict[str, List[dict]] = {}
    for world in sorted({w for w, _, _ in specs.values()}):
        group = {n: s for n, s in specs.items() if s[0] == world}
        per_rank = run_distributed(_train, world, group, str(root), probe, timeout_s=timeout_s)
        for name in group:
            results[name] = [dict(row, comm=mean_over_ranks([r[name][i]["comm"] for r in per_rank]),
                                  moe=moe_summary([r[name][i]["moe"] for r in per_rank]) if row["moe"] else None)
                             for i, row in enumerate(per_rank[0][name])]
            if "probe" in per_rank[0][name][0]:
                results[name][0]["probe"] = [r[name][0]["probe"] for r in per_rank]
    return results


Segment = Tuple[int, Sequence[str], int]


def _run_segments(rank, world, jobs, root: str):
    import contextlib
    import io

    from mpoverlap.config import compose
    from mpoverlap.training.loop import Trainer
    from mpoverlap.training.setup import init_distributed

    out = {}
    for name, overrides, steps in jobs:
        run_dir = Path(root) / name
        run_dir.mkdir(parents=True, exist_ok=True)
        cfg = compose([*overrides, f"train.steps={steps}", f"run.dir={run_dir}", "train.device=cpu"])
        trainer = Trainer(cfg, init_distributed(cfg), run_dir)
        blocked = []  # (step, the executor's own blocked time of that step, this rank's step time) on a pipelined run
        if trainer.pipeline is not None:
            train_step = trainer.train_step

            def timed_step(train_step=train_step, trainer=trainer, blocked=blocked):
                result = train_step()
                blocked.append((trainer.step, trainer.pipeline.executor.bubble_s, result["step_time_s"]))
                return result
            trainer.train_step = timed_step
        stdout = io.StringIO()
        try:
            with contextlib.redirect_stdout(stdout):
                trainer.run()
        finally:
            sys.stdout.write(stdout.getvalue())
        out[name] = {"stage": trainer.state.coords.pp, "blocked": blocked, "stdout": stdout.getvalue()}
    return out


def run_chains(chains: Dict[str, Sequence[Segment]], root, timeout_s: float = 900) -> Dict[str, List[dict]]:
    """Each chain is a list of segments (world, overrides, steps) that run one after another in
    `root/<name>`, each a full `Trainer.run()` (what a console-script launch runs: resume from the
    newest checkpoint, train to `steps`, save, write metrics.jsonl). The k-th segments of all
    chains run in one spawn per world size, after every (k-1)-th segment finished.

    Returns {name: [per segment, per rank: {"stage": pipeline stage, "blocked": [(step, the
    PipelineExecutor's bubble_s of that step, the rank's own step time)] (empty without a pipeline), "stdout": what the
    rank printed (rank 0: the plan and, with train.progress=true, the log lines)}]}."""
    results: Dict[str, List[list]] = {name: [] for name in chains}
    for k in range(max(len(segments) for segments in chains.values())):
        by_world: Dict[int, list] = {}
        for name, segments in chains.items():
            if k < len(segments):
                world, overrides, steps = segments[k]
                by_world.setdefault(world, []).append((name, list(overrides), steps))
        for world, jobs in sorted(by_world.items()):
            per_rank = run_distributed(_run_segments, world, jobs, str(root), timeout_s=timeout_s)
            for name, _, _ in jobs:
                results[name].append([r[name] for r in per_rank])
    return results
