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


@pytest.mark.parametrize("kind,vpp", [("1f1b", 1), ("zb1p", 1)])
def test_one_chunk_per_stage_is_not_paired(kind, vpp):
    with pytest.raises(ScheduleError, match="interleaved"):
        build_schedule(kind, 2, vpp, 4, pairing=True)


@pytest.mark.parametrize("pp,m", [(2, 4), (2, 8), (4, 8)])
def test_a_paired_one_chunk_table_makes_neighbouring_stages_take_turns(pp, m):
    """Why vpp = 1 (1F1B, zb1p) is refused: the 1F1B order paired like the interleaved one (one
    more warm-up forward, then F + B pairs) validates, but a pair's B needs the next stage's pair,
    which needs the F this stage sends after its previous pair: timed with free p2p at F = 1,
    B = 2 its bubble is far above the plain 1F1B table's (pp = 2, m = 8: 0.875 against 0.125 of
    the busy time)."""
    from mpoverlap.pipeline.program import simulate_compute

    orders, paired = zip(*(paired_module.paired_order([(mb, 0) for mb in range(m)], [(mb, 0) for mb in range(m)],
                                                      pp - s - 1) for s in range(pp)))
    times = simulate_compute(list(orders), pp, 1, paired=list(paired))
    makespan = max(t[-1][1] for t in times)
    busy = 3 * m
    plain = simulated_bubble(build_schedule("1f1b", pp, 1, m))
    assert (makespan - busy) / busy > 2 * max(plain)


@pytest.mark.parametrize("pp,vpp,m", [(2, 2, 2), (2, 2, 4), (2, 2, 8), (3, 2, 6), (4, 2, 4), (4, 2, 8), (2, 3, 5), (4, 3, 9)])
def test_paired_zb1p_tables_keep_w_out_of_pairs_and_the_zero_bubble_gain(pp, vpp, m):
    """zb1p + pairing (vpp >= 2): the paired interleaved order with one W per B placed as
    insert_weight_actions places them; validate_schedule passes (coverage, data flow, both posting
    programs, rendezvous, no F paired with its own B); a W never sits between a paired F and its
    B; the pairs are the paired interleaved table's; timed with free p2p (F = B = W = 1, a pair
    F + B) the bubble is at most the paired interleaved table's with B = 2 (the W's fill idle
    slots) and, for m > pp, the unpaired zb1p table's, and the activation peak (F to W) of every stage is the paired table's stage 0 peak."""
    from mpoverlap.pipeline.zero_bubble import peak_in_flight

    tables = build_schedule("zb1p", pp, vpp, m, pairing=True)
    validate_schedule(tables)
    base = build_schedule("interleaved", pp, vpp, m, pairing=True)
    for table, plain in zip(tables, base):
        assert [(a.kind, a.microbatch, a.vchunk) for a in table if a.kind != "W"] == \
            [(a.kind, a.microbatch, a.vchunk) for a in plain]
        assert [a.paired for a in table if a.kind != "W"] == [a.paired for a in plain]
        for i, a in enumerate(table):
            if a.paired:
                assert table[i + 1].kind == "B"
        assert sorted((a.microbatch, a.vchunk) for a in table if a.kind == "W") == \
            sorted((a.microbatch, a.vchunk) for a in table if a.kind == "B")
    # memory: every stage at most the paired interleaved table's peak (its stage 0's), as zb1p's
    # is 1F1B's stage 0 peak on every stage (ZB-H1's pM_B)
    cap = max(peak_in_flight([(a.kind, a.microbatch, a.vchunk) for a in plain]) for plain in base)
    assert max(peak_in_flight([(a.kind, a.microbatch, a.vchunk) for a in t]) for t in tables) == cap
    orders = [[(a.kind, a.microbatch, a.vchunk) for a in t] for t in tables]
    paired = [{i for i, a in enumerate(t) if a.paired} for t in tables]
    times = schedules.simulate_compute(orders, pp, vpp, 1, 1, 1, paired=paired)
    makespan = max(t[-1][1] for t in times)
    idle = [makespan - 3 * m * vpp for _ in times]
    plain_orders = [[(a.kind, a.microbatch, a.vchunk) for a in t] for t in base]
    plain_times = schedules.simulate_compute(plain_orders, pp, vpp, 1, 2, paired=[{i for i, a in enumerate(t) if a.paired}
                                                                                for t in base])
    plain_idle = max(t[-1][1] for t in plain_times) - 3 * m * vpp
    assert max(idle) <= plain_idle + 1e-9
    # and from m > pp on the unpaired zb1p table's (pp 2 x vpp 2, m = 8: 1 against the paired
    # interleaved 3); at m = pp a pair waits more (pp 4 x vpp 2, m = 4: 5 against 3)
    unpaired = max(schedules.simulated_bubble_time(build_schedule("zb1p", pp, vpp, m), 1, 1, 1))
    assert max(idle) <= unpaired + 1e-9 or m == pp


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
