"""Multi-token prediction on the first stage of the loop layouts (parallel.mtp_stage=0 with
1f1b, interleaved or zb1p): the depths become an extra terminal model chunk on stage 0 (the
"loop_mtp" layout, pipeline/actions.py). Pure schedule checks (no processes): the tables
with the MTP chunk validate and run in the timed simulation for every pp, vpp and microbatch
count tried. Parity: pp 2 with the depths on stage 0 reproduces the SINGLE-PROCESS run within
1e-5 relative (fp32) in the LM loss, the MTP loss and the gradient norm of every step and in the
final weights, copies included (the MTP chunk's embedding and output-layer copies equal the
originals), and in the validation loss (forward only, the LM loss alone): 1f1b tied and untied,
interleaved vpp 2, zb1p vpp 2 (the MTP chunk's B a full backward beside the W-deferred chunks),
dp 2 x pp 2, ZeRO-1, ZeRO-2 and ZeRO-3 at dp 2 x pp 2 (ZeRO-3: the dp traffic and the gathered
peak are the estimate's), and deepseek_v3_tiny (MoE depth, untied head) in 1f1b.
Checkpoints written with the depths on stage 0 resume at pp 1 and the other way round, and
checkpoint.init_from fills the MTP chunk's copies."""
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mpoverlap.pipeline import build_schedule
from mpoverlap.pipeline.actions import BACKWARD, FORWARD, LOOP_MTP, WEIGHT, layout_of_tables
from mpoverlap.pipeline.schedules import _timed_run
from mpoverlap.pipeline.validate import validate_schedule

GRID = [(kind, pp, vpp, m) for kind, vpps in (("1f1b", (1,)), ("interleaved", (2,)), ("zb1p", (1, 2)))
        for pp in (2, 3, 4) for vpp in vpps for m in (1, 2, 3, 4, 5, 8) if vpp == 1 or m >= pp]


@pytest.mark.parametrize("kind,pp,vpp,m", GRID)
def test_tables_with_the_mtp_chunk_validate_and_simulate(kind, pp, vpp, m):
    tables = build_schedule(kind, pp, vpp, m, mtp_chunk=True)
    validate_schedule(tables)
    _timed_run(tables, 1, 1, 1)
    assert layout_of_tables(tables) == LOOP_MTP
    N = pp * vpp
    mtp = [a for a in tables[0] if a.chunk == N]
    assert sorted((a.kind, a.microbatch) for a in mtp) == sorted((k, mb) for mb in range(m) for k in (FORWARD, BACKWARD))
    assert not any(a.kind == WEIGHT and a.chunk == N for a in tables[0])  # the MTP chunk's B is a full one
    head = [a for a in tables[pp - 1] if a.chunk == N - 1 and a.kind == FORWARD]
    assert all(a.send is not None and a.send.dst_chunk == N for a in head)  # the head chunk sends on
    for stage in range(1, pp):
        assert all(a.chunk < N for a in tables[stage])


def test_the_checker_sees_a_missing_mtp_backward():
    from mpoverlap.pipeline.actions import ScheduleError

    tables = build_schedule("1f1b", 2, 1, 2, mtp_chunk=True)
    broken = [list(t) for t in tables]
    broken[0] = [a for a in broken[0] if not (a.chunk == 2 and a.kind == BACKWARD and a.microbatch == 1)]
    with pytest.raises(ScheduleError, match="appears 0 times"):
        validate_schedule(broken)


BASE = ["model=gpt_tiny", "model.num_layers=4", "model.seq_length=64", "model.mtp_num_layers=2",
        "model.mtp_loss_scale=0.3", "train.global_batch_size=8", "train.micro_batch_size=2",
        "data.max_bytes=300000", "overlap.dp_bucket_mb=0.05", "train.progress=false", "train.eval_iters=1"]
