"""The simulator with the MTP depths as a chunk of their own on stage 0 (parallel.mtp_stage=0 in a
loop schedule, the loop_mtp layout): their compute moves from the head's stage to stage 0, the
pipeline engine runs the tables with the MTP chunk (build_schedule's `mtp_chunk`) and its two
messages on the pp link, and the engine's timeline is the tables' own timed run."""
import pytest

from mpoverlap.config import compose
from mpoverlap.overlap.layout import build_layout

SCHEDULES = [("1f1b", 1), ("interleaved", 2), ("zb1p", 1)]


def _cfg(schedule, vpp, mtp_stage, depths=2):
    return compose(["model=gpt_tiny", "model.num_layers=4", f"model.mtp_num_layers={depths}",
                    "model.tie_embeddings=false", "parallel.world_size=2", "parallel.pp=2", f"parallel.vpp={vpp}",
                    f"parallel.pp_schedule={schedule}", f"parallel.mtp_stage={mtp_stage}", "hardware=h100_sxm",
                    "train.micro_batch_size=2", "train.global_batch_size=16"])


def _stage_compute(cfg):
    from mpoverlap.overlap.estimate.params import chunk_layout_of
    from mpoverlap.pipeline.actions import stage_of
    from mpoverlap.simulate.collectives import group_links
    from mpoverlap.simulate.costs import MODES, chunk_costs
    from mpoverlap.simulate.hardware import from_config

    lo = build_layout(cfg, 2)
    hw = from_config(cfg)
    costs = chunk_costs(cfg, lo, hw, group_links(lo, hw), {m: False for m in MODES}, 4)
    per_stage = [{"F": 0.0, "B": 0.0} for _ in range(lo.pp)]
    for chunk, cost in enumerate(costs):
        stage = 0 if chunk == lo.pp * lo.vpp else stage_of(chunk, lo.pp, chunk_layout_of(cfg, lo))
        for k in ("F", "B"):
            per_stage[stage][k] += cost.compute[k]
    return costs, per_stage


@pytest.mark.parametrize("schedule,vpp", SCHEDULES)
def test_mtp_chunk_compute_moves_to_stage_0(schedule, vpp):
    """The depths' compute (a block, eh_proj and a head each) is on the head's stage with
    mtp_stage=-1 and on stage 0's MTP chunk pp*vpp with mtp_stage=0, by the same seconds; the
    depths cost what their blocks and heads do (mtp_num_layers=0 takes them away)."""
    head, own = _stage_compute(_cfg(schedule, vpp, -1)), _stage_compute(_cfg(schedule, vpp, 0))
    _, none = _stage_compute(_cfg(schedule, vpp, -1, depths=0))
    (head_costs, at_head), (own_costs, at_own) = head, own
    assert len(own_costs) == len(head_costs) + 1 == 2 * vpp + 1
    depths = {k: own_costs[-1].compute[k] for k in ("F", "B")}
    for k in ("F", "B"):
        assert depths[k] > 0
        assert at_head[1][k] - none[1][k] == pytest.approx(depths[k])  # on the head's stage before
        assert at_own[1][k] == pytest.approx(none[1][k])  # none of it there with the MTP chunk
        assert at_own[0][k] - none[0][k] == pytest.approx(depths[k])


