"""End to end through the console scripts: parity across dp layouts, overlap on/off, resume,
torchrun, and exit codes. Each run is a real multi-process launch (gloo)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
SMALL = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4",
         "model.ffn_hidden_size=128", "model.seq_length=64", "train.global_batch_size=16",
         "train.micro_batch_size=2", "train.log_interval=1", "data.max_bytes=300000",
         "overlap.dp_bucket_mb=0.05", "train.progress=false", "train.eval_iters=1"]


MOE = ["model=moe_tiny", "model.moe_ffn_hidden_size=64"]


def train(run_dir, *overrides, steps=4, expect=0, launcher=None):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("RANK", None)
    cmd = launcher or [str(BIN / "mpoverlap-train")]
    args = cmd + SMALL + [f"train.steps={steps}", f"run.dir={run_dir}", *overrides]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == expect, f"{args}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    return proc


def rows(run_dir):
    path = Path(run_dir) / "metrics.jsonl"
    return [r for r in map(json.loads, path.read_text().splitlines()) if "loss" in r]


def losses(run_dir):
    return loss_of(rows(run_dir))


def loss_of(run_rows):
    return [r["loss"] for r in run_rows]


def assert_close(a, b, rel=1e-5):
    assert len(a) == len(b) and a
    for x, y in zip(a, b):
        assert abs(x - y) <= rel * abs(y), (a, b)


LAYOUTS = {
    "dp1": [],
    "dp1_4layers": ["model.num_layers=4"],
    "dp1_4layers_untied": ["model.num_layers=4", "model.tie_embeddings=false"],
    "dp2_on": ["parallel.dp=2", "overlap.dp=true"],
    "dp2_off": ["parallel.dp=2", "overlap.dp=false"],
    "dp4_zero_on": ["parallel.dp=4", "overlap.dp=true", "train.distributed_optimizer=true",
                    "overlap.dp_param_gather=true"],
    "dp2_zero_off": ["parallel.dp=2", "overlap=none", "train.distributed_optimizer=true"],
    "cp2_ring_on": ["parallel.cp=2", "overlap.cp=true"],
    "cp4_ring_off": ["parallel.cp=4", "overlap.cp=false"],
    "cp2_a2a_on": ["parallel.cp=2", "parallel.cp_comm=a2a", "overlap.cp=true"],
    "cp2_dp2": ["parallel.cp=2", "parallel.dp=2", "train.distributed_optimizer=true"],
    "tp2": ["parallel.tp=2"],
    "tp2_sp_off": ["parallel.tp=2", "parallel.sequence_parallel=true", "overlap.tp=false"],
    "tp2_sp_on": ["parallel.tp=2", "parallel.sequence_parallel=true", "overlap.tp=true"],
    "tp4_sp_on": ["parallel.tp=4", "parallel.sequence_parallel=true", "overlap.tp=true"],
    "tp2_cp2_sp_zero": ["parallel.tp=2", "parallel.cp=2", "parallel.sequence_parallel=true",
                        "train.distributed_optimizer=true"],
    "pp2_on": ["parallel.pp=2", "overlap.pp=true"],
    "pp2_off": ["parallel.pp=2", "overlap.pp=false"],
    "pp2_vpp2_on": ["parallel.pp=2", "parallel.vpp=2", "model.num_layers=4", "overlap.pp=true"],
    "pp4_on": ["parallel.pp=4", "model.num_layers=4", "overlap.pp=true"],
    "pp4_vpp1_untied_zero": ["parallel.pp=4", "model.num_layers=4", "model.tie_embeddings=false",
                             "train.distributed_optimizer=true"],
    # Compositions (world 8): every overlap mode of the layout on.
    "dp2_tp2_pp2_sp_all": ["parallel.dp=2", "parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true",
                           "overlap.dp=true", "overlap.tp=true", "overlap.pp=true"],
    "tp2_cp2_pp2_vpp2": ["parallel.tp=2", "parallel.cp=2", "parallel.pp=2", "parallel.vpp=2",
                         "parallel.sequence_parallel=true", "model.num_layers=4"],
    # Mixture of experts: each layout against the single-process reference.
    "moe_dp1": [*MOE],
    "moe_dp4": [*MOE, "parallel.dp=4"],
    "moe_dp4_ep2_on": [*MOE, "parallel.dp=4", "parallel.ep=2", "overlap.ep=true", "overlap.ep_chunks=4"],
    "moe_dp4_ep4_on": [*MOE, "parallel.dp=4", "parallel.ep=4", "overlap.ep=true", "overlap.ep_chunks=4"],
    "moe_dp4_ep4_off": [*MOE, "parallel.dp=4", "parallel.ep=4", "overlap.ep=false", "overlap.ep_chunks=4"],
    "moe_dp4_ep2_zero": [*MOE, "parallel.dp=4", "parallel.ep=2", "train.distributed_optimizer=true",
                         "overlap.dp_param_gather=true"],
    "moe_shared_dp1": [*MOE, "model.shared_expert=true"],
    "moe_shared_dp2_ep2_allgather": [*MOE, "model.shared_expert=true", "parallel.dp=2", "parallel.ep=2",
                                     "model.moe_dispatcher=allgather", "overlap.ep=true", "overlap.ep_chunks=4"],
    "moe_dp2_ep2_tp2_pp2_all": [*MOE, "parallel.dp=2", "parallel.ep=2", "parallel.tp=2", "parallel.pp=2",
                                "parallel.sequence_parallel=true", "overlap.dp=true", "overlap.tp=true",
                                "overlap.pp=true", "overlap.ep=true", "overlap.ep_chunks=4"],
}


# LAYOUTS train 4 microbatches a step at dp 1 (not SMALL's 8: every comparison is against a run of
# the same batch, and on 2 cores a step's time is its collectives' count), 2 at dp 2, 1 at dp 4.
RUNS = [*SMALL, "train.global_batch_size=8"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{name: rows} for every layout of LAYOUTS, trained 4 steps inside one spawn per world size
    (tests/inproc_train.py: the same Trainer the console script builds, without a launch each)."""
    from inproc_train import train_layouts, world_of

    specs = {name: (world_of([*RUNS, *ov]), [*RUNS, *ov], 4) for name, ov in LAYOUTS.items()}
    return train_layouts(specs, tmp_path_factory.mktemp("runs"))


