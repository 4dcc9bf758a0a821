"""The ledger's per-mode figures against a workload of KNOWN durations.

On CPU a collective's duration cannot be set by its size (loopback is fast and noisy), so the
peer sets it: rank 1 joins each collective D ms after rank 0 issued it, so rank 0's handle
completes ~D ms after issue. Compute is a sleep of C ms between issue and wait. Sleeps need
no CPU, but on a loaded machine (`make test` runs two test files at once) a sleeper can wake, or
a rank leave the barrier, tens of ms late: each scenario measures that lateness (the peer's
joins and rank 0's wake-ups against the schedule, on the machine-wide monotonic clock both
ranks read) and the bound is 10% plus the lateness seen in that scenario.

Expected, for one handle: time_s = D; exposed_s = max(0, D - C) (C = 0: overlap off).
All scenarios run in ONE 2-process spawn; rank 0 keeps the ledger, rank 1 only paces.
"""
import os
import sys
import time
from types import SimpleNamespace

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dist_harness import run_distributed  # noqa: E402

from mpoverlap.comm import CommLedger  # noqa: E402

MS = 1e-3
TOLERANCE = 0.10  # relative; for an expected 0, 10% of the scenario's communication time

# name -> (peer joins: [(at_ms after the common start, group)], expected {mode: (time_ms, exposed_ms)})
# Rank 0's side of each scenario is in `_rank0_scenario`.
SCENARIOS = {
    "compute<comm (C=100, D=300)": ([(300, "world")], {"dp": (300, 200)}),
    "compute>comm (C=350, D=150)": ([(150, "world")], {"dp": (150, 0)}),
    # h1 issued at 0 (D=200), h2 at 50 (done at 350); waits from 100: union 350, not 200+300.
    "two queued handles": ([(200, "world"), (350, "world")], {"dp": (350, 250)}),
    "overlap off (wait at once, D=250)": ([(250, "world")], {"dp": (250, 250)}),
    # dp (D=300) and pp (D=150) in flight together on different groups, compute 100.
    "two modes at once": ([(150, "second"), (300, "world")], {"dp": (300, 200), "pp": (150, 0)}),
    # Two handles with an idle gap between them: the union must not fill the gap.
    "gap between handles (2 x 150 ms, 150 ms idle)": ([(150, "world"), (450, "world")], {"dp": (300, 300)}),
    # Backends without a completion future (gloo p2p, reduce-scatter): completion must be
    # seen when the transfer ends (150 ms), not at the wait after 350 ms of compute.
    "p2p receive, compute>comm (C=350, D=150)": ([(150, "send")], {"pp": (150, 0)}),
    "reduce-scatter, compute>comm (C=350, D=150)": ([(150, "reduce_scatter")], {"tp": (150, 0)}),
}


def _sleep_until(start: float, at_ms: float, late: list = None) -> None:
    """Sleep until `at_ms` after `start`; append to `late` how many ms after it this woke."""
    left = start + at_ms * MS - time.perf_counter()
    if left > 0:
        time.sleep(left)
    if late is not None:
        late.append((time.perf_counter() - start) / MS - at_ms)


def _rank0_scenario(name, ledger, groups, start, late):
    import torch

    from mpoverlap.comm import all_reduce, reduce_scatter, send_recv

    def issue(mode, group="world"):
        return all_reduce(torch.ones(8), groups[group], mode=mode, ledger=ledger)

    if name.startswith("compute<comm"):
        h = issue("dp")
        _sleep_until(start, 100, late)
        h.wait()
    elif name.startswith("compute>comm"):
        h = issue("dp")
        _sleep_until(start, 350, late)
        h.wait()
    elif name == "two queued handles":
        h1 = issue("dp")
        _sleep_until(start, 50, late)
        h2 = issue("dp")
        _sleep_until(start, 100, late)
        h1.wait()
        h2.wait()
    elif name.startswith("overlap off"):
        issue("dp").wait()
    elif name == "two modes at once":
        dp, pp = issue("dp"), issue("pp", "second")
        _sleep_until(start, 100, late)
        dp.wait()
        pp.wait()
    elif name.startswith("p2p receive"):
        h = send_recv([], [(torch.empty(8), 1)], None, mode="pp", ledger=ledger)
        _sleep_until(start, 350, late)
        h.wait()
    elif name.startswith("reduce-scatter"):
        h = reduce_scatter(torch.empty(4), torch.ones(8), groups["world"], mode="tp", ledger=ledger)
        _sleep_until(start, 350, late)
        h.wait()
    elif name.startswith("gap between"):
        issue("dp").wait()
        _sleep_until(start, 300, late)
        issue("dp").wait()
    else:
        raise KeyError(name)


