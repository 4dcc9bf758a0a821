"""The stop agreement's protocol (training/stop_agreement.py), with ranks as threads of this
process on one real TCPStore, each "step" ending in a barrier (the step's collectives couple the
ranks as a gradient all-reduce does). What must hold for every timing: every rank stops after
the same step, a signal reaches every rank within a step of it, nothing is requested of the store
in a step without a signal, and no rank deadlocks waiting for the others. Then what breaks it:
a store that stops answering the signal handler, a watcher failing while its rank closes, and
(in two real processes) ranks that built different numbers of Trainers, and a caller stepping a
Trainer directly. The Trainer end to end (a real SIGTERM, the checkpoint) is
tests/test_training_schedule.py's."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from datetime import timedelta

import pytest
import torch.distributed as dist

from mpoverlap.comm.ledger import CommLedger
from mpoverlap.training.stop_agreement import StopAgreement, StopAgreementError
from tests.dist_harness import free_port, run_distributed

WORLD = 4


class CountingStore:
    """A store whose requests are counted by the calling thread's name: `main` (the rank's
    loop), `watch` (its watcher), `signal` (the signal handler's and restore's requests)."""

    def __init__(self, inner, counts, slow_get_s: float = 0.0) -> None:
        self._inner, self.counts, self._slow_get_s = inner, counts, slow_get_s

    def clone(self):
        return CountingStore(self._inner.clone(), self.counts, self._slow_get_s)

    def __getattr__(self, name):
        method = getattr(self._inner, name)

        def counted(*args, **kwargs):
            self.counts[(threading.current_thread().name.split("-")[-1], name)] += 1
            if name == "get" and self._slow_get_s and threading.current_thread().name.endswith("watch"):
                time.sleep(self._slow_get_s)  # this rank's watcher proposes late
            return method(*args, **kwargs)
        return counted


@pytest.fixture(scope="module")
def server():
    store = dist.TCPStore("127.0.0.1", free_port(), WORLD + 1, True, timeout=timedelta(seconds=30),
                          wait_for_workers=False)
    yield store


def run_ranks(server, name, steps, step_s, signal_at=None, slow_get=None, pause=None):
    """WORLD ranks stepping until they agree to stop (or `steps`). signal_at: {rank: step whose
    middle requests the stop}; slow_get: {rank: seconds its watcher's store get takes};
    pause: {rank: (step, seconds)} an extra pause in that step before its barrier. Returns
    (stop step per rank, store requests by (thread, op) per rank, ledgers, live threads)."""
    barrier = threading.Barrier(WORLD, timeout=20)
    stopped, counts, ledgers, agreements = {}, {}, {}, {}
    errors = []

    def rank_main(rank):
        counts[rank] = Counter()
        client = dist.TCPStore("127.0.0.1", server.port, WORLD + 1, False, timeout=timedelta(seconds=30))
        ledgers[rank] = CommLedger(strict=False)
        stop = agreements[rank] = StopAgreement(
            CountingStore(client, counts[rank], (slow_get or {}).get(rank, 0.0)), WORLD, rank, ledgers[rank],
            timeout_s=20, name=name)
        stop.start(0)
        try:
            for step in range(1, steps + 1):
                time.sleep(step_s / 2)
                if (signal_at or {}).get(rank) == step:
                    stop.request()
                if (pause or {}).get(rank, (None,))[0] == step:
                    time.sleep(pause[rank][1])
                barrier.wait()
                time.sleep(step_s / 2)
                if stop.at_boundary(step):
                    stopped[rank] = step
                    return
            stopped[rank] = None
        except Exception as e:  # reported below, with the rank
            errors.append((rank, repr(e)))
            barrier.abort()
        finally:
            stop.restore()

    threads = [threading.Thread(target=rank_main, args=(r,), name=f"rank{r}-main") for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    live = [t.name for a in agreements.values() for t in a._threads] + [t.name for t in threads if t.is_alive()]
    return stopped, counts, ledgers, live


def test_no_signal_no_store_request_in_any_step(server):
    """30 steps without a signal: each rank's watcher made one wait (and read restore's `exit`),
    the ranks' own threads made no store request at any boundary (start's one count of the run
    and restore's one `exit` aside), and every thread ended."""
    stopped, counts, ledgers, live = run_ranks(server, "quiet", steps=30, step_s=0.004)
    assert stopped == dict.fromkeys(range(WORLD)), stopped
    for rank in range(WORLD):
        by_op = counts[rank]
        # The watcher's wait and its read of restore's `exit`; start's add, restore's compare_set.
        assert by_op == Counter({("watch", "wait"): 1, ("watch", "get"): 1, ("main", "add"): 1,
                                 ("signal", "compare_set"): 1}), by_op
        assert "stop" not in ledgers[rank].summary()
    assert not live, live