@pytest.fixture(scope="module")
def cli_dp2(tmp_path_factory):
    """The one layout launched through the console script: its metrics.jsonl is the contract."""
    run = tmp_path_factory.mktemp("cli") / "dp2_on"
    train(run, *RUNS[len(SMALL):], *LAYOUTS["dp2_on"])
    return run


def test_loss_falls_and_metrics_contract(cli_dp2, runs):
    r = rows(cli_dp2)
    assert [x["step"] for x in r] == [1, 2, 3, 4]
    assert r[-1]["loss"] < r[0]["loss"]
    # The in-process Trainers the other tests read train what the console script trains.
    assert_close([x["loss"] for x in r], [x["loss"] for x in runs["dp2_on"]])
    assert_close([x["grad_norm"] for x in r], [x["grad_norm"] for x in runs["dp2_on"]])
    from mpoverlap.config import compose
    from mpoverlap.models.flops import flops_per_token
    from mpoverlap.training.lr import LRSchedule

    cfg = compose([*RUNS, *LAYOUTS["dp2_on"], "train.steps=4"])
    schedule = LRSchedule.from_config(cfg.train)
    tokens = cfg.train.global_batch_size * cfg.model.seq_length
    for row in r:
        assert row["lr"] == schedule(row["step"] - 1) > 0  # warm-up: lr x step / warm-up steps
        assert row["lr"] == pytest.approx(cfg.train.lr * row["step"] / cfg.train.lr_warmup_steps)
        assert 0 < row["step_time_s"] < 60
        assert row["tokens_per_s"] == pytest.approx(tokens / row["step_time_s"], rel=1e-9)
        assert row["model_tflops_per_s"] == pytest.approx(
            flops_per_token(cfg.model) * tokens / row["step_time_s"] / 2 / 1e12, rel=1e-9)
        # Two worker processes, each holding torch: tens of MB at least, well under the machine.
        assert len(row["peak_memory_bytes"]) == 2
        assert all(50e6 < m < 8e9 for m in row["peak_memory_bytes"])
        dp = row["comm"]["dp"]
        assert dp["ops"] > 1 and dp["bytes"] > 0
        assert 0 <= dp["exposed_s"] <= dp["time_s"]
    assert runs["dp1"][0]["comm"] == {}  # one replica: nothing communicated
    val = [x["val_loss"] for x in map(json.loads, (cli_dp2 / "metrics.jsonl").read_text().splitlines())
           if "val_loss" in x]
    # Once, after the last step: byte-level text near the training loss (within 10%).
    assert len(val) == 1 and abs(val[0] - r[-1]["loss"]) <= 0.1 * r[-1]["loss"], (val, r[-1]["loss"])


def test_dp_layouts_reproduce_single_process_curve(runs):
    ref = loss_of(runs["dp1"])
    for name in ("dp2_on", "dp2_off", "dp4_zero_on", "dp2_zero_off"):
        assert_close(loss_of(runs[name]), ref)


def test_cp_layouts_reproduce_single_process_curve(runs):
    ref = loss_of(runs["dp1"])
    for name in ("cp2_ring_on", "cp4_ring_off", "cp2_a2a_on", "cp2_dp2"):
        assert_close(loss_of(runs[name]), ref)
        cp = runs[name][-1]["comm"]["cp"]
        assert cp["ops"] > 0 and cp["bytes"] > 0 and 0 <= cp["exposed_s"] <= cp["time_s"]
    # The ring moves cp-1 K/V blocks forward and 2cp-1 transfers backward per layer and microbatch.
    cp2 = runs["cp2_ring_on"][-1]["comm"]["cp"]
    from mpoverlap.config import compose
    from mpoverlap.overlap.layout import build_layout

    microbatches, layers = build_layout(compose([*RUNS, *LAYOUTS["cp2_ring_on"]])).num_microbatches, 2
    assert cp2["ops"] == microbatches * layers * (1 + 3)


def test_tp_layouts_reproduce_single_process_curve(runs):
    ref = runs["dp1"]
    for name in ("tp2", "tp2_sp_off", "tp2_sp_on", "tp4_sp_on", "tp2_cp2_sp_zero"):
        got = runs[name]
        assert_close([r["loss"] for r in got], [r["loss"] for r in ref])
        assert_close([r["grad_norm"] for r in got], [r["grad_norm"] for r in ref])
        tp = got[-1]["comm"]["tp"]
        assert tp["ops"] > 0 and tp["bytes"] > 0
    # Collective matmul replaces each SP all-gather / reduce-scatter by tp-1 ring steps.
    assert runs["tp2_sp_on"][-1]["comm"]["tp"]["ops"] != runs["tp2_sp_off"][-1]["comm"]["tp"]["ops"]


def test_pp_layouts_reproduce_single_process_curve(runs):
    ref = runs["dp1"]
    ref4 = runs["dp1_4layers"]
    for name, expected in (("pp2_on", ref), ("pp2_off", ref), ("pp2_vpp2_on", ref4), ("pp4_on", ref4)):
        got = runs[name]
        assert_close([r["loss"] for r in got], [r["loss"] for r in expected])
        assert_close([r["grad_norm"] for r in got], [r["grad_norm"] for r in expected])
        assert got[-1]["comm"]["pp"]["ops"] > 0
    assert loss_of(runs["pp2_on"]) == loss_of(runs["pp2_off"])
    assert_close(loss_of(runs["pp4_vpp1_untied_zero"]), loss_of(runs["dp1_4layers_untied"]))


