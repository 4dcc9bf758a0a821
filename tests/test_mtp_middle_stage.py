"""Multi-token prediction on a middle stage of the loop layouts (parallel.mtp_stage=s with
0 < s < pp-1, 1f1b / interleaved / zb1p): the depths are the terminal model chunk N = pp*vpp on
stage s (the layout value carries s and vpp, pipeline/actions.py `loop_mtp_layout`), their copies
of the embedding and of an untied output layer summed over the groups of the stages holding them
(parallel/grid.py mtp_* kinds, training/pipeline_ties.py). Pure checks (no processes): the tables
validate and run in the timed simulation for pp 3-4, vpp 1-2, every middle s and 1-8
microbatches; the groups hold the right stages; the rule accepts the middle stages (ZeRO-2/3
aside); the estimate counts the copies where the chunks hold them. Parity: pp 3 with the depths
on stage 1 reproduces the SINGLE-PROCESS run within 1e-5 relative (fp32) in the LM loss, the MTP
loss and the gradient norm of every step, in the final weights (copies included) and in the
validation loss: 1f1b tied and untied, zb1p untied, interleaved vpp 2 tied, dp 2 x pp 3 tied. Checkpoints resume
between pp 1 and the depths on stage 1 of pp 3, both ways."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mpoverlap.pipeline import build_schedule
from mpoverlap.pipeline.actions import (BACKWARD, FORWARD, WEIGHT, chunk_index, layout_of_tables,
                                        loop_mtp_layout, mtp_stage_of, stage_of, vchunk_of)
from mpoverlap.pipeline.schedules import _timed_run
from mpoverlap.pipeline.validate import validate_schedule

GRID = [(kind, pp, vpp, m, s) for kind, vpps in (("1f1b", (1,)), ("interleaved", (2,)), ("zb1p", (1, 2)))
        for pp in (3, 4) for vpp in vpps for m in range(1, 9) for s in range(1, pp - 1) if vpp == 1 or m >= pp]


@pytest.mark.parametrize("kind,pp,vpp,m,s", GRID)
def test_tables_with_the_mtp_chunk_on_a_middle_stage_validate_and_simulate(kind, pp, vpp, m, s):
    tables = build_schedule(kind, pp, vpp, m, mtp_chunk=True, mtp_stage=s)
    validate_schedule(tables)
    _timed_run(tables, 1, 1, 1)  # the timed run of an order with a dependency cycle never ends
    layout = layout_of_tables(tables)
    assert layout == loop_mtp_layout(s, vpp) and mtp_stage_of(layout) == s
    N = pp * vpp
    mtp = [a for a in tables[s] if a.chunk == N]
    assert all(a.vchunk == vpp for a in mtp)
    assert sorted((a.kind, a.microbatch) for a in mtp) == sorted((k, mb) for mb in range(m) for k in (FORWARD, BACKWARD))
    assert not any(a.kind == WEIGHT and a.chunk == N for a in tables[s])  # the MTP chunk's B is a full one
    head = [a for a in tables[pp - 1] if a.chunk == N - 1 and a.kind == FORWARD]
    assert all(a.send is not None and a.send.dst_chunk == N for a in head)  # the head chunk sends on
    for stage in set(range(pp)) - {s}:
        assert all(a.chunk < N for a in tables[stage])


def test_the_middle_layout_places_only_the_mtp_chunk_elsewhere():
    pp, vpp, s = 4, 2, 2
    layout = loop_mtp_layout(s, vpp)
    assert loop_mtp_layout(0, vpp) == "loop_mtp"
    for stage in range(pp):
        for v in range(vpp):
            k = chunk_index(stage, v, pp, layout)
            assert k == v * pp + stage and (stage_of(k, pp, layout), vchunk_of(k, pp, layout)) == (stage, v)
    N = pp * vpp
    assert chunk_index(s, vpp, pp, layout) == N
    assert (stage_of(N, pp, layout), vchunk_of(N, pp, layout)) == (s, vpp)


def test_the_copies_groups_hold_the_stages_of_the_copies():
    from mpoverlap.parallel.grid import RankGrid

    grid = RankGrid(tp=2, dp=2, pp=4, mtp_stage=2)
    want = {"mtp_tied": (0, 2, 3), "mtp_embedding": (0, 2), "mtp_output": (2, 3)}
    for kind, stages in want.items():
        groups = grid.groups(kind)
        assert len(groups) == grid.tp * grid.dp, kind
        for g in groups:
            cs = [grid.coords(r) for r in g]
            assert tuple(c.pp for c in cs) == stages and len({(c.tp, c.dp) for c in cs}) == 1, kind
        assert grid.group_of(kind, grid.rank(pp=1)) == []
    for s in (-1, 0, 3):  # an MTP chunk on stage 0 sums over "embedding"; none on the head's stage
        assert all(RankGrid(pp=4, mtp_stage=s).groups(k) == [] for k in want)


def test_the_ties_name_the_middle_groups():
    from mpoverlap.config import compose
    from mpoverlap.training.pipeline_glue import pipeline_ties

    for tied, want in ((True, {"embedding.weight": "mtp_tied"}),
                       (False, {"embedding.weight": "mtp_embedding", "output.weight": "mtp_output"})):
        model = compose([f"model.tie_embeddings={str(tied).lower()}", "model.mtp_num_layers=1"]).model
        assert pipeline_ties(model, 4, loop_mtp_layout(1, 1)) == want
        first = pipeline_ties(model, 4, loop_mtp_layout(0, 1))  # stage 0: the embedding group
        assert first == ({"embedding.weight": "embedding"} if tied
                         else {"embedding.weight": None, "output.weight": "embedding"})


def _problems(overrides, world):
    from mpoverlap.config import compose
    from mpoverlap.overlap import validate

    cfg = compose(["model.num_layers=8", "model.mtp_num_layers=1", "train.global_batch_size=16", *overrides])
    return [p for p in validate(cfg, world) if p.rule == "mtp.stage"]


@pytest.mark.parametrize("overrides", [
    ["parallel.pp=4", "parallel.mtp_stage=1"],
    ["parallel.pp=4", "parallel.mtp_stage=2", "parallel.vpp=2", "parallel.pp_schedule=interleaved"],
    ["parallel.pp=3", "parallel.mtp_stage=1", "parallel.pp_schedule=zb1p"],
    ["parallel.pp=4", "parallel.mtp_stage=2", "parallel.dp=2", "train.dp_sharding=optim"],
])
def test_the_rule_accepts_a_middle_stage_in_the_loop_schedules(overrides):
    world = 1
    for key in ("pp", "dp"):
        world *= next((int(o.split("=")[1]) for o in overrides if o.startswith(f"parallel.{key}=")), 1)
    assert _problems(overrides, world) == []


@pytest.mark.parametrize("overrides,world,fix", [
    (["parallel.pp=4", "parallel.mtp_stage=1", "parallel.dp=2", "train.dp_sharding=optim_grads"], 8,
     "train.dp_sharding=optim"),
    (["parallel.pp=4", "parallel.vpp=2", "parallel.pp_schedule=zbv", "parallel.mtp_stage=2"], 4,
     "parallel.mtp_stage=0"),
])
def test_the_rule_refuses_zero23_and_the_v_on_a_middle_stage(overrides, world, fix):
    bad = _problems(overrides, world)
    assert bad and fix in bad[0].fix, [p.render() for p in bad]


@pytest.mark.parametrize("tied", [True, False])
def test_the_estimate_counts_the_copies_on_the_middle_stage(tied):
    """overlap/estimate/params.py against the built chunks of pp 3 with parallel.mtp_stage=1."""
    from mpoverlap.config import compose
    from mpoverlap.models.gpt import num_parameters
    from mpoverlap.overlap.estimate.params import stage_params
    from mpoverlap.overlap.estimate.sharding import mtp_depths_on
    from mpoverlap.overlap.layout import build_layout
    from mpoverlap.training.pipeline_glue import build_chunks, schedule_layout

    cfg = compose(["model.num_layers=3", "model.seq_length=16", "model.mtp_num_layers=2",
                   f"model.tie_embeddings={str(tied).lower()}", "parallel.pp=3", "parallel.mtp_stage=1"])
    lo = build_layout(cfg, 3)
    layout = schedule_layout(cfg.parallel, 1, cfg.model, 3)
    assert layout == loop_mtp_layout(1, 1)
    for stage in range(3):
        chunks = build_chunks(cfg.model, 3, 1, stage, 1, layout=layout)
        assert len(chunks) == (2 if stage == 1 else 1) and getattr(chunks[-1], "is_mtp_chunk", False) == (stage == 1)
        assert stage_params(cfg, lo, stage) == sum(num_parameters(c) for c in chunks), stage
        assert mtp_depths_on(cfg, lo, stage) == (2 if stage == 1 else 0)


BASE = ["model=gpt_tiny", "model.num_layers=3", "model.seq_length=32", "model.mtp_num_layers=2",
        "model.mtp_loss_scale=0.3", "train.global_batch_size=8", "train.micro_batch_size=2",
        "data.max_bytes=300000", "overlap.dp_bucket_mb=0.05", "train.progress=false", "train.eval_iters=1"]
UNTIED = ["model.tie_embeddings=false"]
MIDDLE = ["parallel.pp=3", "parallel.mtp_stage=1"]
STEPS = 3
LAYOUTS = {
    "ref": (1, ["parallel.dp=1"]),
    "untied_ref": (1, [*UNTIED, "parallel.dp=1"]),
    "middle_1f1b": (3, [*MIDDLE, "parallel.dp=1"]),
    "untied_middle_1f1b": (3, [*UNTIED, *MIDDLE, "parallel.dp=1"]),
    "untied_middle_zb1p": (3, [*UNTIED, *MIDDLE, "parallel.pp_schedule=zb1p", "parallel.dp=1"]),
    "middle_dp2": (6, [*MIDDLE, "parallel.dp=2"]),
    # six layers: two chunks per stage, the MTP chunk vchunk 2 of stage 1
    "ref6": (1, ["parallel.dp=1"]),
    "middle_interleaved": (3, [*MIDDLE, "parallel.vpp=2", "parallel.pp_schedule=interleaved", "parallel.dp=1"]),
}
SIX_LAYERS = ("ref6", "middle_interleaved")
REFS = {name: ("untied_ref" if name.startswith("untied") else "ref") for name in LAYOUTS if "middle" in name}
REFS["middle_interleaved"] = "ref6"


def _base(name):
    return [o.replace("num_layers=3", "num_layers=6") for o in BASE] if name in SIX_LAYERS else BASE


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from test_mtp_stage import run_layouts

    every = {n: (w, [*_base(n), *ov]) for n, (w, ov) in LAYOUTS.items()}
    return run_layouts(tmp_path_factory.mktemp("mtp_middle"), every, STEPS)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(REFS))
def test_mtp_on_a_middle_stage_reproduces_the_single_process_run(runs, name):
    from test_mtp_stage import assert_matches_single_process

    assert_matches_single_process(runs[REFS[name]], runs[name], name, 3, tied=not name.startswith("untied"))


@pytest.mark.slow
def test_checkpoints_with_the_depths_on_a_middle_stage_resume_across_layouts(tmp_path):
    """A checkpoint written with the depths on stage 1 of pp 3 (its copies, all on stage 1, not
    written) resumes at pp 1, and one written at pp 1 resumes with the depths on stage 1 (the MTP
    chunk's copies filled from the saved embedding and output layer): each chain's LM and MTP
    losses are the uninterrupted single-process run's, within 1e-5 (untied: both copies)."""
    from test_mtp_stage import assert_resume_across_layouts

    assert_resume_across_layouts(tmp_path, BASE, 3, MIDDLE)
