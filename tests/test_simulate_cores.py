"""The simulator on a machine whose ranks share fewer CPU cores than there are ranks
(`Hardware.cores`, measured: bench.ep_pairing_pp runs 4 gloo ranks on 2 cores). Compute stretches
by how many ranks want a core at once, max(1, (1 + (N - 1) r) / cores) for a rank computing a
fraction r of the step, found as a fixed point (simulate/sharing.py); with a core per rank nothing
changes. Checked against bench.ep_pairing_pp's measurement in docs/benchmarks.md (the predicted
cores per rank beside the measured ones)."""
from __future__ import annotations

from dataclasses import replace

import pytest


def _cfg(*extra):
    """overlap.dp_bucket_mb pinned: `_simulate` below takes a resolved config, as simulate() hands
    it one (bucket_size.py chooses `auto` on the hardware given, which the cores change)."""
    from mpoverlap.config import compose

    return compose(["model=moe_tiny", "overlap.dp_bucket_mb=4", "parallel.world_size=4", "parallel.pp=2", "parallel.vpp=2", "parallel.ep=2",
                    "overlap.ep=true", "overlap.pp=true", "model.tie_embeddings=false", "parallel.pp_schedule=zbv",
                    "hardware=h100_sxm", "hardware.peak_flops=1e11", "hardware.hbm_bw=0", "hardware.inter_bw=2.5e8",
                    "hardware.intra_bw=2.5e8", "train.micro_batch_size=2", "train.global_batch_size=32", *extra])


def test_ranks_sharing_cores_stretch_compute_to_the_fixed_point():
    from mpoverlap.simulate import from_config, simulate
    from mpoverlap.simulate.core import _simulate
    from mpoverlap.simulate.sharing import slowed

    cfg = _cfg()
    hw = from_config(cfg)
    own = simulate(cfg, hw)
    assert own.core_sharing == {}
    assert simulate(cfg, replace(hw, cores=4)).step_s == own.step_s  # a core per rank: unchanged
    shared = simulate(cfg, replace(hw, cores=2))
    c = shared.core_sharing
    assert c["ranks"] == 4 and c["cores"] == 2
    # the fixed point: the stretch the run's own busy fraction asks for
    assert c["stretch"] == pytest.approx(max(1.0, (1 + 3 * c["runnable"]) / 2), rel=1e-3)
    assert 1.0 < c["stretch"] < 2.0
    # the result is the step at rates slowed by that stretch; links unchanged
    again = _simulate(cfg, slowed(replace(hw, cores=2), c["stretch"]))
    assert shared.step_s == pytest.approx(again.step_s)
    assert shared.in_flight_s["ep"] == pytest.approx(own.in_flight_s["ep"])
    assert shared.step_s > own.step_s
    # MFU against the machine's own peak
    assert shared.mfu == pytest.approx(own.mfu * own.step_s / shared.step_s, rel=1e-6)
    # one rank per core at most: 1 core, 4 ranks computing all the time would be x4; the
    # stretch never exceeds ranks / cores
    assert simulate(cfg, replace(hw, cores=1)).core_sharing["stretch"] <= 4.0


def test_measured_rates_carry_the_cores_and_with_rates_keeps_the_fewest():
    from mpoverlap.simulate.hardware import available_cores, with_rates

    cfg = _cfg()
    from mpoverlap.simulate import from_config

    hw = from_config(cfg)
    rate = {"peak_flops": 1e11, "model_flops": 5e10, "update_s_per_param": 0.0, "expert_flops": 0.0,
            "comm_cpu_s_per_byte": 0.0, "link_bytes_s": 0.0, "link_latency": 0.0, "link_efficiency": {}}
    assert with_rates(hw, cfg, [dict(rate, cores=2), dict(rate, cores=4)]).cores == 2
    assert with_rates(hw, cfg, [rate]).cores == 0  # a result from before the key: not modelled
    assert available_cores() >= 1
