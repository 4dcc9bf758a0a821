"""The training loop's step bookkeeping, through `Trainer.run()` (what `mpoverlap-train` runs)
inside one spawn per world size: the LR schedule against its formula, rows averaged over
`train.log_interval`, SIGTERM on one rank stopping every rank at the next step, `val_loss` at
pp 2, tp 2 + SP, cp 2 and ZeRO-3 equal to the single-process value, the
MPOVERLAP_VERBOSE_P2P lines, and `train.on_nonfinite=skip` leaving the weights untouched."""
import contextlib
import io
import json
import math
import os
import re
import signal
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dist_harness import run_distributed  # noqa: E402

pytestmark = pytest.mark.slow

SMALL = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.ffn_hidden_size=128",
         "model.seq_length=32", "train.global_batch_size=8", "train.micro_batch_size=2", "data.max_bytes=100000",
         "overlap.dp_bucket_mb=0.02", "train.progress=false", "train.eval_iters=1", "train.device=cpu",
         "train.log_interval=1"]
LR = ["train.lr=1e-3", "train.min_lr=1e-4", "train.lr_warmup_steps=3", "train.lr_decay_steps=7"]
VAL_LAYOUTS = {"pp2": ["parallel.pp=2"], "tp2_sp": ["parallel.tp=2", "parallel.sequence_parallel=true"],
               "cp2": ["parallel.cp=2"], "zero3": ["parallel.dp=2", "train.dp_sharding=optim_grads_params"]}
# name -> (world, overrides, steps, what the worker does beside Trainer.run()).
JOBS = {
    "ref": (1, [], 2, None),
    **{f"val_{name}": (2, ov, 2, None) for name, ov in VAL_LAYOUTS.items()},
    "every_step": (2, ["parallel.dp=2", *LR], 8, None),
    "every_2": (2, ["parallel.dp=2", *LR, "train.log_interval=2"], 8, None),
    # SIGTERM arrives on rank 1 during step 5 (in its loss): both ranks stop and save after
    # step 5 or 6 (logged steps are 4, 8, ...).
    "sigterm": (2, ["parallel.dp=2", "train.log_interval=4", "checkpoint.interval=0"], 100, "sigterm"),
    "verbose_pp2": (2, ["parallel.pp=2"], 1, "verbose"),
    # Rank 1's gradient is NaN in step 2 only: the update of step 2 must be skipped everywhere.
    "skip": (2, ["parallel.dp=2", "train.on_nonfinite=skip"], 4, "nan_at_2"),
}


def _job(rank, trainer, action, snapshots):
    """Wrap the Trainer for `action`; returns what the worker reports besides the metrics."""
    import torch

    step_fn = trainer.train_step

    def train_step():
        out = step_fn()
        if action == "nan_at_2":  # (not under ZeRO-3: its parameters' storage is freed between uses)
            snapshots.append([p.detach().clone() for p in trainer.model.parameters()])
        return out
    trainer.train_step = train_step
    if action in ("nan_at_2", "sigterm"):
        loss_fn = trainer.model.loss

        def poisoned_loss(logits, targets):
            loss = loss_fn(logits, targets)
            if action == "sigterm" and trainer.step == 4 and rank == 1:  # inside step 5
                os.kill(os.getpid(), signal.SIGTERM)
            # The second step's loss on rank 1: its gradients, hence the reduced ones, are NaN.
            return loss * math.nan if action == "nan_at_2" and trainer.step == 1 and rank == 1 else loss
        trainer.model.loss = poisoned_loss
    return torch