UNTIED = ["model.tie_embeddings=false"]
FIRST = ["parallel.pp=2", "parallel.mtp_stage=0"]
STEPS = 2
LAYOUTS = {
    "ref": (1, ["parallel.dp=1"]),
    "untied_ref": (1, [*UNTIED, "parallel.dp=1"]),
    "first_1f1b": (2, [*FIRST, "parallel.dp=1"]),
    "untied_first_1f1b": (2, [*UNTIED, *FIRST, "parallel.dp=1"]),
    "first_interleaved": (2, [*FIRST, "parallel.vpp=2", "parallel.pp_schedule=interleaved", "parallel.dp=1"]),
    "untied_first_zb1p": (2, [*UNTIED, *FIRST, "parallel.vpp=2", "parallel.pp_schedule=zb1p", "parallel.dp=1"]),
    "first_dp2": (4, [*FIRST, "parallel.dp=2"]),
    "untied_first_zero1": (4, [*UNTIED, *FIRST, "parallel.dp=2", "train.dp_sharding=optim"]),
}
# ZeRO-2/3 with the MTP chunk: each copy (and original) is a bucket of its own, so the reduced
# shards summed over the copies line up; 1 MB buckets would put the head's output layer (or
# the last stage's tied embedding copy) in one bucket with the final norm otherwise.
ZERO = [*FIRST, "parallel.dp=2", "overlap.dp_bucket_mb=1"]
for _level, _sharding in (("zero2", "optim_grads"), ("zero3", "optim_grads_params")):
    LAYOUTS[f"first_{_level}"] = (4, [*ZERO, f"train.dp_sharding={_sharding}"])
    LAYOUTS[f"untied_first_{_level}"] = (4, [*UNTIED, *ZERO, f"train.dp_sharding={_sharding}"])
# zb1p: the MTP chunk's full B beside the W-deferred chunks, whose units are freed on their input's gradient
LAYOUTS["untied_first_zb1p_zero3"] = (4, [*UNTIED, *ZERO, "parallel.vpp=2", "parallel.pp_schedule=zb1p",
                                          "train.dp_sharding=optim_grads_params"])
# deepseek_v3_tiny (latent attention, MoE depth, untied head) with one depth: overrides complete
V3 = ["model=deepseek_v3_tiny", "model.num_layers=2", "model.mtp_num_layers=1", *BASE[4:]]
FULL_LAYOUTS = {"v3_ref": (1, [*V3, "parallel.dp=1"]), "v3_first_1f1b": (2, [*V3, *FIRST, "parallel.dp=1"])}
REFS = {name: ("untied_ref" if name.startswith("untied") else "ref") for name in LAYOUTS if "first" in name}
REFS["v3_first_1f1b"] = "v3_ref"


def _train(rank, world, specs, root):
    """Each spec's rows and this rank's final weights {layout-free name: [copies]}."""
    from mpoverlap.config import compose
    from mpoverlap.training.loop import Trainer
    from mpoverlap.training.setup import init_distributed

    out = {}
    for name, (_, overrides, steps) in specs.items():
        run_dir = Path(root) / name
        cfg = compose([*overrides, f"train.steps={steps}", f"run.dir={run_dir}", "train.device=cpu"])
        trainer = Trainer(cfg, init_distributed(cfg), run_dir)
        rows, gatherer, peak = [], trainer.ddp.gatherer, None
        for step in range(steps):
            if gatherer is not None and step == 1:
                gatherer.reset_peak()  # the working set of a step after the first
            res = trainer.train_step()
            rows.append({"loss": trainer._mean_over_replicas(res["loss_local"]), "grad_norm": res["grad_norm"],
                         "mtp_loss": trainer._mean_over_replicas(res["mtp_loss_local"]),
                         "comm": trainer.ledger.reset()})
        if gatherer is not None:  # ZeRO-3: (this rank's stage, the most bytes of full buckets held at once)
            peak = (trainer.state.coords.pp, gatherer.peak_held_bytes)
        rows[-1]["val_loss"] = trainer.evaluate()  # forward only: the LM loss alone, the MTP chunk idle
        weights = {}
        with trainer.ddp.full_params():  # ZeRO-3: the parameters gathered from their shards
            for n, p in trainer.model.named_parameters():
                weights.setdefault(trainer.dp_names[n], []).append(p.detach().clone().numpy())
        trainer.close()
        out[name] = {"rows": rows, "weights": weights, "peak": peak}
    return out