def test_compositions_reproduce_single_process_curve(runs):
    assert_close(loss_of(runs["dp2_tp2_pp2_sp_all"]), loss_of(runs["dp1"]))
    assert_close(loss_of(runs["tp2_cp2_pp2_vpp2"]), loss_of(runs["dp1_4layers"]))
    comm = runs["dp2_tp2_pp2_sp_all"][-1]["comm"]
    assert {"dp", "tp", "pp"} <= set(comm)


def test_moe_layouts_reproduce_single_process_curve(runs):
    """Dropless MoE: expert parallelism (2 and 4, overlap on and off, ZeRO-1, the all-gather
    dispatcher with a shared expert, and composed with dp2 x tp2 x pp2 + SP) reproduces the
    single-process run (losses and grad norms)."""
    ref = runs["moe_dp1"]
    for name in ("moe_dp4", "moe_dp4_ep2_on", "moe_dp4_ep4_on", "moe_dp4_ep4_off", "moe_dp4_ep2_zero",
                 "moe_dp2_ep2_tp2_pp2_all"):
        assert_close(loss_of(runs[name]), loss_of(ref))
        assert_close([r["grad_norm"] for r in runs[name]], [r["grad_norm"] for r in ref])
    assert_close(loss_of(runs["moe_shared_dp2_ep2_allgather"]), loss_of(runs["moe_shared_dp1"]))
    assert_close([r["grad_norm"] for r in runs["moe_shared_dp2_ep2_allgather"]],
                 [r["grad_norm"] for r in runs["moe_shared_dp1"]])
    ref = loss_of(ref)
    assert {"dp", "tp", "pp", "ep"} <= set(runs["moe_dp2_ep2_tp2_pp2_all"][-1]["comm"])
    assert ref[-1] < ref[0]


def test_moe_metrics_and_ep_overlap_on_off_identical(runs):
    on, off = runs["moe_dp4_ep4_on"], runs["moe_dp4_ep4_off"]
    assert [r["loss"] for r in on] == [r["loss"] for r in off]
    assert [r["grad_norm"] for r in on] == [r["grad_norm"] for r in off]
    for row in on + off:
        ep = row["comm"]["ep"]
        assert ep["ops"] > 0 and ep["bytes"] > 0 and 0 <= ep["exposed_s"] <= ep["time_s"]
        # Load balancing: 1.0 when perfectly balanced, at most num_experts; dropless drops nothing.
        assert 0.5 < row["moe"]["aux_loss"] < 8 and row["moe"]["z_loss"] > 0
        assert row["moe"]["dropped_fraction"] == 0
    assert [r["comm"]["ep"]["bytes"] for r in on] == [r["comm"]["ep"]["bytes"] for r in off]
    assert "ep" not in runs["moe_dp4"][0]["comm"]  # ep=1: nothing dispatched over a group


def test_no_row_of_any_run_exposes_more_than_in_flight(runs, moe_sequence_runs, bf16_runs):
    """The metrics contract, as an invariant: 0 <= exposed_s <= time_s for every mode and row."""
    every = dict(runs)
    every.update({f"moe_seq/{name}": r for name, r in moe_sequence_runs.items()})
    every.update({f"bf16/{name}": r for name, r in bf16_runs.items()})
    for name, run_rows in every.items():
        for i, row in enumerate(run_rows):
            for mode, c in row["comm"].items():
                assert 0 <= c["exposed_s"] <= c["time_s"], (name, i, mode, c)


# MoE whose tokens are split over ranks (SP, CP) keeps the dp-only
# curve, because the router's statistics are the whole sequence's.
MOE_SEQ = ["model=moe_tiny", "model.num_layers=4", "model.hidden_size=64", "model.num_experts=4",
           "model.moe_top_k=2", "model.seq_length=64", "train.global_batch_size=8", "parallel.dp=2"]
MOE_SEQ_LAYOUTS = {
    "ref_dp1": ["parallel.dp=1"],
    "ref_dp2": [],
    "tp2": ["parallel.tp=2"],
    "cp2": ["parallel.cp=2"],
    "tp2_sp": ["parallel.tp=2", "parallel.sequence_parallel=true"],
    "cp2_tp2_sp": ["parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true"],
    "ep2_tp2_sp_allgather": ["parallel.ep=2", "parallel.tp=2", "parallel.sequence_parallel=true",
                             "model.moe_dispatcher=allgather"],
    "ep2_tp2_pp2_sp_all": ["parallel.ep=2", "parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true",
                           "overlap.dp=true", "overlap.tp=true", "overlap.pp=true", "overlap.ep=true", "overlap.ep_chunks=4"],
    # the paired zb1p table with tp 2 + SP and the experts split over tp (etp 2)
    "ep2_tp2_sp_etp2_pp2_vpp2_zb1p_paired": ["parallel.ep=2", "parallel.tp=2", "parallel.etp=2", "parallel.pp=2",
                                             "parallel.vpp=2", "parallel.sequence_parallel=true",
                                             "parallel.pp_schedule=zb1p", "overlap.tp=true", "overlap.ep=true", "overlap.ep_chunks=4",
                                             "overlap.ep_pairing=true"],
}


MOE_SEQ_STEPS = 4  # as tests/test_pairing.py STEPS: the first step already shows a wrong gradient
MOE_SEQ_WORLD = {"ref_dp1": 1, "ref_dp2": 2, "tp2": 4, "cp2": 4, "tp2_sp": 4, "cp2_tp2_sp": 8, "ep2_tp2_sp_allgather": 4,
                 "ep2_tp2_pp2_sp_all": 8, "ep2_tp2_sp_etp2_pp2_vpp2_zb1p_paired": 8}