def _accuracy_worker(rank, world):
    import torch
    import torch.distributed as dist

    groups = {"world": dist.group.WORLD, "second": dist.new_group([0, 1])}
    for group in groups.values():  # first use of a group may set up state: keep it out of the timings
        dist.all_reduce(torch.ones(8), group=group)
    ledger = CommLedger()
    measured, starts, late = {}, {}, {}
    for name, (peer_joins, _) in SCENARIOS.items():
        dist.barrier()  # both ranks leave together: the common start of the scenario
        start = starts[name] = time.perf_counter()
        late[name] = []
        if rank == 0:
            _rank0_scenario(name, ledger, groups, start, late[name])
            measured[name] = ledger.reset()
        else:
            for at_ms, op in peer_joins:
                _sleep_until(start, at_ms, late[name])
                if op == "send":
                    dist.send(torch.ones(8), dst=0)
                elif op == "reduce_scatter":
                    dist.reduce_scatter_tensor(torch.empty(4), torch.ones(8), group=groups["world"])
                else:
                    dist.all_reduce(torch.ones(8), group=groups[op])
    return measured, starts, late


@pytest.fixture(scope="module")
def timed():
    """(rank 0's ledger per scenario, {scenario: ms of scheduling lateness}): the most any join
    of the peer or any wake-up of rank 0 came after its place in the schedule, the peer's
    measured from rank 0's start (its barrier exit included). perf_counter is CLOCK_MONOTONIC,
    one clock for both processes."""
    (measured, starts0, late0), (_, starts1, late1) = run_distributed(_accuracy_worker, 2)
    lateness = {}
    for name in SCENARIOS:
        skew = (starts1[name] - starts0[name]) / MS
        lateness[name] = max([0.0, *late0[name], *(x + skew for x in late1[name])])
    return measured, lateness


@pytest.fixture(scope="module")
def measured(timed):
    return timed[0]


def test_ledger_matches_known_durations(timed):
    measured, lateness = timed
    lines, errors = [], []
    for name, (peer_joins, expected) in SCENARIOS.items():
        got = measured[name]
        assert set(got) == set(expected), f"{name}: modes {sorted(got)}, expected {sorted(expected)}"
        for mode, (time_ms, exposed_ms) in expected.items():
            for field, want in (("time_s", time_ms), ("exposed_s", exposed_ms)):
                have = got[mode][field] / MS
                allowed = TOLERANCE * (want if want else time_ms) + lateness[name]
                ok = abs(have - want) <= allowed
                lines.append(f"{name:<48} {mode} {field:<9} expected {want:6.1f} ms  measured {have:6.1f} ms"
                             f"  (+-{allowed:5.1f}, late {lateness[name]:5.1f})  ({'ok' if ok else 'OFF'})")
                if not ok:
                    errors.append(lines[-1])
    print("\n" + "\n".join(lines))
    assert not errors, "\n".join(errors)


def test_ledger_counts_ops_and_bytes(measured):
    assert measured["two queued handles"]["dp"]["ops"] == 2
    assert measured["two modes at once"]["pp"]["ops"] == 1
    assert measured["overlap off (wait at once, D=250)"]["dp"]["bytes"] == 8 * 4  # 8 fp32


def _fake(mode, issued, completed, blocked, nbytes=4):
    """A waited handle whose blocked span ends at its completion (as CommHandle.wait sets it)."""
    return SimpleNamespace(mode=mode, op="x", nbytes=nbytes, link_bytes=nbytes // 2, issued_at=issued,
                           completed_at=completed,
                           blocked_s=blocked, wait_began_at=completed - blocked, wait_ended_at=completed, post_span=None,
                           uses_cuda_events=False)


def test_ledger_arithmetic_without_processes():
    """Union of in-flight intervals per mode, union of blocked spans, division by steps."""
    ledger = CommLedger()
    for h in [_fake("dp", 0.0, 3.0, 1.0), _fake("dp", 1.0, 2.0, 0.5),  # nested: union 3
              _fake("dp", 5.0, 6.0, 0.0),                               # disjoint: +1
              _fake("tp", 2.0, 4.0, 2.0), _fake("tp", 3.0, 7.0, 0.0)]:  # overlapping: union 5
        ledger.record(h)
    out = ledger.reset(per=2)
    assert out["dp"] == {"ops": 1.5, "bytes": 6.0, "link_bytes": 3.0, "time_s": pytest.approx(2.0),
                         "exposed_s": pytest.approx(0.75)}
    assert out["tp"]["time_s"] == pytest.approx(2.5) and out["tp"]["exposed_s"] == pytest.approx(1.0)
    assert ledger.summary() == {}


