"""Pipeline schedules as pure tables (no processes): coverage, data flow, p2p matching,
link order, deadlock freedom, the microbatch rule, broken tables, and the bubble; the
zero-bubble (zb1p, zbv) tables' W actions, zbv's V layout, and the paper's bubble formulas."""
import dataclasses

import pytest

from mpoverlap.pipeline import (ScheduleError, bubble_fraction, build_schedule,
                                microbatch_groups, resolve_schedule, schedule_constraints,
                                schedule_kind, simulated_bubble, simulated_bubble_time,
                                validate_schedule)
from mpoverlap.pipeline.actions import RECV, SEND, is_local
from mpoverlap.pipeline.bubble import closed_form_bubble, closed_forms, in_window_idle
from mpoverlap.pipeline.schedules import _timed_run
from mpoverlap.pipeline.zero_bubble import peak_in_flight


def microbatch_counts(pp, vpp):
    counts = {pp, 2 * pp, 3 * pp, pp + 1, 2 * pp + 1, 3 * pp - 1}
    if vpp == 1:
        counts |= {1, max(1, pp - 1), pp // 2 or 1}
    return sorted(counts)


CASES = [(pp, vpp, m) for pp in (2, 4, 8) for vpp in (1, 2, 3) for m in microbatch_counts(pp, vpp)]


@pytest.mark.parametrize("pp,vpp,m", CASES)
def test_tables_validate_and_cover_every_microbatch(pp, vpp, m):
    tables = build_schedule(schedule_kind(vpp), pp, vpp, m)
    validate_schedule(tables)
    assert len(tables) == pp
    for stage, actions in enumerate(tables):
        seen = sorted((a.kind, a.microbatch, a.vchunk) for a in actions)
        assert seen == sorted((k, mb, v) for k in "FB" for mb in range(m) for v in range(vpp))
        assert all(a.chunk == a.vchunk * pp + stage for a in actions)
        for prefetch in (False, True):  # every op of the stage is posted exactly once
            ops = [op for a in actions for part in a.batches(prefetch) for b in part for op in b]
            assert len(ops) == len(set(ops)) == sum((a.recv is not None) + (a.send is not None) for a in actions)
            assert all(len({op.peer for op in b}) == 1 and sum(op.op == RECV for op in b) <= 1
                       for a in actions for part in a.batches(prefetch) for b in part)


@pytest.mark.parametrize("pp,vpp,m", [(2, 1, 4), (4, 1, 8), (4, 2, 8), (8, 3, 9), (4, 3, 6)])
def test_prefetch_posts_some_receives_a_compute_ahead(pp, vpp, m):
    for actions in build_schedule(schedule_kind(vpp), pp, vpp, m):
        consumer = {a.recv: i for i, a in enumerate(actions) if a.recv}
        ahead = [consumer[op.message] - i for i, a in enumerate(actions)
                 for b in a.prefetch_after for op in b if op.op == RECV]
        assert max(ahead) >= 2, "a receive posted after compute i is used at i+1 at the latest"


def test_one_f_one_b_warmup_and_shape():
    tables = build_schedule("1f1b", 4, 1, 8)
    for stage, actions in enumerate(tables):
        kinds = "".join(a.kind for a in actions)
        warmup = 4 - stage - 1
        assert kinds == "F" * warmup + "FB" * (8 - warmup) + "B" * warmup
    short = build_schedule("1f1b", 4, 1, 2)  # m < pp: warm-up capped at m
    assert "".join(a.kind for a in short[0]) == "FFBB"


def test_interleaved_groups_and_rule():
    assert [list(g) for g in microbatch_groups(4, 9)] == [[0, 1, 2, 3, 4], [5, 6, 7, 8]]
    assert [len(g) for g in microbatch_groups(4, 8)] == [4, 4]
    problems = schedule_constraints("interleaved", 4, 2, 3)
    assert len(problems) == 1 and "at least pp=4 microbatches" in problems[0] and "vpp=1" in problems[0]
    assert schedule_constraints("interleaved", 4, 2, 6) == []  # m % pp != 0 is fine
    assert "pp >= 2" in schedule_constraints("interleaved", 1, 2, 4)[0]
    assert "vpp=1" in schedule_constraints("1f1b", 4, 2, 8)[0]
    assert schedule_constraints("1f1b", 8, 1, 3) == []
    assert "unknown" in schedule_constraints("gpipe", 2, 1, 2)[0]
    with pytest.raises(ScheduleError, match="at least pp=4"):
        build_schedule("interleaved", 4, 2, 3)


def test_bubble_theory_and_simulation_agree():
    assert bubble_fraction(4, 1, 8) == pytest.approx(3 / 8)
    assert bubble_fraction(8, 2, 16) == pytest.approx(7 / 32)
    for pp, vpp, m in [(4, 1, 8), (4, 1, 3), (4, 2, 8), (4, 2, 6), (8, 3, 17), (2, 3, 5)]:
        measured = simulated_bubble(build_schedule(schedule_kind(vpp), pp, vpp, m))
        assert max(measured) == pytest.approx(bubble_fraction(pp, vpp, m)), (pp, vpp, m)


# ---------------------------------------------------------------- broken tables are caught

def _replace(tables, stage, index, **fields):
    out = [list(t) for t in tables]
    out[stage][index] = dataclasses.replace(out[stage][index], **fields)
    return out


def _find(actions, text):
    return next(i for i, a in enumerate(actions)
                if any(text in str(op) for part in a.batches(False) for b in part for op in b))


def test_swapped_order_on_one_link_is_caught():
    tables = build_schedule("interleaved", 2, 2, 4)
    # Stage 1 posts two receives from stage 0 after one compute, in two batches: swap them.
    i = next(i for i, a in enumerate(tables[1]) if len(a.posts_after) == 2
             and all(any(op.op == RECV for op in b) for b in a.posts_after))
    swapped = _replace(tables, 1, i, posts_after=tuple(reversed(tables[1][i].posts_after)))
    with pytest.raises(ScheduleError, match=r"overlap=off link s0<->s1: s0->s1 FIFO order differs"):
        validate_schedule(swapped)


def test_opposite_send_receive_order_deadlocks_with_blocking_p2p():
    tables = build_schedule("1f1b", 2, 1, 4)
    # Megatron's send_forward_recv_backward split in two at both ends, receive first: each
    # stage waits for the other's send (NCCL-style blocking), which is never posted.
    i0, i1 = _find(tables[0], "act[mb1"), _find(tables[1], "grad[mb0")
    split = []
    for stage, i in ((0, i0), (1, i1)):
        (batch,) = tables[stage][i].posts_after
        split.append((stage, i, tuple((op,) for op in sorted(batch, key=lambda op: op.op != RECV))))
    broken = tables
    for stage, i, batches in split:
        broken = _replace(broken, stage, i, posts_after=batches)
    with pytest.raises(ScheduleError) as err:
        validate_schedule(broken)
    assert "posted in a different order at the two ends" in str(err.value)
    assert "deadlock with blocking p2p" in str(err.value)
    assert "overlap=off: deadlock with deferred" not in str(err.value)  # async p2p would survive


def test_missing_send_is_caught():
    tables = build_schedule("interleaved", 4, 2, 4)
    i = _find(tables[3], "send->s0:act[mb0 c3->c4]")
    dropped = tuple(tuple(op for op in b if "act[mb0 c3->c4]" not in str(op)) for b in tables[3][i].posts_after)
    broken = _replace(tables, 3, i, posts_after=tuple(b for b in dropped if b))
    with pytest.raises(ScheduleError, match=r"act\[mb0 c3->c4\] has 0 send\(s\) and 1 receive"):
        validate_schedule(broken)


def test_backward_before_forward_and_wrong_dataflow_are_caught():
    tables = build_schedule("1f1b", 2, 1, 2)
    swapped = [list(t) for t in tables]
    swapped[1][0], swapped[1][1] = swapped[1][1], swapped[1][0]
    with pytest.raises(ScheduleError, match="backward before its forward"):
        validate_schedule(swapped)
    wrong = _replace(tables, 1, 0, recv=tables[1][2].recv)
    with pytest.raises(ScheduleError, match="consumes"):
        validate_schedule(wrong)


def test_p2p_ops_name_peers_and_directions():
    tables = build_schedule("interleaved", 4, 2, 4)
    for stage, actions in enumerate(tables):
        for a in actions:
            for part in a.batches(True):
                for b in part:
                    for op in b:
                        assert op.peer in ((stage - 1) % 4, (stage + 1) % 4)
                        assert op.op in (SEND, RECV)


# ---------------------------------------------------------------- zero bubble (ZB-H1, zb1p)

ZB_CASES = [(2, 1, 1), (2, 1, 4), (4, 1, 3), (4, 1, 8), (8, 1, 9), (2, 2, 2), (2, 2, 5), (4, 2, 8),
            (4, 3, 5)]


@pytest.mark.parametrize("pp,vpp,m", ZB_CASES)
def test_zb1p_tables_validate_one_w_after_each_b(pp, vpp, m):
    tables = build_schedule("zb1p", pp, vpp, m)
    validate_schedule(tables)  # includes both posting programs' link order and deadlock checks
    base = build_schedule(schedule_kind(vpp), pp, vpp, m)
    for stage, actions in enumerate(tables):
        seen = sorted((a.kind, a.microbatch, a.vchunk) for a in actions)
        assert seen == sorted((k, mb, v) for k in "FBW" for mb in range(m) for v in range(vpp))
        # the F/B order is the base schedule's; W's never carry p2p
        assert [(a.kind, a.microbatch, a.vchunk) for a in actions if a.kind != "W"] == \
            [(a.kind, a.microbatch, a.vchunk) for a in base[stage]]
        assert all(a.recv is None and a.send is None for a in actions if a.kind == "W")
        order = [(a.kind, a.microbatch, a.vchunk) for a in actions]
        assert all(order.index(("W", mb, v)) > order.index(("B", mb, v))
                   for mb in range(m) for v in range(vpp))
    # activation memory (F done, W not done) stays within the base schedule's peak
    peak = max(peak_in_flight([(a.kind, a.microbatch, a.vchunk) for a in t]) for t in base)
    assert max(peak_in_flight([(a.kind, a.microbatch, a.vchunk) for a in t]) for t in tables) == peak


@pytest.mark.parametrize("costs", [(1, 1, 1), (1, 1, 0.5), (2, 2, 1), (1.5, 1, 0.75)])
def test_simulated_bubble_reproduces_the_paper_formulas(costs):
    F, B, W = costs
    for pp, m in [(2, 4), (4, 8), (4, 4), (8, 16)]:
        one_f_one_b = simulated_bubble_time(build_schedule("1f1b", pp, 1, m), F, B, W)
        zb1p = simulated_bubble_time(build_schedule("zb1p", pp, 1, m), F, B, W)
        assert one_f_one_b == pytest.approx([(pp - 1) * (F + B + W)] * pp), (pp, m)
        assert zb1p == pytest.approx([(pp - 1) * (F + B - W)] * pp), (pp, m)
    # on interleaved chunks (costs per chunk) the same placement takes the bubble from
    # (p-1)(F+B+W) to at most (p-1)(F+B-W)
    inter = simulated_bubble_time(build_schedule("interleaved", 4, 2, 8), F, B, W)
    zb_inter = simulated_bubble_time(build_schedule("zb1p", 4, 2, 8), F, B, W)
    assert max(inter) == pytest.approx(3 * (F + B + W))
    assert max(zb_inter) <= 3 * (F + B - W) + 1e-9


# Per-chunk (F, B, W): equal, and unequal on each side of the forms' conditions (W below and
# above min(F, B), F above and below B).
CLOSED_FORM_COSTS = [(1, 1, 1), (1, 1, 0.5), (1.5, 1, 0.75), (1, 2, 1), (2, 1, 1), (1, 1, 2), (3, 1, 1),
                     (1, 0.5, 0.5), (0.5, 1.5, 1.5)]


@pytest.mark.parametrize("kind,vpp,pp,m", [("1f1b", 1, 4, 8), ("1f1b", 1, 2, 3), ("interleaved", 2, 4, 8),
                                           ("interleaved", 3, 2, 5), ("zb1p", 1, 4, 8), ("zb1p", 1, 3, 3),
                                           ("zb1p", 2, 4, 8), ("zb1p", 2, 2, 5), ("zbv", 2, 4, 8), ("zbv", 2, 3, 4)])
def test_closed_forms_are_the_tables_bubble(kind, vpp, pp, m):
    """Each closed form (pipeline/bubble.py) against the schedule's own table timed with free
    p2p, at F = B = W and at unequal costs: equal on every stage wherever the form says it is
    exact (and it says so at F = B = W for every schedule); where it does not, the table's
    bubble is reported beside it, never replaced by it."""
    tables = build_schedule(kind, pp, vpp, m)
    exact = 0
    for costs in CLOSED_FORM_COSTS:
        form = closed_form_bubble(kind, pp, vpp, *costs)
        if costs == (1, 1, 1):
            assert form.exact and form.seconds == pytest.approx({"1f1b": 3, "interleaved": 3}.get(kind, 1) * (pp - 1))
        if form.exact:
            exact += 1
            assert simulated_bubble_time(tables, *costs) == pytest.approx([form.seconds] * pp), (costs, form)
    # every costs for 1F1B, interleaved and ZB-H1; F = B = W for zb1p on chunks; F <= B = W for zbv
    assert exact == {"zb1p": 1 if vpp > 1 else len(CLOSED_FORM_COSTS), "zbv": 2}.get(kind, len(CLOSED_FORM_COSTS))
    # per-stage costs: each stage's own figure, and the pooled one at the stages' mean
    per_stage = [(1, 1, 0.5), (2, 2, 1)][:pp] + [(1.5, 1.5, 0.75)] * (pp - 2)
    pooled, at_pooled, at_stages = closed_forms(kind, pp, vpp, per_stage)
    assert pooled == pytest.approx((1.5, 1.5, 0.75))
    assert at_pooled.seconds == closed_form_bubble(kind, pp, vpp, *pooled).seconds
    assert [f.seconds for f in at_stages] == [closed_form_bubble(kind, pp, vpp, *c).seconds for c in per_stage]


def test_paired_v_closed_form_is_dualpipev_s():
    """DeepSeek-V3 Table 2: DualPipeV's (PP/2-1)(F&B+B-3W) with B the full backward, PP/2 = pp
    devices: (pp-1)(FB+B-2W) with B the input gradient. The reference's replay of torch's
    DualPipeV at 4 ranks, F = B = W = 1, serial pairs (FB = F+B+W = 3): 6; a perfect overlap
    (FB = max(F, B+W) = 2) leaves the V's fill (pp-1) F = 3."""
    assert closed_form_bubble("zbv", 4, 2, 1, 1, 1, paired=True).seconds == 6
    assert closed_form_bubble("zbv", 4, 2, 1, 1, 1, paired=True, fb=2).seconds == 3
    assert not closed_form_bubble("zbv", 4, 2, 1, 1, 1, paired=True).exact  # DualPipe's table, not ours


def test_timed_run_takes_per_stage_costs_and_a_p2p_latency():
    """The benchmark's table (bench/zero_bubble_report.py): `latency` delays each message
    between stages, `cost_of(kind, stage, vchunk)` replaces the three costs. 1F1B at pp 2:
    stage 0 idles F + B for the fill plus one latency per microbatch (each round trip costs
    two, one hides under stage 0's next forward); with stage 1 twice as slow, stage 0 also
    waits the difference once per later microbatch."""
    from mpoverlap.pipeline.schedules import _timed_run

    def idle(times):
        return [t[-1][1] - sum(e - s for s, e in t) for t in times]

    F, B, lat = 1.0, 2.0, 0.25
    for m in (2, 4, 8):
        tables = build_schedule("1f1b", 2, 1, m)
        assert idle(_timed_run(tables, F, B, 0.0))[0] == pytest.approx(F + B)
        assert idle(_timed_run(tables, F, B, 0.0, latency=lat))[0] == pytest.approx(F + B + m * lat), m
        slow = _timed_run(tables, 0.0, 0.0, 0.0, cost_of=lambda kind, stage, v: (F if kind == "F" else B) * (1 + stage))
        assert idle(slow)[0] == pytest.approx(2 * (F + B) + (m - 1) * (F + B)), m
        # `start`: stage 0 entering the step d late delays every message it sends by d; stage
        # 1, which entered on time, waits d more before its first forward (and nowhere else in
        # 1F1B at equal costs: stage 0 does not wait on it then, its fill idles the same)
        d = 0.4
        late = _timed_run(tables, F, B, 0.0, start=[d, 0.0])
        assert late[1][0][0] == pytest.approx(d + F) and late[0][0][0] == pytest.approx(d)
        assert late[1][-1][1] == pytest.approx(_timed_run(tables, F, B, 0.0)[1][-1][1] + d)


def test_weight_action_before_its_b_or_missing_is_caught():
    tables = build_schedule("zb1p", 2, 1, 2)
    stage1 = [list(t) for t in tables]
    w = next(i for i, a in enumerate(stage1[1]) if a.kind == "W")
    b = next(i for i, a in enumerate(stage1[1]) if a.kind == "B" and a.microbatch == stage1[1][w].microbatch)
    stage1[1][w], stage1[1][b] = stage1[1][b], stage1[1][w]
    with pytest.raises(ScheduleError, match="weight gradients before their B"):
        validate_schedule(stage1)
    dropped = [list(t) for t in tables]
    dropped[0] = [a for a in dropped[0] if not (a.kind == "W" and a.microbatch == 1)]
    dropped[0][-1] = dataclasses.replace(dropped[0][-1], posts_after=tables[0][-1].posts_after)
    with pytest.raises(ScheduleError, match=r"W\(mb1,v0\) appears 0 times"):
        validate_schedule(dropped)


def test_schedule_choice_rules():
    assert resolve_schedule("auto", 1) == "1f1b" and resolve_schedule("auto", 2) == "interleaved"
    assert resolve_schedule("zb1p", 2) == "zb1p"
    assert "vpp > 1" in schedule_constraints("interleaved", 4, 1, 8)[0]
    assert schedule_constraints("zb1p", 4, 1, 2) == [] and schedule_constraints("zb1p", 4, 2, 4) == []
    assert "at least pp=4" in schedule_constraints("zb1p", 4, 2, 3)[0]


# ---------------------------------------------------------------- ZB-V (zbv): two chunks in a V

ZBV_CASES = [(2, 2), (2, 3), (2, 8), (3, 4), (4, 6), (4, 7), (4, 8), (4, 13), (8, 14), (8, 16)]


@pytest.mark.parametrize("pp,m", ZBV_CASES)
def test_zbv_tables_validate_in_a_v(pp, m):
    tables = build_schedule("zbv", pp, 2, m)
    validate_schedule(tables)  # coverage, W after B, data flow, both posting programs, deadlock
    for stage, actions in enumerate(tables):
        seen = sorted((a.kind, a.microbatch, a.vchunk) for a in actions)
        assert seen == sorted((k, mb, v) for k in "FBW" for mb in range(m) for v in (0, 1))
        assert {(a.vchunk, a.chunk) for a in actions} == {(0, stage), (1, 2 * pp - 1 - stage)}
        assert all(a.recv is None and a.send is None for a in actions if a.kind == "W")
        order = [(a.kind, a.microbatch, a.vchunk) for a in actions]
        assert all(order.index(("W", mb, v)) > order.index(("B", mb, v)) for mb in range(m) for v in (0, 1))
        posted = {op.message for a in actions for prefetch in (False, True)
                  for part in a.batches(prefetch) for b in part for op in b}
        local = {msg for a in actions for msg in (a.recv, a.send) if msg is not None and is_local(msg, pp, "v")}
        # the turn of the V (chunk pp-1 -> pp) is the only local hand-over, on stage pp-1, never posted
        assert bool(local) == (stage == pp - 1) and not (local & posted)
        assert all(msg.src_chunk + msg.dst_chunk == 2 * pp - 1 for msg in local)
        for a in actions:  # every posted op goes to a neighbour (the V has no wrap-around link)
            assert all(abs(op.peer - stage) == 1 for part in a.batches(True) for b in part for op in b)
    # stage 0 runs the embedding chunk and the loss chunk
    assert {a.chunk for a in tables[0]} == {0, 2 * pp - 1}
    # activation memory: at most 2pp chunk-microbatches between F and W = 1F1B's p stage-sized ones
    assert max(peak_in_flight([(a.kind, a.microbatch, a.vchunk) for a in t]) for t in tables) <= 2 * pp


@pytest.mark.parametrize("pp,m", [(2, 2), (2, 6), (4, 6), (4, 8), (4, 12), (8, 14), (8, 24)])
def test_zbv_bubble_is_the_fill_only(pp, m):
    """F = B = W (per chunk): each stage idles (pp-1) F, the first forward's wait for the chunks
    above it - "zero bubble" beyond the fill (paper section 6), against 1F1B's (pp-1)(F+B+W)
    per stage-sized cost = 6 (pp-1) F here. The order is built for B = W: with B = W >= F the
    bubble is (pp-1) B; for other costs it is at least the fill."""
    tables = build_schedule("zbv", pp, 2, m)
    assert simulated_bubble_time(tables, 1, 1, 1) == pytest.approx([pp - 1] * pp)
    # The paper's "zero bubble" (its formula's value at F = B = W): no stage idles between its
    # own first and last action; the (pp-1) F above is the fill, before a stage's first action.
    if m >= 2 * pp:
        assert in_window_idle(_timed_run(tables, 1, 1, 1)) == pytest.approx([0.0] * pp)
    assert closed_form_bubble("zbv", pp, 2, 1, 1, 1).seconds == pp - 1
    assert max(simulated_bubble(tables)) == pytest.approx(bubble_fraction(pp, 2, m, "zbv"))
    assert bubble_fraction(pp, 2, m, "zbv") == pytest.approx((pp - 1) / (6 * m))
    for F, B in [(1, 2), (1, 3), (2, 3), (0.5, 0.75)]:
        assert simulated_bubble_time(tables, F, B, B) == pytest.approx([(pp - 1) * B] * pp), (F, B)
    for F, B, W in [(1, 1, 0.5), (1.5, 1, 0.75), (2, 1, 1)]:
        assert min(simulated_bubble_time(tables, F, B, W)) >= (pp - 1) * F - 1e-9
    one_f_one_b = simulated_bubble_time(build_schedule("1f1b", pp, 1, m), 2, 2, 2)  # a stage = 2 chunks
    assert max(one_f_one_b) == pytest.approx(6 * (pp - 1))


def test_zbv_microbatch_threshold():
    """Below m = 2(pp-1) the 1F-1B-1W steady state never forms (the rule's reason): the
    schedule is refused; at the threshold the bubble is already the fill."""
    assert schedule_constraints("zbv", 4, 2, 6) == []
    assert "at least 2(pp-1) = 6 microbatches" in schedule_constraints("zbv", 4, 2, 5)[0]
    assert "exactly two model chunks" in schedule_constraints("zbv", 4, 1, 8)[0]
    assert "exactly two model chunks" in schedule_constraints("zbv", 4, 3, 8)[0]
    assert "pp >= 2" in schedule_constraints("zbv", 1, 2, 8)[0]
    with pytest.raises(ScheduleError):
        build_schedule("zbv", 4, 2, 5)
    assert resolve_schedule("zbv", 2) == "zbv"


def test_zbv_local_hand_over_posted_or_misordered_is_caught():
    tables = build_schedule("zbv", 2, 2, 2)
    stage = [list(t) for t in tables]
    turn = next(i for i, a in enumerate(stage[1]) if a.kind == "F" and a.vchunk == 1)
    producer = next(i for i, a in enumerate(stage[1]) if a.send == stage[1][turn].recv)
    stage[1][turn], stage[1][producer] = stage[1][producer], stage[1][turn]
    with pytest.raises(ScheduleError, match="runs before"):
        validate_schedule(stage)
    posted = [list(t) for t in tables]
    bogus = (dataclasses.replace(next(op for a in tables[1] for b in a.prefetch_after for op in b),
                                 message=tables[1][turn].recv),)
    posted[1][0] = dataclasses.replace(posted[1][0], prefetch_after=posted[1][0].prefetch_after + (bogus,))
    with pytest.raises(ScheduleError, match="local hand-over"):
        validate_schedule(posted)


def test_check_and_simulate_know_zbv():
    """mpoverlap-check's estimate and --simulate on zbv: the bubble formula, the activation
    memory of 1F1B (the same layers in flight, W closures counted), twice 1F1B's p2p bytes, and a
    simulated step shorter than interleaved 1F1B's and zb1p's on the same chunks."""
    from mpoverlap.config import compose
    from mpoverlap.overlap import validate
    from mpoverlap.overlap.estimate import estimate
    from mpoverlap.simulate import from_config, simulate

    common = ["model=gpt_125m", "model.num_layers=16", "parallel.world_size=4", "parallel.pp=4",
              "train.global_batch_size=32", "train.micro_batch_size=4", "model.tie_embeddings=false"]
    layouts = {"1f1b": [], "interleaved": ["parallel.vpp=2"],
               "zb1p_v2": ["parallel.vpp=2", "parallel.pp_schedule=zb1p"],
               "zbv": ["parallel.vpp=2", "parallel.pp_schedule=zbv"]}
    cfgs = {name: compose(common + extra) for name, extra in layouts.items()}
    assert not validate(cfgs["zbv"], 4)
    est = {name: estimate(cfg) for name, cfg in cfgs.items()}
    assert est["zbv"].bubble == pytest.approx(3 / (6 * 8))
    peak_1f1b = max(s.layers_in_flight for s in est["1f1b"].stages)
    assert [s.layers_in_flight for s in est["zbv"].stages] == [peak_1f1b] * 4
    assert est["zbv"].comm_bytes_per_step["pp"] == 2 * est["1f1b"].comm_bytes_per_step["pp"]
    sim = {name: simulate(cfg, from_config(cfg)) for name, cfg in cfgs.items()}
    assert sim["zbv"].step_s < min(sim["interleaved"].step_s, sim["zb1p_v2"].step_s)
    assert sim["zbv"].bubble_s < sim["interleaved"].bubble_s
    # --simulate prints each schedule's closed form at the simulated per-chunk costs, pooled and
    # per stage, beside the simulated idle (pipeline/bubble.py)
    from mpoverlap.pipeline.bubble import closed_form_bubble
    from mpoverlap.simulate.core import render

    for name, cfg in cfgs.items():
        forms = sim[name].bubble_forms
        kind = forms["schedule"]
        assert kind == {"zb1p_v2": "zb1p"}.get(name, name)
        assert forms["form"] == closed_form_bubble(kind, 4, cfg.parallel.vpp, *forms["pooled"])
        assert len(forms["per_stage"]) == 4 and all(f.seconds > 0 for f in forms["per_stage"])
        line = next(x for x in render(cfg, from_config(cfg), sim[name]).splitlines() if "bubble closed form" in x)
        assert f"{forms['form'].seconds * 1e3:,.2f} ms at the pooled per-chunk" in line, line
        assert f"{sim[name].bubble_s * 1e3:,.2f} ms" in line.rsplit(";", 1)[1], line
    assert sim["1f1b"].bubble_forms["form"].formula == "(p-1)(F+B+W)"
    assert sim["zbv"].bubble_forms["form"].formula == "(p-1)max(F,B)"