def run_layouts(root, every, steps):
    """{name: rows of rank 0, weights of every rank} of each (world, overrides) in `every`."""
    from dist_harness import run_distributed

    from mpoverlap.comm.ledger import mean_over_ranks

    results = {}
    for world in sorted({w for w, _ in every.values()}):
        specs = {n: (w, ov, steps) for n, (w, ov) in every.items() if w == world}
        per_rank = run_distributed(_train, world, specs, str(root), timeout_s=900)
        for name in specs:
            rows = [dict(row, comm=mean_over_ranks([r[name]["rows"][i]["comm"] for r in per_rank]))
                    for i, row in enumerate(per_rank[0][name]["rows"])]
            results[name] = {"rows": rows, "weights": [r[name]["weights"] for r in per_rank],
                             "peaks": [r[name]["peak"] for r in per_rank]}
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    every = {**{n: (w, [*BASE, *ov]) for n, (w, ov) in LAYOUTS.items()}, **FULL_LAYOUTS}
    return run_layouts(tmp_path_factory.mktemp("mtp_stage"), every, STEPS)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(REFS))
def test_mtp_on_the_first_stage_reproduces_the_single_process_run(runs, name):
    assert_matches_single_process(runs[REFS[name]], runs[name], name, 2, tied=not name.startswith(("untied", "v3")))


def assert_matches_single_process(ref, got, name, pp, tied):
    """`got`'s losses, gradient norms, validation loss and final weights (every copy, on every
    rank of its `pp` stages) against the single-process run `ref`."""
    import numpy as np

    assert got["rows"][-1]["val_loss"] == pytest.approx(ref["rows"][-1]["val_loss"], rel=1e-5)
    for key in ("loss", "mtp_loss", "grad_norm"):
        for i, (a, b) in enumerate(zip([r[key] for r in got["rows"]], [r[key] for r in ref["rows"]])):
            assert abs(a - b) <= 1e-5 * abs(b), f"{key} step {i + 1}: {a} vs {b}"
    # Adam turns a 1e-7 gradient difference on a near-zero gradient into up to ~1e-5 in a weight;
    # a wrong gradient moves weights by about the learning rate (3e-4 and 6e-4 in these warm-up steps).
    ref_w = {n: copies[0] for n, copies in ref["weights"][0].items()}
    held = {}
    for rank_weights in got["weights"]:
        for n, copies in rank_weights.items():
            for w in copies:
                np.testing.assert_allclose(w, ref_w[n], rtol=1e-5, atol=2e-5, err_msg=f"{name}: {n}")
            held.setdefault(n, []).extend(copies)
    assert set(held) == set(ref_w)
    for n, copies in held.items():  # replicas and copies (the MTP chunk's too) stay exactly equal
        assert all(np.array_equal(w, copies[0]) for w in copies), n
    dp = len(got["weights"]) // pp
    assert len(held["embedding.weight"]) == (3 if tied else 2) * dp  # chunk 0's, the MTP chunk's (, the head's)
    assert tied or len(held["output.weight"]) == 2 * dp  # the head's, the MTP chunk's


@pytest.mark.slow
@pytest.mark.parametrize("name", ["first_zero3", "untied_first_zero3"])
def test_zero3_traffic_with_the_mtp_chunk_is_the_estimate(runs, name):
    """ZeRO-3 with the depths on stage 0 in 1f1b: every depth's forward gathers the MTP chunk's
    embedding copy (and output-layer copy) beside its own weights, and its backward once for all
    depths. The ledger's dp bytes per step are what mpoverlap-check estimates (the unit buckets'
    padding aside), as tests/test_mtp_parity.py holds the depths on the head's stage."""
    from mpoverlap.config import compose
    from mpoverlap.overlap.estimate import estimate

    want = estimate(compose([*BASE, *LAYOUTS[name][1]]), LAYOUTS[name][0]).comm_bytes_per_step["dp"]
    for row in runs[name]["rows"]:
        assert abs(row["comm"]["dp"]["bytes"] - want) <= 1e-4 * want, (row["comm"]["dp"]["bytes"], want)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["first_zero3", "untied_first_zero3", "untied_first_zb1p_zero3"])