@pytest.mark.parametrize("signalled", [(2,), tuple(range(WORLD))], ids=["one_rank", "every_rank"])
def test_a_signal_in_step_6_stops_every_rank_after_step_6_or_7(server, signalled):
    """A stop requested halfway through step 6 (on rank 2, or on every rank at once as SLURM
    does): every rank stops after the same step, 6 or 7 (7 where a watcher woke after its rank
    had finished 6); the first rank signalled wakes everyone (one multi_set in all); the ledger
    of the stop counts the agreement: store bytes, in flight from the wake-up, exposed within."""
    name = f"signal-{len(signalled)}"
    stopped, counts, ledgers, live = run_ranks(server, name, steps=30, step_s=0.05,
                                               signal_at=dict.fromkeys(signalled, 6))
    assert len(set(stopped.values())) == 1 and stopped[0] in (6, 7), stopped
    assert sum(c[("signal", "multi_set")] for c in counts.values()) == 1
    assert sum(c[("main", "add")] for c in counts.values()) == WORLD  # each rank's count of its run at the start
    assert sum(c[("signal", "add")] for c in counts.values()) == len(signalled)
    for rank in range(WORLD):
        stop = ledgers[rank].summary()["stop"]
        assert stop["ops"] == 1 and stop["bytes"] > 0 and 0 <= stop["exposed_s"] <= stop["time_s"], stop
    assert not live, live


def test_a_rank_that_proposes_late_is_waited_for_without_deadlock(server):
    """Rank 1's watcher takes 0.3 s to propose (a slow store get): by then rank 1 has finished
    step 6 and sits in step 7's barrier, waiting for ranks that wait for its proposal at their
    boundary 6. The proposal comes from its watcher thread, not from its blocked loop, so every
    rank goes on and stops after step 7."""
    stopped, counts, ledgers, live = run_ranks(server, "late", steps=30, step_s=0.06, signal_at={2: 6},
                                               slow_get={1: 0.3})
    assert stopped == dict.fromkeys(range(WORLD), 7), stopped
    # The ranks that proposed 6 waited at boundary 6: exposed time, most of rank 1's delay.
    waited = [ledgers[r].summary()["stop"]["exposed_s"] for r in (0, 2, 3)]
    assert all(w > 0.05 for w in waited), waited
    assert not live, live


def _wait_proposed(stop, timeout_s: float = 10.0) -> None:
    """Until the agreement's watcher has proposed (woken by a request)."""
    deadline = time.monotonic() + timeout_s
    while stop._proposed is None and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_rank_whose_watcher_never_proposes_raises_naming_the_timeout(server):
    """A rank that never proposes (its watcher dead): the others' boundary wait ends after
    train.comm_timeout_s with an error that says so, instead of hanging the job."""
    client = dist.TCPStore("127.0.0.1", server.port, WORLD + 1, False, timeout=timedelta(seconds=30))
    stop = StopAgreement(client, 2, 0, CommLedger(strict=False), timeout_s=0.5, name="dead")
    stop.start(0)
    try:
        stop.request()
        _wait_proposed(stop)
        assert stop.at_boundary(0) is False
        with pytest.raises(RuntimeError, match=r"train.comm_timeout_s=0.5.*never\s+proposed"):
            stop.at_boundary(1)
    finally:
        stop.restore()
    assert not stop._threads


