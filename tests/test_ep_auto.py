"""overlap.ep=auto and overlap.ep_chunks=auto by the simulator's prediction (simulate/ep_choice.py):
on only where the predicted step with chunked EP overlap is faster than without, the chunk count
the fastest predicted one; the plan's reason gives the predicted figures; true forces, explicit
chunk counts are honoured. Each expectation is checked against the simulator run directly on
the configs with both keys set explicitly."""
from __future__ import annotations

import re

import pytest

from mpoverlap.config import compose
from mpoverlap.overlap.config import CommOverlapConfig, ep_chunks
from mpoverlap.overlap.plan import render_plan
from mpoverlap.simulate.core import simulate
from mpoverlap.simulate.ep_choice import CANDIDATE_CHUNKS, choose, decision_hardware, pinned

# ep 2 of moe_tiny, 2 microbatches on an H100 node: latency-bound, every chunk only adds exchanges
SMALL = (["model=moe_tiny", "parallel.dp=2", "parallel.ep=2"], 2)
# ep 8 of moe_350m, 1 microbatch on an H100 node: the experts hide part of the exchanges
LARGE = (["model=moe_350m", "parallel.dp=8", "parallel.ep=8"], 8)


def _step(overrides, world, on, chunks):
    cfg = compose(overrides)
    return simulate(pinned(cfg, on, chunks), decision_hardware(cfg), world).step_s


def _ms(seconds):
    ms = seconds * 1e3
    return f"{ms:.3f} ms" if ms < 10 else f"{ms:,.1f} ms"


@pytest.mark.parametrize("layout", [SMALL, LARGE], ids=["small_ep_loss", "large_ep_gain"])
def test_auto_is_on_exactly_where_the_simulator_predicts_a_gain(layout):
    overrides, world = layout
    off = _step(overrides, world, False, 1)
    on = {k: _step(overrides, world, True, k) for k in CANDIDATE_CHUNKS}
    best = min(on, key=lambda k: (on[k], k))
    gain = on[best] < off
    assert gain == (layout is LARGE)  # the two layouts are what they claim to be
    state = CommOverlapConfig.from_config(compose(overrides), world).ep
    assert state.requested == "auto" and state.enabled == gain
    # the reason carries both predicted steps and the layout
    assert _ms(off) in state.reason and _ms(on[best]) in state.reason
    assert f"at ep {compose(overrides).parallel.ep}" in state.reason and "h100_sxm" in state.reason
    assert state.reason.startswith("token dispatch" if gain else "off: predicted")
    # ep_chunks=auto: the fastest predicted count with overlap on, 1 with it off
    assert ep_chunks(compose(overrides), world) == (best if gain else 1)


def test_plan_lines_give_the_predicted_figures():
    overrides, world = LARGE
    plan = render_plan(compose(overrides), world)
    ep_line = next(line for line in plan.splitlines() if "overlap.ep " in line)
    chunks_line = next(line for line in plan.splitlines() if "overlap.ep_chunks" in line)
    assert "auto -> ON" in ep_line and re.search(r"predicted [\d.,]+ ms a step with chunked EP overlap", ep_line)
    for k in CANDIDATE_CHUNKS:
        assert f"{k}: {_ms(_step(overrides, world, True, k))}" in chunks_line


def test_true_forces_and_auto_chunks_pick_the_fastest_with_overlap_on():
    overrides, world = SMALL
    forced = [*overrides, "overlap.ep=true"]
    assert CommOverlapConfig.from_config(compose(forced), world).ep.enabled
    on = {k: _step(overrides, world, True, k) for k in CANDIDATE_CHUNKS}
    assert ep_chunks(compose(forced), world) == min(on, key=lambda k: (on[k], k))
    off = [*overrides, "overlap.ep=false"]
    assert not CommOverlapConfig.from_config(compose(off), world).ep.enabled
    assert ep_chunks(compose(off), world) == 1


def test_explicit_chunks_are_honoured_and_auto_compares_at_them():
    overrides, world = LARGE
    two = [*overrides, "overlap.ep_chunks=8"]
    assert ep_chunks(compose(two), world) == 8
    on, off = _step(overrides, world, True, 8), _step(overrides, world, False, 8)
    state = CommOverlapConfig.from_config(compose(two), world).ep
    assert state.enabled == (on < off) and _ms(on) in state.reason and _ms(off) in state.reason


def test_simulate_runs_what_auto_resolves_on_the_hardware_it_is_given():
    overrides, world = LARGE
    cfg = compose(overrides)
    hw = decision_hardware(cfg)
    c = choose(cfg, world, hw)
    assert simulate(cfg, hw, world).step_s == pytest.approx(simulate(pinned(cfg, c.enabled, c.chunks), hw, world).step_s)
    # a link 100x slower: the decision follows the hardware passed in, not the config's preset
    from dataclasses import replace

    slow = replace(hw, intra=replace(hw.intra, bandwidth=hw.intra.bandwidth / 100),
                   inter=replace(hw.inter, bandwidth=hw.inter.bandwidth / 100))
    s = choose(cfg, world, slow)
    steps = {(on, k): simulate(pinned(cfg, on, k), slow, world).step_s for on, k in
             [(False, 1)] + [(True, k) for k in CANDIDATE_CHUNKS]}
    best_on = min((k for on, k in steps if on), key=lambda k: (steps[(True, k)], k))
    assert s.enabled == (steps[(True, best_on)] < steps[(False, 1)])
    assert s.chunks == (best_on if s.enabled else 1)
    assert (s.enabled, s.chunks) != (c.enabled, c.chunks)  # the slow link changes the decision
    assert simulate(cfg, slow, world).step_s == pytest.approx(steps[(s.enabled, s.chunks)])


def test_measured_without_rates_decides_on_the_stated_figures_and_says_so():
    overrides, world = SMALL
    state = CommOverlapConfig.from_config(compose([*overrides, "hardware=measured"]), world).ep
    assert "hardware=measured's stated figures" in state.reason and "no measured rates" in state.reason


def test_pairing_auto_follows_ep_auto():
    overrides, world = SMALL
    # a 1 ms collective step: pairing's extra exchanges in flight cost more than they hide
    slow = [*overrides, "hardware.intra_latency=1e-3", "hardware.inter_latency=1e-3"]
    for layout, gain in ((slow, False), (overrides, True)):
        cfg = compose([*layout, "overlap.ep_pairing=auto"])
        # `on` is EP overlap with pairing as auto resolves it then (on here: 2 microbatches, pp 1)
        paired = CommOverlapConfig.from_config(compose([*layout, "overlap.ep_pairing=auto", "overlap.ep=true",
                                                        "overlap.ep_chunks=1"]), world)
        assert paired.ep_pairing.enabled
        on = simulate(pinned(cfg, True, 1), decision_hardware(cfg), world).step_s
        off = simulate(pinned(cfg, False, 1), decision_hardware(cfg), world).step_s
        assert (on < off) == gain
        ov = CommOverlapConfig.from_config(cfg, world)
        assert ov.ep.enabled == gain and ov.ep_pairing.enabled == gain
        if not gain:
            assert ov.ep_pairing.reason.startswith("overlap.ep=auto resolved off") and _ms(off) in ov.ep_pairing.reason
    # pairing asked for: EP overlap is needed, so auto resolves on
    ov = CommOverlapConfig.from_config(compose([*overrides, "overlap.ep_pairing=true"]), world)
    assert ov.ep.enabled and ov.ep_pairing.enabled and "overlap.ep_pairing=true" in ov.ep.reason
