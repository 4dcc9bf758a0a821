"""Two hosts for real (tests/multihost.py: two network namespaces joined by a veth pair, each
with its own hostname), one `torchrun --nnodes 2 --nproc-per-node 2` agent per host over a c10d
rendezvous: dp 2 x tp 2 with tp inside a host, on the single-process curve; a killed agent and a
killed worker on one host bring the other host down with the lost host named; the same command
resumes from the newest complete checkpoint on the same curve, three times over one run
directory (the checkpoints both hosts' agents wrote)."""
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from multihost import TwoHosts, unavailable_reason  # noqa: E402
from test_train_cli import SMALL, assert_close, rows, train  # noqa: E402

pytestmark = pytest.mark.slow

LAYOUT = ["parallel.dp=2", "parallel.tp=2", "checkpoint.interval=2", "train.lr_decay_steps=50"]
GONE_WITHIN_S = 60


@pytest.fixture(scope="module")
def hosts():
    why = unavailable_reason()
    if why:
        pytest.skip(why)
    with TwoHosts() as two:
        yield two


def _command(run_dir):
    # The same command every time: steps beyond what the test lets it reach (the LR schedule
    # has keys of its own, so the curve does not depend on train.steps).
    return ["-m", "mpoverlap.train", *SMALL, *LAYOUT, "train.steps=100000", f"run.dir={run_dir}"]


def _wait_rows(run_dir, n, agents, timeout=150):
    deadline = time.time() + timeout
    path = Path(run_dir) / "metrics.jsonl"
    while time.time() < deadline:
        if path.exists() and len(rows(run_dir)) >= n:
            return
        if any(a.poll() is not None for a in agents):
            raise AssertionError(f"an agent exited early: {[a.poll() for a in agents]}")
        time.sleep(0.2)
    raise AssertionError(f"fewer than {n} logged steps in {timeout} s")


def _wait_gone(hosts, agents):
    """Seconds until both agents exited and no process is left in either namespace."""
    t0 = time.time()
    while time.time() - t0 < GONE_WITHIN_S + 30:
        if all(a.poll() is not None for a in agents) and not hosts.pids(0) and not hosts.pids(1):
            return time.time() - t0
        time.sleep(0.2)
    return float("inf")


def _newest_complete(run_dir):
    done = [p for p in (Path(run_dir) / "checkpoints").iterdir() if (p / "COMPLETE").is_file()]
    return max(int(p.name.split("_")[1]) for p in done)


def _log(log_dir, name):
    return (Path(log_dir) / name).read_text()


def _launch(hosts, run_dir, log_dir):
    return hosts.torchrun(_command(run_dir), nproc_per_node=2, log_dir=log_dir)


