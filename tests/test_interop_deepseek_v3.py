"""DeepSeek-V3 from and to Hugging Face: a transformers-made random DeepseekV3ForCausalLM (tiny:
4 layers, the first dense, 8 routed experts in 4 groups of which 2 are kept, a shared expert,
routed weights scaled 2.5, nonzero e_score_correction_bias) imported with checkpoint.init_from
at tp 2 x pp 2 with sequence parallelism and saved; the single-process model with the saved
weights gives transformers' logits (1e-4 relative), and so does transformers on the exported
directory. Two directories: query latent with interleaved RoPE rows (DeepSeek's layout, which
the import permutes) and no query latent (q_proj) with rope_interleave=false (no permutation).

MTP: a model with one multi-token prediction depth, saved at tp 2 x pp 2, exported (DeepSeek's
model.layers.<num_hidden_layers>. layout, which transformers loads and skips) and read back:
every MTP tensor equals the checkpoint's. And a DeepSeek-layout directory holding an MTP layer
imported at tp 2 x pp 2: the saved checkpoint equals the source model tensor for tensor.
"""
import json
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from mpoverlap.config import compose  # noqa: E402

RUN = ["train.global_batch_size=4", "train.micro_batch_size=2", "train.log_interval=1", "data.max_bytes=300000",
       "train.progress=false", "train.eval_iters=1", "train.device=cpu", "train.steps=1"]
LAYOUT = ["parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true"]
OURS = ["model=deepseek_v3_tiny"]
HF_TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
               routed_scaling_factor=2.5, kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16,
               n_group=4, topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1, norm_topk_prob=True,
               max_position_embeddings=64, tie_word_embeddings=False, rms_norm_eps=1e-6)
CASES = {"latent_interleaved": (dict(q_lora_rank=32, rope_interleave=True), []),
         "q_proj_halves": (dict(q_lora_rank=None, rope_interleave=False), ["model.q_lora_rank=0"])}
TOL = 1e-4