def _worker(rank, world, jobs, root):
    from mpoverlap.config import compose
    from mpoverlap.training.loop import Trainer
    from mpoverlap.training.setup import init_distributed

    out = {}
    for name, (overrides, steps, action) in jobs.items():
        run_dir = Path(root) / name
        run_dir.mkdir(parents=True, exist_ok=True)
        cfg = compose([*SMALL, *overrides, f"train.steps={steps}", f"run.dir={run_dir}"])
        if action == "verbose":
            os.environ["MPOVERLAP_VERBOSE_P2P"] = "1"
        try:
            trainer = Trainer(cfg, init_distributed(cfg), run_dir)
        finally:
            os.environ.pop("MPOVERLAP_VERBOSE_P2P", None)
        snapshots = []
        torch = _job(rank, trainer, action, snapshots)
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr):
            result = trainer.run()
        report = {"result": {k: v for k, v in result.items() if k != "losses"},
                  "stderr": stderr.getvalue().splitlines(), "pp_ops": None}
        if action == "nan_at_2":
            report["unchanged"] = [all(torch.equal(a, b) for a, b in zip(s0, s1))
                                   for s0, s1 in zip(snapshots, snapshots[1:])]
            report["finite"] = all(bool(torch.isfinite(p).all()) for p in snapshots[-1])
        if action == "verbose":
            report["pp_ops"] = trainer.pipeline.executor.p2p_calls_per_run
            report["pp_ranks"] = list(trainer.state.ranks("pp"))
        out[name] = report
    return out


