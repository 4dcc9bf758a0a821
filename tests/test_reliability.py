"""Failures end the run cleanly: a NaN stops or skips before the update, SIGTERM saves and
stops at a step boundary, a killed, raising or hung worker brings every process down with a
rank named, and the same command resumes a killed run on its curve."""
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from inproc_train import run_chains, world_of  # noqa: E402
from test_train_cli import BIN, SMALL, rows, train  # noqa: E402

pytestmark = pytest.mark.slow
DIVERGE = ["parallel.dp=2", "train.lr=1e30", "train.lr_warmup_steps=0", "checkpoint.interval=1"]


def reference_run(run_dir, overrides, steps):
    """The uninterrupted run a resumed one is compared with: `Trainer.run()` in a spawned world
    (tests/inproc_train.py), the console script's run without its launch (its metrics.jsonl
    is bitwise the launched run's). What is under test, the kill, the signal and the resume,
    stays a real launch."""
    full = [*SMALL, *overrides]
    run_chains({Path(run_dir).name: [(world_of(full), full, steps)]}, Path(run_dir).parent)


def test_nonfinite_stop(tmp_path):
    """train.on_nonfinite=stop; `skip` (one step's NaN, the weights untouched by it) is
    test_training_schedule.py::test_nonfinite_skip_leaves_the_weights_untouched."""
    proc = train(tmp_path / "stop", *DIVERGE, "train.on_nonfinite=stop", steps=4, expect=1)
    assert "non-finite gradient at step 2" in proc.stderr and "Traceback" not in proc.stderr
    ckpts = sorted(p.name for p in (tmp_path / "stop" / "checkpoints").iterdir())
    assert ckpts == ["step_00000001"]  # nothing saved once the gradient went bad


def _launch(run_dir, *overrides, fault=None):
    env = dict(os.environ, OMP_NUM_THREADS="1", **({"MPOVERLAP_FAULT": fault} if fault else {}))
    env.pop("RANK", None)
    args = [str(BIN / "mpoverlap-train"), *SMALL, "train.steps=100000", f"run.dir={run_dir}", *overrides]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)


def _children():
    """{parent pid: [(pid, command line)]} of every process."""
    out = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text().split(")")[-1].split()
            cmd = (proc / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        out.setdefault(int(stat[1]), []).append((int(proc.name), cmd))
    return out


def _workers(launcher_pid):
    """The launcher's worker processes: forked by its fork server (training/fork_server.py; the
    server is the launcher's child), or spawned children where the launcher spawns."""
    children = _children()
    pids = []
    for pid, cmd in children.get(launcher_pid, []):
        if "multiprocessing.forkserver" in cmd:
            pids += [worker for worker, _ in children.get(pid, [])]
        elif "spawn_main" in cmd:
            pids.append(pid)
    return sorted(pids)


def _launched(launcher_pid):
    """Every process the launcher started (its workers, its fork server, multiprocessing's
    resource tracker)."""
    children = _children()
    pids, todo = [], [launcher_pid]
    while todo:
        kids = [pid for pid, _ in children.get(todo.pop(), [])]
        pids += kids
        todo += kids
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
    """SIGTERM to the self-launcher at train.log_interval=1000, soon after the asynchronous save of
    step 10 completed (how soon depends on the machine's load: the run may have saved step 20 or
    more by then): the launcher passes the signal on to its workers (SigtermForwarder), every
    rank stops at the next step boundary (not at the logged step 1000) and saves asynchronously
    (checkpoint.async_save=true): the stop waits for the write in flight (written, marked
    COMPLETE, renamed), then every process exits 0 (before issue 48: the agent's 30 s wait, then
    SIGKILL). The resumed run (synchronous saves) continues the uninterrupted curve."""
    run = tmp_path / "pre"
    layout = ["parallel.dp=2", "train.lr_decay_steps=50", "train.log_interval=1000", "checkpoint.interval=10"]
    proc = _launch(run, *layout, "checkpoint.async_save=true")
    deadline = time.time() + 120
    while not (run / "checkpoints" / "step_00000010" / "COMPLETE").is_file():
        assert time.time() < deadline and proc.poll() is None, "the run did not save step 10"
        time.sleep(0.05)
    workers = _launched(proc.pid)  # the workers, the fork server and multiprocessing's resource tracker
    assert len(_workers(proc.pid)) == 2, workers
    t0 = time.time()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=90)
    while any(Path(f"/proc/{p}").exists() for p in workers) and time.time() - t0 < 90:
        time.sleep(0.05)
    took = time.time() - t0
    assert proc.returncode == 0, err[-2000:]
    stop = out.index("SIGTERM: saved a checkpoint at step ")
    k = int(out[stop:].split("step ", 1)[1].split(" ", 1)[0])
    saved = sorted(p.name for p in (run / "checkpoints").iterdir())
    # The newest checkpoint.keep (2) of the interval saves and the stop's: no .partial left.
    kept = [f"step_{s:08d}" for s in sorted({*range(10, k, 10), k})][-2:]
    assert saved == kept, (saved, kept)
    assert (run / "checkpoints" / saved[-1] / "COMPLETE").is_file()
    assert 10 < k < 1000, k  # at a step boundary soon after the signal, not at the logged step 1000
    assert f"staged checkpoint step {k} in" in out[:stop]
    assert f"saved checkpoint {run / 'checkpoints' / saved[-1]} in the background" in out[:stop]
    assert [r["step"] for r in rows(run)] == [k]  # the stop step is logged
    step_s = rows(run)[0]["step_time_s"]
    save_s = float(out[stop:].split(" in ", 1)[1].split("s ", 1)[0])
    print(f"\nSIGTERM to the launcher after step 10 (log_interval 1000): checkpoint at step {k}, saved in {save_s:.2f}s; "
          f"every process gone {took:.1f}s after the signal (step {step_s:.2f}s + save + 5 s = "
          f"{step_s + save_s + 5:.1f}s; before issue 48 the agent's 30 s wait made it ~32 s)")
    assert not [p for p in workers if Path(f"/proc/{p}").exists()]
    # The 30 s wait is gone; the rest is the step, the save and two interpreters' teardown
    # (torch's alone takes 2-3 s per process on this loaded 2-core machine).
    assert took < 20, took
    train(run, *layout, steps=k + 2)
    reference_run(tmp_path / "ref", [*layout, "train.log_interval=1"], k + 2)
    ref = {r["step"]: r["loss"] for r in rows(tmp_path / "ref")}
    assert [r["step"] for r in rows(run)] == [k, k + 2]  # resumed: train.steps is a logged step
    assert [r["loss"] for r in rows(run)] == [ref[r["step"]] for r in rows(run)]


