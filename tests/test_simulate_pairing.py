"""The simulator's model of EP forward/backward pairing (mpoverlap/simulate/pairing.py):
one pair's program by hand, in the executor's order, the backward first (Megatron's: at 1:1
compute and exchanges per sub-step nothing exposed, where a forward-first order exposes
the first forward dispatch and the last reverse dispatch; exchanges longer than the compute; the
counts exchange queued behind the other microbatch's exchange), the lone first forward and last
backward, chunking alone, the step's average over the unpaired passes and the pairs, where
pairing does not apply, and `mpoverlap-check --simulate`'s line. The switch is handed over explicitly (a Plain config copy
with `overlap.ep_pairing` set), so these tests run with or without the key in the schema."""
from __future__ import annotations

import pytest

from mpoverlap.simulate.overlap import ep_chunks_exposed, serial_link_waits
from mpoverlap.simulate.pairing import (LayerPass, alone_exposed, apply_pairing, backward_program, forward_program,
                                        pair_exposed, pair_program, pairing_state, round_robin)

# 1:1 per sub-step: every exchange as long as the compute sub-step it runs beside. Forward:
# pre-dispatch 1, experts 1, dispatch 1, combine 1; backward: compute twice the forward's
# (pre 2, experts 2), its reverse exchanges as long as the forward's.
FWD = LayerPass(pre=1.0, experts=1.0, dispatch=1.0, combine=1.0)
BWD = LayerPass(pre=2.0, experts=2.0, dispatch=1.0, combine=1.0)


def test_serial_link_waits_per_transfer():
    # A (3) and B (2) issued at 0: link A 0-3, B 3-5; 4 of compute; A waited 0, B 1
    prog = [("issue", "A", 3.0), ("issue", "B", 2.0), ("compute", 4.0), ("wait", "A"), ("wait", "B")]
    assert serial_link_waits(prog) == pytest.approx({"A": 0.0, "B": 1.0})


def test_pair_hides_everything_at_one_to_one_in_megatrons_order():
    # One layer, whole exchanges, B first (the executor's order). B's reverse combine 0-1 under
    # F's pre-dispatch 0-1; F's dispatch 1-2 under B's experts backward 1-3; B's reverse
    # dispatch 3-4 under F's experts 3-4; F's combine 4-5 under B's pre-dispatch backward 4-6.
    # Nothing waited: the pair takes its compute, 6.
    assert pair_exposed([FWD], [BWD], 1) == pytest.approx({"F": 0.0, "B": 0.0})
    # Two layers: B's C1 0-1 under F's pre0 0-1; F's D0 1-2 under B's E1 1-3; B's D1 3-4 under
    # F's E0 3-4; F's C0 4-5 under B's pre1 4-6; B's C0 6-7 under F's pre1 6-7; F's D1 7-8 under
    # B's E0 7-9; B's D0 9-10 under F's E1 9-10; F's C1 10-11 under B's pre0 10-12.
    assert pair_exposed([FWD, FWD], [BWD, BWD], 1) == pytest.approx({"F": 0.0, "B": 0.0})
    total = sum(step[1] for step in pair_program([FWD, FWD], [BWD, BWD], 1) if step[0] == "compute")
    assert total == pytest.approx(12.0)  # 2 x (1 + 1 + 2 + 2), and the pair takes 12
    assert pair_exposed([FWD] * 8, [BWD] * 8, 1) == pytest.approx({"F": 0.0, "B": 0.0})
    assert pair_exposed([FWD, FWD], [BWD, BWD], 2) == pytest.approx({"F": 0.0, "B": 0.0})
    # The head backward (1) and the head (0.5) only shift it: B's head 0-1, C 1-2 under F's
    # pre 1-2, D 2-3 under B's E 2-4, B's D 4-5 under F's E 4-5, F's C 5-6 under B's pre 5-7.
    assert pair_exposed([FWD], [BWD], 1, other_f=0.5, other_b=1.0) == pytest.approx({"F": 0.0, "B": 0.0})
    # A forward-first order exposes the pair's edges, 1 + 1: F's first dispatch 1-2
    # beside nothing of B's (its head backward is 0), B's last reverse dispatch with F done.
    old = serial_link_waits(round_robin(forward_program([FWD, FWD], 1), backward_program([BWD, BWD], 1)))
    assert sum(w for n, w in old.items() if n.startswith("F:")) == pytest.approx(1.0)
    assert sum(w for n, w in old.items() if n.startswith("B:")) == pytest.approx(1.0)