def _save_hf(extra, out):
    """A random DeepseekV3ForCausalLM, saved; norms, routers and the routers' score biases moved
    off their initial ones/zeros so that a dropped or swapped tensor changes the logits."""
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**HF_TINY, **extra)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("gate.weight"):
                p.add_(0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    model.save_pretrained(str(out))
    return model


def resumed_trainer(rank, overrides, run_dir):
    """A Trainer in `run_dir` (its config.yaml written by rank 0, for `_ours`), resumed or
    imported (checkpoint.init_from)."""
    from omegaconf import OmegaConf

    from mpoverlap.training.loop import Trainer
    from mpoverlap.training.setup import init_distributed

    cfg = compose([*overrides, f"run.dir={run_dir}"])
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    t = Trainer(cfg, init_distributed(cfg), run_dir)
    t.maybe_resume()
    return t


def _worker(rank, world, specs, root):
    """Per spec: a Trainer at tp 2 x pp 2 (importing when checkpoint.init_from is set), saved."""
    from mpoverlap.training.loop import Trainer
    from mpoverlap.training.setup import init_distributed

    for name, overrides in specs.items():
        t = resumed_trainer(rank, overrides, Path(root) / name)
        for chunk in (t.chunks if not t.cfg.checkpoint.init_from else []):  # MTP routers' biases off zero
            for d, depth in (chunk.mtp.named_children() if chunk.mtp is not None else []):
                depth.block.mlp.router.expert_bias.copy_(0.01 * torch.arange(8.0) + int(d))
        t.save()
        t.checkpointer.wait()
    out = {}
    # The MTP routers' biases come back on resume; a checkpoint without them (as written when
    # only the main layers' were saved) still resumes, the MTP ones from zero.
    import mpoverlap.training.resume as resume

    def resumed(run_dir):
        cfg = compose([*specs["mtp"], f"run.dir={run_dir}"])
        t = Trainer(cfg, init_distributed(cfg), Path(run_dir))
        t.maybe_resume()
        return {k: b.tolist() for k, b in resume.expert_biases(t.chunks).items() if k.startswith("mtp.")}

    out["mtp_resumed"] = resumed(Path(root) / "mtp")
    keep = resume.expert_biases
    resume.expert_biases = lambda chunks: {k: b for k, b in keep(chunks).items() if not k.startswith("mtp.")}
    try:
        cfg = compose([*specs["mtp"], f"run.dir={Path(root) / 'mtp_old'}"])
        t = Trainer(cfg, init_distributed(cfg), Path(root) / "mtp_old")
        t.save()
        t.checkpointer.wait()
    finally:
        resume.expert_biases = keep
    out["mtp_old_resumed"] = resumed(Path(root) / "mtp_old")
    return out


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """{case: (original HF model, hf dir, run dir)} and the MTP run dir, after one spawn of 4."""
    from dist_harness import run_distributed

    root = tmp_path_factory.mktemp("deepseek_v3")
    made, specs = {}, {}
    for name, (extra, ours) in CASES.items():
        made[name] = (_save_hf(extra, root / f"hf_{name}"), root / f"hf_{name}", root / name)
        specs[name] = [*OURS, *ours, *LAYOUT, *RUN, f"checkpoint.init_from={root / f'hf_{name}'}"]
    specs["mtp"] = [*OURS, "model.mtp_num_layers=1", *LAYOUT, *RUN]
    specs["mtp_import"] = [*OURS, "model.mtp_num_layers=1", *LAYOUT, *RUN, f"checkpoint.init_from={root / 'hf_mtp'}"]
    source = _write_deepseek_dir_with_mtp(root / "hf_mtp")
    per_rank = run_distributed(_worker, 4, specs, str(root), timeout_s=600)
    return made, root / "mtp", (source, root / "mtp_import"), per_rank


def _write_deepseek_dir_with_mtp(out):
    """A DeepSeek-layout directory with one MTP layer (transformers writes none): a random
    single-process model with its norms and router biases off their initial values, exported."""
    from mpoverlap.interop.hf_dir import write_hf_dir
    from mpoverlap.interop.hf_mapping import hf_config
    from mpoverlap.interop.hf_tensors import to_hf
    from mpoverlap.models.gpt import GPT

    model = compose([*OURS, "model.mtp_num_layers=1"]).model
    torch.manual_seed(1)
    gpt = GPT(model)
    with torch.no_grad():
        for name, t in [*gpt.named_parameters(), *gpt.named_buffers()]:
            if "norm" in name or name.endswith("expert_bias"):
                t.add_(0.05 * torch.randn_like(t))
    keys = {k: model[k] for k in model}
    write_hf_dir(out, hf_config(keys), to_hf(gpt.state_dict(), keys), 10**9)
    return {k: v.detach().clone() for k, v in gpt.state_dict().items()}


def _tokens():
    return torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(7))


def _ours(run):
    """The single-process model with the checkpoint's weights (its config.yaml's model)."""
    from omegaconf import OmegaConf

    from mpoverlap.interop.checkpoint_reader import read_checkpoint, resolve_step_dir
    from mpoverlap.models.gpt import GPT

    weights, _ = read_checkpoint(resolve_step_dir(run))
    model = GPT(OmegaConf.load(run / "config.yaml").model).eval()
    model.load_state_dict(weights, strict=True)
    return model, weights


def _rel(a, b):
    return ((a - b).abs().max() / a.abs().max()).item()


