"""SIGTERM to a self-launched run, measured: `mpoverlap-train` dp 2 x
tp 2 (4 ranks) at train.log_interval=50 saving every step; once step N's checkpoint is COMPLETE
(step N + 1 in flight) the launcher gets SIGTERM. Prints the step the ranks stopped after, the
save's time, the time from the signal until every process of the launch is gone against one
step + the save + 5 s, then runs the same command again (it resumes) and an uninterrupted run,
and compares their last logged loss and validation loss.

    python -m bench.sigterm_stop [--after 5] [--steps 40] [--out DIR] [--no-resume]

--two-hosts: the same layout under torchrun on the two network-namespace hosts of
tests/multihost.py (root), and SIGTERM to ONE worker on host 1 only: the other three ranks learn
of it through the stop agreement (nothing is resumed).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List

TRAIN = str(Path(sys.executable).with_name("mpoverlap-train"))


def overrides(steps: int) -> List[str]:
    return ["parallel.dp=2", "parallel.tp=2", "model=gpt_tiny", "model.num_layers=4", "model.hidden_size=256",
            "model.ffn_hidden_size=1024", "model.seq_length=128", "train.micro_batch_size=4",
            "train.global_batch_size=16", f"train.steps={steps}", f"train.lr_decay_steps={steps}",
            "train.log_interval=50", "checkpoint.interval=1", "checkpoint.keep=100", "train.progress=false",
            "data.max_bytes=2000000"]


def last_rows(run: Path):
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r], [r for r in rows if "val_loss" in r]


def stop_report(out: str, run: Path, after: int, gone_s: float, failed: bool, err: str = "") -> str:
    """The stop as the run logged it (`SIGTERM: saved a checkpoint at step N in X s`) against
    the stop's bounds (docs/checkpoints.md): after step k or k + 1 (k = after + 1, in flight at
    the signal), every process gone within one step + the save + 5 s. Exits when the run failed or saved nothing."""
    saved = re.search(r"SIGTERM: saved a checkpoint at step (\d+) in ([0-9.]+)s", out)
    if failed or saved is None:
        sys.exit(f"the run failed or wrote no SIGTERM save line: {err[-2000:]}")
    stop, save_s = int(saved.group(1)), float(saved.group(2))
    step_s = last_rows(run)[0][-1]["step_time_s"]
    bound = step_s + save_s + 5
    return (f"every rank stopped after step {stop} (k or k+1: {stop in (after + 1, after + 2)}), saved in "
            f"{save_s:.2f}s, every process gone {gone_s:.2f}s after the signal (one step {step_s:.2f}s + save + 5 s "
            f"= {bound:.2f}s: {'within' if gone_s <= bound else 'OVER'})")


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def two_hosts(args, root: Path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from multihost import TwoHosts, unavailable_reason

    why = unavailable_reason()
    if why:
        sys.exit(why)
    run = root / "two-hosts"
    with TwoHosts() as hosts:
        agents = hosts.torchrun(["-m", "mpoverlap.train", *overrides(args.steps), f"run.dir={run}"],
                                nproc_per_node=2, log_dir=root / "agents")
        target = run / "checkpoints" / f"step_{args.after:08d}" / "COMPLETE"
        deadline = time.time() + 300
        while not target.is_file():
            if any(a.poll() is not None for a in agents) or time.time() > deadline:
                sys.exit(f"the run ended or stalled before step {args.after}: {[a.poll() for a in agents]}")
            time.sleep(0.01)
        # A worker: the agent's children that run mpoverlap.train (not the agent, not helpers).
        workers = [p for p in hosts.pids(1) if p != agents[1].pid and _parent(p) == agents[1].pid]
        if len(workers) != 2:
            sys.exit(f"expected the agent's 2 workers on host 1, found {workers}")
        worker = workers[-1]
        t0 = time.time()
        os.kill(worker, signal.SIGTERM)
        while (any(a.poll() is None for a in agents) or hosts.pids(0) or hosts.pids(1)) and time.time() - t0 < 300:
            time.sleep(0.02)
        gone_s = time.time() - t0
        codes = [a.wait(timeout=10) for a in agents]
    out = "".join((root / "agents" / f"agent{i}.out").read_text() for i in range(2))
    print(f"two hosts, torchrun: SIGTERM to one worker (pid {worker}) after step {args.after}: "
          f"{stop_report(out, run, args.after, gone_s, codes != [0, 0])}; agents exited {codes}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--after", type=int, default=5, help="signal once this step's checkpoint is complete")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--out", default=None)
    p.add_argument("--no-resume", action="store_true")
    p.add_argument("--two-hosts", action="store_true", help="torchrun on two network-namespace hosts (root)")
    args = p.parse_args()
    root = Path(args.out or tempfile.mkdtemp(prefix="mpo-sigterm-"))
    if args.two_hosts:
        return two_hosts(args, root)
    run = root / "stopped"
    cmd = [TRAIN, *overrides(args.steps), f"run.dir={run}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    target = run / "checkpoints" / f"step_{args.after:08d}" / "COMPLETE"
    while not target.is_file():
        if proc.poll() is not None:
            sys.exit(f"the run ended before step {args.after}: {proc.communicate()[1][-2000:]}")
        time.sleep(0.01)
    t0 = time.time()
    pids = subprocess.run(["pgrep", "-s", str(proc.pid)], capture_output=True, text=True).stdout.split()
    os.kill(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    while any(Path(f"/proc/{pid}").exists() for pid in pids) and time.time() - t0 < 300:
        time.sleep(0.02)
    gone_s = time.time() - t0
    print(f"SIGTERM after step {args.after} ({args.after + 1} in flight): "
          f"{stop_report(out, run, args.after, gone_s, proc.returncode != 0, err)}; launcher exit {proc.returncode}")
    if args.no_resume:
        return
    subprocess.run(cmd, check=True, capture_output=True)
    ref = root / "uninterrupted"
    subprocess.run([TRAIN, *overrides(args.steps), "checkpoint.interval=0", f"run.dir={ref}"], check=True,
                   capture_output=True)
    (a, va), (b, vb) = last_rows(run), last_rows(ref)
    print(f"resumed with the same command: step {a[-1]['step']} loss {a[-1]['loss']!r} val {va[-1]['val_loss']!r}; "
          f"uninterrupted: step {b[-1]['step']} loss {b[-1]['loss']!r} val {vb[-1]['val_loss']!r}; "
          f"equal: {(a[-1]['loss'], va[-1]['val_loss']) == (b[-1]['loss'], vb[-1]['val_loss'])}")


if __name__ == "__main__":
    main()
