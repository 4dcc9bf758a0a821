"""Hugging Face interop end to end: a checkpoint trained at dp2 x tp2 x pp2 is exported and
loaded by transformers, whose logits must equal the single-process mpoverlap model's with the
same weights (dense Llama-style and MoE/Mixtral); import at a layout starts from exactly those
weights; import then export is bitwise identical; inexact models are refused."""
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from test_train_cli import SMALL, rows, train

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from omegaconf import OmegaConf  # noqa: E402

from mpoverlap.config import compose  # noqa: E402
from mpoverlap.interop.checkpoint_reader import read_checkpoint, resolve_step_dir  # noqa: E402
from mpoverlap.interop.export import main as export_main  # noqa: E402
from mpoverlap.models.gpt import GPT  # noqa: E402

# Grouped-query attention (4 heads over 2 K/V groups: HF num_key_value_heads=2), as Llama 3 and
# Mixtral have it; the tied-embeddings case below keeps multi-head attention.
LLAMA = ["model.norm=rmsnorm", "model.activation=swiglu", "model.tie_embeddings=false", "model.num_query_groups=2"]
MODELS = {"dense": LLAMA,
          "moe": ["model=moe_tiny", "model.moe_ffn_hidden_size=64", "model.moe_layer_freq=1",
                  "model.shared_expert=false", *LLAMA, "parallel.ep=2"]}
LAYOUT = ["parallel.dp=2", "parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true"]
# The same math in fp32: measured 0 (bitwise equal logits: dense, MoE, and tied on
# 1,024 positions); a RoPE base 5% off gives 7.6e-5 at 64 positions, 1.1e-4 at 1,024.
EXPORT_TOL = 1e-6
# Model overrides only (what an import run must repeat to match the export's shapes).
SHAPE = [o for o in SMALL if o.startswith("model.")]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """{kind: (run dir, export dir)}: 2 steps at dp2 x tp2 x pp2 (both kinds in one spawn of 8
    ranks, each a full Trainer.run()), exported (MoE in shards). checkpoint.dir lies outside
    run.dir (shared storage, as on clusters): the export gets the checkpoint alone, no
    --config, and reads the config the checkpoint carries."""
    from inproc_train import run_chains

    root = tmp_path_factory.mktemp("trained")
    run_chains({kind: [(8, [*SMALL, *model, *LAYOUT, "checkpoint.interval=2",
                            f"checkpoint.dir={root / 'shared_storage' / kind}"], 2)] for kind, model in MODELS.items()},
               root)
    out = {}
    for kind in MODELS:
        run, store = root / kind, root / "shared_storage" / kind
        hf = run / "hf"
        assert (store / "step_00000002" / "config.yaml").is_file() and not (store.parent / "config.yaml").exists()
        shard = ["--max-shard-size", "200KB"] if kind == "moe" else []
        assert export_main([str(store), "--out", str(hf), *shard]) == 0
        out[kind] = (run, hf)
    return out


def checkpoint_of(run: Path) -> Path:
    """The newest complete checkpoint of `run` (its checkpoint.dir, else <run>/checkpoints)."""
    return resolve_step_dir(OmegaConf.load(run / "config.yaml").checkpoint.dir or run)


def reference_logits(run: Path, tokens: torch.Tensor) -> torch.Tensor:
    """The single-process mpoverlap model with the checkpoint's weights."""
    cfg = OmegaConf.load(run / "config.yaml")
    model = GPT(cfg.model)
    weights, _ = read_checkpoint(checkpoint_of(run))
    model.load_state_dict(weights, strict=True)
    with torch.no_grad():
        return model.eval()(tokens)