def test_pair_exposes_what_its_exchanges_exceed_the_compute_by():
    # One layer, exchanges 2 (twice the forward's sub-steps). B's C 0-2; F's pre 0-1, its
    # counts exchange (0 long) queues behind C: waited 1 (1-2), D 2-4; B waits C 0 at 2, E 2-4,
    # D_b 4-6; F waits D 0 at 4, E 4-5, C 6-8 behind D_b; B waits D_b 1 (5-6), pre 6-8; F
    # waits C 0 at 8.
    fwd = LayerPass(pre=1.0, experts=1.0, dispatch=2.0, combine=2.0)
    bwd = LayerPass(pre=2.0, experts=2.0, dispatch=2.0, combine=2.0)
    assert pair_exposed([fwd], [bwd], 1) == pytest.approx({"F": 1.0, "B": 1.0})


def test_counts_exchange_queues_behind_the_other_microbatchs_exchange():
    # Two layers, F's pre-dispatch 0.5 with a 0.25 counts exchange before each dispatch. B's C1
    # 0-1; F's pre0 0-0.5, its counts queue behind C1: 1-1.25 (waited 0.75), D0 1.25-2.25 under
    # B's E1 1.25-3.25; B's D1 3.25-4.25 under F's E0 3.25-4.25; F's C0 4.25-5.25 under B's
    # pre1 4.25-6.25; B's C0 6.25-7.25; F's pre1 6.25-6.75, counts queue behind C0: 7.25-7.5
    # (waited 0.75), D1 7.5-8.5 under B's E0 7.5-9.5; B's D0 9.5-10.5 under F's E1; F's C1
    # 10.5-11.5 under B's pre0 10.5-12.5.
    fwd = LayerPass(pre=0.5, experts=1.0, dispatch=1.0, combine=1.0, counts=0.25)
    assert pair_exposed([fwd, fwd], [BWD, BWD], 1) == pytest.approx({"F": 0.75 + 0.75, "B": 0.0})


def test_lone_passes_as_the_executor_runs_them():
    # Alone, whole exchanges: nothing under them. Forward: D 1-2 waited 1, C 3-4 waited 1;
    # backward: reverse combine 0-1 waited, experts 1-3, reverse dispatch 3-4 waited.
    assert alone_exposed([FWD], [BWD], 1) == pytest.approx({"F": 2.0, "B": 2.0})
    # Two chunks: the forward's first dispatch chunk and last combine chunk (0.5 each) are
    # exposed, as with the chunked overlap alone; the backward waits all its reverse combines
    # before the experts' backward (one autograd call) and all its reverse dispatches after:
    # nothing hidden.
    assert alone_exposed([FWD], [BWD], 2) == pytest.approx({"F": 1.0, "B": 2.0})


def test_chunks_alone_leave_the_first_dispatch_and_last_combine_exposed():
    # The chunked overlap alone, forward, 1:1 (dispatch 1, combine 1, experts 1), 2 chunks: D0 0-0.5
    # waited at once (0.5 exposed), D1 0.5-1 under E0 0.5-1; C0 1-1.5 under E1 1-1.5; C1
    # 1.5-2 waited at 1.5 (0.5). 1 of 2 exposed.
    assert ep_chunks_exposed(1.0, 1.0, 1.0, 2) == pytest.approx(1.0)
    # 1 chunk: nothing under anything: 2 of 2
    assert ep_chunks_exposed(1.0, 1.0, 1.0, 1) == pytest.approx(2.0)


def test_step_averages_the_unpaired_passes_and_the_pairs():
    """apply_pairing on a hand-made cost: 4 microbatches, whole exchanges; alone the forward
    and the backward expose 2 each, a pair 0 + 0 (above): per microbatch (2 + 3 x 0) / 4 = 0.5
    forward and backward; the step's ep exposed 4 x 1 = 4 = 2 + 2 + 3 x 0."""
    from mpoverlap.simulate.costs import ChunkCost

    cost = ChunkCost()
    cost.compute = {"F": 2.0, "B": 4.0}  # the layer's compute: nothing outside it
    cost.exposed = {"F": {"ep": 9.0}, "B": {"ep": 9.0}}  # the chunked overlap's: replaced
    cost.layers = {"F": [FWD], "B": [BWD]}
    x = apply_pairing(cost, 4, 1)
    assert x == pytest.approx({"F": 0.0, "B": 0.0, "F_alone": 2.0, "B_alone": 2.0})
    assert cost.exposed["F"]["ep"] == pytest.approx(0.5) and cost.exposed["B"]["ep"] == pytest.approx(0.5)