def test_world_1_stops_at_the_next_boundary_without_a_store():
    stop = StopAgreement(None, 1, 0)
    stop.start(0)
    assert stop.at_boundary(1) is False
    stop.request()
    assert stop.at_boundary(2) is True
    stop.restore()


# -- what breaks it ---------------------------------------------------------------------------
_STORE_HOST = """
import sys, time
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 2, True, wait_for_workers=False)
print("ready", flush=True)
time.sleep(600)
"""


def test_the_signal_handlers_store_request_is_bounded():
    """The store's host stops answering (SIGSTOP) after the run started: the signal handler,
    which holds the training thread, returns after its bound (1 s here), where a TCPStore
    request would wait for ever (the connection's 60 s timeout bounds waits only), and the next
    boundary raises naming what failed."""
    host = subprocess.Popen([sys.executable, "-c", _STORE_HOST, str(port := free_port())], stdout=subprocess.PIPE,
                            text=True)
    stop = None
    try:
        assert host.stdout.readline().strip() == "ready"
        client = dist.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=60))
        stop = StopAgreement(client, 2, 0, CommLedger(strict=False), timeout_s=60, name="hung", signal_timeout_s=1.0)
        stop.start(0)
        os.kill(host.pid, signal.SIGSTOP)
        began = time.monotonic()
        handler = threading.Thread(target=stop.request, daemon=True)  # what the SIGTERM handler calls
        handler.start()
        handler.join(timeout=10)
        took = time.monotonic() - began
        assert not handler.is_alive(), "the signal handler's store request was still blocked after 10 s"
        assert took < 5, took
        with pytest.raises(StopAgreementError, match=r"rank 0 got SIGTERM but could not wake the other ranks "
                                                     r"through the store within 1s"):
            stop.at_boundary(1)
    finally:
        os.kill(host.pid, signal.SIGCONT)
        if stop is not None:
            stop.restore()
        host.kill()
        host.wait()


class _ProposalFails:
    """A store whose watcher (the thread `mpoverlap-stop-watch`) fails its proposal: its first
    compare-and-set of `max` raises, once `closing()` is true (at most 10 s later)."""

    def __init__(self, inner, closing) -> None:
        self._inner, self._closing = inner, closing

    def clone(self):
        return _ProposalFails(self._inner.clone(), self._closing)

    def __getattr__(self, name):
        method = getattr(self._inner, name)

        def maybe_failing(*args, **kwargs):
            if (name == "compare_set" and str(args[0]).endswith("/max")
                    and threading.current_thread().name == "mpoverlap-stop-watch"):
                deadline = time.monotonic() + 10
                while not self._closing() and time.monotonic() < deadline:
                    time.sleep(0.01)
                raise RuntimeError("injected: the watcher's store connection broke")
            return method(*args, **kwargs)
        return maybe_failing


def test_a_watcher_error_while_closing_reaches_the_peers(server, capsys):
    """Rank 0 has finished its run and closes when rank 1's signal wakes its watcher, whose
    proposal then fails: rank 1, waiting for every proposal at its boundary, raises at once with
    rank 0's error (not after train.comm_timeout_s, 5 s here, as if rank 0 had never proposed),
    and rank 0 prints its own."""
    clients = [dist.TCPStore("127.0.0.1", server.port, WORLD + 1, False, timeout=timedelta(seconds=30))
               for _ in range(2)]
    closing = StopAgreement(_ProposalFails(clients[0], lambda: closing._closing), 2, 0, CommLedger(strict=False),
                            timeout_s=5, name="close-fails")
    waiting = StopAgreement(clients[1], 2, 1, CommLedger(strict=False), timeout_s=5, name="close-fails")
    closing.start(0)
    waiting.start(0)
    try:
        waiting.request()
        _wait_proposed(waiting)
        closing.restore()  # the watcher fails now, while its rank closes
        began = time.monotonic()
        with pytest.raises(StopAgreementError, match=r"failed on another rank: rank 0: .*injected"):
            waiting.at_boundary(1)
        assert time.monotonic() - began < 2.5
    finally:
        closing.restore()
        waiting.restore()
    assert "rank 0's stop-agreement watcher lost the store" in capsys.readouterr().err


