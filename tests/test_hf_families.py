"""Starting from the checkpoints users have: for each family, a tiny model
built with transformers' own class from its config (random weights, no download) and saved with
`save_pretrained` is imported with checkpoint.init_from at tp2 x pp2 (x ep2 for the MoE ones)
with sequence parallelism. The first step's loss (computed before any update) equals
transformers' loss on the same global batch within 1e-5 relative, and exporting the imported
weights gives transformers logits equal to the original model's within 1e-5.

Families: Llama 3.2-style (tied, llama3 rope scaling), Qwen2.5-style (q/k/v bias), Qwen3 (per-head
q/k RMSNorm, head_dim wider than hidden / heads), Qwen3-MoE (fine-grained, renormalised top-k,
no shared expert) and Mixtral.

The same spawn (8 ranks, once) also checks: every rank reads exactly the bytes of the
parameters it holds (its stage, its experts, its TP slice: safetensors slices), also at tp 4;
a resume whose MoE shape key changed is refused with the "different model" message; the shared
expert is split over tp (its parameters per rank halve at tp 2).
"""
import json
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from mpoverlap.config import compose  # noqa: E402

RUN = ["train.global_batch_size=8", "train.micro_batch_size=2", "train.log_interval=1", "data.max_bytes=300000",
       "overlap.dp_bucket_mb=0.05", "train.progress=false", "train.eval_iters=1", "train.device=cpu"]
DENSE_LAYOUT = ["parallel.tp=2", "parallel.pp=2", "parallel.dp=2", "parallel.sequence_parallel=true"]
MOE_LAYOUT = [*DENSE_LAYOUT, "parallel.ep=2", "overlap.ep=true", "overlap.ep_chunks=4"]
LLAMA3 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          # 16 (not 8192): at head width 16 and base 500000 the wavelengths 6.3, 33, 168, ...
          # fall in all three bands (kept, interpolated, divided by factor)
          "original_max_position_embeddings": 16}
QWEN25 = ["model=qwen3_tiny", "model.qk_norm=false", "model.qkv_bias=true", "model.head_dim=null"]
HF_COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6)


# The new attention options through the modes, 3 steps against the dp-only reference of the same
# model and global batch (DESIGN: the single-process or dp-only reference): q/k/v bias, per-head
# q/k norm with a head wider than hidden / heads and llama3 rope scaling in one model; TP splits
# the bias with its heads and sums the q/k norms' gradients (each rank saw its own heads, also
# without SP); CP, PP and EP leave them alone.
QWEN_ALL = ["model=qwen3_tiny", "model.qkv_bias=true", "model.rope_scaling.rope_type=llama3",
            "model.rope_scaling.original_max_position_embeddings=16", "model.rope_scaling.factor=4"]
CURVE_RUN = [o for o in RUN if not o.startswith("train.global_batch_size")] + ["train.global_batch_size=16", "train.lr=3e-3"]
CURVES = {
    "curve_ref": [*QWEN_ALL, "parallel.dp=8"],
    "curve_tp2": [*QWEN_ALL, "parallel.tp=2", "parallel.dp=4"],
    "curve_tp2_sp_cp2": [*QWEN_ALL, "parallel.tp=2", "parallel.cp=2", "parallel.dp=2", "parallel.sequence_parallel=true"],
    "curve_tp2_sp_pp2": [*QWEN_ALL, "parallel.tp=2", "parallel.pp=2", "parallel.dp=2", "parallel.sequence_parallel=true"],
    "curve_moe_ref": ["model=qwen3_moe_tiny", "parallel.dp=8"],
    "curve_moe_tp2_sp_pp2_ep2": ["model=qwen3_moe_tiny", *MOE_LAYOUT],
}


