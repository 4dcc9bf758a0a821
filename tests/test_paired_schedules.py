"""Paired interleaved tables (overlap.ep_pairing at pp > 1, mpoverlap/pipeline/paired.py), pure:
every F and B once, each paired F followed by a B of another (microbatch, vchunk) with nothing
posted between them, both receives of a pair posted before it and both sends after it, one
extra warm-up forward per stage, the free-communication bubble of the plain table; a table
pairing a forward with its own backward (the plain table's last stage, without the extra
warm-up) is caught; schedules other than interleaved have no paired table."""
import pytest

from mpoverlap.pipeline import ScheduleError, build_schedule, simulated_bubble, validate_schedule
from mpoverlap.pipeline import paired as paired_module
from mpoverlap.pipeline import schedules
from mpoverlap.pipeline.actions import RECV, SEND

CASES = [(pp, vpp, m) for pp in (2, 3, 4) for vpp in (2, 3) for m in sorted({pp, pp + 1, 2 * pp, 3 * pp - 1, 8})]


def _warmup(actions):
    return next(i for i, a in enumerate(actions) if a.kind == "B" or a.paired)


@pytest.mark.parametrize("pp,vpp,m", CASES)
def test_paired_tables_validate_pair_steady_f_and_b_and_keep_the_bubble(pp, vpp, m):
    tables = build_schedule("interleaved", pp, vpp, m, pairing=True)
    plain = build_schedule("interleaved", pp, vpp, m)
    validate_schedule(tables)
    for stage, (actions, base) in enumerate(zip(tables, plain)):
        assert sorted((a.kind, a.microbatch, a.vchunk) for a in actions) == \
            sorted((a.kind, a.microbatch, a.vchunk) for a in base)
        # one more warm-up forward than the interleaved table (capped at m x vpp)
        assert _warmup(actions) == min(m * vpp, schedules._interleaved_parts(pp, vpp, m, stage)[2] + 1)
        pairs = [i for i, a in enumerate(actions) if a.paired]
        assert len(pairs) == m * vpp - _warmup(actions)
        for i in pairs:
            f, b = actions[i], actions[i + 1]
            assert f.kind == "F" and b.kind == "B" and (f.microbatch, f.vchunk) != (b.microbatch, b.vchunk)
            for prefetch in (False, True):
                assert f.batches(prefetch)[1] == ()  # nothing between the F and the B
                posted_before = {op.message for a in actions[:i] for part in a.batches(prefetch)
                                 for batch in part for op in batch if op.op == RECV}
                assert all(r in posted_before for r in (f.recv, b.recv) if r is not None)
                sends_after = {op.message for part in b.batches(prefetch)[1:] for batch in part for op in batch
                               if op.op == SEND}
                assert all(s in sends_after for s in (f.send, b.send) if s is not None)
    assert simulated_bubble(tables) == pytest.approx(simulated_bubble(plain))


def test_pairing_a_forward_with_its_own_backward_is_caught(monkeypatch):
    """Without the extra warm-up forward the last stage pairs F(mb, last chunk) with its own B."""
    plain_order = paired_module.paired_order
    monkeypatch.setattr(schedules, "paired_order", lambda f, b, warmup: plain_order(f, b, warmup - 1))
    schedules._cached_orders.cache_clear()
    try:
        tables = build_schedule("interleaved", 2, 2, 4, pairing=True)
        with pytest.raises(ScheduleError, match="paired with its own backward"):
            validate_schedule(tables)
    finally:
        schedules._cached_orders.cache_clear()


@pytest.mark.parametrize("kind,vpp", [("1f1b", 1), ("zb1p", 2)])
def test_only_the_interleaved_schedule_and_the_v_are_paired(kind, vpp):
    with pytest.raises(ScheduleError, match="interleaved"):
        build_schedule(kind, 2, vpp, 4, pairing=True)


@pytest.mark.parametrize("pp,m", [(2, 4), (2, 5), (3, 7), (4, 8), (4, 13), (8, 16)])
def test_paired_v_validates_pairs_across_its_chunks_and_keeps_the_fill(pp, m):
    """The paired V (pipeline/zbv_paired.py):
    zbv's layout, one F, B and W per (microbatch, chunk), both posting programs deadlock-free
    (validate_schedule); its main phase pairs F of one chunk with B of the stage's other chunk
    (DualPipeV's F0+B1, F1+B0), never a chunk with itself. Timed with free p2p, a pair costing
    its F + B (its W is a separate action after it), at F = B = W it keeps zbv's bubble, the
    fill (p-1) F: DualPipeV's (p-1)(FB+B-2W) with FB = F+B; with the W inside the pair (FB =
    F+B+W, DualPipeV's main phase) the form doubles it."""
    from mpoverlap.pipeline.actions import V_SHAPE
    from mpoverlap.pipeline.bubble import closed_form_bubble
    from mpoverlap.pipeline.program import simulate_compute

    tables = build_schedule("zbv", pp, 2, m, pairing=True)
    validate_schedule(tables)
    for table in tables:
        for kind in "FBW":
            for v in (0, 1):
                assert sorted(a.microbatch for a in table if a.kind == kind and a.vchunk == v) == list(range(m))
        pairs = [(a, table[i + 1]) for i, a in enumerate(table) if a.paired]
        assert pairs and all(f.vchunk != b.vchunk for f, b in pairs)
        assert {(f.vchunk, b.vchunk) for f, b in pairs} == {(0, 1), (1, 0)}
    orders = [[(a.kind, a.microbatch, a.vchunk) for a in t] for t in tables]
    paired = [{i for i, a in enumerate(t) if a.paired} for t in tables]
    times = simulate_compute(orders, pp, 2, 1, 1, 1, V_SHAPE, paired=paired)
    makespan = max(t[-1][1] for t in times)
    idle = [makespan - sum(e - s for s, e in dict.fromkeys(t)) for t in times]  # a pair: one span
    assert idle == pytest.approx([pp - 1] * pp)
    assert closed_form_bubble("zbv", pp, 2, 1, 1, 1, paired=True, fb=2).seconds == pp - 1
    assert closed_form_bubble("zbv", pp, 2, 1, 1, 1, paired=True).seconds == 2 * (pp - 1)
    with pytest.raises(ScheduleError, match="2pp"):
        build_schedule("zbv", pp, 2, 2 * pp - 1, pairing=True)