@pytest.fixture(scope="module")
def moe_sequence_runs(tmp_path_factory):
    """{name: rows}, every layout trained inside one spawn per world size (tests/inproc_train.py)."""
    from inproc_train import train_layouts

    specs = {name: (MOE_SEQ_WORLD[name], [*SMALL, *MOE_SEQ, *ov], MOE_SEQ_STEPS) for name, ov in MOE_SEQ_LAYOUTS.items()}
    return train_layouts(specs, tmp_path_factory.mktemp("moe_seq"))


def test_moe_with_split_sequences_reproduces_the_dp_reference(moe_sequence_runs):
    ref = moe_sequence_runs["ref_dp1"]  # the single-process run
    assert len(ref) == MOE_SEQ_STEPS
    for name in MOE_SEQ_LAYOUTS:
        got = moe_sequence_runs[name]
        assert_close([r["loss"] for r in got], [r["loss"] for r in ref])
        assert_close([r["grad_norm"] for r in got], [r["grad_norm"] for r in ref])
        # The reported router figures are the whole sequence's too.
        assert_close([r["moe"]["aux_loss"] for r in got], [r["moe"]["aux_loss"] for r in ref])
        assert_close([r["moe"]["z_loss"] for r in got], [r["moe"]["z_loss"] for r in ref])
    # The statistics' all-reduce is counted (tp under SP, cp under CP).
    assert moe_sequence_runs["cp2"][-1]["comm"]["cp"]["ops"] > 0


def test_check_estimates_match_measured_comm(runs):
    """mpoverlap-check's per-step communication estimate against what the ledger measured."""
    from mpoverlap.config import compose
    from mpoverlap.overlap.estimate import estimate
    from mpoverlap.overlap.layout import build_layout

    off = []
    for name in ("dp2_on", "dp4_zero_on", "tp2", "tp2_sp_on", "pp2_vpp2_on", "pp4_on", "cp4_ring_off", "cp2_a2a_on",
                 "dp2_tp2_pp2_sp_all", "moe_dp4_ep2_on", "moe_dp4_ep2_zero", "moe_dp2_ep2_tp2_pp2_all",
                 "moe_shared_dp2_ep2_allgather"):
        cfg = compose([*RUNS, *LAYOUTS[name]])
        est = estimate(cfg, build_layout(cfg).world).comm_bytes_per_step
        measured = runs[name][-1]["comm"]
        # Every mode either side names: a mode the estimate predicts and the ledger misses (or
        # the other way round) fails.
        predicted = {mode for mode, b in est.items() if b > 0}
        assert set(measured) == predicted, (name, sorted(measured), sorted(predicted))
        for mode in predicted:
            got = measured[mode]["bytes"]
            if mode in ("pp", "cp") or (mode == "dp" and name == "dp2_on"):
                # Exact for pp, cp and plain dp.
                if got != est[mode]:
                    off.append((name, mode, got, est[mode]))
            elif abs(got - est[mode]) > 0.03 * est[mode]:
                # tp leaves out the small loss and norm reductions; ZeRO-1 pads its buckets to a
                # multiple of dp; dp composed with tp/pp/ep is within 0.2% (bucket padding).
                off.append((name, mode, got, est[mode]))
    assert not off, off


def test_overlap_on_off_identical(runs):
    assert loss_of(runs["dp2_on"]) == loss_of(runs["dp2_off"])
    on, off = runs["dp2_on"], runs["dp2_off"]
    assert [r["grad_norm"] for r in on] == [r["grad_norm"] for r in off]
    # Same collectives either way: the same number of DP ops and bytes.
    assert [r["comm"]["dp"]["bytes"] for r in on] == [r["comm"]["dp"]["bytes"] for r in off]


RESUME = ["parallel.dp=2", "train.distributed_optimizer=true", "train.lr_decay_steps=6", "checkpoint.interval=3"]
RESHARD = ["train.lr_decay_steps=6", "checkpoint.interval=3"]
CHAIN = ["train.lr_decay_steps=6", "checkpoint.interval=2"]
MOE_RESHARD = [*MOE, "parallel.dp=2", "train.lr_decay_steps=6", "checkpoint.interval=3"]
SAVED_TP2_SP_ZERO = ["parallel.tp=2", "parallel.sequence_parallel=true", "train.distributed_optimizer=true"]


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """Runs that save, stop, and are resumed (at the same or another layout) by the next
    segment, each segment a full Trainer.run() (tests/inproc_train.py run_chains); the root
    holds one run directory per chain."""
    from inproc_train import run_chains, world_of

    def seg(overrides, steps):
        full = [*SMALL, *overrides]
        return world_of(full), full, steps

    chains = {
        "full": [seg(RESUME, 6)], "part": [seg(RESUME, 3), seg(RESUME, 6)],
        "ref": [seg(RESHARD, 6)],
        "to_dp2": [seg([*RESHARD, *SAVED_TP2_SP_ZERO], 3), seg([*RESHARD, "parallel.dp=2"], 6)],
        "to_cp2": [seg([*RESHARD, *SAVED_TP2_SP_ZERO], 3), seg([*RESHARD, "parallel.cp=2"], 6)],
        "pp2_to_tp2": [seg([*RESHARD, "parallel.pp=2"], 3), seg([*RESHARD, "parallel.tp=2"], 6)],
        "chain_ref": [seg(CHAIN, 6)],
        "chain": [seg([*CHAIN, "parallel.tp=2", "parallel.pp=2"], 2), seg([*CHAIN, "parallel.tp=1"], 4),
                  seg([*CHAIN, "parallel.tp=4"], 6)],
        "moe_ref": [seg(MOE_RESHARD, 6)],
        # Saved with ZeRO-1 at ep1 (expert optimizer state sharded over edp = 2), loaded at ep2.
        "ep1_zero_to_ep2": [seg([*MOE_RESHARD, "train.distributed_optimizer=true"], 3),
                            seg([*MOE_RESHARD, "parallel.ep=2"], 6)],
        "ep2_to_ep1": [seg([*MOE_RESHARD, "parallel.ep=2"], 3), seg(MOE_RESHARD, 6)],
    }
    root = tmp_path_factory.mktemp("resumed")
    run_chains(chains, root)
    return root


