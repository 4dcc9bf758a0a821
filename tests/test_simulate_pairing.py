"""The simulator's model of EP forward/backward pairing (mpoverlap/simulate/pairing.py, issue 31):
one pair's program by hand (1:1 compute and exchanges per sub-step: nothing exposed; a dispatch
longer than its cover: the difference), chunking alone by hand, the step's average over the
unpaired first forward / last backward and the pairs, where pairing does not apply, and
`mpoverlap-check --simulate`'s line. The switch is handed over explicitly (a Plain config copy
with `overlap.ep_pairing` set), so these tests run with or without the key in the schema."""
from __future__ import annotations

import pytest

from mpoverlap.simulate.overlap import ep_chunks_exposed, serial_link_waits
from mpoverlap.simulate.pairing import LayerPass, apply_pairing, pair_exposed, pair_program, pairing_state

# 1:1 per sub-step: every exchange as long as the compute sub-step it runs beside. Forward:
# pre-dispatch 1, experts 1, dispatch 1, combine 1; backward: compute twice the forward's
# (pre 2, experts 2), its reverse exchanges as long as the forward's.
FWD = LayerPass(pre=1.0, experts=1.0, dispatch=1.0, combine=1.0)
BWD = LayerPass(pre=2.0, experts=2.0, dispatch=1.0, combine=1.0)


def test_serial_link_waits_per_transfer():
    # A (3) and B (2) issued at 0: link A 0-3, B 3-5; 4 of compute; A waited 0, B 1
    prog = [("issue", "A", 3.0), ("issue", "B", 2.0), ("compute", 4.0), ("wait", "A"), ("wait", "B")]
    assert serial_link_waits(prog) == pytest.approx({"A": 0.0, "B": 1.0})


def test_one_to_one_pair_hides_every_exchange():
    # One layer, whole exchanges. Link: B's combine 0-1 (under F's pre-dispatch 0-1); F's
    # dispatch 1-2 (under B's experts 1-3); B's dispatch 3-4 (issued at 3, under F's experts
    # 3-4); F's combine 4-5 (under B's pre-dispatch 4-6). Every wait finds its exchange done.
    assert pair_exposed([FWD], [BWD], 1) == pytest.approx({"F": 0.0, "B": 0.0})
    # Two chunks each: B's combines 0-0.5, 0.5-1; F's dispatches 1-1.5, 1.5-2; B's experts
    # 1-2, 2-3 issue its dispatches 2-2.5, 3-3.5; F's experts 3-3.5, 3.5-4 (dispatches long
    # done) issue combines 3.5-4, 4-4.5; B's pre-dispatch 4-6. Nothing waits.
    assert pair_exposed([FWD], [BWD], 2) == pytest.approx({"F": 0.0, "B": 0.0})
    # Two layers: the second pair starts at 6; F's layer-0 combine (done at 5) is ready for its
    # layer 1; the same four exchanges at 6-7, 7-8, 9-10, 10-11 under 6-7, 7-9, 9-10, 10-12.
    assert pair_exposed([FWD, FWD], [BWD, BWD], 1) == pytest.approx({"F": 0.0, "B": 0.0})
    total = sum(step[1] for step in pair_program([FWD, FWD], [BWD, BWD], 1) if step[0] == "compute")
    assert total == pytest.approx(12.0)  # 2 x (1 + 1 + 2 + 2): the pair's step is its compute


def test_pair_exposes_what_the_other_microbatch_cannot_cover():
    # F's dispatch 3 (not 1): link B's combine 0-1, F's dispatch 1-4; B's experts 1-3; B's
    # dispatch queued behind it, 4-5; F waits its dispatch 3-4 (1 exposed), experts 4-5,
    # combine 5-6; B's dispatch done at 5 when waited at 5; B's pre-dispatch 5-7.
    slow = LayerPass(pre=1.0, experts=1.0, dispatch=3.0, combine=1.0)
    assert pair_exposed([slow], [BWD], 1) == pytest.approx({"F": 1.0, "B": 0.0})
    # The backward's compute before its layers (the head's backward, 1) delays B's combine:
    # link 1-2, F's pre-dispatch 1-2, F's dispatch 2-3, B's experts 2-4, B's dispatch 4-5,
    # F's experts 4-5, combine 5-6, B's dispatch waited at 5, pre 5-7, F's head at 7.
    assert pair_exposed([FWD], [BWD], 1, other_f=0.5, other_b=1.0) == pytest.approx({"F": 0.0, "B": 0.0})


def test_chunks_alone_leave_the_first_dispatch_and_last_combine_exposed():
    # Today's overlap, forward, 1:1 (dispatch 1, combine 1, experts 1), 2 chunks: D0 0-0.5
    # waited at once (0.5 exposed), D1 0.5-1 under E0 0.5-1; C0 1-1.5 under E1 1-1.5; C1
    # 1.5-2 waited at 1.5 (0.5). 1 of 2 exposed.
    assert ep_chunks_exposed(1.0, 1.0, 1.0, 2) == pytest.approx(1.0)
    # 1 chunk: nothing under anything: 2 of 2
    assert ep_chunks_exposed(1.0, 1.0, 1.0, 1) == pytest.approx(2.0)


def test_step_averages_the_unpaired_passes_and_the_pairs():
    """apply_pairing on a hand-made cost: 4 microbatches, unpaired forward exposes 2 and
    backward 1.5 (today's chunked overlap), a pair at 1:1 nothing: per microbatch (2 + 3 x 0)
    / 4 = 0.5 forward, 0.375 backward; the step's ep exposed 4 x 0.875 = 3.5 = 2 + 1.5."""
    from mpoverlap.simulate.costs import ChunkCost

    cost = ChunkCost()
    cost.compute = {"F": 2.0, "B": 4.0}
    cost.exposed = {"F": {"ep": 2.0}, "B": {"ep": 1.5}}
    cost.layers = {"F": [FWD], "B": [BWD]}
    x = apply_pairing(cost, 4, 1)
    assert x == pytest.approx({"F": 0.0, "B": 0.0, "F_alone": 2.0, "B_alone": 1.5})
    assert cost.exposed["F"]["ep"] == pytest.approx(0.5) and cost.exposed["B"]["ep"] == pytest.approx(0.375)


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
    plus 3 pairs, the step shorter by exactly what that hides, in-flight unchanged; the pairs
    at H100 rates leave latency-bound exchanges exposed, never more than unpaired."""
    from mpoverlap.simulate import from_config, simulate

    base = _moe()
    hw = from_config(base)
    off, on = simulate(_with_pairing(base, "false"), hw), simulate(_with_pairing(base, "true"), hw)
    x = on.ep_pairing_exposed
    assert on.ep_pairing.startswith("on") and off.ep_pairing.startswith("off") and off.ep_pairing_exposed == {}
    assert on.exposed_s["ep"] == pytest.approx(x["F_alone"] + x["B_alone"] + 3 * (x["F"] + x["B"]))
    assert off.exposed_s["ep"] == pytest.approx(4 * (x["F_alone"] + x["B_alone"]))
    assert x["F"] + x["B"] < x["F_alone"] + x["B_alone"]
    assert on.in_flight_s["ep"] == pytest.approx(off.in_flight_s["ep"])
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
