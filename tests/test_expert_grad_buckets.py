"""Experts replicated over tp under sequence parallelism (parallel.etp=1): each tp rank routes
only its S/tp positions through the same whole experts, so their gradients are partial over tp.
They are reduced over tp x edp in the data-parallel buckets, issued inside backward as each
bucket fills (RankGrid.expert_grad_kind), not copied into the flat sequence-parallel buffer that
is summed over tp after backward. Checked here:

- moe_tiny and moe_fine_tiny at tp 2 + SP (etp 1, and etp 2 for moe_fine_tiny) with dp 2, at
  every train.dp_sharding level: losses and grad norms within 1e-5 of the single-process run;
- the flat reduction after backward holds exactly the replicated parameters that are not
  expert weights (norms, routers) and no expert gradient;
- at tp 2 + SP with dp 1 (no data-parallel replica at all) the expert gradients' reductions
  are still issued before backward ends, one per expert bucket;
- a checkpoint saved at tp 2 + SP, dp 2 under ZeRO-1 and ZeRO-3 (expert state sharded over
  tp x edp: every tp rank writes its share) resumes in one process on the uninterrupted curve.

All layouts of a world size train inside one spawn."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dist_harness import run_distributed  # noqa: E402

STEPS = 3
BASE = ["train.global_batch_size=8", "train.micro_batch_size=2", "train.log_interval=100", "train.progress=false",
        "data.max_bytes=300000", "train.lr_decay_steps=6", "overlap.dp_bucket_mb=0.01"]
MOE = ["model=moe_tiny", "model.num_layers=2", "model.hidden_size=64", "model.moe_ffn_hidden_size=32",
       "model.seq_length=32"]
FINE = ["model=moe_fine_tiny", "model.num_layers=3", "model.seq_length=32"]
SP = ["parallel.tp=2", "parallel.sequence_parallel=true"]
LEVELS = ("none", "optim", "optim_grads", "optim_grads_params")
SAVED_AT = {"zero1": "optim", "zero3": "optim_grads_params"}  # chain -> level of the saving run
# name -> (world, overrides, reference)
LAYOUTS = {
    "ref_moe": (1, [*MOE], None),
    "ref_fine": (1, [*FINE], None),
    "moe_tp2_sp_dp1": (2, [*MOE, *SP, "overlap.tp=true"], "ref_moe"),
    **{f"moe_tp2_sp_dp2_{lv}": (4, [*MOE, *SP, "parallel.dp=2", f"train.dp_sharding={lv}"], "ref_moe")
       for lv in LEVELS},
    **{f"fine_tp2_sp_dp2_{lv}": (4, [*FINE, *SP, "parallel.dp=2", f"train.dp_sharding={lv}"], "ref_fine")
       for lv in ("none", "optim_grads_params")},
    "fine_etp2_sp_dp2_optim": (4, [*FINE, *SP, "parallel.etp=2", "parallel.dp=2", "train.dp_sharding=optim"],
                               "ref_fine"),
}
CKPT = ["checkpoint.interval=3", "train.log_interval=1", "train.eval_iters=1"]


def _run_segment(name, overrides, steps, root):
    """A full Trainer.run() in root/name: resumes from its newest checkpoint, saves every 3 steps."""
    from mpoverlap.config import compose
    from mpoverlap.training.loop import Trainer
    from mpoverlap.training.setup import init_distributed

    run_dir = Path(root) / name
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = compose([*BASE, *overrides, *CKPT, f"train.steps={steps}", f"run.dir={run_dir}", "train.device=cpu"])
    Trainer(cfg, init_distributed(cfg), run_dir).run()


def _train(rank, world, specs, root, segments):
    """Per layout: each step's loss (replicas' mean) and grad norm, and in the last step the
    reductions issued before `finish_grad_sync` (backward's end) and the flat SP reduction's bytes;
    then the checkpoint chains' `segments` [(name, overrides, steps)] of this world size."""
    from mpoverlap.config import compose
    from mpoverlap.training.loop import Trainer
    from mpoverlap.training.setup import init_distributed

    for name, overrides, steps in segments:
        _run_segment(name, overrides, steps, root)
    out = {}
    for name, overrides in specs.items():
        run_dir = Path(root) / name
        cfg = compose([*BASE, *overrides, f"train.steps={STEPS}", f"run.dir={run_dir}", "train.device=cpu"])
        trainer = Trainer(cfg, init_distributed(cfg), run_dir)
        handles, backward_end = [], []
        trainer.ledger.recorder = lambda h: handles.append((h.mode, h.op, h.nbytes, h.issued_at))
        finish = trainer.ddp.finish_grad_sync

        def stamped_finish():
            backward_end.append(time.perf_counter())
            finish()
        trainer.ddp.finish_grad_sync = stamped_finish
        rows = []
        for _ in range(STEPS):
            handles.clear()
            backward_end.clear()
            res = trainer.train_step()
            rows.append((trainer._mean_over_replicas(res["loss_local"]), res["grad_norm"]))
        end = backward_end[0]
        replicated = [p for p in trainer.model.parameters() if not getattr(p, "tensor_model_parallel", False)]
        out[name] = {
            "rows": rows,
            "dp_in_backward": sum(m == "dp" and t < end for m, _, _, t in handles),
            "tp_all_reduce_after_backward": sum(n for m, op, n, t in handles
                                                if m == "tp" and op == "all_reduce" and t >= end),
            "replicated_dense_bytes": 4 * sum(p.numel() for p in replicated
                                              if not getattr(p, "expert_parallel", False)),
            "replicated_expert_bytes": 4 * sum(p.numel() for p in replicated if getattr(p, "expert_parallel", False)),
            "expert_buckets": sum(b.key == "expert" for b in trainer.ddp.buffer.buckets),
        }
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("expert_grad_buckets")
    results = {}
    # Largest world first: its spawn saves the checkpoints that the one-process spawn resumes.
    segments = {4: [(chain, [*MOE, *SP, "parallel.dp=2", f"train.dp_sharding={lv}"], 3)
                    for chain, lv in SAVED_AT.items()],
                1: [(chain, MOE, 6) for chain in SAVED_AT] + [("uninterrupted", MOE, 6)]}
    for world in sorted({w for w, _, _ in LAYOUTS.values()}, reverse=True):
        specs = {n: ov for n, (w, ov, _) in LAYOUTS.items() if w == world}
        results.update(run_distributed(_train, world, specs, str(root), segments.get(world, []), timeout_s=900)[0])
    results["losses"] = {chain: {r["step"]: r["loss"] for r in map(json.loads, (root / chain / "metrics.jsonl")
                                                                   .read_text().splitlines()) if "loss" in r}
                         for chain in [*SAVED_AT, "uninterrupted"]}
    return results


@pytest.mark.parametrize("name", [n for n, (_, _, ref) in LAYOUTS.items() if ref])
def test_losses_and_grad_norms_follow_the_single_process_run(runs, name):
    ref = runs[LAYOUTS[name][2]]["rows"]
    for step, ((loss, norm), (loss_ref, norm_ref)) in enumerate(zip(runs[name]["rows"], ref), 1):
        assert loss == pytest.approx(loss_ref, rel=1e-5), (name, step)
        assert norm == pytest.approx(norm_ref, rel=1e-5), (name, step)


def test_flat_sp_reduction_holds_no_expert_gradient(runs):
    """After backward only the norms and routers are summed over tp (full gradients at level none)."""
    for name in ("moe_tp2_sp_dp1", "moe_tp2_sp_dp2_none", "fine_tp2_sp_dp2_none"):
        r = runs[name]
        assert r["replicated_expert_bytes"] > 0, name  # etp 1: the experts are replicated over tp
        assert r["tp_all_reduce_after_backward"] == r["replicated_dense_bytes"], name


def test_expert_gradients_are_reduced_inside_backward_without_replicas(runs):
    """dp 1: no dense bucket communicates, yet each expert bucket's tp reduction is issued in backward."""
    r = runs["moe_tp2_sp_dp1"]
    assert r["expert_buckets"] > 1
    assert r["dp_in_backward"] == r["expert_buckets"]


def test_checkpoint_with_expert_state_sharded_over_tp_resumes_on_the_curve(runs):
    """Steps 4-6 resumed in one process from the tp 2 + SP, dp 2 save match the uninterrupted run."""
    ref = runs["losses"]["uninterrupted"]
    assert sorted(ref) == [1, 2, 3, 4, 5, 6]
    for chain in SAVED_AT:
        resumed = [runs["losses"][chain][step] for step in (4, 5, 6)]
        assert resumed == pytest.approx([ref[step] for step in (4, 5, 6)], rel=1e-5), chain