def _families():
    """{name: (transformers class, its config, our overrides, our layout)}."""
    t = transformers
    llama = ["model=qwen3_tiny", "model.qk_norm=false", "model.head_dim=null", "model.rope_base=500000"]
    llama += [f"model.rope_scaling.{k}={v}" for k, v in LLAMA3.items()]
    moe_hf = dict(HF_COMMON, num_experts_per_tok=2, tie_word_embeddings=False, rope_theta=1e6)
    return {
        "llama32": (t.LlamaForCausalLM, t.LlamaConfig(**HF_COMMON, tie_word_embeddings=True,
                                                       rope_parameters=dict(LLAMA3, rope_theta=500000.0)),
                    llama, DENSE_LAYOUT),
        "qwen25": (t.Qwen2ForCausalLM, t.Qwen2Config(**HF_COMMON, tie_word_embeddings=True, rope_theta=1e6),
                   QWEN25, DENSE_LAYOUT),
        "qwen3": (t.Qwen3ForCausalLM, t.Qwen3Config(**HF_COMMON, head_dim=32, tie_word_embeddings=True, rope_theta=1e6),
                  ["model=qwen3_tiny"], DENSE_LAYOUT),
        "qwen3_moe": (t.Qwen3MoeForCausalLM, t.Qwen3MoeConfig(**moe_hf, head_dim=32, num_experts=8,
                                                               moe_intermediate_size=32, norm_topk_prob=True),
                      ["model=qwen3_moe_tiny"], MOE_LAYOUT),
        "mixtral": (t.MixtralForCausalLM, t.MixtralConfig(**dict(moe_hf, intermediate_size=32), num_local_experts=8),
                    ["model=qwen3_moe_tiny", "model.qk_norm=false", "model.head_dim=null"], MOE_LAYOUT),
    }


