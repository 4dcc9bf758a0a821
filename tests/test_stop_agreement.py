"""The stop agreement's protocol (training/stop_agreement.py), with ranks as threads of this
process on one real TCPStore, each "step" ending in a barrier (the step's collectives couple the
ranks as a gradient all-reduce does). What must hold for every timing: every rank stops after
the same step, a signal reaches every rank within a step of it, nothing is requested of the store
in a step without a signal, and no rank deadlocks waiting for the others. The Trainer end to end
(a real SIGTERM, the checkpoint) is tests/test_training_schedule.py's."""
from __future__ import annotations

import threading
import time
from collections import Counter
from datetime import timedelta

import pytest
import torch.distributed as dist

from mpoverlap.comm.ledger import CommLedger
from mpoverlap.training.stop_agreement import StopAgreement
from tests.dist_harness import free_port

WORLD = 4


class CountingStore:
    """A store whose requests are counted by the calling thread's name."""

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
    the ranks' own threads made no store request at any boundary (restore's one `exit` aside),
    and every thread ended."""
    stopped, counts, ledgers, live = run_ranks(server, "quiet", steps=30, step_s=0.004)
    assert stopped == dict.fromkeys(range(WORLD)), stopped
    for rank in range(WORLD):
        by_op = counts[rank]
        # The watcher's wait and its read of restore's `exit`; restore's compare_set.
        assert by_op == Counter({("watch", "wait"): 1, ("watch", "get"): 1, ("main", "compare_set"): 1}), by_op
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
    assert sum(c[("main", "multi_set")] for c in counts.values()) == 1
    assert sum(c[("main", "add")] for c in counts.values()) == len(signalled)
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


def test_a_rank_whose_watcher_never_proposes_raises_naming_the_timeout(server):
    """A rank that never proposes (its watcher dead): the others' boundary wait ends after
    train.comm_timeout_s with an error that says so, instead of hanging the job."""
    client = dist.TCPStore("127.0.0.1", server.port, WORLD + 1, False, timeout=timedelta(seconds=30))
    stop = StopAgreement(client, 2, 0, CommLedger(strict=False), timeout_s=0.5, name="dead")
    stop.start(0)
    try:
        stop.request()
        deadline = time.time() + 10
        while stop._proposed is None and time.time() < deadline:
            time.sleep(0.01)
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