def metrics(root, name):
    return [json.loads(line) for line in (Path(root) / name / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    root = tmp_path_factory.mktemp("schedule")
    reports = {}
    for world in (1, 2):
        jobs = {n: (ov, steps, action) for n, (w, ov, steps, action) in JOBS.items() if w == world}
        per_rank = run_distributed(_worker, world, jobs, str(root), timeout_s=600)
        for name in jobs:
            reports[name] = [r[name] for r in per_rank]
    return root, reports


def expected_lr(step, lr=1e-3, min_lr=1e-4, warmup=3, decay=7):
    """The documented schedule, 1-based step as in metrics.jsonl: linear warm-up over `warmup`
    steps to `lr`, cosine to `min_lr` at step `decay` + 1, flat after."""
    if step <= warmup:
        return lr * step / warmup
    progress = min(1.0, (step - 1 - warmup) / (decay - warmup))
    return min_lr + (lr - min_lr) * (1 + math.cos(math.pi * progress)) / 2


def test_lr_schedule_follows_warmup_and_cosine(ran):
    root, _ = ran
    rows = [r for r in metrics(root, "every_step") if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, 9))
    got = [r["lr"] for r in rows]
    want = [expected_lr(s) for s in range(1, 9)]
    assert got == pytest.approx(want, rel=1e-12), (got, want)
    # Hand values: 1/3 and 2/3 of the peak, the peak, the cosine's middle, min_lr from step 8.
    assert got[:4] == pytest.approx([1e-3 / 3, 2e-3 / 3, 1e-3, 1e-3])
    assert got[5] == pytest.approx(1e-4 + 0.9e-3 / 2) and got[7] == pytest.approx(1e-4)


def test_rows_average_comm_over_the_log_interval(ran):
    """At train.log_interval=2 a row holds the last step's loss, lr and grad norm and the mean
    per step of the comm figures over the two steps since the last row."""
    root, _ = ran
    every = {r["step"]: r for r in metrics(root, "every_step") if "loss" in r}
    pairs = [r for r in metrics(root, "every_2") if "loss" in r]
    assert [r["step"] for r in pairs] == [2, 4, 6, 8]
    for row in pairs:
        a, b = every[row["step"] - 1], every[row["step"]]
        assert (row["loss"], row["lr"], row["grad_norm"]) == (b["loss"], b["lr"], b["grad_norm"])
        for key in ("ops", "bytes"):
            assert row["comm"]["dp"][key] == pytest.approx((a["comm"]["dp"][key] + b["comm"]["dp"][key]) / 2)
        assert a["comm"]["dp"]["ops"] > 0


def test_sigterm_on_one_rank_stops_every_rank_at_the_next_step(ran):
    """Not at the next logged step (8): rank 1's signal of step 5 reaches rank 0 through the
    stop agreement (training/stop_agreement.py), and both stop after the same step, 5 or 6 (6
    where a rank had finished 5 when its watcher woke); the stop step gets its metrics row and
    checkpoint, and only that row counts the agreement under `stop` (nothing in the steps before)."""
    root, reports = ran
    steps = {r["result"]["steps"] for r in reports["sigterm"]}
    assert len(steps) == 1 and steps <= {5, 6} and all(r["result"]["preempted"] for r in reports["sigterm"]), \
        [r["result"] for r in reports["sigterm"]]
    step, = steps
    saved = sorted(p.name for p in (root / "sigterm" / "checkpoints").iterdir())
    assert saved == [f"step_{step:08d}"], saved
    assert (root / "sigterm" / "checkpoints" / saved[0] / "COMPLETE").is_file()
    logged = [r for r in metrics(root, "sigterm") if "loss" in r]
    assert [r["step"] for r in logged] == [4, step]
    assert "stop" not in logged[0]["comm"], logged[0]["comm"]
    stop = logged[1]["comm"]["stop"]  # one agreement, averaged over the row's steps and ranks
    assert stop["ops"] == 1 / (step - 4) and stop["bytes"] > 0 and 0 <= stop["exposed_s"] <= stop["time_s"], stop


def test_val_loss_at_every_layout_equals_single_process(ran):
    root, _ = ran
    ref = [r["val_loss"] for r in metrics(root, "ref") if "val_loss" in r]
    assert len(ref) == 1
    for name in VAL_LAYOUTS:
        got = [r["val_loss"] for r in metrics(root, f"val_{name}") if "val_loss" in r]
        assert len(got) == 1 and abs(got[0] - ref[0]) <= 1e-5 * abs(ref[0]), (name, got, ref)


def test_verbose_p2p_prints_every_op(ran):
    """MPOVERLAP_VERBOSE_P2P=1: one stderr line per p2p op, numbered by call, naming the peer's
    global rank, the stage, the microbatch and the chunk; the two ends of the link print the
    same messages (a send here is a receive there)."""
    _, reports = ran
    line = re.compile(r"\[pp-p2p\] step (\d+) call (\d+) rank (\d+) (send to|recv from) rank (\d+) "
                      r"\(stage (\d)\) (\w+) vchunk (\d+) mb (\d+)$")
    messages = []
    for rank, report in enumerate(reports["verbose_pp2"]):
        parsed = [line.match(x) for x in report["stderr"] if x.startswith("[pp-p2p]")]
        assert parsed and all(parsed), report["stderr"][-5:]
        peer = [r for r in report["pp_ranks"] if r != rank][0]
        assert {m[1] for m in parsed} == {"0"}  # the executor's first run
        assert {int(m[2]) for m in parsed} == set(range(1, report["pp_ops"] + 1)), report["pp_ops"]
        assert all(int(m[3]) == rank and int(m[5]) == peer and int(m[6]) == 1 - rank for m in parsed)
        # 4 microbatches: an activation goes forward and a gradient back for each.
        messages.append({(m[4], m[7], int(m[9])) for m in parsed})
    assert len(messages[0]) == 8 and len(messages[1]) == 8
    assert {(k, mb) for d, k, mb in messages[0] if d == "send to"} == \
        {(k, mb) for d, k, mb in messages[1] if d == "recv from"}
    assert not any("[pp-p2p]" in x for r in reports["val_pp2"] for x in r["stderr"])  # off by default


def test_nonfinite_skip_leaves_the_weights_untouched(ran):
    """train.on_nonfinite=skip with one rank's gradient NaN in step 2 only: every rank skips
    step 2's update (the weights after it equal those after step 1, bitwise), steps 1, 3 and 4
    update, the weights stay finite, and metrics.jsonl says which step was skipped."""
    root, reports = ran
    for report in reports["skip"]:
        assert report["unchanged"] == [True, False, False], report["unchanged"]
        assert report["finite"]
    rows = metrics(root, "skip")
    assert [r["step"] for r in rows if r.get("nonfinite")] == [2]
    assert all(math.isfinite(r["loss"]) for r in rows if "loss" in r and r["step"] != 2)