def _save_family(cls, config, out):
    """A transformers model with random weights, saved; norms, biases and routers moved off their
    initial ones/zeros so that a swapped or dropped tensor changes the numbers."""
    torch.manual_seed(0)
    model = cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name or name.endswith("gate.weight"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(str(out))
    return model


def _worker(rank, world, specs, root):
    """Per spec: import (maybe_resume), the bytes read and held, a save of the imported weights
    as step 0, then one training step's loss; extra probes after."""
    from pathlib import Path

    from omegaconf import OmegaConf

    from mpoverlap.overlap.estimate.params import stage_params
    from mpoverlap.overlap.layout import build_layout
    from mpoverlap.training.checkpoint import CheckpointError
    from mpoverlap.training.loop import Trainer
    from mpoverlap.training.setup import init_distributed

    def trainer(overrides, run_dir, write_config=True):
        cfg = compose([*overrides, "train.steps=1", f"run.dir={run_dir}"])
        if rank == 0 and write_config:  # the export reads the run's config.yaml
            Path(run_dir).mkdir(parents=True, exist_ok=True)
            (Path(run_dir) / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
        return Trainer(cfg, init_distributed(cfg), Path(run_dir))

    out = {}
    for name, overrides in CURVES.items():  # 3 steps each, no import
        t = trainer([*overrides, *CURVE_RUN], f"{root}/{name}", write_config=False)
        out[name] = []
        for _ in range(3):
            res = t.train_step()
            out[name].append((t._mean_over_replicas(res["loss_local"]), res["grad_norm"]))
        # The replicated q/k norm weights after the steps (AdamW's first steps move each element
        # by about lr in the direction of its gradient's sign: a partial gradient shows here)
        out[name + "/qk_norms"] = {n: p.detach().tolist() for n, p in t.params_by_name.items()
                                   if n.endswith(("q_norm.weight", "k_norm.weight"))}
    for name, overrides in specs.items():
        t = trainer(overrides, f"{root}/{name}")
        t.maybe_resume()
        held = sum(p.numel() * p.element_size() for p in t.params_by_name.values())
        # mpoverlap-check's per-rank count of this rank's stage (q/k norms, biases, head_dim)
        estimated = stage_params(t.cfg, build_layout(t.cfg, world), t.state.coords.pp)
        row = {"read": t.init_bytes_read, "held": held, "estimated": estimated * 4}
        if not name.endswith("_tp4"):
            t.save()
            t.checkpointer.wait()
            row["loss"] = t._mean_over_replicas(t.train_step()["loss_local"])
        out[name] = row
    # A resume whose MoE shape changed: refused before any tensor is read.
    t = trainer([*specs["qwen3_moe"], "model.moe_first_dense_layers=1"], f"{root}/qwen3_moe", write_config=False)
    try:
        t.maybe_resume()
        out["resume_changed"] = None
    except CheckpointError as err:
        out["resume_changed"] = str(err)
    # A checkpoint written before this shape keys existed (its meta lacks them) still
    # resumes: the missing keys count as their defaults.
    import mpoverlap.training.resume as resume

    old = ["model=llama_tiny", "model.num_layers=2", *CURVE_RUN]
    keys, resume.SHAPE_KEYS = resume.SHAPE_KEYS, resume.SHAPE_KEYS[:15]  # a meta without the later shape keys
    try:
        t = trainer(old, f"{root}/old")
        t.train_step()
        t.save()
        t.checkpointer.wait()
    finally:
        resume.SHAPE_KEYS = keys
    t = trainer(old, f"{root}/old")
    t.maybe_resume()
    out["old_resumed_step"] = t.step
    # The shared expert's parameters on this rank at tp 2 (single process: GPT(cfg.model)).
    t = trainer(["model=moe_fine_tiny", "parallel.tp=2", "parallel.dp=4", "parallel.sequence_parallel=true", *RUN],
                f"{root}/shared")
    out["shared_numel"] = sum(p.numel() for n, p in t.params_by_name.items() if ".shared_expert." in n)
    out["shared_held"] = (sum(p.numel() for p in t.params_by_name.values()),
                          stage_params(t.cfg, build_layout(t.cfg, world), t.state.coords.pp))
    return out


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """{name: (original HF model, hf dir, run dir)} and the per-rank results of the one spawn."""
    from dist_harness import run_distributed

    root = tmp_path_factory.mktemp("families")
    made, specs = {}, {}
    for name, (cls, config, ours, layout) in _families().items():
        made[name] = (_save_family(cls, config, root / f"hf_{name}"), root / f"hf_{name}", root / name)
        specs[name] = [*ours, *layout, *RUN, f"checkpoint.init_from={root / f'hf_{name}'}"]
    # tp 4 (x dp 2): every rank reads a quarter of each split tensor (q/k/v and their biases too)
    specs["qwen25_tp4"] = [*QWEN25, "parallel.tp=4", "parallel.dp=2", "parallel.sequence_parallel=true",
                           *RUN, f"checkpoint.init_from={root / 'hf_qwen25'}"]
    per_rank = run_distributed(_worker, 8, specs, str(root), timeout_s=900)
    return made, specs, per_rank


def _first_batch(overrides):
    from mpoverlap.training.data import build_datasets, global_batch

    cfg = compose(overrides)
    data, _ = build_datasets(cfg.data, cfg.model.seq_length, cfg.model.vocab_size)
    return global_batch(data, 0, cfg.train.global_batch_size, cfg.train.seed)


@pytest.mark.parametrize("name", ["llama32", "qwen25", "qwen3", "qwen3_moe", "mixtral"])
def test_import_first_loss_and_export_logits_equal_transformers(families, name, tmp_path):
    from mpoverlap.interop.export import main as export_main

    made, specs, per_rank = families
    original, _, run = made[name]
    batch = _first_batch(specs[name])
    with torch.no_grad():
        logits = original(batch[:, :-1]).logits.float()
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)).item()
    got = per_rank[0][name]["loss"]
    print(f"{name}: first loss {got:.8f}, transformers {ref:.8f}, rel {abs(got - ref) / ref:.2e}")
    assert abs(got - ref) <= 1e-5 * abs(ref), (got, ref)

    assert export_main([str(run), "--out", str(tmp_path / "hf")]) == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == [type(original).__name__]
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    assert type(again) is type(original)
    tokens = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        theirs, ours = original(tokens).logits, again(tokens).logits
    rel = ((theirs - ours).abs().max() / theirs.abs().max()).item()
    print(f"{name}: exported logits rel diff {rel:.2e}")
    assert rel <= 1e-5


