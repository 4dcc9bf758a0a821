"""The simulator's model of EP forward/backward pairing (mpoverlap/simulate/pairing.py, issue 31):
one pair's program by hand, in the executor's order (1:1 compute and exchanges per sub-step:
only the pair's edges exposed, the first forward dispatch and the last reverse dispatch; the
counts exchange queued behind the other microbatch's exchange), the lone first forward and last
backward, chunking alone, the step's average over the unpaired passes and the pairs, where
pairing does not apply, and `mpoverlap-check --simulate`'s line. The switch is handed over explicitly (a Plain config copy
with `overlap.ep_pairing` set), so these tests run with or without the key in the schema."""
from __future__ import annotations

import pytest

from mpoverlap.simulate.overlap import ep_chunks_exposed, serial_link_waits
from mpoverlap.simulate.pairing import (LayerPass, alone_exposed, apply_pairing, pair_exposed, pair_program,
                                        pairing_state)

# 1:1 per sub-step: every exchange as long as the compute sub-step it runs beside. Forward:
# pre-dispatch 1, experts 1, dispatch 1, combine 1; backward: compute twice the forward's
# (pre 2, experts 2), its reverse exchanges as long as the forward's.
FWD = LayerPass(pre=1.0, experts=1.0, dispatch=1.0, combine=1.0)
BWD = LayerPass(pre=2.0, experts=2.0, dispatch=1.0, combine=1.0)


def test_serial_link_waits_per_transfer():
    # A (3) and B (2) issued at 0: link A 0-3, B 3-5; 4 of compute; A waited 0, B 1
    prog = [("issue", "A", 3.0), ("issue", "B", 2.0), ("compute", 4.0), ("wait", "A"), ("wait", "B")]
    assert serial_link_waits(prog) == pytest.approx({"A": 0.0, "B": 1.0})


def test_pair_hides_all_but_its_edges_at_one_to_one():
    # One layer, whole exchanges, F first (the executor's order). F's pre-dispatch 0-1, its
    # dispatch 1-2 with nothing of B's beside it (B's head backward is 0): F waits 1. B's
    # reverse combine 2-3 under F's experts 2-3; F's combine 3-4 under B's experts 3-5; B's
    # reverse dispatch 5-6 with F done: B waits 1, then its pre-dispatch 6-8.
    assert pair_exposed([FWD], [BWD], 1) == pytest.approx({"F": 1.0, "B": 0.0 + 1.0})
    # Two layers: the middle hides. F: pre 0-1, D0 1-2 (waited 1), E0 2-3, C0 3-4; B: C1 2-3,
    # E1 3-5, D1 5-6 under F's C0 wait and pre1 5-6; F's D1 6-7 under B's pre 6-8; B's C0 8-9
    # under F's E1 8-9; F's C1 9-10 under B's E0 9-11; B's D0 11-12 alone: waited 1. Still 1 + 1.
    assert pair_exposed([FWD, FWD], [BWD, BWD], 1) == pytest.approx({"F": 1.0, "B": 1.0})
    total = sum(step[1] for step in pair_program([FWD, FWD], [BWD, BWD], 1) if step[0] == "compute")
    assert total == pytest.approx(12.0)  # 2 x (1 + 1 + 2 + 2); the pair takes 14
    # The steady state between the edges hides everything: 8 layers still expose 1 + 1, of
    # 8 x 4 exchanges in flight
    assert pair_exposed([FWD] * 8, [BWD] * 8, 1) == pytest.approx({"F": 1.0, "B": 1.0})
    # B's head backward (1) covers F's first dispatch; F's head (0.5) half of B's last dispatch:
    # D 1-2 under B's head 1-2; C_b 2-3 under E_f 2-3; C_f 3-4 under E_b 3-5; D_b 5-6 under
    # F's head 5-5.5: B waits 0.5.
    assert pair_exposed([FWD], [BWD], 1, other_f=0.5, other_b=1.0) == pytest.approx({"F": 0.0, "B": 0.5})


def test_counts_exchange_queues_behind_the_other_microbatchs_exchange():
    # Two layers, F's pre-dispatch 0.5 with a 0.25 counts exchange before each dispatch. F: pre
    # 0-0.5, counts 0.5-0.75 (waited 0.25), D0 0.75-1.75 (waited 1); B's C1 1.75-2.75 under
    # E0 1.75-2.75; C0 2.75-3.75 under B's E1 2.75-4.75; B's D1 4.75-5.75; F's pre1 4.75-5.25,
    # then its counts queue behind D1: 5.75-6 (waited 0.75); D1 6-7 under B's pre 6-8; B's C0
    # 8-9, F's E1 8-9, C1 9-10, B's E0 9-11, D0 11-12 waited 1.
    fwd = LayerPass(pre=0.5, experts=1.0, dispatch=1.0, combine=1.0, counts=0.25)
    assert pair_exposed([fwd, fwd], [BWD, BWD], 1) == pytest.approx({"F": 0.25 + 1.0 + 0.75, "B": 1.0})


def test_lone_passes_as_the_executor_runs_them():
    # Alone, whole exchanges: nothing under them. Forward: D 1-2 waited 1, C 3-4 waited 1;
    # backward: reverse combine 0-1 waited, experts 1-3, reverse dispatch 3-4 waited.
    assert alone_exposed([FWD], [BWD], 1) == pytest.approx({"F": 2.0, "B": 2.0})
    # Two chunks: the forward's first dispatch chunk and last combine chunk (0.5 each) are
    # exposed, as with today's chunked overlap; the backward waits all its reverse combines
    # before the experts' backward (one autograd call) and all its reverse dispatches after:
    # nothing hidden.
    assert alone_exposed([FWD], [BWD], 2) == pytest.approx({"F": 1.0, "B": 2.0})


def test_chunks_alone_leave_the_first_dispatch_and_last_combine_exposed():
    # Today's overlap, forward, 1:1 (dispatch 1, combine 1, experts 1), 2 chunks: D0 0-0.5
    # waited at once (0.5 exposed), D1 0.5-1 under E0 0.5-1; C0 1-1.5 under E1 1-1.5; C1
    # 1.5-2 waited at 1.5 (0.5). 1 of 2 exposed.
    assert ep_chunks_exposed(1.0, 1.0, 1.0, 2) == pytest.approx(1.0)
    # 1 chunk: nothing under anything: 2 of 2
    assert ep_chunks_exposed(1.0, 1.0, 1.0, 1) == pytest.approx(2.0)


def test_step_averages_the_unpaired_passes_and_the_pairs():
    """apply_pairing on a hand-made cost: 4 microbatches, whole exchanges; alone the forward
    and the backward expose 2 each, a pair 1 + 1 (above): per microbatch (2 + 3 x 1) / 4 = 1.25
    forward and backward; the step's ep exposed 4 x 2.5 = 10 = 2 + 2 + 3 x 2."""
    from mpoverlap.simulate.costs import ChunkCost

    cost = ChunkCost()
    cost.compute = {"F": 2.0, "B": 4.0}  # the layer's compute: nothing outside it
    cost.exposed = {"F": {"ep": 9.0}, "B": {"ep": 9.0}}  # today's overlap: replaced
    cost.layers = {"F": [FWD], "B": [BWD]}
    x = apply_pairing(cost, 4, 1)
    assert x == pytest.approx({"F": 1.0, "B": 1.0, "F_alone": 2.0, "B_alone": 2.0})
    assert cost.exposed["F"]["ep"] == pytest.approx(1.25) and cost.exposed["B"]["ep"] == pytest.approx(1.25)


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