@pytest.mark.parametrize("schedule,vpp", SCHEDULES)
def test_simulated_step_runs_the_mtp_chunk(schedule, vpp):
    """simulate(): stage 0 runs the MTP chunk's F and B (the engine's tables hold them, and
    the head's output to it and its gradient back, two messages more per microbatch): the
    stages' mean compute is the depths on the head's stage's (the work moved, none lost; the
    update differs by the copies' parameters), above the model without depths, the step
    differs, and the closed bubble forms count the depths' work too."""
    from mpoverlap.simulate.core import simulate
    from mpoverlap.simulate.engine import _compiled
    from mpoverlap.simulate.hardware import from_config

    m = 8
    with_mtp, without = _compiled(2, vpp, m, True, schedule, False, True), _compiled(2, vpp, m, True, schedule)
    assert with_mtp.messages == without.messages + 2 * m
    runs = {}
    for stage, depths in ((-1, 2), (0, 2), (-1, 0)):
        cfg = _cfg(schedule, vpp, stage, depths)
        runs[stage, depths] = simulate(cfg, from_config(cfg), 2)
    own, head, none = runs[0, 2], runs[-1, 2], runs[-1, 0]
    assert own.avg_compute_s == pytest.approx(head.avg_compute_s, rel=2e-3)
    assert head.avg_compute_s > 1.2 * none.avg_compute_s
    assert own.step_s != pytest.approx(head.step_s, rel=1e-3)
    # the closed bubble forms' pooled per-chunk F + B + W: the depths' work counted on stage 0
    assert sum(own.bubble_forms["pooled"]) == pytest.approx(sum(head.bubble_forms["pooled"]), rel=1e-9)
    assert sum(head.bubble_forms["pooled"]) > sum(none.bubble_forms["pooled"])


@pytest.mark.parametrize("schedule,vpp", SCHEDULES + [("zb1p", 2)])
def test_engine_runs_the_mtp_chunk_as_the_timed_table(schedule, vpp):
    """With free p2p and fixed costs (the MTP chunk's its own), every compute of the engine's
    run of the loop_mtp tables starts and ends where the tables' timed run
    (program.simulate_compute on the same orders) puts it, in the same order per stage."""
    from mpoverlap.pipeline.actions import LOOP_MTP
    from mpoverlap.pipeline.program import simulate_compute
    from mpoverlap.pipeline.schedules import build_schedule
    from mpoverlap.simulate.engine import run_pipeline

    pp, m = 2, 8
    cost = {"F": 1.0, "B": 1.5, "W": 0.7}
    mtp = {"F": 0.4, "B": 0.9, "W": 0.0}  # distinct, so an MTP action timed as a main one shows
    tables = build_schedule(schedule, pp, vpp, m, mtp_chunk=True)
    orders = [[(a.kind, a.microbatch, a.vchunk) for a in t] for t in tables]
    assert sum(v == vpp for _, _, v in orders[0]) == 2 * m
    ref = simulate_compute(orders, pp, vpp, layout=LOOP_MTP,
                           cost_of=lambda k, s, v: (mtp if v == vpp else cost)[k])
    run = run_pipeline(pp, vpp, m, lambda k, c: (mtp if c == pp * vpp else cost)[k], lambda a, b: 0.0, True,
                       schedule=schedule, mtp_chunk=True)
    for stage in range(pp):
        assert run.orders[stage] == orders[stage]
        assert [t for span in run.times[stage] for t in span] == pytest.approx([t for span in ref[stage] for t in span])


@pytest.mark.parametrize("mtp_stage", [-1, 0])
def test_model_work_runs_the_depths_where_the_layout_holds_them(monkeypatch, mtp_stage):
    """measure.model_work (the measured model rate) runs the pipeline's chunks in the layout
    the schedule runs: with mtp_stage=0 the MTP chunk (h_0 in), else the depths beside the
    head, each depth once per microbatch, as flops_per_token counts them."""
    from mpoverlap.models.mtp import MTPDepth
    from mpoverlap.models.mtp_chunk import MTPChunk
    from mpoverlap.simulate.measure import model_work

    calls = {"depth": 0, "chunk": 0}
    for cls, key in ((MTPDepth, "depth"), (MTPChunk, "chunk")):
        def counted(self, *a, _forward=cls.forward, _key=key, **k):
            calls[_key] += 1
            return _forward(self, *a, **k)
        monkeypatch.setattr(cls, "forward", counted)
    work, _ = model_work(_cfg("1f1b", 1, mtp_stage), pp=2)
    work()
    assert calls == {"depth": 2, "chunk": 1 if mtp_stage == 0 else 0}