@pytest.mark.parametrize("name,ref", [("curve_tp2", "curve_ref"), ("curve_tp2_sp_cp2", "curve_ref"),
                                      ("curve_tp2_sp_pp2", "curve_ref"), ("curve_moe_tp2_sp_pp2_ep2", "curve_moe_ref")])
def test_qkv_bias_qk_norm_rope_scaling_through_the_modes(families, name, ref):
    got, want = families[2][0][name], families[2][0][ref]
    for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(got, want), start=1):
        assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (name, step, loss, ref_loss)
        assert abs(norm - ref_norm) <= 1e-4 * abs(ref_norm), (name, step, norm, ref_norm)
    assert got[-1][0] < got[0][0]  # it trains
    ref_norms = families[2][0][ref + "/qk_norms"]
    for res in families[2]:
        assert res[name + "/qk_norms"], "no q/k norm on this rank"
        for n, value in res[name + "/qk_norms"].items():
            torch.testing.assert_close(torch.tensor(value), torch.tensor(ref_norms[n]), rtol=0, atol=1e-5,
                                       msg=lambda m, n=n: f"{name} {n}: {m}")


def test_every_rank_reads_only_what_it_holds(families):
    """Sliced reads: each rank's bytes read from the safetensors files equal the bytes of the
    parameters it holds (its pipeline stage, its experts, its TP slice of each split tensor, the
    replicated ones whole); at tp 4 that is at most a quarter of each split tensor."""
    made, _, per_rank = families
    for name in [*made, "qwen25_tp4"]:
        for rank, res in enumerate(per_rank):
            assert res[name]["read"] == res[name]["held"] == res[name]["estimated"], (name, rank, res[name])
    from safetensors import safe_open

    with safe_open(str(made["qwen25"][1] / "model.safetensors"), framework="pt") as f:
        nbytes = {k: math.prod(f.get_slice(k).get_shape()) * 4 for k in f.keys()}
    replicated = sum(n for k, n in nbytes.items() if "norm" in k)
    for res in per_rank:
        assert res["qwen25_tp4"]["read"] <= (sum(nbytes.values()) - replicated) / 4 + replicated


def test_resume_with_a_changed_moe_shape_key_is_refused_by_name(families):
    msg = families[2][0]["resume_changed"]
    assert msg is not None, "the resume with model.moe_first_dense_layers=1 was accepted"
    assert "different model" in msg and "model.moe_first_dense_layers: saved 0, now 1" in msg, msg
    assert "model.moe_first_dense_layers=0" in msg, msg  # the fix


def test_checkpoint_without_the_new_shape_keys_still_resumes(families):
    assert all(res["old_resumed_step"] == 1 for res in families[2])


def test_shared_expert_parameters_per_rank_halve_at_tp2(families):
    from mpoverlap.models.gpt import GPT

    single = sum(p.numel() for n, p in GPT(compose(["model=moe_fine_tiny"]).model).named_parameters()
                 if ".shared_expert." in n)
    assert single > 0
    for res in families[2]:
        assert res["shared_numel"] * 2 == single, (res["shared_numel"], single)
        held, estimated = res["shared_held"]
        assert held == estimated  # mpoverlap-check's per-rank count splits it too


def test_refused_rope_and_mismatched_scaling_name_the_key(families):
    from mpoverlap.interop.hf_dir import read_hf_config
    from mpoverlap.interop.hf_mapping import ConversionError, describe_mismatches, fix_overrides, mismatches

    made, specs, _ = families
    hf_dir = made["llama32"][1]
    plain = compose(["model=qwen3_tiny", "model.qk_norm=false", "model.head_dim=null", "model.rope_base=500000"]).model
    found = mismatches(read_hf_config(hf_dir), plain)
    assert "model.rope_scaling.rope_type: HF llama3, ours null" in describe_mismatches(str(hf_dir), found, plain)
    assert "model.rope_scaling.factor=32.0" in fix_overrides(found)
    yarn = dict(read_hf_config(hf_dir), rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 5e5})
    with pytest.raises(ConversionError, match="rope_type='yarn'"):
        mismatches(yarn, plain)