KILL_LAYOUT = ["parallel.dp=2", "parallel.pp=2", "checkpoint.interval=2", "train.lr_decay_steps=50"]


def test_killed_worker_brings_the_run_down_and_rerun_resumes_exactly(tmp_path):
    """SIGKILL one worker of a dp2 x pp2 run: every process gone within 60 s with the rank
    named; the same command then resumes from the last checkpoint on the uninterrupted curve."""
    run = tmp_path / "kill"
    proc = _launch(run, *KILL_LAYOUT)
    _wait_for_steps(run, 5)
    workers, launched = _workers(proc.pid), _launched(proc.pid)
    assert len(workers) == 4
    os.kill(workers[1], signal.SIGKILL)
    t0 = time.time()
    out, err = proc.communicate(timeout=90)
    took = time.time() - t0
    assert proc.returncode not in (0, 2)
    assert "run failed: rank 1 exited" in err and "SIGKILL" in err
    print(f"\nall processes gone {took:.1f}s after SIGKILL; launcher said: {err.strip().splitlines()[-1]}")
    assert took < 60, took
    # The fork server and the resource tracker end when they read the launcher's pipes closed.
    while any(Path(f"/proc/{p}").exists() for p in launched) and time.time() - t0 < 60:
        time.sleep(0.05)
    assert not [p for p in launched if Path(f"/proc/{p}").exists()]
    last = max(int(p.name.split("_")[1]) for p in (run / "checkpoints").iterdir() if (p / "COMPLETE").exists())
    steps = last + 3
    again = train(run, *KILL_LAYOUT, steps=steps)
    assert "resumed from" in again.stdout and f"at step {last}" in again.stdout
    reference_run(tmp_path / "ref", KILL_LAYOUT, steps)
    resumed = rows(run)[-3:]
    assert [r["step"] for r in resumed] == [last + 1, last + 2, last + 3]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in rows(tmp_path / "ref")][-3:]


def _faulty(run_dir, fault, *overrides):
    env = dict(os.environ, OMP_NUM_THREADS="1", MPOVERLAP_FAULT=fault)
    env.pop("RANK", None)
    args = [str(BIN / "mpoverlap-train"), *SMALL, "train.steps=20", f"run.dir={run_dir}", *overrides]
    t0 = time.time()
    proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=150)
    return proc, time.time() - t0


def test_exception_in_one_rank_names_it_and_the_cause(tmp_path):
    proc, took = _faulty(tmp_path / "raise", "1:3:raise", "parallel.dp=2")
    assert proc.returncode == 1
    assert "run failed: rank 1 exited" in proc.stderr and "injected fault" in proc.stderr
    assert took < 60, took


@pytest.fixture(scope="module", autouse=True)
def hung_run(tmp_path_factory):
    """The hung-rank run, started before this module's first test and checked by the last: its
    ~40 s of waiting (the comm timeout, then the launcher's grace) overlap the other tests'
    work instead of adding to the suite's time. Yields a function that joins it."""
    run = tmp_path_factory.mktemp("hang") / "hang"
    proc = _launch(run, "parallel.dp=2", "train.comm_timeout_s=10", fault="1:3:hang")
    result = {}

    def watch():
        try:
            _wait_for_steps(run, 2)
            result["workers"] = _launched(proc.pid)
            t0 = time.time()
            result["out"], result["err"] = proc.communicate(timeout=120)
            result["took"], result["returncode"] = time.time() - t0, proc.returncode
        except BaseException as err:  # reported by the test, not lost in the thread
            result["error"] = err

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()

    def join():
        thread.join(timeout=300)
        return result

    yield join
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)


def test_hung_rank_times_out_instead_of_hanging(hung_run):
    """Rank 1 stops at step 3 without dying: rank 0's next collective times out after
    train.comm_timeout_s, and the launcher takes the hung rank down too (SIGTERM, then
    SIGKILL after its grace period, as for a rank stuck inside a C++ call)."""
    result = hung_run()
    if "error" in result:
        raise result["error"]
    err, took = result["err"], result["took"]
    assert result["returncode"] == 1
    # gloo names its timeout "Timed out ..." or, when the pair is closed by it, "Application
    # timeout caused pair closure" (seen under load): both are the comm timeout firing.
    assert "run failed: rank 0 exited" in err and ("Timed out" in err or "Application timeout" in err), \
        err[-2000:]
    print(f"\nhung rank: every process gone {took:.1f}s after step 2 (timeout 10 s); launcher said: "
          f"{err.strip().splitlines()[-1]}")
    assert took < 60, took
    assert not [p for p in result["workers"] if Path(f"/proc/{p}").exists()]