def test_resume_reproduces_uninterrupted_run(resumed):
    assert (resumed / "part" / "checkpoints" / "step_00000003" / "COMPLETE").is_file()
    part = rows(resumed / "part")
    # Steps 1-3 from the first segment, 4-6 from the resumed one: nothing retrained.
    assert [r["step"] for r in part] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in part] == [r["loss"] for r in rows(resumed / "full")]


def test_checkpoint_reshards_across_layouts(resumed):
    """Saved at tp2 x SP with ZeRO-1 (resumed at dp2 and at cp2) and at pp2 (resumed at tp2):
    the same curve."""
    ref = losses(resumed / "ref")
    for name in ("to_dp2", "to_cp2", "pp2_to_tp2"):
        assert [r["step"] for r in rows(resumed / name)] == [1, 2, 3, 4, 5, 6]
        assert_close(losses(resumed / name), ref)


def test_checkpoint_reshards_tp_pp_chain_and_ep(resumed):
    """tp2 x pp2 -> tp1 x pp1 -> tp4 on one curve; an MoE checkpoint moves from ep1 (ZeRO-1) to
    ep2 and from ep2 to ep1 (experts are saved under their global index)."""
    assert [r["step"] for r in rows(resumed / "chain")] == [1, 2, 3, 4, 5, 6]
    assert_close(losses(resumed / "chain"), losses(resumed / "chain_ref"))
    for name in ("ep1_zero_to_ep2", "ep2_to_ep1"):
        assert [r["step"] for r in rows(resumed / name)] == [1, 2, 3, 4, 5, 6]
        assert_close(losses(resumed / name), losses(resumed / "moe_ref"))


def test_torchrun_joins(tmp_path, cli_dp2):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                "-m", "mpoverlap.train"]
    train(tmp_path / "tr", *RUNS[len(SMALL):], "parallel.dp=auto", "overlap.dp=true", launcher=launcher)
    assert losses(tmp_path / "tr") == losses(cli_dp2)


def test_invalid_config_exits_2_before_any_worker(tmp_path):
    proc = train(tmp_path / "bad", "overlap.dp=true", "parallel.tp=0", "model.num_attention_heads=3",
                 expect=2)
    assert "Traceback" not in proc.stderr
    assert "overlap.dp=true" in proc.stderr and "parallel.tp=0" in proc.stderr
    assert not (tmp_path / "bad").exists()


def test_missing_data_file_is_one_paragraph(tmp_path):
    proc = train(tmp_path / "bad", "data=indexed", f"data.path={tmp_path}/nothing", expect=2)
    assert "Traceback" not in proc.stderr and f"{tmp_path}/nothing" in proc.stderr


def test_incompatible_checkpoint_is_refused(tmp_path):
    from inproc_train import run_chains

    # The checkpoint comes from Trainer.run() in a spawned world (what the launch runs); the
    # refusal under test is the console script's.
    run_chains({"a": [(1, [*SMALL, "checkpoint.interval=2"], 2)]}, tmp_path)
    proc = train(tmp_path / "a", "model.num_layers=3", steps=4, expect=1)
    assert "model.num_layers" in proc.stderr and "Traceback" not in proc.stderr
    assert (tmp_path / "a" / "checkpoints" / "step_00000002" / "COMPLETE").is_file()


def test_multirun_gives_each_job_its_run_dir(tmp_path):
    proc = train(tmp_path / "mr", "-m", "overlap.dp=true,false", "parallel.dp=2", steps=2)
    jobs = sorted(p.name for p in (tmp_path / "mr").iterdir())
    assert jobs == ["0_overlap.dp-True", "1_overlap.dp-False"], proc.stdout
    assert losses(tmp_path / "mr" / jobs[0]) == losses(tmp_path / "mr" / jobs[1])
    bad = train(tmp_path / "mr2", "-m", "parallel.dp=1,0", steps=2, expect=2)
    assert "no job was started" in bad.stderr and not (tmp_path / "mr2").exists()


