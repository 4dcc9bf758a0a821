"""Failures end the run cleanly: a NaN stops or skips before the update, SIGTERM saves and
stops at a step boundary, a killed worker brings every process down with its rank named."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_train_cli import BIN, SMALL, rows, train  # noqa: E402

pytestmark = pytest.mark.slow
DIVERGE = ["parallel.dp=2", "train.lr=1e30", "train.lr_warmup_steps=0", "checkpoint.interval=1"]


def test_nonfinite_stop_and_skip(tmp_path):
    proc = train(tmp_path / "stop", *DIVERGE, "train.on_nonfinite=stop", steps=4, expect=1)
    assert "non-finite gradient at step 2" in proc.stderr and "Traceback" not in proc.stderr
    ckpts = sorted(p.name for p in (tmp_path / "stop" / "checkpoints").iterdir())
    assert ckpts == ["step_00000001"]  # nothing saved once the gradient went bad
    train(tmp_path / "skip", *DIVERGE, "train.on_nonfinite=skip", steps=4)
    lines = [json.loads(x) for x in (tmp_path / "skip" / "metrics.jsonl").read_text().splitlines()]
    events = [x["step"] for x in lines if x.get("nonfinite")]
    assert events == [2, 3, 4]


def _launch(run_dir, *overrides):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("RANK", None)
    args = [str(BIN / "mpoverlap-train"), *SMALL, "train.steps=100000", f"run.dir={run_dir}", *overrides]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)


def _workers(launcher_pid):
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text().split(")")[-1].split()
            cmd = (proc / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if int(stat[1]) == launcher_pid and "spawn_main" in cmd:
            pids.append(int(proc.name))
    return pids


def _wait_for_steps(run_dir, n, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        path = Path(run_dir) / "metrics.jsonl"
        if path.exists() and len(path.read_text().splitlines()) >= n:
            return
        time.sleep(0.2)
    raise AssertionError("the run did not reach its first steps")


def test_sigterm_saves_and_resume_continues_the_curve(tmp_path):
    run = tmp_path / "pre"
    proc = _launch(run, "parallel.dp=2", "train.lr_decay_steps=50")
    _wait_for_steps(run, 3)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=90)
    assert proc.returncode == 0, err[-2000:]
    assert "SIGTERM: saved a checkpoint at step" in out
    saved = [p.name for p in (run / "checkpoints").iterdir()]
    assert len(saved) == 1
    k = int(saved[0].split("_")[1])
    train(run, "parallel.dp=2", "train.lr_decay_steps=50", steps=k + 2)
    train(tmp_path / "ref", "parallel.dp=2", "train.lr_decay_steps=50", steps=k + 2)
    assert [r["loss"] for r in rows(run)][-(k + 2):] == [r["loss"] for r in rows(tmp_path / "ref")]


def test_killed_worker_brings_the_run_down(tmp_path):
    run = tmp_path / "kill"
    proc = _launch(run, "parallel.dp=2")
    _wait_for_steps(run, 2)
    workers = _workers(proc.pid)
    assert len(workers) == 2
    os.kill(workers[1], signal.SIGKILL)
    t0 = time.time()
    out, err = proc.communicate(timeout=90)
    took = time.time() - t0
    assert proc.returncode not in (0, 2)
    assert "run failed: rank 1 exited" in err and "SIGKILL" in err
    print(f"\nall processes gone {took:.1f}s after SIGKILL; launcher said: {err.strip().splitlines()[-1]}")
    assert took < 60, took
    assert not [p for p in workers if Path(f"/proc/{p}").exists()]
