"""launch/slurm.sbatch on a real two-node SLURM cluster (launch/slurm-testcluster.sh: Debian's
slurm-wlm and munge, one slurmd per host of tests/multihost.py): `sbatch --nodes=2` trains
dp 2 x tp 2, `scancel --signal=TERM` (SLURM's preemption) makes every rank save at the next
step and the job exit 0, the same sbatch command resumes on the single-process curve, and a job
submitted with --requeue requeues itself and resumes by itself.

Run by `make test-slurm` (MPOVERLAP_TEST_SLURM=1; it installs slurm-wlm and munge with apt-get
when they are missing), not by `make test`.
"""
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from multihost import BIN, TwoHosts, unavailable_reason  # noqa: E402
from test_train_cli import SMALL, assert_close, rows, train  # noqa: E402

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parent.parent
LAYOUT = ["parallel.dp=2", "parallel.tp=2", "checkpoint.interval=3", "train.lr_decay_steps=50"]


class Cluster:
    def __init__(self, hosts: TwoHosts, state: Path) -> None:
        self.hosts, self.state = hosts, state
        self.env = dict(os.environ, SLURM_CONF=str(state / "slurm.conf"),
                        PATH=f"{BIN}:{os.environ['PATH']}", OMP_NUM_THREADS="1")
        self.env.pop("RANK", None)

    def run(self, *argv, check=True, timeout=60):
        """A SLURM command on host 0 (the controller's host)."""
        proc = subprocess.run(["ip", "netns", "exec", self.hosts.netns[0], *argv], capture_output=True, text=True,
                              env=self.env, timeout=timeout, cwd=REPO)
        assert not check or proc.returncode == 0, f"{argv}: {proc.stdout}\n{proc.stderr}"
        return proc

    def job(self, job_id):
        out = self.run("scontrol", "show", "job", job_id).stdout
        return dict(re.findall(r"(\w+)=(\S+)", out))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if os.environ.get("MPOVERLAP_TEST_SLURM") != "1":
        pytest.skip("SLURM cluster tests run with `make test-slurm` (MPOVERLAP_TEST_SLURM=1)")
    why = unavailable_reason()
    if why:
        pytest.skip(why)
    state = tmp_path_factory.mktemp("slurm")
    script = str(REPO / "launch" / "slurm-testcluster.sh")
    with TwoHosts() as hosts:
        try:
            spec = [f"{ns}:{name}:{addr}" for ns, name, addr in zip(hosts.netns, hosts.names, hosts.addrs)]
            up = subprocess.run([script, "start", str(state), *spec], capture_output=True, text=True, timeout=600)
            assert up.returncode == 0, up.stdout + up.stderr
            yield Cluster(hosts, state)
        finally:
            subprocess.run([script, "stop", str(state)], capture_output=True, timeout=60)