# ---- bf16 (train.precision=bf16): the GPU's precision path, run on CPU autocast -------------
# 4 layers (so pp2 x vpp2 fits), 2 microbatches per step, 20 steps (layouts 10); every layout against the
# single-process bf16 run, which is checked against fp32.
#
# Where the bounds come from. CPUs round bf16 (and order fp32 sums) differently by kernel
# path: ATen's vectorised kernels (DEFAULT, AVX2, AVX-512), MKL's fp32 GEMMs by ISA, oneDNN's bf16 GEMMs
# on AVX-512/AMX machines and ATen's own elsewhere. Over a training curve the last-bit differences grow
# to 1e-5..1e-3, so no constant tuned on one machine's curve is a bound (constants tuned on an AVX-512
# machine fail on an AVX2 one). The bounds are multiples of a noise floor measured in the same run: the single
# process at micro-batch 2 against itself at micro-batch 4 (the same math summed in another order).
# Measured over this fixture on five kernel paths of one AVX-512 machine: ATen AVX-512 +
# oneDNN (the machine as it is), ATen AVX2 + oneDNN, ATen DEFAULT + oneDNN, an AVX2 machine's path (ATen
# AVX2, MKL_ENABLE_INSTRUCTIONS=AVX2, oneDNN off: ATen's own bf16 GEMM), and all scalar (ATen DEFAULT,
# MKL_CBWR=COMPATIBLE, oneDNN off). Dense floor over the 20 steps: loss 7.1e-5..1.6e-4, grad norm
# 9.2e-4..4.3e-3. MoE floor over the first 10 steps: loss 1.2e-4..1.7e-4, grad norm 4.2e-4..1.1e-3
# (over 20 it reaches 3e-3..1.2e-2 on every path: the twins fall into other routings after step 10, a
# floor that would hide anything). The ratios each assertion saw are listed beside its factor.
BF16 = ["model.num_layers=4", "train.global_batch_size=8", "train.micro_batch_size=4", "train.eval_iters=1"]
BF16_LAYOUTS = {
    "fp32": ["train.precision=fp32"],
    "bf16": ["train.precision=bf16"],
    "dp2_on": ["train.precision=bf16", "parallel.dp=2", "train.grad_reduce_dtype=bf16", "overlap.dp=true"],
    "dp2_off": ["train.precision=bf16", "parallel.dp=2", "train.grad_reduce_dtype=bf16", "overlap=none"],
    "tp2_sp_off": ["train.precision=bf16", "parallel.tp=2", "parallel.sequence_parallel=true", "overlap.tp=false"],
    "tp2_sp_pp2_vpp2_on": ["train.precision=bf16", "parallel.tp=2", "parallel.sequence_parallel=true",
                           "parallel.pp=2", "parallel.vpp=2", "overlap.tp=true", "overlap.pp=true"],
    # ZeRO-1 over the dp x cp group of two.
    "cp2_ring_zero": ["train.precision=bf16", "parallel.cp=2", "overlap.cp=true", "train.distributed_optimizer=true"],
    "cp2_a2a": ["train.precision=bf16", "parallel.cp=2", "parallel.cp_comm=a2a"],
    # Zero-bubble pipelines: the weight gradients deferred to W actions, in bf16 GEMMs.
    "zb1p_pp2": ["train.precision=bf16", "parallel.pp=2", "parallel.pp_schedule=zb1p", "overlap.pp=true"],
    "zbv_pp2": ["train.precision=bf16", "parallel.pp=2", "parallel.vpp=2", "parallel.pp_schedule=zbv",
                "overlap.pp=true"],
    # MoE: the single-process bf16 run is the reference of the expert-parallel one.
    "moe_bf16": [*MOE, "train.precision=bf16"],
    "moe_dp2_ep2_bf16": [*MOE, "train.precision=bf16", "parallel.dp=2", "parallel.ep=2", "overlap.ep=true", "overlap.ep_chunks=4"],
    # The noise floors: each single-process reference at micro-batch 2 (the same math, another order).
    "bf16_mb2": ["train.precision=bf16", "train.micro_batch_size=2"],
    "moe_bf16_mb2": [*MOE, "train.precision=bf16", "train.micro_batch_size=2"],
}
REFERENCES = ("fp32", "bf16", "moe_bf16", "bf16_mb2", "moe_bf16_mb2")
FLOOR_OF = {"bf16": "bf16_mb2", "moe_bf16": "moe_bf16_mb2"}
# The single-process references and the dense floor train 20 steps (the MoE floor 10); the layouts the
# first 10 of them, but context parallelism (its blocks on the fused kernel in bf16, merged in fp32) all 20.
BF16_STEPS = {"fp32": 20, "bf16": 20, "moe_bf16": 20, "bf16_mb2": 20, "moe_bf16_mb2": 10, "cp2_ring_zero": 20,
              "cp2_a2a": 20}
# fp32 twins of every multi-rank bf16 layout, 1 step: their bytes per step are compared (each
# layout's dtype check: its activations / gradients travel in bf16), and their first loss is the
# fp32 curve a layout that silently computed in fp32 would sit on.
BF16_TWINS = {name: f"fp32_{name}" for name in BF16_LAYOUTS if name not in REFERENCES}
# The fp32 residual stream (docs/invariants.md, "The bf16 residual stream"): its
# configuration, its first F9_STEPS steps, trained in the same spawns. train.seed=2: a trajectory where the single
# process is stable; at the default seed its own micro-batch-1 twin (same math, another fp32
# accumulation order) is 2.1% away at step 7 and tp2/cp2 5% at single-step spikes (the first step's
# bf16-level gradient error, ~2e-3, flips the signs of Adam's first update: docs/invariants.md).
F9 = ["model.num_layers=8", "model.hidden_size=64", "model.num_attention_heads=4", "model.ffn_hidden_size=256",
      "model.seq_length=64", "train.micro_batch_size=2", "train.global_batch_size=8", "train.lr_warmup_steps=2",
      "train.precision=bf16", "train.lr_decay_steps=40", "train.seed=2", "train.eval_iters=1",
      "train.progress=false", "train.log_interval=1"]
# 10 steps (of the 20 measured below): the spikes at the default seed come by step 7, a bf16 residual stream
# shows at step 1 (the 1e-6 / 1e-5 checks below) and in the bytes; the gaps measured over 20 steps
# (below) bound those over the first 10.
F9_STEPS = 10
F9_LAYOUTS = {
    "f9_ref": [],
    "f9_tp2_sp_cm": ["parallel.tp=2", "parallel.sequence_parallel=true", "overlap.tp=true"],
    "f9_pp2_vpp2": ["parallel.pp=2", "parallel.vpp=2"],
    "f9_cp2": ["parallel.cp=2"],
    "f9_dp2": ["parallel.dp=2"],
}