# -- in two real processes, with Trainers ------------------------------------------------------
TRAINER = ["model.num_layers=1", "model.hidden_size=32", "model.num_attention_heads=2", "model.ffn_hidden_size=64",
           "model.seq_length=16", "train.global_batch_size=4", "train.micro_batch_size=2", "data.max_bytes=50000",
           "parallel.dp=2", "train.device=cpu", "train.progress=false", "checkpoint.interval=0",
           "train.comm_timeout_s=10"]


class _Tripwire:
    """Stands in for a Trainer's stop agreement: records every attribute asked of it."""

    def __init__(self) -> None:
        self.touched = []

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        self.touched.append(name)
        return lambda *args, **kwargs: False


def _trainers(rank, world, root):
    """Rank 0 builds two Trainers, rank 1 one. The first steps twice with a tripwire for its
    agreement; then the last Trainer's agreement runs with SIGTERM on rank 1 in step 3."""
    from pathlib import Path

    from mpoverlap.config import compose
    from mpoverlap.training.loop import Trainer
    from mpoverlap.training.setup import init_distributed

    cfg = compose([*TRAINER, f"run.dir={root}"])
    state = init_distributed(cfg)
    trainers = [Trainer(cfg, state, Path(root)) for _ in range(2 if rank == 0 else 1)]
    first = trainers[0]
    agreement, first.stop = first.stop, _Tripwire()
    out = [first.train_step() for _ in range(2)][-1]
    direct = {"touched": first.stop.touched, "keys": sorted(out)}
    first.stop = agreement
    stop = trainers[-1].stop
    stopped = error = signalled = None
    stop.install(0)
    try:
        for step in range(1, 50):
            time.sleep(0.02)
            if rank == 1 and step == 3:
                signalled = time.monotonic()
                os.kill(os.getpid(), signal.SIGTERM)
            dist.barrier()
            if stop.at_boundary(step):
                stopped = step
                break
    except Exception as e:  # reported with the rank
        error = repr(e)
    finally:
        stop.restore()
    took = time.monotonic() - signalled if signalled is not None else None
    for trainer in trainers:
        trainer.close()
    return {"direct": direct, "stopped": stopped, "error": error, "took": took}


@pytest.fixture(scope="module")
def trainers(tmp_path_factory):
    return run_distributed(_trainers, 2, str(tmp_path_factory.mktemp("trainers")), timeout_s=120)


def test_ranks_that_built_different_numbers_of_trainers_agree_at_once(trainers):
    """Rank 0 built one Trainer (and so one agreement) more than rank 1: rank 1's SIGTERM in step 3
    still stops both after step 3 or 4, within a second or two of the signal, where keys named by
    the count of agreements a process built never met and rank 1 raised after
    train.comm_timeout_s (10 s)."""
    assert [r["error"] for r in trainers] == [None, None], trainers
    stopped = {r["stopped"] for r in trainers}
    assert len(stopped) == 1 and stopped <= {3, 4}, trainers
    assert trainers[1]["took"] < 3, trainers[1]["took"]


def test_a_direct_train_step_takes_no_part_in_the_agreement(trainers):
    """Trainer.train_step asks nothing of the stop agreement and returns no stop decision: that
    is Trainer.run's (run_loop.py), so tests, benchmarks and the counters that step a Trainer
    directly take no part in it."""
    for r in trainers:
        assert r["direct"]["touched"] == [], r["direct"]
        assert r["direct"]["keys"] == ["grad_norm", "loss_local", "lr", "skipped", "step_time_s"], r["direct"]