def fixed_batch(vocab: int = 256, seq: int = 64) -> torch.Tensor:
    return torch.randint(0, vocab, (3, seq), generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize("kind", list(MODELS))
def test_export_logits_equal_single_process(trained, kind):
    run, hf = trained[kind]
    config = json.loads((hf / "config.json").read_text())
    expected_arch = "MixtralForCausalLM" if kind == "moe" else "LlamaForCausalLM"
    assert config["architectures"] == [expected_arch] and config["vocab_size"] == 256
    assert config["num_attention_heads"] == 4 and config["num_key_value_heads"] == 2
    if kind == "moe":  # sharded above --max-shard-size, with the index
        index = json.loads((hf / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1
        assert all((hf / f).is_file() for f in index["weight_map"].values())
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32).eval()
    assert type(model).__name__ == expected_arch
    tokens = fixed_batch()
    with torch.no_grad():
        theirs = model(tokens).logits
    ours = reference_logits(run, tokens)
    rel = ((theirs - ours).abs().max() / ours.abs().max()).item()
    print(f"{kind}: max |HF - mpoverlap| / max |mpoverlap| = {rel:.3e}")
    assert rel <= EXPORT_TOL


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _import_and_save(hf: Path, run: Path, model_overrides) -> Path:
    """A one-process trainer imports `hf` through the trainer's own path (maybe_resume) and
    saves that state as step 0, untrained."""
    script = (
        "import sys\nfrom omegaconf import OmegaConf\nfrom mpoverlap.config import compose\n"
        "from mpoverlap.training.loop import Trainer\n"
        "from mpoverlap.training.setup import init_distributed, shared_run_dir\n"
        "cfg = compose(sys.argv[1:])\nstate = init_distributed(cfg)\nrun_dir = shared_run_dir(cfg)\n"
        "(run_dir / 'config.yaml').write_text(OmegaConf.to_yaml(cfg))\n"
        "t = Trainer(cfg, state, run_dir)\nt.maybe_resume()\nassert t.step == 0\nt.save()\n")
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()), OMP_NUM_THREADS="1")
    args = [sys.executable, "-c", script, *model_overrides, f"checkpoint.init_from={hf}", f"run.dir={run}"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "initialised from" in proc.stdout
    return run


@pytest.mark.parametrize("kind", list(MODELS))
def test_import_then_export_is_bitwise_identical(trained, kind, tmp_path):
    run, hf = trained[kind]
    model = [o for o in MODELS[kind] if o.startswith("model")]
    again = _import_and_save(hf, tmp_path / "imported", SHAPE + model)
    out = tmp_path / "hf_again"
    shard = ["--max-shard-size", "200KB"] if kind == "moe" else []
    assert export_main([str(again), "--out", str(out), *shard]) == 0
    files = sorted(os.listdir(hf))
    assert sorted(os.listdir(out)) == files
    for name in files:
        assert (out / name).read_bytes() == (hf / name).read_bytes(), name


def test_import_at_a_layout_starts_from_the_exported_weights(trained, tmp_path):
    """Imported at tp2 x pp2: the first step's loss, computed before any update, equals
    the single-process model's loss on the same batch; a checkpoint in checkpoint.dir then
    takes precedence over init_from."""
    from mpoverlap.training.data import build_datasets, global_batch

    run, hf = trained["dense"]
    layout = ["parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true", "checkpoint.interval=1"]
    proc = train(tmp_path / "imp", *LLAMA, *layout, f"checkpoint.init_from={hf}", steps=1)
    assert "initialised from" in proc.stdout
    cfg = compose(SMALL + LLAMA)
    data, _ = build_datasets(cfg.data, cfg.model.seq_length, cfg.model.vocab_size)
    batch = global_batch(data, 0, cfg.train.global_batch_size, cfg.train.seed)
    model = GPT(cfg.model)
    model.load_state_dict(read_checkpoint(checkpoint_of(run))[0])
    with torch.no_grad():
        ref = model.loss(model(batch[:, :-1]), batch[:, 1:]).item()
    got = rows(tmp_path / "imp")[0]["loss"]
    assert abs(got - ref) <= 1e-5 * abs(ref), (got, ref)
    again = train(tmp_path / "imp", *LLAMA, *layout, f"checkpoint.init_from={hf}", steps=2)
    assert "takes precedence" in again.stdout and "initialised from" not in again.stdout


def test_init_from_shape_mismatch_refused_before_workers(trained, tmp_path):
    _, hf = trained["dense"]
    proc = train(tmp_path / "bad", *LLAMA, "model.num_layers=3", f"checkpoint.init_from={hf}", expect=2)
    assert "model.num_layers: HF 2, ours 3" in proc.stderr and "fix: model.num_layers=2" in proc.stderr
    assert not (tmp_path / "bad" / "metrics.jsonl").exists()
    # K/V groups are a shape key too: HF num_key_value_heads=2 against multi-head attention
    proc = train(tmp_path / "bad_kv", *LLAMA, "model.num_query_groups=null", f"checkpoint.init_from={hf}", expect=2)
    assert "model.num_query_groups: HF 2, ours 4" in proc.stderr and "fix: model.num_query_groups=2" in proc.stderr


def _fake_checkpoint(root: Path, overrides) -> Path:
    """A complete one-process checkpoint (initial weights) of the model `overrides` describe,
    as checkpoints were written before they carried their config: the run's config.yaml
    beside checkpoints/, none inside the step directory."""
    import torch.distributed.checkpoint as dcp

    from mpoverlap.training.resume import shape_keys

    cfg = compose(SMALL + list(overrides))
    step = root / "checkpoints" / "step_00000000"
    meta = {"step": 0, "model": shape_keys(cfg.model)}
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": GPT(cfg.model).state_dict(), "meta": meta}, checkpoint_id=str(step), no_dist=True)
    (step / "COMPLETE").write_text("{}")
    (root / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    return root


def test_old_checkpoint_away_from_its_run_needs_config_and_config_overrides(tmp_path, capsys):
    """A checkpoint without its own config.yaml, moved away from its run directory: refused
    with the keys it lacks and the fix; --config supplies them. (The checkpoints a run writes
    carry their config: the `trained` fixture exports one with no --config.)"""
    run = _fake_checkpoint(tmp_path / "run", LLAMA)
    moved = tmp_path / "elsewhere" / "step_00000000"
    moved.parent.mkdir()
    (run / "checkpoints" / "step_00000000").rename(moved)
    assert export_main([str(moved), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "model.rope_base" in err and "pass --config" in err, err
    assert export_main([str(moved), "--out", str(tmp_path / "hf"), "--config", str(run / "config.yaml")]) == 0


@pytest.mark.parametrize("overrides,named", [
    (["model.norm=layernorm", "model.activation=gelu"], ["model.norm=layernorm", "model.activation=gelu"]),
    (["model=moe_tiny", "model.shared_expert=true"], ["model.shared_expert=true"]),
    (["model=moe_tiny", "model.moe_layer_freq=2"], ["model.moe_layer_freq=2"]),
    (["model=moe_tiny", "model.moe_router_force_load_balancing=true"], ["model.moe_router_force_load_balancing=true"]),
    (["model=moe_tiny", "model.moe_router_num_groups=2", "model.moe_router_scaling_factor=2.5"],
     ["model.moe_router_num_groups=2", "model.moe_router_scaling_factor=2.5"]),
    (["model.mtp_num_layers=1"], ["model.mtp_num_layers=1"]),
    (["model=moe_fine_tiny", "model.shared_expert=false", "model.moe_shared_expert_ffn_hidden_size=null",
      "model.moe_router_score=sigmoid", "model.moe_router_bias_update_rate=0.01"],
     ["model.moe_first_dense_layers=1", "model.moe_router_score=sigmoid", "model.moe_router_norm_topk=false",
      "model.moe_router_bias_update_rate=0.01"]),
    # latent attention maps to DeepseekV3ForCausalLM (tests/test_interop_deepseek_v3.py), but not
    # with a softmax router or a norm epsilon its latent norms do not take
    (["model=deepseek_v3_tiny", "model.moe_router_score=softmax", "model.norm_eps=1e-5"],
     ["model.moe_router_score=softmax", "model.norm_eps=1e-05", "DeepseekV3ForCausalLM"]),
])
def test_inexact_models_are_refused(tmp_path, capsys, overrides, named):
    ckpt = _fake_checkpoint(tmp_path / "run", overrides)
    assert export_main([str(ckpt), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert all(n in err for n in named), err
    assert not (tmp_path / "hf").exists()


def test_tied_embeddings_padded_vocab_and_rope_base_export_exactly(tmp_path):
    """Tied head (no lm_head written), vocab 200 padded to 256, a non-default RoPE base, on 1,024
    positions (a RoPE base off by 5% shows at far positions)."""
    overrides = ["model.tie_embeddings=true", "model.vocab_size=200", "model.rope_base=500000",
                 "model.seq_length=1024"]
    ckpt = _fake_checkpoint(tmp_path / "run", overrides)
    assert export_main([str(ckpt), "--out", str(tmp_path / "hf")]) == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["tie_word_embeddings"] and config["vocab_size"] == 256
    # transformers 5 reads rope_parameters (4.x read rope_theta)
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 500000}
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    assert model.config.rope_parameters["rope_theta"] == 500000
    tokens = fixed_batch(vocab=200, seq=1024)
    with torch.no_grad():
        theirs = model(tokens).logits
    ours = reference_logits(tmp_path / "run", tokens)
    rel = ((theirs - ours).abs().max() / ours.abs().max()).item()
    print(f"tied, rope base 500000, 1,024 positions: max |HF - mpoverlap| / max |mpoverlap| = {rel:.3e}")
    assert rel <= EXPORT_TOL