@pytest.fixture(scope="module")
def bf16_runs(tmp_path_factory):
    """{name: rows}: every layout trained inside one spawn per world size (tests/inproc_train.py)."""
    from inproc_train import train_layouts, world_of

    specs = {name: (world_of([*SMALL, *BF16, *ov]), [*SMALL, *BF16, *ov], BF16_STEPS.get(name, 10))
             for name, ov in BF16_LAYOUTS.items()}
    for name, twin in BF16_TWINS.items():
        fp32 = [o for o in BF16_LAYOUTS[name] if not o.startswith(("train.precision", "train.grad_reduce"))]
        specs[twin] = (world_of([*SMALL, *BF16, *fp32]), [*SMALL, *BF16, *fp32, "train.precision=fp32"], 1)
    specs.update({name: (world_of([*F9, *ov]), [*F9, *ov], F9_STEPS) for name, ov in F9_LAYOUTS.items()})
    return train_layouts(specs, tmp_path_factory.mktemp("bf16"))


def rel_gaps(got, want, key):
    """Largest relative gap of `key` (loss or grad_norm) over the rows both runs have."""
    n = min(len(got), len(want))
    assert n
    return max(abs(a[key] - b[key]) / abs(b[key]) for a, b in zip(got[:n], want[:n]))


def floor_gaps(bf16_runs, ref):
    """{loss, grad_norm}: the largest relative gap between the single-process reference `ref` and
    its micro-batch-2 twin: over their 20 steps for the dense model, over the first 10 for MoE
    (see above). How far bf16 rounding in another summation order moves this trajectory on this
    machine's kernels."""
    twin, want = bf16_runs[FLOOR_OF[ref]], bf16_runs[ref]
    n = 10 if ref == "moe_bf16" else 20
    assert len(twin) == n and len(want) == 20
    return {key: rel_gaps(twin[:n], want, key) for key in ("loss", "grad_norm")}


# Factors on the floor (largest ratio measured on the five paths; the factor leaves at least 2.8x):
# bf16 against fp32 over the first 10 steps: loss 1.29, grad norm 1.12 -> 4. Over 20 steps the
# grad norm of the two drifts apart by up to 7.4 floors (6.8e-3 on the AVX2 machine's path; that
# machine reported 1.08e-2), so the grad norm is held over the first 10 and the loss curve over all
# 20 to the 2e-2 every bf16 curve is held to (measured 1.1e-4..1.8e-4).
FP32_FLOORS = 4.0
# The lower bound (autocast ran): fp32 at micro-batch 2 against micro-batch 4 differs by 1.8e-7 to
# 2.2e-7 on the loss over 20 steps (every path); bf16 against fp32 by 1.1e-4 at least: 1e-6 is 4.5x
# the one and under 1/100 of the other.
AUTOCAST_RAN = 1e-6


def test_bf16_single_process_tracks_fp32(bf16_runs):
    fp32, bf16 = bf16_runs["fp32"], bf16_runs["bf16"]
    assert len(bf16) == len(fp32) == 20
    floor = floor_gaps(bf16_runs, "bf16")
    gaps = {key: rel_gaps(bf16[:10], fp32, key) for key in ("loss", "grad_norm")}
    whole = rel_gaps(bf16, fp32, "loss")
    print(f"\nbf16 vs fp32 over 10 steps: {gaps}, loss over 20: {whole:.2e}; the floor: {floor}")
    assert whole > AUTOCAST_RAN, whole  # autocast really ran
    assert whole <= 2e-2, whole
    for key in ("loss", "grad_norm"):
        assert gaps[key] <= FP32_FLOORS * floor[key], (key, gaps, floor)
    assert bf16[-1]["loss"] < bf16[0]["loss"]


# Each layout's first 10 steps (CP's 20) against the single-process bf16 run of the same model, in
# floors of that reference. Largest ratios on the five paths: dense layouts loss 0.87, grad norm 1.27
# -> 4; MoE ep 2 loss 1.77, grad norm 2.11 -> 6.
LAYOUT_FLOORS = {"bf16": 4.0, "moe_bf16": 6.0}
# A layout that silently computed in fp32 sits on the fp32 curve: its first loss within fp32 rounding
# of the fp32 single process (its fp32 twin: 0 to 1.8e-7 relative on every path). A bf16 layout's first
# loss is 9.2e-6..2.3e-5 from it: at least 10x the larger of 1e-7 and its twin's gap leaves 5x.
FP32_CURVE_FACTOR = 10.0


def test_bf16_layouts_reproduce_single_process_bf16_curve(bf16_runs):
    """Each layout tracks its bf16 reference within a few noise floors on loss and grad norm, and
    computes in bf16 (its first loss is off the fp32 curve, which an fp32 layout sits on)."""
    report, floors = {}, {ref: floor_gaps(bf16_runs, ref) for ref in FLOOR_OF}
    fp32_first = bf16_runs["fp32"][0]["loss"]
    for name in BF16_LAYOUTS:
        if name in REFERENCES:
            continue
        ref = "moe_bf16" if name.startswith("moe") else "bf16"
        got = bf16_runs[name]
        assert len(got) == BF16_STEPS.get(name, 10)
        if len(got) > 10:  # CP's 20 steps: the whole curve within 2e-2 (measured 8.1e-5 to
            # 2.4e-4 on the five paths), the floor-relative bounds over the first 10 as for every layout
            assert rel_gaps(got, bf16_runs[ref], "loss") <= 2e-2, name
            got = got[:10]
        report[name] = {key: rel_gaps(got, bf16_runs[ref], key) / floors[ref][key] for key in ("loss", "grad_norm")}
        report[name]["ref"] = ref
        if ref == "bf16":
            report[name]["first_loss_off_fp32"] = abs(got[0]["loss"] - fp32_first) / fp32_first
            report[name]["fp32_twin_off_fp32"] = abs(bf16_runs[BF16_TWINS[name]][0]["loss"] - fp32_first) / fp32_first
    print(f"\nbf16 layouts, largest relative gap to the bf16 reference in floors {floors}: {report}")
    for name, gaps in report.items():
        for key in ("loss", "grad_norm"):
            assert gaps[key] <= LAYOUT_FLOORS[gaps["ref"]], (name, key, gaps, floors)
        if "first_loss_off_fp32" in gaps:
            assert gaps["first_loss_off_fp32"] >= FP32_CURVE_FACTOR * max(1e-7, gaps["fp32_twin_off_fp32"]), \
                (name, gaps)
    moe_ref = [r["loss"] for r in bf16_runs["moe_bf16"]]
    assert len(moe_ref) == 20 and moe_ref[-1] < moe_ref[0]