def test_recorder_sees_every_recorded_handle_and_is_off_by_default():
    ledger = CommLedger()
    assert ledger.recorder is None
    seen = []
    ledger.recorder = seen.append
    h = _fake("pp", 0.0, 1.0, 0.2)
    ledger.record(h)
    ledger.recorder = None
    ledger.record(_fake("pp", 2.0, 3.0, 0.0))
    assert seen == [h] and ledger.summary()["pp"]["ops"] == 2


def test_exposed_never_exceeds_in_flight_for_real_handles():
    """A handle whose backend completed just before (or while) the waiter woke, one
    waited long after it completed, and one still in flight: each blocked span lies inside its
    in-flight interval, so exposed <= time_s holds exactly, not within a tolerance."""
    from mpoverlap.comm.handle import CommHandle

    class Work:
        def __init__(self, done_after_s):
            self.done_at = time.perf_counter() + done_after_s

        def wait(self):
            time.sleep(max(0.0, self.done_at - time.perf_counter()))

        def get_future(self):
            raise RuntimeError("no future")  # completion known only once waited

        def is_completed(self):
            return time.perf_counter() >= self.done_at

    ledger = CommLedger()
    handles = []
    for delay, wait_after in ((0.02, 0.0), (0.0, 0.02), (0.01, 0.01), (0.03, 0.005)):
        h = CommHandle("dp", "all_reduce", 4, [Work(delay)], ledger)
        time.sleep(wait_after)
        handles.append(h.wait())
    for h in handles:
        assert h.issued_at <= h.completed_at
        waited = h.wait_ended_at - h.wait_began_at
        assert waited == 0.0 or h.issued_at <= h.wait_began_at <= h.wait_ended_at <= h.completed_at
        assert h.issued_at <= h.post_span[0] <= h.post_span[1] <= h.completed_at
    assert any(h.blocked_s > 0 for h in handles)
    out = ledger.reset()["dp"]
    assert 0 <= out["exposed_s"] <= out["time_s"]
    # A handle that completed before its wait began blocked nothing.
    late = CommHandle("dp", "all_reduce", 4, [], ledger)
    time.sleep(0.005)
    assert late.wait().blocked_s == 0.0


def test_ledger_exposed_is_bounded_by_in_flight_under_random_spans():
    import random

    rng = random.Random(0)
    for _ in range(200):
        ledger = CommLedger()
        for _ in range(rng.randint(1, 8)):
            issued = rng.uniform(0, 1)
            completed = issued + rng.uniform(0, 0.5)
            ledger.record(_fake(rng.choice(["dp", "tp"]), issued, completed, rng.uniform(0, completed - issued)))
        for row in ledger.reset(per=rng.randint(1, 3)).values():
            assert 0 <= row["exposed_s"] <= row["time_s"]


def test_time_inside_the_post_is_exposed_on_cpu():
    """On CPU the caller computes nothing while gloo writes inside the post (a p2p send): the
    post's span counts as exposed, and a transfer done inside its own post completes, for the
    ledger, when the post returns. A handle that sent nothing blocked nothing."""
    from mpoverlap.comm.handle import CommHandle, now

    class DoneWork:
        def wait(self):
            pass

        def get_future(self):
            raise RuntimeError("no future")

        def is_completed(self):
            return True

    ledger = CommLedger()
    issued = now()
    time.sleep(0.02)  # the post
    h = CommHandle("pp", "send_recv", 4, [DoneWork()], ledger, issued_at=issued).wait()
    assert h.post_span == (issued, h.posted_at) and h.posted_at - issued >= 0.02
    assert h.completed_at >= h.posted_at and h.blocked_s == pytest.approx(h.posted_at - issued)
    nothing_sent = CommHandle("pp", "send_recv", 0, [], ledger, issued_at=now() - 0.02).wait()
    assert nothing_sent.post_span is None and nothing_sent.blocked_s == 0.0
    out = ledger.reset()["pp"]
    assert out["exposed_s"] == pytest.approx(h.posted_at - issued) and out["exposed_s"] <= out["time_s"]