def test_zero3_gathered_peak_with_the_mtp_chunk_is_the_estimate(runs, name):
    """The gathered units' working set mpoverlap-check estimates (sharding.gathered_working_set)
    bounds each rank's measured peak (2%) and is within 20% of it on stage 0, which holds the
    depths' units with the copies; in zb1p the MTP chunk's B is a full backward (no depth's
    buckets wait for a W), beside the W-deferred embedding."""
    from mpoverlap.config import compose
    from mpoverlap.overlap.estimate import estimate

    est = estimate(compose([*BASE, *LAYOUTS[name][1]]), LAYOUTS[name][0])
    for rank, (stage, peak) in enumerate(runs[name]["peaks"]):
        bound = est.stages[stage].gathered_bytes
        assert peak <= 1.02 * bound, (rank, stage, peak, bound)
        if stage == 0:
            assert bound <= 1.2 * peak, (rank, stage, peak, bound)


def test_the_mtp_chunk_holds_the_depths_and_copies_on_stage_0():
    """parallel.mtp_stage=0 in 1f1b: stage 0 holds chunk 0 and the MTP chunk (the depths, a copy
    of the embedding and of the untied output layer, equal to the originals at init and marked
    as copies); the head's chunk on stage 1 has no depths."""
    import torch

    from mpoverlap.config import compose
    from mpoverlap.models.gpt import GPT
    from mpoverlap.overlap import validate
    from mpoverlap.training.pipeline_glue import build_chunks, schedule_layout

    cfg = compose(["model.num_layers=4", "model.mtp_num_layers=1", "model.tie_embeddings=false",
                   "parallel.pp=2", "parallel.mtp_stage=0"])
    assert [p.render() for p in validate(cfg, 2) if p.rule.startswith("mtp.")] == []
    layout = schedule_layout(cfg.parallel, 1, cfg.model, 2)
    assert layout == LOOP_MTP
    first, last = (build_chunks(cfg.model, 2, 1, s, 1, layout=layout) for s in (0, 1))
    assert len(first) == 2 and first[1].is_mtp_chunk and len(last) == 1 and last[0].mtp is None
    ref = dict(GPT(cfg.model, seed=1).named_parameters())
    for n, p in first[1].named_parameters():
        assert torch.equal(p, ref[n]), n
        assert getattr(p, "pipeline_duplicate", False) == (n in ("embedding.weight", "output.weight")), n
    assert last[0].embedding is None  # untied: the head's stage reads no embedding


@pytest.mark.parametrize("overrides,fix", [
    (["parallel.pp=4", "parallel.mtp_stage=1", "parallel.dp=2", "train.dp_sharding=optim_grads"],
     "train.dp_sharding=optim"),
    (["parallel.pp=2", "parallel.vpp=2", "parallel.pp_schedule=zbv", "parallel.mtp_stage=1"], "parallel.mtp_stage=0"),
])
def test_what_stays_refused(overrides, fix):
    """ZeRO-2/3 beside an MTP chunk on a middle stage, and in zbv's V any stage but the head's (0)."""
    from mpoverlap.config import compose
    from mpoverlap.overlap import validate

    cfg = compose(["model.num_layers=4", "model.mtp_num_layers=1", *overrides])
    world = 1
    for key in ("pp", "dp"):
        world *= next((int(o.split("=")[1]) for o in overrides if o.startswith(f"parallel.{key}=")), 1)
    bad = [p for p in validate(cfg, world) if p.rule == "mtp.stage"]
    assert bad and fix in bad[0].fix, [p.render() for p in validate(cfg, world)]


def test_zero2_and_zero3_with_the_mtp_chunk_pass_the_rules():
    from mpoverlap.config import compose
    from mpoverlap.overlap import validate

    for name in ("first_zero2", "untied_first_zero2", "first_zero3", "untied_first_zero3", "untied_first_zb1p_zero3"):
        world, overrides = LAYOUTS[name]
        assert [p.render() for p in validate(compose([*BASE, *overrides]), world)] == [], name