def test_two_hosts_train_fail_and_resume_on_the_single_process_curve(hosts, tmp_path):
    run = tmp_path / "run"
    report = []

    # 1. Train; the plan names both hosts, tp stays inside one, dp crosses.
    agents = _launch(hosts, run, tmp_path / "a1")
    _wait_rows(run, 4, agents)
    plan = _log(tmp_path / "a1", "agent0.out") + _log(tmp_path / "a1", "agent1.out")
    for name in hosts.names:
        assert re.search(rf"{name}: ranks \d-\d", plan), plan[-3000:]
    assert "groups across hosts (inter-node link): dp (2 of 2 groups" in plan
    assert "groups inside a host: tp" in plan and "warning" not in plan

    # 2. SIGKILL host 1's agent: its workers die with it (parent-death signal), host 0's
    #    ranks fail their next collective and name the lost host.
    os.kill(agents[1].pid, signal.SIGKILL)
    took = _wait_gone(hosts, agents)
    err0 = _log(tmp_path / "a1", "agent0.err")
    assert agents[0].returncode not in (0, None)
    assert f"lost host {hosts.names[1]} (ranks" in err0, err0[-3000:]
    report.append(f"agent killed: everything gone in {took:.1f}s")
    assert took < GONE_WITHIN_S, took

    # 3. The same command resumes from the newest complete checkpoint; then SIGKILL one
    #    worker on host 1: its agent names the rank, host 0's ranks name the host.
    last = _newest_complete(run)
    agents = _launch(hosts, run, tmp_path / "a2")
    _wait_rows(run, len(rows(run)) + 3, agents)
    out = _log(tmp_path / "a2", "agent0.out") + _log(tmp_path / "a2", "agent1.out")
    assert f"at step {last}" in out and "resumed from" in out, out[-2000:]
    workers = [p for p in hosts.pids(1) if p != agents[1].pid]
    assert len(workers) == 2, workers
    os.kill(workers[0], signal.SIGKILL)
    took = _wait_gone(hosts, agents)
    err0, err1 = _log(tmp_path / "a2", "agent0.err"), _log(tmp_path / "a2", "agent1.err")
    assert agents[0].returncode not in (0, None) and agents[1].returncode not in (0, None)
    assert f"lost host {hosts.names[1]} (ranks" in err0, err0[-3000:]
    assert re.search(rf"exitcode\s*: -9 \(pid: {workers[0]}\)", err1), err1[-3000:]
    report.append(f"worker killed: everything gone in {took:.1f}s")
    assert took < GONE_WITHIN_S, took

    # 4. Resume again, then SIGTERM every worker (what SLURM's preemption does): every rank
    #    agrees at the next step boundary, saves, and every process exits 0.
    last = _newest_complete(run)
    agents = _launch(hosts, run, tmp_path / "a3")
    _wait_rows(run, len(rows(run)) + 2, agents)
    for pid in [p for host in (0, 1) for p in hosts.pids(host) if p not in (agents[0].pid, agents[1].pid)]:
        os.kill(pid, signal.SIGTERM)
    took = _wait_gone(hosts, agents)
    assert [a.wait(timeout=90) for a in agents] == [0, 0], _log(tmp_path / "a3", "agent0.err")[-3000:]
    out = _log(tmp_path / "a3", "agent0.out") + _log(tmp_path / "a3", "agent1.out")
    assert f"at step {last}" in out and "SIGTERM: saved a checkpoint at step" in out
    save = re.search(r"SIGTERM: saved a checkpoint at step (\d+) in ([0-9.]+)s", out)
    report.append(f"SIGTERM: checkpoint at step {save.group(1)} (saved in {save.group(2)}s), every process "
                  f"gone in {took:.1f}s")
    assert took < 20, took  # the step, the save and the interpreters' teardown

    # Every logged step of the three launches (resumed steps appear twice) against the
    # single-process run of the same model and global batch.
    got = rows(run)
    steps = max(r["step"] for r in got)
    train(tmp_path / "ref", "train.lr_decay_steps=50", steps=steps)
    ref = {r["step"]: r["loss"] for r in rows(tmp_path / "ref")}
    assert_close([r["loss"] for r in got], [ref[r["step"]] for r in got])
    worst = max(abs(r["loss"] - ref[r["step"]]) / abs(ref[r["step"]]) for r in got)
    print(f"\ntwo hosts dp2 x tp2: {len(got)} logged steps up to step {steps}, worst relative loss "
          f"difference to the single-process run {worst:.1e}; " + "; ".join(report))


def test_harness_cleans_up_after_a_failing_body_and_a_dead_creator(hosts):
    """A body that raises leaves no namespace, no /etc/netns entry and no process behind; a
    namespace left by a crashed run (its creator's pid is gone) is removed by the next run."""
    import subprocess

    from multihost import PREFIX, remove_stale

    def namespaces():
        return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout

    with pytest.raises(RuntimeError, match="the body failed"):
        with TwoHosts() as two:
            sleeper = two.popen(1, ["sleep", "1000"])
            deadline = time.time() + 30  # `ip netns exec` enters the namespace, then execs sleep
            while sleeper.pid not in two.pids(1) and time.time() < deadline:
                time.sleep(0.1)
            assert hosts.addrs == two.addrs and sleeper.pid in two.pids(1)
            raise RuntimeError("the body failed")
    assert sleeper.poll() is not None
    assert not any(ns in namespaces() for ns in two.netns)
    assert not any((Path("/etc/netns") / ns).exists() for ns in two.netns)
    dead = 2 ** 22 + 1  # above pid_max's default: never a live process
    stale = f"{PREFIX}{dead}-feed00-h0"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    remove_stale()
    assert stale not in namespaces()
