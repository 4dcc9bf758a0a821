"""CommHandle clocks and the ledger: blocked time is exposed, hidden time is not."""
import os
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dist_harness import run_distributed  # noqa: E402

from mpoverlap.comm import CommHandle, CommLedger, all_gather, all_reduce, reduce_scatter  # noqa: E402
from mpoverlap.comm.ledger import mean_over_ranks, union_length  # noqa: E402


def test_union_length():
    assert union_length([]) == 0
    assert union_length([(0, 1), (0.5, 2), (3, 4)]) == pytest.approx(3.0)
    assert union_length([(0, 5), (1, 2)]) == pytest.approx(5.0)


def test_local_handle_is_complete_and_recorded_once():
    ledger = CommLedger()
    t = torch.ones(10)
    h = all_reduce(t, None, mode="dp", ledger=ledger)  # one-member group: nothing to send
    assert h.is_completed()
    h.wait()
    h.wait()
    s = ledger.reset(per=2)
    assert s["dp"]["ops"] == 0.5 and s["dp"]["bytes"] == 20
    assert ledger.summary() == {}
    out = torch.empty(4)
    all_gather(out, torch.arange(4.0), None, mode="dp", ledger=None).wait()
    assert torch.equal(out, torch.arange(4.0))
    with pytest.raises(ValueError):
        CommHandle("xx", "op", 0, [], None)


class _Work:
    """A finished backend work; with `future=False` it refuses a completion future, as gloo's
    p2p and reduce-scatter works do."""

    def __init__(self, future: bool) -> None:
        self.future, self.asked = future, 0

    def get_future(self):
        self.asked += 1
        if not self.future:
            raise RuntimeError("this work has no future")
        fut = torch.futures.Future()
        fut.set_result(None)
        return fut

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def test_a_refused_future_is_remembered_per_backend_and_op(monkeypatch):
    """One gloo refusal of an op sends later gloo handles of that op to the background wait
    (without asking again) but leaves an NCCL handle of the same op on its completion future."""
    from mpoverlap.comm import handle as handle_mod

    monkeypatch.setattr(handle_mod, "_NO_FUTURE_OPS", set())
    ledger = CommLedger()
    try:
        first = _Work(future=False)
        CommHandle("dp", "reduce_scatter", 4, [first], ledger, backend="gloo").wait()
        again = _Work(future=False)
        gloo = CommHandle("dp", "reduce_scatter", 4, [again], ledger, backend="gloo")
        assert again.asked == 0 and gloo._background is not None
        nccl_work = _Work(future=True)
        nccl = CommHandle("dp", "reduce_scatter", 4, [nccl_work], ledger, backend="nccl")
        assert nccl_work.asked == 1 and nccl._background is None and nccl.completed_at is not None
        gloo.wait(), nccl.wait()
    finally:
        ledger.close()


def test_mean_over_ranks():
    a = {"dp": {"ops": 2, "bytes": 100, "time_s": 1.0, "exposed_s": 0.5}}
    b = {"dp": {"ops": 2, "bytes": 100, "time_s": 3.0, "exposed_s": 0.1}}
    m = mean_over_ranks([a, b])
    assert m["dp"]["time_s"] == 2.0 and m["dp"]["exposed_s"] == pytest.approx(0.3) and m["dp"]["bytes"] == 100


def _timing_worker(rank, world):
    import torch.distributed as dist

    group = dist.group.WORLD
    ledger = CommLedger()
    big = torch.ones(4_000_000)
    # Waited at once: compute blocked for (nearly) all of it.
    all_reduce(big, group, mode="dp", ledger=ledger).wait()
    at_once = ledger.reset()["dp"]
    # Issued, then 0.5 s of "compute", then waited: the collective finished under it.
    h = all_reduce(big, group, mode="dp", ledger=ledger)
    time.sleep(0.5)
    done_before_wait = h.is_completed()
    h.wait()
    hidden = ledger.reset()["dp"]
    out = torch.empty(2)
    scattered = reduce_scatter(out, torch.arange(4.0) * (rank + 1), group, mode="tp", ledger=ledger).wait()
    assert scattered.backend == "gloo"  # what a refused future is remembered under
    return at_once, hidden, done_before_wait, out.tolist(), float(big[0])


def test_exposed_versus_hidden_on_gloo():
    results = run_distributed(_timing_worker, 2)
    for rank, (at_once, hidden, done, out, value) in enumerate(results):
        assert value == 4.0  # 1 -> 2 -> 4 after two sums
        assert at_once["exposed_s"] > 0.5 * at_once["time_s"] > 0
        assert done and hidden["exposed_s"] < 0.05 and hidden["time_s"] < 0.5
        assert out == ([0.0, 3.0] if rank == 0 else [6.0, 9.0])