@pytest.mark.parametrize("tied", [True, False])
def test_the_estimate_counts_the_depths_and_copies_on_stage_0(tied):
    """overlap/estimate/params.py against the built chunks of pp 2 with parallel.mtp_stage=0."""
    from mpoverlap.config import compose
    from mpoverlap.models.gpt import num_parameters
    from mpoverlap.overlap.estimate.params import stage_params
    from mpoverlap.overlap.estimate.sharding import mtp_depths_on
    from mpoverlap.overlap.layout import build_layout
    from mpoverlap.training.pipeline_glue import build_chunks

    cfg = compose(["model.num_layers=2", "model.seq_length=16", "model.mtp_num_layers=2",
                   f"model.tie_embeddings={str(tied).lower()}", "parallel.pp=2", "parallel.mtp_stage=0"])
    lo = build_layout(cfg, 2)
    for stage in (0, 1):
        chunks = build_chunks(cfg.model, 2, 1, stage, 1, layout=LOOP_MTP)
        assert stage_params(cfg, lo, stage) == sum(num_parameters(c) for c in chunks), stage
        assert mtp_depths_on(cfg, lo, stage) == (2 if stage == 0 else 0)


@pytest.mark.slow
def test_checkpoints_hold_the_mtp_weights_once_and_resume_across_layouts(tmp_path):
    """A checkpoint written with the depths on stage 0 (copies not written) resumes at pp 1, and
    one written at pp 1 resumes with the depths on stage 0 (chunk 0's embedding and the MTP
    chunk's copy both filled from the one saved tensor): each chain's LM losses are the
    uninterrupted single-process run's, within 1e-5."""
    assert_resume_across_layouts(tmp_path, BASE, 2, FIRST)


def assert_resume_across_layouts(tmp_path, base, world, placed):
    """Chains of 4 untied steps with a checkpoint at step 2: the single process throughout
    ("ref"), `placed` on `world` ranks then the single process ("out"), and the reverse ("in");
    steps 3 and 4 of both chains have the reference's LM and MTP losses within 1e-5."""
    import json

    from inproc_train import run_chains

    common = [*base, *UNTIED, "train.log_interval=1", "train.lr_decay_steps=4", "checkpoint.interval=2"]
    single, other = [*common, "parallel.dp=1"], [*common, *placed, "parallel.dp=1"]
    run_chains({"ref": [(1, single, 4)], "out": [(world, other, 2), (1, single, 4)],
                "in": [(1, single, 2), (world, other, 4)]}, tmp_path)

    def rows(name):
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return {r["step"]: r for r in map(json.loads, lines) if "grad_norm" in r}

    ref = rows("ref")
    for name in ("out", "in"):
        got = rows(name)
        assert sorted(got) == [1, 2, 3, 4]
        for step in (3, 4):
            for key in ("loss", "mtp_loss"):
                assert got[step][key] == pytest.approx(ref[step][key], rel=1e-5), (name, step, key)


@pytest.mark.slow
def test_init_from_a_hugging_face_directory_fills_the_mtp_chunk_copies(tmp_path):
    """checkpoint.init_from with the depths on stage 0 (deepseek_v3_tiny, untied): chunk 0's
    embedding and the MTP chunk's copy both take the directory's embedding, the MTP chunk's
    output copy the directory's head; the LM and MTP losses are the single process's (1e-5)."""
    import json

    import torch

    from inproc_train import run_chains
    from mpoverlap.config import compose
    from mpoverlap.interop.hf_dir import write_hf_dir
    from mpoverlap.interop.hf_mapping import hf_config
    from mpoverlap.interop.hf_tensors import to_hf
    from mpoverlap.models.gpt import GPT

    model = compose(V3).model
    torch.manual_seed(3)
    gpt = GPT(model, seed=77)  # weights other than the runs' own initialisation
    keys = {k: model[k] for k in model}
    write_hf_dir(tmp_path / "hf", hf_config(keys), to_hf(gpt.state_dict(), keys), 10**9)
    common = [*V3, "train.log_interval=1", f"checkpoint.init_from={tmp_path / 'hf'}"]
    run_chains({"ref": [(1, [*common, "parallel.dp=1"], 2)], "first": [(2, [*common, *FIRST, "parallel.dp=1"], 2)]},
               tmp_path)

    def rows(name):
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return [r for r in map(json.loads, lines) if "grad_norm" in r]

    ref, got = rows("ref"), rows("first")
    assert len(got) == len(ref) == 2
    for a, b in zip(got, ref):
        for key in ("loss", "mtp_loss", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-5), key