@pytest.mark.parametrize("pp,vpp,ep,on,micro,applies", [
    (1, 1, 2, True, 4, True), (1, 1, 2, True, 1, False), (2, 1, 2, True, 4, False), (1, 2, 2, True, 4, False),
    (1, 1, 1, True, 4, False), (1, 1, 2, False, 4, False)])
def test_where_pairing_applies(pp, vpp, ep, on, micro, applies):
    from types import SimpleNamespace

    from mpoverlap.simulate.plain import Plain

    for value in ("true", "auto", True):
        cfg = SimpleNamespace(overlap=Plain(ep_pairing=value))
        got, why = pairing_state(cfg, pp, vpp, ep, on, micro)
        assert got is applies, why
    for cfg in (SimpleNamespace(overlap=Plain(ep_pairing="false")), SimpleNamespace(overlap=Plain())):
        assert pairing_state(cfg, pp, vpp, ep, on, micro)[0] is False  # off, or a build without the key


def _moe(*extra):
    from mpoverlap.config import compose

    return compose(["model=moe_tiny", "parallel.world_size=2", "parallel.ep=2", "overlap.ep=true",
                    "hardware=h100_sxm", "train.micro_batch_size=2", "train.global_batch_size=16", *extra])


def _with_pairing(cfg, value):
    from mpoverlap.simulate.plain import plain, with_values

    return with_values(plain(cfg), {"overlap.ep_pairing": value})


def test_simulated_step_with_pairing():
    """moe_tiny, ep 2 (dp 2), 4 microbatches, on the h100 preset (no CPU cost of hidden
    communication): with pairing the step's ep exposed is the unpaired forward and backward
    plus 3 pairs, the step changed by exactly the change in exposed ep, a pair exposing less
    than the two passes alone."""
    from mpoverlap.simulate import from_config, simulate

    base = _moe()
    hw = from_config(base)
    off, on = simulate(_with_pairing(base, "false"), hw), simulate(_with_pairing(base, "true"), hw)
    x = on.ep_pairing_exposed
    assert on.ep_pairing.startswith("on") and off.ep_pairing.startswith("off") and off.ep_pairing_exposed == {}
    assert on.exposed_s["ep"] == pytest.approx(x["F_alone"] + x["B_alone"] + 3 * (x["F"] + x["B"]))
    assert x["F"] + x["B"] < x["F_alone"] + x["B_alone"]
    # in flight: the counts exchanges' calls join it (one all-to-all step's latency per MoE layer
    # and microbatch), and the exposed stays within it
    layers, lat = base.model.num_layers, hw.intra.latency
    assert on.in_flight_s["ep"] == pytest.approx(off.in_flight_s["ep"] + 4 * layers * lat)
    assert on.exposed_s["ep"] <= on.in_flight_s["ep"]
    assert off.step_s - on.step_s == pytest.approx(off.exposed_s["ep"] - on.exposed_s["ep"])
    # one microbatch per rank: nothing to pair
    one = _moe("train.global_batch_size=4")
    assert simulate(_with_pairing(one, "true"), hw).step_s == pytest.approx(simulate(one, hw).step_s)


def test_simulate_cli_shows_pairing(capsys):
    from mpoverlap.check import main
    from mpoverlap.config import ConfigError, compose

    try:
        compose(["overlap.ep_pairing=true"])
        key = "overlap.ep_pairing"
    except ConfigError:  # a build without the key: the simulator reads it defensively
        key = "+overlap.ep_pairing"
    args = ["--simulate", "hardware=h100_sxm", "model=moe_tiny", "parallel.world_size=2", "parallel.ep=2",
            "train.micro_batch_size=2", "train.global_batch_size=16"]
    assert main(args + [f"{key}=true"]) == 0
    out = capsys.readouterr().out
    assert "ep forward/backward pairing (overlap.ep_pairing): on: microbatch 0's forward alone, 3" in out
    assert "ep exposed per pair" in out


@pytest.mark.parametrize("kind,pp,vpp,m", [("interleaved", 2, 2, 8), ("zb1p", 2, 2, 8), ("zbv", 2, 2, 8),
                                           ("interleaved", 4, 2, 8), ("zb1p", 4, 2, 8), ("zbv", 4, 2, 8)])