@pytest.mark.parametrize("name", list(CASES))
def test_import_at_tp2_pp2_and_export_give_transformers_logits(imported, name, tmp_path):
    from mpoverlap.interop.export import main as export_main

    original, _, run = imported[0][name]
    tokens = _tokens()
    model, weights = _ours(run)
    with torch.no_grad():
        theirs = original(tokens).logits
        rel = _rel(theirs, model(tokens)[..., :theirs.shape[-1]])
    print(f"{name}: imported logits rel diff {rel:.2e}")
    assert rel <= TOL
    # the score biases were imported (and saved: the checkpoint holds them beside the model)
    assert any(w.abs().sum() > 0 for k, w in weights.items() if k.endswith("router.expert_bias"))

    assert export_main([str(run), "--out", str(tmp_path / "hf")]) == 0
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    assert type(again) is type(original)
    with torch.no_grad():
        rel = _rel(theirs, again(tokens).logits)
    print(f"{name}: exported logits rel diff {rel:.2e}")
    assert rel <= TOL


def test_mtp_weights_survive_save_load_export_reimport(imported, tmp_path):
    from mpoverlap.interop.export import main as export_main
    from mpoverlap.interop.hf_import import read_state

    run = imported[1]
    model, weights = _ours(run)
    mtp = {k: w for k, w in weights.items() if k.startswith("mtp.")}
    assert any(k.startswith("mtp.0.block.mlp.experts.") for k in mtp) and "mtp.0.eh_proj.weight" in mtp
    assert mtp["mtp.0.block.mlp.router.expert_bias"].abs().sum() > 0  # the checkpoint kept the MTP router bias
    assert export_main([str(run), "--out", str(tmp_path / "hf")]) == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1
    from safetensors import safe_open

    with safe_open(str(tmp_path / "hf" / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        L = config["num_hidden_layers"]
        for n in ("enorm", "hnorm", "eh_proj", "shared_head.norm", "embed_tokens", "shared_head.head"):
            assert f"model.layers.{L}.{n}.weight" in names, n
        torch.testing.assert_close(f.get_tensor(f"model.layers.{L}.shared_head.head.weight"), weights["output.weight"])
        # DeepSeek's eh_proj reads [embedding ; hidden]
        H = weights["mtp.0.eh_proj.weight"].shape[0]
        torch.testing.assert_close(f.get_tensor(f"model.layers.{L}.eh_proj.weight")[:, :H],
                                   weights["mtp.0.eh_proj.weight"][:, H:])
    back, _ = read_state(str(tmp_path / "hf"), _run_model(run))
    for k, w in mtp.items():
        torch.testing.assert_close(back[k], w, rtol=0, atol=0, msg=lambda m, k=k: f"{k}: {m}")
    # transformers loads the directory (skipping the MTP layer) and gives our main logits
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    tokens = _tokens()
    with torch.no_grad():
        theirs = again(tokens).logits
        assert _rel(theirs, model(tokens)[..., :theirs.shape[-1]]) <= TOL


def _run_model(run):
    from omegaconf import OmegaConf

    return OmegaConf.load(run / "config.yaml").model


def test_check_names_every_difference_and_its_fix(imported):
    from mpoverlap.interop.hf_dir import read_hf_config
    from mpoverlap.interop.hf_mapping import ConversionError, describe_mismatches, fix_overrides, mismatches

    hf_dir = imported[0]["latent_interleaved"][1]
    model = compose([*OURS, "model.q_lora_rank=0", "model.moe_router_num_groups=1", "model.kv_lora_rank=8",
                     "model.moe_router_scaling_factor=1.0", "model.shared_expert=false"]).model
    found = mismatches(read_hf_config(hf_dir), model)
    text, fix = describe_mismatches(str(hf_dir), found, model), fix_overrides(found)
    for key, theirs, ours in [("q_lora_rank", 32, 0), ("kv_lora_rank", 16, 8), ("moe_router_num_groups", 4, 1),
                              ("moe_router_scaling_factor", 2.5, 1.0), ("shared_expert", "true", "false")]:
        assert f"model.{key}: HF {theirs}, ours {ours}" in text, (key, text)
        assert f"model.{key}={theirs}" in fix, (key, fix)
    assert not mismatches(read_hf_config(hf_dir), compose(OURS).model)
    # nulls compare as the values they stand for: the shared width (the expert width), the kept
    # groups (all of them)
    nulls = compose([*OURS, "model.moe_shared_expert_ffn_hidden_size=null", "model.moe_router_group_topk=null"]).model
    assert mismatches(read_hf_config(hf_dir), nulls) == [("moe_router_group_topk", 2, 4)]
    # mpoverlap-check's rule says the same before any worker starts
    from mpoverlap.overlap import validate

    found = [p for p in validate(compose([*OURS, "model.kv_lora_rank=8", f"checkpoint.init_from={hf_dir}"]))
             if p.rule == "checkpoint.init_from"]
    assert len(found) == 1 and "model.kv_lora_rank: HF 16, ours 8" in found[0].reason, found
    assert found[0].fix == ["model.kv_lora_rank=16"], found[0].fix
    yarn = dict(read_hf_config(hf_dir), rope_parameters={"rope_type": "yarn", "factor": 40.0, "rope_theta": 1e4})
    with pytest.raises(ConversionError, match="rope_parameters.rope_type='yarn'"):
        mismatches(yarn, compose(OURS).model)


def test_mtp_layers_import_at_tp2_pp2(imported):
    """A DeepSeek-layout directory with an MTP layer imported at tp 2 x pp 2 with SP: every
    tensor of the saved checkpoint (MTP depth and router biases included) equals the source
    model's, bit for bit (the rope rows and eh_proj halves undone on each rank's shard)."""
    source, run = imported[2]
    _, weights = _ours(run)
    assert set(weights) == set(source)
    for k, w in source.items():
        torch.testing.assert_close(weights[k], w, rtol=0, atol=0, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("key,value,named", [
    ("rms_norm_eps", 1e-5, "rms_norm_eps=1e-05"),
    ("topk_method", "greedy", "topk_method='greedy'"),
    ("scoring_func", "softmax", "scoring_func='softmax'"),
    ("num_key_value_heads", 2, "num_key_value_heads=2"),
    ("n_shared_experts", 0, "n_shared_experts=0"),
])
def test_directories_it_cannot_reproduce_are_refused_by_key(imported, key, value, named):
    from mpoverlap.interop.hf_dir import read_hf_config
    from mpoverlap.interop.hf_mapping import ConversionError, mismatches

    hf = dict(read_hf_config(imported[0]["latent_interleaved"][1]), **{key: value})
    with pytest.raises(ConversionError, match=named.replace("(", r"\(").replace(".", r"\.")):
        mismatches(hf, compose(OURS).model)


def test_mtp_requested_from_a_directory_without_it_names_the_fix(imported):
    """transformers' save_pretrained writes no MTP layer: asking for one names model.mtp_num_layers=0."""
    from mpoverlap.interop.hf_import import read_state
    from mpoverlap.training.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match="model.mtp_num_layers=0"):
        read_state(str(imported[0]["latent_interleaved"][1]), compose([*OURS, "model.mtp_num_layers=1"]).model)


def test_mtp_router_biases_resume(imported):
    per_rank = imported[3]
    for res in per_rank:
        for name, bias in res["mtp_resumed"].items():  # the values the worker set before saving
            torch.testing.assert_close(torch.tensor(bias), 0.01 * torch.arange(8.0) + int(name.split(".")[1]))
        assert all(b == [0.0] * 8 for b in res["mtp_old_resumed"].values())
    assert any(res["mtp_resumed"] for res in per_rank)  # the last stage holds the depth


def test_a_router_bias_the_model_cannot_hold_is_refused(imported):
    """The directory's e_score_correction_bias is nonzero; a model without router biases
    (model.moe_router_bias_update_rate=0) would drop it and choose other experts."""
    from mpoverlap.interop.hf_import import read_state
    from mpoverlap.training.checkpoint import CheckpointError

    no_bias = compose([*OURS, "model.moe_router_bias_update_rate=0"]).model
    with pytest.raises(CheckpointError, match="model.moe_router_bias_update_rate=1e-3"):
        read_state(str(imported[0]["latent_interleaved"][1]), no_bias, params={})
