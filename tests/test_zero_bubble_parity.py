"""Zero-bubble pipelines (parallel.pp_schedule=zb1p and zbv, weight gradients deferred to W
actions) against the single-process reference: the loss and gradient-norm curves over STEPS = 4
fp32 steps, alone and composed with dp (sharding none, optim_grads (ZeRO-2) and optim_grads_params),
tp 2 + SP (collective matmul on and off), cp 2 with selective recompute, MoE ep 2 and full
recompute. zbv (two chunks per stage in a V, the tied embedding and head both on stage 0) at
pp 2 and pp 4, with dp 2 (none, ZeRO-2 for gpt and llama, ZeRO-3 tied), tp 2 + SP, MoE ep 2 and
full recompute; the paired V (overlap.ep_pairing with zbv) and the paired zb1p table (pp 2 x vpp 2)
on moe_fine_tiny at dp 2 x ep 2, each with selective recompute and with full recompute (the V's
under ZeRO-2, zb1p's under ZeRO-1), and the paired V on moe_tiny with its tied head (one weight
both chunks of stage 0 use) at dp 2 x ep 2 with overlap.dp=true, sharding none and ZeRO-3. Every
layout against the single-process run of its model (bf16 zb1p / zbv: tests/test_train_cli.py's
bf16 fixture, against its floors); the paired ones also for where their weight gradients land (in
the W after each B, the shared weight in its microbatch's last W, as tests/test_pipeline_executor.py
checks the unpaired tables). One spawn
per world size (tests/inproc_train.py)."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_train_cli import MOE, SMALL, assert_close  # noqa: E402

pytestmark = pytest.mark.slow

STEPS = 4  # as tests/test_pairing.py STEPS: the first step already shows a wrong gradient
ZB = ["parallel.pp_schedule=zb1p"]
L4 = ["model.num_layers=4"]
LAYOUTS = {
    # references
    "ref": [],
    "ref_4layers": L4,
    "moe_ref": [*MOE],
    # zb1p on 1F1B and on interleaved chunks
    "zb_pp2": [*ZB, "parallel.pp=2", "overlap.pp=true"],
    "zb_pp4": [*ZB, *L4, "parallel.pp=4", "overlap.pp=false"],
    "zb_pp2_vpp2": [*ZB, *L4, "parallel.pp=2", "parallel.vpp=2", "overlap.pp=true"],
    "zb_pp2_recompute_full": [*ZB, "parallel.pp=2", "model.recompute=full"],
    # compositions
    "zb_dp2_pp2": [*ZB, "parallel.dp=2", "parallel.pp=2", "overlap.dp=true"],
    "zb_dp2_pp2_zero2": [*ZB, "parallel.dp=2", "parallel.pp=2", "overlap.dp=true",
                         "train.dp_sharding=optim_grads"],
    "zb_dp2_pp2_zero3": [*ZB, "parallel.dp=2", "parallel.pp=2", "overlap.dp=true",
                         "train.dp_sharding=optim_grads_params", "model.tie_embeddings=false"],
    "zb_tp2_sp_ring_pp2": [*ZB, "parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true",
                           "overlap.tp=true"],
    "zb_tp2_sp_pp2": [*ZB, "parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true",
                      "overlap.tp=false"],
    "zb_moe_dp2_ep2_pp2": [*ZB, *MOE, "parallel.dp=2", "parallel.ep=2", "parallel.pp=2",
                           "overlap.ep=true", "overlap.ep_chunks=4"],
    "zb_cp2_pp2_selective": [*ZB, "parallel.cp=2", "parallel.pp=2", "overlap.cp=true",
                             "model.recompute=selective"],
}
ZBV = ["parallel.pp_schedule=zbv", "parallel.vpp=2"]
L8 = ["model.num_layers=8"]
PAIRED_DP2_EP2_PP2 = ["parallel.dp=2", "parallel.ep=2", "parallel.pp=2", "overlap.ep=true", "overlap.ep_chunks=4",
                      "overlap.ep_pairing=true"]
FINE_PAIRED = ["model=moe_fine_tiny", *L4, *PAIRED_DP2_EP2_PP2]
LAYOUTS.update({
    "ref_8layers": L8,
    "zbv_pp2": [*ZBV, *L4, "parallel.pp=2", "overlap.pp=true"],
    "zbv_pp4": [*ZBV, *L8, "parallel.pp=4", "overlap.pp=false"],
    "zbv_pp2_recompute_full": [*ZBV, *L4, "parallel.pp=2", "model.recompute=full"],
    "zbv_dp2_pp2": [*ZBV, *L4, "parallel.dp=2", "parallel.pp=2", "overlap.dp=true"],
    # tied: the V keeps the embedding and the head on stage 0, ZeRO-3 gathers it for both
    "zbv_dp2_pp2_zero2": [*ZBV, *L4, "parallel.dp=2", "parallel.pp=2", "overlap.dp=true",
                          "train.dp_sharding=optim_grads"],
    "llama_ref": ["model=llama_tiny", *L4],
    "zbv_llama_dp2_pp2_zero2": ["model=llama_tiny", *ZBV, *L4, "parallel.dp=2", "parallel.pp=2", "overlap.dp=true",
                                "train.dp_sharding=optim_grads"],
    "zbv_dp2_pp2_zero3": [*ZBV, *L4, "parallel.dp=2", "parallel.pp=2", "overlap.dp=true",
                          "train.dp_sharding=optim_grads_params"],
    "zbv_tp2_sp_pp2": [*ZBV, *L4, "parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true",
                       "overlap.tp=true"],
    "moe_ref_4layers": [*MOE, *L4],
    "zbv_moe_dp2_ep2_pp2": [*ZBV, *MOE, *L4, "parallel.dp=2", "parallel.ep=2", "parallel.pp=2", "overlap.ep=true", "overlap.ep_chunks=4"],
    # the paired V (pipeline/zbv_paired.py): F of one chunk paired with B of the other, each B's W
    # deferred out of the pair (moe_fine_tiny: a dense first layer, shared experts)
    "moe_fine_ref": ["model=moe_fine_tiny", *L4],
    "zbv_paired_moe_fine_dp2_ep2_pp2_selective": [*FINE_PAIRED, *ZBV, "model.recompute=selective"],
    # full recompute (each MoE block's forward sub-steps replayed as sub-steps in its backward,
    # pairing/steps.py _Replayed, the replay's exchanges in flight under the pair's other side),
    # composed with ZeRO-2 (one spawn's worth of layouts: the test budget)
    "zbv_paired_moe_fine_dp2_ep2_pp2_full_zero2": [*FINE_PAIRED, *ZBV, "model.recompute=full",
                                                   "train.dp_sharding=optim_grads"],
    # the paired V with a tied head (moe_tiny): stage 0's embedding chunk and head chunk share one
    # weight, its gradient summed over both chunks' W and added in the microbatch's last W; with
    # the dp reduction overlapped (overlap.dp=true, the embedding a bucket of its own at
    # dp_bucket_mb=0.05) a bucket issued before that W reduces a partial gradient, under
    # ZeRO-3 a reduce-scatter per microbatch
    "zbv_paired_moe_tied_dp2_ep2_pp2": [*MOE, *L4, *PAIRED_DP2_EP2_PP2, *ZBV, "overlap.dp=true"],
    "zbv_paired_moe_tied_dp2_ep2_pp2_zero3": [*MOE, *L4, *PAIRED_DP2_EP2_PP2, *ZBV, "overlap.dp=true",
                                              "train.dp_sharding=optim_grads_params"],
    # the paired zb1p table (vpp 2): the paired interleaved order, each B's W placed where the stage
    # idles; with selective recompute, and with full recompute and ZeRO-1
    "zb_paired_moe_fine_dp2_ep2_pp2_vpp2_selective": [*FINE_PAIRED, *ZB, "parallel.vpp=2", "model.recompute=selective"],
    "zb_paired_moe_fine_dp2_ep2_pp2_vpp2_full_zero1": [*FINE_PAIRED, *ZB, "parallel.vpp=2", "model.recompute=full",
                                                       "train.dp_sharding=optim"],
})
REFS = {"zb_pp4": "ref_4layers", "zb_pp2_vpp2": "ref_4layers", "zb_moe_dp2_ep2_pp2": "moe_ref",
        "zb_dp2_pp2_zero3": "ref_untied", "zbv_pp2": "ref_4layers", "zbv_pp4": "ref_8layers",
        "zbv_pp2_recompute_full": "ref_4layers", "zbv_dp2_pp2": "ref_4layers", "zbv_dp2_pp2_zero3": "ref_4layers",
        "zbv_tp2_sp_pp2": "ref_4layers", "zbv_moe_dp2_ep2_pp2": "moe_ref_4layers", "zbv_dp2_pp2_zero2": "ref_4layers",
        "zbv_llama_dp2_pp2_zero2": "llama_ref",
        **{name: "moe_fine_ref" for name in LAYOUTS if "_paired_moe_fine_" in name},
        **{name: "moe_ref_4layers" for name in LAYOUTS if "_paired_moe_tied_" in name}}
LAYOUTS["ref_untied"] = ["model.tie_embeddings=false"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from inproc_train import train_layouts, world_of

    specs = {name: (world_of([*SMALL, *ov]), [*SMALL, *ov], STEPS) for name, ov in LAYOUTS.items()}
    return train_layouts(specs, tmp_path_factory.mktemp("zb"), probe=paired_landings)


@pytest.mark.parametrize("name", [n for n in LAYOUTS if n.startswith(("zb_", "zbv_"))])
def test_zero_bubble_reproduces_the_reference_curve(runs, name):
    ref, got = runs[REFS.get(name, "ref")], runs[name]
    assert len(got) == STEPS
    assert_close([r["loss"] for r in got], [r["loss"] for r in ref])
    assert_close([r["grad_norm"] for r in got], [r["grad_norm"] for r in ref])


def paired_landings(trainer):
    """The probe of the runs above (tests/inproc_train.py) on a paired zero-bubble table: where
    each weight gradient of this stage's chunks lands in the first step (weight: (vchunk,
    parameter name)), and the weights the chunks defer (those of the layers attach_deferral
    handed the deferral, their biases kept in B: the linears, embedding, grouped experts), and
    the names of the weights both chunks of the stage hold (the V's tied embedding, under each
    chunk's name: PipelineExecutor.shared_params)."""
    pipeline = trainer.pipeline
    if pipeline is None or pipeline.paired is None or pipeline.executor.weight_grads is None:
        return None
    from weight_grad_landings import watch_landings

    executor = pipeline.executor
    named = [((v, n), p) for v, chunk in enumerate(pipeline.chunks) for n, p in chunk.named_parameters()]
    landings, handles = watch_landings(lambda: executor.trace, executor.weight_grads, named)
    deferrable = sorted((v, f"{module}.{n}") for v, chunk in enumerate(pipeline.chunks)
                        for module, sub in chunk.named_modules()
                        if getattr(sub, "wgrad", None) is not None
                        or getattr(getattr(sub, "comm", None), "wgrad", None) is not None
                        for n, _ in sub.named_parameters(recurse=False) if n != "bias")

    def seen():
        for handle in handles:
            handle.remove()
        return {"stage": trainer.state.coords.pp, "landings": landings, "deferrable": deferrable,
                "shared": sorted(w for w, p in named if id(p) in executor.shared),
                "table": [(a.kind, a.microbatch, a.vchunk, a.chunk) for a in executor.actions]}
    return seen


PAIRED_ZB = [n for n in LAYOUTS if "_paired_" in n]


@pytest.mark.parametrize("name", PAIRED_ZB)
def test_paired_zero_bubble_tables_land_weight_gradients_in_w(runs, name):
    """The paired V and the paired zb1p table run each sub-step of a paired B inside the deferral
    region of its W (PipelineExecutor._paired_backward), the pair's forward steps outside it:
    every deferred weight's gradient lands in a W after its B, each W lands exactly its chunk's
    deferred weights (tests/weight_grad_landings.py), on every stage of the first step. The curve
    test above holds the same runs to the single-process reference: a W folded back into B
    computes the same values, and only this test sees it. A weight both chunks of the stage hold
    (the tied embedding) lands once per microbatch, under both its names, in that microbatch's
    last W on the stage (after both chunks' B): landing in an earlier W would ready its bucket
    for the dp reduction before the other chunk's share arrives."""
    from weight_grad_landings import assert_weight_grads_land_in_their_w

    for r in runs[name][0]["probe"]:
        table, deferrable = r["table"], {tuple(w) for w in r["deferrable"]}
        shared = {tuple(w) for w in r["shared"]}
        assert deferrable, (name, r["stage"])
        assert ("_tied_" in name and r["stage"] == 0) == bool(shared), (name, r["stage"], shared)
        landings = [(tuple(w), i) for w, i in r["landings"] if tuple(w) in deferrable]
        last_w = {mb: i for i, (kind, mb, _, _) in enumerate(table) if kind == "W"}

        def expected(i):
            own = {w for w in deferrable - shared if w[0] == table[i][2]}
            return own | shared if last_w[table[i][1]] == i else own
        assert_weight_grads_land_in_their_w(table, landings, expected, (name, r["stage"]))


def test_zbv_pp_bytes_equal_the_estimate(runs):
    """zbv's p2p: 2pp-1 chunk boundaries, the turn handed over in memory, so 2(pp-1) per
    microbatch and direction: the estimate (twice 1F1B's bytes) equals the ledger exactly."""
    from mpoverlap.config import compose
    from mpoverlap.overlap.estimate import estimate
    from mpoverlap.overlap.layout import build_layout

    for name in [n for n in LAYOUTS if n.startswith("zbv_")]:
        cfg = compose([*SMALL, *LAYOUTS[name]])
        assert runs[name][-1]["comm"]["pp"]["bytes"] == estimate(cfg, build_layout(cfg).world).comm_bytes_per_step["pp"]
    for pp in (2, 4):  # untied: 1F1B's pp bytes are its p2p alone (no embedding-group sum)
        base = [*SMALL, *L8, "model.tie_embeddings=false", f"parallel.pp={pp}"]
        one_f_one_b = estimate(compose(base), pp).comm_bytes_per_step["pp"]
        assert estimate(compose([*base, *ZBV]), pp).comm_bytes_per_step["pp"] == 2 * one_f_one_b


def test_zero_bubble_dp_bytes_equal_the_estimate(runs):
    """dp under zb1p and zbv (sharding none and ZeRO-3): the estimate is the mean over the
    stages, as the ledger averages the ranks (zbv's stage 0 holds the embedding and the head,
    its bytes alone were +9% at none, +12% under ZeRO-3), and exact. ZeRO-3 gathers each unit
    before every forward and every B (a B frees its units at once, W reads no parameter)."""
    from mpoverlap.config import compose
    from mpoverlap.overlap.estimate import estimate
    from mpoverlap.overlap.layout import build_layout

    off = []
    for name in ("zb_dp2_pp2", "zb_dp2_pp2_zero2", "zb_dp2_pp2_zero3", "zbv_dp2_pp2", "zbv_dp2_pp2_zero2",
                 "zbv_dp2_pp2_zero3"):
        cfg = compose([*SMALL, *LAYOUTS[name]])
        got = runs[name][-1]["comm"]["dp"]["bytes"]
        est = estimate(cfg, build_layout(cfg).world).comm_bytes_per_step["dp"]
        if got != est:
            off.append((name, got, est))
    assert not off, off


@pytest.fixture(scope="module")
def chains(tmp_path_factory):
    """zbv -> 1F1B and 1F1B -> zbv at pp 2, STEPS / 2 + STEPS / 2 steps, each segment a full Trainer.run()
    (metrics.jsonl, the log line: train.progress=true)."""
    from inproc_train import run_chains

    root = tmp_path_factory.mktemp("chains")
    half = STEPS // 2
    reshard = [*SMALL, *L4, f"train.lr_decay_steps={STEPS}", f"checkpoint.interval={half}", "train.progress=true"]
    zbv = [*reshard, *ZBV, "parallel.pp=2"]
    one_f_one_b = [*reshard, "parallel.pp=2"]
    segments = run_chains({"zbv_to_1f1b": [(2, zbv, half), (2, one_f_one_b, STEPS)],
                           "1f1b_to_zbv": [(2, one_f_one_b, half), (2, zbv, STEPS)]}, root)
    return root, segments


def test_zbv_checkpoint_resumes_under_1f1b_and_back(runs, chains):
    """A zbv checkpoint holds every layer under its global id and the tied embedding once (stage
    0 holds both ends of the V): resumed under 1F1B (where the last stage gets its copy of the
    embedding) and a 1F1B one resumed under zbv, both stay on the single-process curve."""
    from test_train_cli import losses, rows

    tmp_path, _ = chains
    for name in ("zbv_to_1f1b", "1f1b_to_zbv"):  # the reference: a STEPS-step run decays over STEPS
        assert [r["step"] for r in rows(tmp_path / name)] == list(range(1, STEPS + 1))
        assert_close(losses(tmp_path / name), [r["loss"] for r in runs["ref_4layers"]])
    # Each segment ends with an evaluation (forward-only through the pipeline): at step STEPS / 2
    # and at step STEPS one chain evaluates through the V (the turn handed over in memory), the other
    # through 1F1B's stages, on the same weights.
    def val_losses(name):
        rows_ = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        return [(r["step"], r["val_loss"]) for r in rows_ if "val_loss" in r]
    zbv_first, one_f_one_b_first = val_losses("zbv_to_1f1b"), val_losses("1f1b_to_zbv")
    assert [s for s, _ in zbv_first] == [s for s, _ in one_f_one_b_first] == [STEPS // 2, STEPS]
    assert_close([v for _, v in zbv_first], [v for _, v in one_f_one_b_first])


def test_pp_bubble_in_metrics_and_log_line_is_the_executors_blocked_time(chains):
    """`pp_bubble_s` of every metrics.jsonl row (train.log_interval=1) and the `pp bubble a/bms`
    of its log line are, per stage, the PipelineExecutor's own blocked time of that step
    (`bubble_s`, read from the executor after each step), for zbv and 1F1B segments alike:
    exactly (one rank per stage here: the mean over a stage's ranks is that rank's), and the
    log line to its 0.1 ms print precision. Each is a part of its own rank's step time, and some
    stage waits every step (the fill)."""
    import re

    from test_train_cli import rows

    root, segments = chains
    for name, per_segment in segments.items():
        blocked, step_time = {}, {}  # step -> [per stage]: the executor's blocked time, the rank's step time
        for per_rank in per_segment:
            for rank in per_rank:
                for step, seconds, took in rank["blocked"]:
                    blocked.setdefault(step, [None, None])[rank["stage"]] = seconds
                    step_time.setdefault(step, [None, None])[rank["stage"]] = took
        assert sorted(blocked) == list(range(1, STEPS + 1)), (name, sorted(blocked))
        got = rows(root / name)
        assert [r["step"] for r in got] == list(range(1, STEPS + 1))
        for r in got:
            assert r["pp_bubble_s"] == blocked[r["step"]], (name, r["step"], r["pp_bubble_s"], blocked[r["step"]])
            # a part of its own rank's step (metrics' step_time_s is rank 0's: a later stage that
            # entered the step while rank 0 still wrote the last row waits longer than that)
            assert all(0 <= b <= t for b, t in zip(r["pp_bubble_s"], step_time[r["step"]])), \
                (name, r["step"], r["pp_bubble_s"], step_time[r["step"]])
            assert sum(r["pp_bubble_s"]) > 0
        printed = {}
        for per_rank in per_segment:  # rank 0 prints
            for line in per_rank[0]["stdout"].splitlines():
                match = re.match(r"step +(\d+) \|.* pp bubble ([0-9./]+)ms$", line)
                if match:
                    printed[int(match.group(1))] = match.group(2)
        assert printed == {step: "/".join(f"{b * 1e3:.1f}" for b in per_stage)
                           for step, per_stage in blocked.items()}, (name, printed, blocked)


def test_paired_full_recompute_replays_the_exchanges_in_the_ledger(runs):
    """Pairing with model.recompute=full replays each MoE block's forward in its backward as
    sub-steps (pairing/steps.py `_Replayed`): its dispatch and combine all-to-alls go out again,
    counted under ep, and its counts exchange does not (the forward's counts are reused). Per
    step and rank: 4 microbatches x 1.5 MoE layers per stage on average (moe_fine_tiny's 4 layers
    over 2 x 2 chunks, layer 0 dense) x 4 token chunks (overlap.ep_chunks) x 2 (dispatch and
    combine) = 48 more ep operations than the same table with selective recompute; every handle
    waited inside its step (0 <= exposed <= in flight)."""
    for schedule in ("zbv_paired_moe_fine_dp2_ep2_pp2", "zb_paired_moe_fine_dp2_ep2_pp2_vpp2"):
        full = runs[next(n for n in LAYOUTS if n.startswith(f"{schedule}_full"))]
        selective = runs[f"{schedule}_selective"]
        for f, s in zip(full, selective):
            assert f["comm"]["ep"]["ops"] - s["comm"]["ep"]["ops"] == 48, (schedule, f["comm"]["ep"], s["comm"]["ep"])
            assert 0 <= f["comm"]["ep"]["exposed_s"] <= f["comm"]["ep"]["time_s"]