def test_engine_runs_a_paired_table_as_the_timed_table(kind, pp, vpp, m):
    """At pp > 1 the simulator's pipeline engine runs the paired table (engine.run_pipeline's
    `pair_duration`): with free p2p and fixed costs every compute starts and ends where the
    tables' own timed run (program.simulate_compute, which validate.py and the W placement use)
    puts it; a pair's F part starts at the pair's start, its B part ends at the pair's end."""
    from mpoverlap.pipeline import chunk_layout, compute_orders
    from mpoverlap.pipeline.program import simulate_compute
    from mpoverlap.pipeline.schedules import paired_forwards
    from mpoverlap.simulate.engine import run_pipeline

    F, B, W = 1.0, 1.5, 0.7  # distinct, so a part timed as the other shows
    cost = {"F": F, "B": B, "W": W}
    orders = compute_orders(kind, pp, vpp, m, pairing=True)
    paired = paired_forwards(kind, pp, vpp, m)
    has_w = any(k == "W" for o in orders for k, _, _ in o)
    ref = simulate_compute(orders, pp, vpp, F, B, W if has_w else 0.0, chunk_layout(kind), paired=paired)
    run = run_pipeline(pp, vpp, m, lambda k, c: cost[k], lambda a, b: 0.0, True, schedule=kind,
                       pair_duration=lambda f, b: (F, B))
    assert sum(role == 1 for s in run.pairs for role, _ in s) == sum(len(p) for p in paired) > 0
    for stage in range(pp):
        assert run.orders[stage] == [tuple(a) for a in orders[stage]]
        for (role, _), (start, end), (r_start, r_end) in zip(run.pairs[stage], run.times[stage], ref[stage]):
            if role != 2:
                assert start == pytest.approx(r_start)
            if role != 1:
                assert end == pytest.approx(r_end)


def _moe_pp(schedule, *extra):
    from mpoverlap.config import compose

    # a CPU-like rate (1e11 FLOP/s, no memory-bound term) and link (250 MB/s): exchanges about
    # as long as the experts, one dispatch chunk (the pairing hides them, nothing else does)
    return compose(["model=moe_tiny", "parallel.world_size=4", "parallel.pp=2", "parallel.vpp=2", "parallel.ep=2",
                    "overlap.ep=true", "overlap.ep_chunks=1", "overlap.pp=true", "model.tie_embeddings=false",
                    f"parallel.pp_schedule={schedule}", "hardware=h100_sxm", "hardware.peak_flops=1e11",
                    "hardware.hbm_bw=0", "hardware.inter_bw=2.5e8", "hardware.intra_bw=2.5e8",
                    "train.micro_batch_size=2", "train.global_batch_size=32", *extra])


@pytest.mark.parametrize("schedule", ["interleaved", "zb1p", "zbv"])
def test_simulated_pipeline_step_with_pairing(schedule):
    """moe_tiny at pp 2 x vpp 2 x dp 2 x ep 2, 8 microbatches, exchanges : experts about 1:1: the
    paired table is simulated (its line says so and counts the critical stage's pairs); its ep
    exposed is the stage's pairs and lone passes (the counts of its table times the per-pair and
    per-lone-pass figures), within the ep in flight and well below the unpaired table's (which
    hides nothing at one chunk); the step shorter."""
    from mpoverlap.pipeline import compute_orders
    from mpoverlap.pipeline.schedules import paired_forwards
    from mpoverlap.simulate import from_config, simulate

    base = _moe_pp(schedule)
    hw = from_config(base)
    off, on = simulate(_with_pairing(base, "false"), hw), simulate(_with_pairing(base, "true"), hw)
    assert off.ep_pairing.startswith("off") and off.ep_pairing_exposed == {}
    assert on.ep_pairing.startswith(f"on: the paired {schedule} table"), on.ep_pairing
    assert f"pairs on stage {on.critical_stage}" in on.ep_pairing
    x = on.ep_pairing_exposed
    assert x["F"] + x["B"] < x["F_alone"] + x["B_alone"]
    order = compute_orders(schedule, 2, 2, 8, pairing=True)[on.critical_stage]
    pairs = len(paired_forwards(schedule, 2, 2, 8)[on.critical_stage])
    lone = {k: sum(kind == k for kind, _, _ in order) - pairs for k in ("F", "B")}
    assert on.exposed_s["ep"] == pytest.approx(pairs * (x["F"] + x["B"]) + lone["F"] * x["F_alone"]
                                               + lone["B"] * x["B_alone"])
    assert off.exposed_s["ep"] == pytest.approx(off.in_flight_s["ep"])
    assert 0 < on.exposed_s["ep"] <= on.in_flight_s["ep"]
    assert on.exposed_s["ep"] < 0.7 * off.exposed_s["ep"]
    assert on.step_s < off.step_s
