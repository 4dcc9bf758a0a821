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


def _logged(run_dir):
    """The last step with a metrics row (0 before the first)."""
    path = Path(run_dir) / "metrics.jsonl"
    steps = [r["step"] for r in rows(run_dir)] if path.exists() else []
    return steps[-1] if steps else 0


def _signal_between(run_dir, send):
    """send() the signal between two reads of the steps logged: (before, after). At
    train.log_interval=1 rank 0 logs each step before it starts the next, so the ranks had
    completed c steps with before <= c <= after + 1 when the signal arrived (the row of step
    after + 1 may be on its way), and the stop agreement stops them after step c + 1 or c + 2
    (training/stop_agreement.py: every rank proposes the step it is in, or the next where it
    had finished that one when its watcher woke): before + 1 <= stop step <= after + 3."""
    before = _logged(run_dir)
    send()
    return before, _logged(run_dir)


def _stop_step(out):
    stop = out.index("SIGTERM: saved a checkpoint at step ")
    return int(out[stop:].split("step ", 1)[1].split(" ", 1)[0]), stop


def _gone(pids, since, timeout=90):
    while any(Path(f"/proc/{p}").exists() for p in pids) and time.time() - since < timeout:
        time.sleep(0.05)
    return not [p for p in pids if Path(f"/proc/{p}").exists()]


def test_sigterm_saves_and_resume_continues_the_curve(tmp_path):
    """SIGTERM to the self-launcher soon after the asynchronous save of step 10 completed (how
    soon depends on the machine's load: the run may have saved step 20 or more by then): the
    launcher passes the signal on to its workers (SigtermForwarder), every rank stops after the
    step the signal arrived in or the next (bounded by the steps logged around the signal,
    `_signal_between`) and saves asynchronously (checkpoint.async_save=true): the stop waits for
    the write in flight (written, marked COMPLETE, renamed), then every process exits 0 within
    the step, the save and the interpreters' teardown. The resumed run (synchronous saves)
    continues the uninterrupted curve."""
    run = tmp_path / "pre"
    layout = ["parallel.dp=2", "train.lr_decay_steps=50", "checkpoint.interval=10"]
    proc = _launch(run, *layout, "checkpoint.async_save=true")
    deadline = time.time() + 120
    while not (run / "checkpoints" / "step_00000010" / "COMPLETE").is_file():
        assert time.time() < deadline and proc.poll() is None, "the run did not save step 10"
        time.sleep(0.05)
    workers = _launched(proc.pid)  # the workers, the fork server and multiprocessing's resource tracker
    assert len(_workers(proc.pid)) == 2, workers
    t0 = time.time()
    before, after = _signal_between(run, lambda: proc.send_signal(signal.SIGTERM))
    out, err = proc.communicate(timeout=90)
    gone = _gone(workers, t0)
    took = time.time() - t0
    assert proc.returncode == 0, err[-2000:]
    k, stop = _stop_step(out)
    assert before + 1 <= k <= after + 3, (before, k, after)
    saved = sorted(p.name for p in (run / "checkpoints").iterdir())
    # The newest checkpoint.keep (2) of the interval saves and the stop's: no .partial left.
    kept = [f"step_{s:08d}" for s in sorted({*range(10, k, 10), k})][-2:]
    assert saved == kept, (saved, kept)
    assert (run / "checkpoints" / saved[-1] / "COMPLETE").is_file()
    assert f"staged checkpoint step {k} in" in out[:stop]
    assert f"saved checkpoint {run / 'checkpoints' / saved[-1]} in the background" in out[:stop]
    assert _logged(run) == k  # the stop step is logged, and nothing after it
    step_s = rows(run)[-1]["step_time_s"]
    save_s = float(out[stop:].split(" in ", 1)[1].split("s ", 1)[0])
    print(f"\nSIGTERM to the launcher with steps {before}-{after} logged: checkpoint at step {k}, saved in "
          f"{save_s:.2f}s; every process gone {took:.1f}s after the signal (step {step_s:.2f}s + save + 5 s = "
          f"{step_s + save_s + 5:.1f}s)")
    assert gone
    # The step, the save and two interpreters' teardown (torch's alone takes 2-3 s per process
    # on this loaded 2-core machine); the agent's own shutdown (a 30 s grace, then SIGKILL) would
    # take past this.
    assert took < 20, took
    train(run, *layout, steps=k + 2)
    reference_run(tmp_path / "ref", layout, k + 2)
    ref = {r["step"]: r["loss"] for r in rows(tmp_path / "ref")}
    assert [r["step"] for r in rows(run)] == list(range(1, k + 3))  # resumed after the stop step
    assert [r["loss"] for r in rows(run)] == [ref[r["step"]] for r in rows(run)]