def test_bf16_overlap_on_off_identical(bf16_runs):
    """Overlap changes when handles are waited, not the arithmetic: dp with a bf16 gradient
    reduction, on vs off. (tp on/off differ: collective matmul changes the reduction order.)"""
    on, off = bf16_runs["dp2_on"], bf16_runs["dp2_off"]
    assert [r["loss"] for r in on] == [r["loss"] for r in off]
    assert [r["grad_norm"] for r in on] == [r["grad_norm"] for r in off]


def test_bf16_halves_activation_and_gradient_bytes(bf16_runs):
    """Every multi-rank bf16 layout against its fp32 twin: tp, cp and ep move activations
    (and their gradients) in bf16: half the fp32 bytes, but for the reductions that stay fp32
    (the embedding's output, the residual stream's start; the loss statistics, the SP norm
    gradients, the router's). pp moves the residual stream, fp32 in every layout
    (docs/invariants.md): the fp32 bytes. dp halves with train.grad_reduce_dtype=bf16 and stays
    fp32 without it."""
    ratios = {}
    for name, twin in BF16_TWINS.items():
        bf16, fp32 = bf16_runs[name][-1]["comm"], bf16_runs[twin][-1]["comm"]
        assert set(bf16) == set(fp32), name
        ratios[name] = {mode: bf16[mode]["bytes"] / fp32[mode]["bytes"] for mode in bf16}
    print(f"\nbf16 / fp32 bytes: {ratios}")
    for name, per_mode in ratios.items():
        if "train.grad_reduce_dtype=bf16" in BF16_LAYOUTS[name]:
            assert per_mode["dp"] == 0.5, (name, per_mode)
        # (ZeRO-1's after-step gather is counted at the next forward: a 1-step twin's dp row
        # is not comparable with a 10th step's, so dp is compared only where it halves.)
        activations = {mode: ratio for mode, ratio in per_mode.items() if mode not in ("dp", "pp")}
        if "pp" in per_mode:
            assert per_mode["pp"] == 1.0, (name, per_mode)
        assert "stop" not in per_mode, (name, per_mode)  # no SIGTERM: the agreement exchanged nothing
        for mode, ratio in activations.items():
            assert 0.5 <= ratio <= 0.56, (name, mode, ratio)
        # Something halved, except where the layout moves only the fp32 residual stream (pp alone):
        # whether those compute in bf16 is test_bf16_layouts_reproduce_single_process_bf16_curve's.
        assert activations or per_mode.get("dp") == 0.5 or set(per_mode) == {"pp"}, (name, per_mode)
    # mpoverlap-check's dp estimate follows train.grad_reduce_dtype.
    from mpoverlap.config import compose
    from mpoverlap.overlap.estimate import estimate

    measured = bf16_runs["dp2_on"][-1]["comm"]["dp"]["bytes"]
    est = estimate(compose([*SMALL, *BF16, *BF16_LAYOUTS["dp2_on"]]), 2).comm_bytes_per_step["dp"]
    assert abs(measured - est) <= 0.03 * est, (measured, est)


def test_bf16_residual_stream_is_one_dtype_in_every_layout(bf16_runs):
    """The residual stream is fp32 in every layout (pipeline p2p, TP
    embedding reduction). pp 2 x vpp 2 (and dp 2) compute the single process's first step up to
    fp32 summation order; the four layouts of
    F9_LAYOUTS stay within 2e-2 of the bf16 single process over F9_STEPS steps; the pp bytes are the
    estimate's, the tp bytes within 3% of it (fp32 embedding reduction, bf16 GEMM partial sums)."""
    from mpoverlap.config import compose
    from mpoverlap.overlap.estimate import estimate

    ref = bf16_runs["f9_ref"]
    # Step 1, relative: pp 2 x vpp 2 measured loss 0, grad norm 7.5e-7 (the tied embedding's
    # gradient summed over the stages in another order); with bf16 boundaries 3.7e-6 and 7.3e-5.
    for name in ("f9_pp2_vpp2", "f9_dp2"):
        for key, tol in (("loss", 1e-6), ("grad_norm", 1e-5)):
            assert abs(bf16_runs[name][0][key] - ref[0][key]) <= tol * ref[0][key], (name, key)
    gaps = {name: rel_gaps(bf16_runs[name], ref, "loss") for name in F9_LAYOUTS if name != "f9_ref"}
    print(f"\nfp32 residual stream, {F9_STEPS} steps, largest relative loss gap to the bf16 single process: {gaps}")
    assert len(ref) == F9_STEPS and all(len(bf16_runs[name]) == F9_STEPS for name in gaps)
    # 2e-2 (the bound for bf16 curves): on the five kernel paths of the bf16 notes above the four
    # layouts reached 4.4e-4..1.0e-3 over 20 steps and a micro-batch-1 twin of the reference 2.5e-4..3.8e-4 (measured
    # once, not trained here) (step 1: loss 0, grad norm 6.8e-7..7.6e-7
    # against the 1e-5 above): 13x margin or more on every bound of this test.
    assert max(gaps.values()) <= 2e-2, gaps
    for name, mode, tol in (("f9_pp2_vpp2", "pp", 0.0), ("f9_tp2_sp_cm", "tp", 0.03)):
        est = estimate(compose([*F9, *F9_LAYOUTS[name]]), 2).comm_bytes_per_step[mode]
        got = bf16_runs[name][-1]["comm"][mode]["bytes"]
        assert abs(got - est) <= tol * est, (name, mode, got, est)