def _submit(cluster, run_dir, out, steps=100000, requeue=False):
    env_run = dict(cluster.env, RUN_DIR=str(run_dir), NPROC_PER_NODE="2")
    proc = subprocess.run(["ip", "netns", "exec", cluster.hosts.netns[0], "sbatch", "--parsable", "--nodes=2",
                           f"--output={out}", "--open-mode=append", *(["--requeue"] if requeue else ["--no-requeue"]),
                           "launch/slurm.sbatch", *SMALL, *LAYOUT, f"train.steps={steps}"],
                          capture_output=True, text=True, env=env_run, timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def _wait_rows(cluster, job_id, run_dir, n_rows, out, deadline):
    while not ((run_dir / "metrics.jsonl").exists() and len(rows(run_dir)) >= n_rows):
        state = cluster.job(job_id).get("JobState")
        assert state in ("PENDING", "RUNNING", "CONFIGURING", "REQUEUED"), (state, Path(out).read_text()[-3000:])
        assert time.time() < deadline, Path(out).read_text()[-3000:] if Path(out).exists() else "no output"
        time.sleep(0.5)


def _preempt_after(cluster, job_id, run_dir, n_rows, out, timeout=240):
    """Wait until metrics.jsonl has n_rows rows, scancel --signal=TERM (SIGTERM to every
    process of the job: the batch shell, torchrun's agents, the workers), wait until the job
    left RUNNING. (job, seconds from the signal to the job's end)."""
    deadline = time.time() + timeout
    _wait_rows(cluster, job_id, run_dir, n_rows, out, deadline)
    t0 = time.time()
    cluster.run("scancel", "--signal=TERM", job_id)
    while cluster.job(job_id).get("JobState") in ("RUNNING", "COMPLETING", "CONFIGURING"):
        assert time.time() < deadline + 90, Path(out).read_text()[-3000:]
        time.sleep(0.2)
    return cluster.job(job_id), time.time() - t0


def test_sbatch_trains_is_preempted_requeued_and_resumes_on_the_curve(cluster, tmp_path):
    """Job 1 (no requeue): preempted, exits 0; the same sbatch command resumes. Job 2, submitted
    with --requeue and a finite train.steps: preempted, it requeues itself, starts again as the
    same job id, resumes from its own checkpoint and finishes. Every logged step of the three
    starts lies on the single-process curve."""
    run = tmp_path / "run"
    out1, out2 = tmp_path / "job1.out", tmp_path / "job2.out"
    job, took1 = _preempt_after(cluster, _submit(cluster, run, out1), run, 4, out1)
    log1 = out1.read_text()
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", (job, log1[-3000:])
    for name in cluster.hosts.names:
        assert re.search(rf"{name}: ranks \d-\d", log1), log1[-3000:]
    saved = int(re.search(r"SIGTERM: saved a checkpoint at step (\d+)", log1).group(1))
    assert (run / "checkpoints" / f"step_{saved:08d}" / "COMPLETE").is_file()  # all ranks' shards written
    assert "mpoverlap: preempted; checkpoint at step" in log1 and "requeueing" not in log1

    steps = saved + 30
    job_id = _submit(cluster, run, out2, steps=steps, requeue=True)
    job, took2 = _preempt_after(cluster, job_id, run, len(rows(run)) + 3, out2)
    log2 = out2.read_text()
    assert f"at step {saved}" in log2 and "resumed from" in log2, log2[-3000:]
    saved2 = int(re.findall(r"SIGTERM: saved a checkpoint at step (\d+)", log2)[-1])
    assert f"requeueing job {job_id}" in log2, log2[-3000:]
    # Requeued: pending again, then running as the same job id until train.steps.
    deadline = time.time() + 300
    while cluster.job(job_id).get("JobState") != "COMPLETED" or "done:" not in out2.read_text():
        assert cluster.job(job_id).get("JobState") in ("REQUEUED", "PENDING", "RUNNING", "COMPLETING",
                                                       "CONFIGURING", "COMPLETED"), (cluster.job(job_id),
                                                                                     out2.read_text()[-3000:])
        assert time.time() < deadline, out2.read_text()[-3000:]
        time.sleep(0.5)
    job, log2 = cluster.job(job_id), out2.read_text()
    assert job["ExitCode"] == "0:0" and job.get("Restarts") == "1", (job, log2[-3000:])
    assert f"at step {saved2}" in log2.split("requeueing")[-1], log2[-3000:]

    got = rows(run)
    assert max(r["step"] for r in got) == steps
    train(tmp_path / "ref", "train.lr_decay_steps=50", steps=steps)
    ref = {r["step"]: r["loss"] for r in rows(tmp_path / "ref")}
    assert_close([r["loss"] for r in got], [ref[r["step"]] for r in got])
    print(f"\nslurm: preempted at step {saved} (job gone {took1:.1f}s after scancel --signal=TERM), resumed by "
          f"resubmission, preempted at step {saved2} ({took2:.1f}s), requeued, resumed and finished at step "
          f"{steps}; {len(got)} logged steps on the single-process curve (1e-5)")