def test_sigterm_to_the_process_group_saves_the_stop_checkpoint(tmp_path):
    """SIGTERM to every process of the launch at once, as SLURM signals a job step: the launcher
    (which forwards it), the workers (which get it twice, theirs and the forwarded one) and the
    fork server the workers were forked from, whose death would kill them by their parent-death
    signal in the middle of their save. The server ignores it (training/fork_server.py): every
    rank stops after the step the signal arrived in or the next, saves, and every process exits
    0."""
    run = tmp_path / "group"
    proc = _launch(run, "parallel.dp=2", "train.lr_decay_steps=50", "checkpoint.interval=0")
    _wait_for_steps(run, 5)
    launched = _launched(proc.pid)
    assert len(_workers(proc.pid)) == 2, launched
    t0 = time.time()
    before, after = _signal_between(run, lambda: os.killpg(proc.pid, signal.SIGTERM))  # its own session
    out, err = proc.communicate(timeout=90)
    assert proc.returncode == 0, err[-2000:]
    k, _ = _stop_step(out)
    assert before + 1 <= k <= after + 3, (before, k, after)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [f"step_{k:08d}"]
    assert (run / "checkpoints" / f"step_{k:08d}" / "COMPLETE").is_file()
    assert _logged(run) == k
    assert _gone(launched, t0)
    print(f"\nSIGTERM to the process group with steps {before}-{after} logged: checkpoint at step {k}, every "
          f"process gone {time.time() - t0:.1f}s after the signal")


_START = """
import sys
from multiprocessing import forkserver
from mpoverlap.training import fork_server
if sys.argv[1:] == ["earlier"]:  # a server this process started before, with multiprocessing's defaults
    forkserver.ensure_running()
elif sys.argv[1:]:
    fork_server.PRELOAD = sys.argv[1:]
try:
    fork_server.start()
except fork_server.ForkServerError as err:
    print(f"ForkServerError: {err}")
    raise SystemExit(3)
with open(f"/proc/{forkserver._forkserver._forkserver_pid}/status") as status:
    print(next(line.split()[1] for line in status if line.startswith("SigIgn:")))
"""
# A Python start-up hook that makes the fork server's import of training/fork_server.py fail (the
# server alone has MPOVERLAP_FORK_SERVER in its environment): multiprocessing skips it silently.
_REFUSE = """
import os, sys
class _Refuse:
    def find_spec(self, name, path=None, target=None):
        if name == "mpoverlap.training.fork_server" and "MPOVERLAP_FORK_SERVER" in os.environ:
            raise ImportError("refused by the test's sitecustomize")
sys.meta_path.insert(0, _Refuse())
"""


def _start_server(*preload, env=None):
    return subprocess.run([sys.executable, "-c", _START, *preload], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, **(env or {})))


def test_fork_server_start_confirms_that_the_server_ignores_sigterm():
    """start() returns once a probe forked from the server found SIGTERM, SIGHUP and SIGQUIT
    ignored, and the server's own signal mask (/proc) says the same."""
    proc = _start_server("mpoverlap.training.fork_server")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ignored = int(proc.stdout.split()[-1], 16)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        assert ignored >> (sig - 1) & 1, (sig, hex(ignored))


@pytest.mark.parametrize("failure", ["not_preloaded", "import_fails", "earlier_server"])
def test_fork_server_start_raises_where_the_server_would_die_of_sigterm(tmp_path, failure):
    """Where the server did not import training/fork_server.py (its preload does not name it, the
    import fails, which multiprocessing's server ignores, or the process already ran a server of
    its own, which multiprocessing reuses), start() raises ForkServerError
    instead of launching workers that a group SIGTERM would kill in their save."""
    if failure == "earlier_server":  # multiprocessing reuses a running server as it is
        proc = _start_server("earlier")
        assert proc.returncode == 3, proc.stdout + proc.stderr
        assert "already ran a multiprocessing fork server" in proc.stdout, proc.stdout
    elif failure == "not_preloaded":
        proc = _start_server("mpoverlap.training.no_such_module")
        assert proc.returncode == 3, proc.stdout + proc.stderr
        assert "does not ignore SIGTERM, SIGHUP, SIGQUIT" in proc.stdout, proc.stdout
        assert "could not import: mpoverlap.training.no_such_module" in proc.stdout, proc.stdout
    else:
        (tmp_path / "sitecustomize.py").write_text(_REFUSE)
        proc = _start_server("mpoverlap.training.fork_server", env={"PYTHONPATH": str(tmp_path)})
        assert proc.returncode == 3, proc.stdout + proc.stderr
        assert "could not confirm that it ignores SIGTERM" in proc.stdout, proc.stdout
        assert "refused by the test's sitecustomize" in proc.stderr, proc.stderr


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
