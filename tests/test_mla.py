"""Multi-head latent attention (models/mla.py) on one process, and the DeepSeek-V3 presets' counts."""
import math
import re

import pytest
import torch

from mpoverlap.config import ModelConfig, compose
from mpoverlap.models.flops import flops_per_token
from mpoverlap.models.gpt import GPT, num_parameters
from mpoverlap.models.mla import LatentAttention
from mpoverlap.models.rope import rope_cos_sin
from mpoverlap.overlap.estimate import estimate


def mla_cfg(**kw):
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, seq_length=16,
                attention="mla", q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4,
                v_head_dim=6)
    base.update(kw)
    return ModelConfig(**base)


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rotate(x, pos, base):
    """Rotate-half RoPE of x [..., S, p] at positions pos, written out by hand."""
    p = x.shape[-1]
    inv = 1.0 / base ** (torch.arange(0, p, 2, dtype=torch.float64) / p)
    ang = pos.double()[:, None] * inv[None, :]
    cos, sin = ang.cos(), ang.sin()
    x1, x2 = x[..., : p // 2], x[..., p // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def reference_mla(attn: LatentAttention, cfg, x_BSH):
    """DeepSeek-V3's attention from its equations, in float64 with an explicit softmax."""
    B, S, _ = x_BSH.shape
    N, n, p, v = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    W = {k: t.detach().double() for k, t in attn.state_dict().items()}
    x = x_BSH.double()
    if cfg.q_lora_rank:
        c_q = rms(x @ W["q_a_proj.weight"].T, W["q_a_layernorm.weight"], cfg.norm_eps)
        q = c_q @ W["q_b_proj.weight"].T
    else:
        q = x @ W["q_proj.weight"].T
    q = q.view(B, S, N, n + p).transpose(1, 2)
    kv_a = x @ W["kv_a_proj_with_mqa.weight"].T
    c_kv, k_pe = kv_a[..., : cfg.kv_lora_rank], kv_a[..., cfg.kv_lora_rank:]
    kv = (rms(c_kv, W["kv_a_layernorm.weight"], cfg.norm_eps) @ W["kv_b_proj.weight"].T)
    kv = kv.view(B, S, N, n + v).transpose(1, 2)
    pos = torch.arange(S)
    q = torch.cat([q[..., :n], rotate(q[..., n:], pos, cfg.rope_base)], dim=-1)
    k_pe = rotate(k_pe[:, None], pos, cfg.rope_base).expand(B, N, S, p)
    k = torch.cat([kv[..., :n], k_pe], dim=-1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(n + p)
    scores = scores.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    y = scores.softmax(-1) @ kv[..., n:]
    return y.transpose(1, 2).reshape(B, S, N * v) @ W["proj.weight"].T


@pytest.mark.parametrize("q_lora_rank", [16, 0])
def test_latent_attention_matches_the_equations(q_lora_rank):
    """Query/key heads n + p = 12 wide, value heads 6: the module equals DeepSeek-V3's equations
    (shared RoPE key, scale 1/sqrt(n + p)) computed by hand, with and without the query latent."""
    cfg = mla_cfg(q_lora_rank=q_lora_rank)
    model = GPT(cfg, seed=3)
    attn = model.layers["0"].attn
    assert isinstance(attn, LatentAttention)
    with torch.no_grad():  # norms away from ones, so a missing norm shows
        attn.kv_a_layernorm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(0))
        if q_lora_rank:
            attn.q_a_layernorm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(1))
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(2))
    cos, sin = rope_cos_sin(torch.arange(16), cfg.qk_rope_head_dim, cfg.rope_base)
    y = attn(x, cos, sin)
    torch.testing.assert_close(y.double(), reference_mla(attn, cfg, x), rtol=1e-5, atol=1e-6)


def test_latent_attention_is_causal_and_trains():
    cfg = mla_cfg()
    model = GPT(cfg)
    t = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    u = t.clone()
    u[0, 9:] = (u[0, 9:] + 5) % 256
    a, b = model(t), model(u)
    torch.testing.assert_close(a[:, :9], b[:, :9], rtol=0, atol=0)
    model.loss(a, t).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


@pytest.mark.parametrize("overrides", [["model=deepseek_v3_tiny"], ["model=deepseek_v3_tiny", "model.q_lora_rank=0"]])
def test_estimated_parameters_equal_the_model(overrides):
    cfg = compose(overrides)
    assert estimate(cfg, 1).total_params == num_parameters(GPT(cfg.model))


def test_flops_per_token_counts_the_latent_projections_and_both_head_widths():
    cfg = mla_cfg()
    H, N, S, L = 32, 4, 16, 2
    proj = H * 16 + 16 * N * 12 + H * (12 + 4) + 12 * N * (8 + 6) + N * 6 * H
    matmul = L * (proj + 3 * H * 64) + H * 256
    assert flops_per_token(cfg) == 6 * matmul + 6 * L * N * (12 + 6) * S


def test_deepseek_v3_671b_counts_the_published_total_and_active(capsys):
    """DeepSeek-V3: the main model's published 671B total (within 1%) and 37B active (2%); with
    its MTP depth, the released 685B (1%: the release stores the MTP module's own embedding and
    head copy, 1.85B, which ours shares)."""
    from mpoverlap.check import main

    assert main(["model=deepseek_v3_671b"]) == 0
    out = capsys.readouterr().out
    line = re.search(r"parameters: .*", out).group(0)
    with_mtp = int(re.search(r"parameters: ([\d,]+) total", line).group(1).replace(",", ""))
    total, active = (int(g.replace(",", "")) for g in
                     re.search(r"MTP depth\(s\) .*?: ([\d,]+) .*? total, ([\d,]+) .*? active", line).groups())
    assert abs(total - 671e9) <= 0.01 * 671e9
    assert abs(active - 37e9) <= 0.02 * 37e9
    assert abs(with_mtp - 685e9) <= 0.01 * 685e9
    from mpoverlap.config import config_dir
    from pathlib import Path

    text = (Path(config_dir()) / "model" / "deepseek_v3_671b.yaml").read_text()
    assert all(f"{n:,}" in text for n in (with_mtp, total, active))  # the comment's figures


@pytest.mark.parametrize("overrides,named", [
    (["model.num_attention_heads=100", "parallel.tp=8", "parallel.world_size=8"],
     ["parallel.tp=8", "model.num_attention_heads=100", "fix: parallel.tp=4"]),
    (["parallel.cp=2", "parallel.world_size=2", "parallel.cp_attention_backend=cudnn", "train.precision=bf16"],
     ["model.attention=mla", "parallel.cp_attention_backend=cudnn", "fix: parallel.cp_attention_backend=auto"]),
])
def test_check_refuses_invalid_mla_layouts_naming_the_key_and_a_fix(overrides, named, capsys):
    """Latent attention over a layout that cannot run exits 2 naming the key and a fix: heads
    not divisible by tp (100 heads at tp 8), CP on the cuDNN block kernel."""
    from mpoverlap.check import main

    assert main(["model=deepseek_v3_671b", *overrides]) == 2
    err = capsys.readouterr().err
    assert all(n in err for n in named), err


def test_every_latent_projection_is_deferrable_and_cast_for_bf16():
    """The zero-bubble W split defers the weight gradients of the wgrad Linear builders, and
    train.precision=bf16 casts exactly the linears' weights (precision.compute_cast_weights):
    every 2-D weight of the latent attention is one of them; its norms are not."""
    from mpoverlap.precision.autocast import compute_cast_weights
    from mpoverlap.wgrad.functions import Linear

    attn = GPT(mla_cfg()).layers["0"].attn
    linears = [m for m in attn.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 5 and all(isinstance(m, Linear) for m in linears)
    cast = compute_cast_weights(attn)
    assert {id(p) for p in cast} == {id(p) for p in attn.parameters() if p.dim() == 2}


@pytest.mark.parametrize("q_lora_rank,bf16", [(32, False), (0, False), (32, True)])
def test_estimated_activations_equal_what_a_block_saves(q_lora_rank, bf16):
    """The estimate's bytes of one deepseek_v3_tiny block (the dense layer: latents, their norms,
    q and k 24 wide, v 16) against what autograd keeps, measured, with a flash-style core (the
    ring kernel at cp 1: what CP and the GPU's kernels keep; CPU SDPA takes the math path when
    the q/k and v widths differ): within 1% in fp32, 10% in bf16 (as tests/test_estimate.py)."""
    import functools
    import sys
    from pathlib import Path

    from mpoverlap.context_parallel import ring_attention
    from mpoverlap.models.gpt import Block
    from mpoverlap.overlap.estimate import Conventions, layer_activation_bytes
    from mpoverlap.overlap.layout import build_layout

    sys.path.insert(0, str(Path(__file__).parent))
    from saved_bytes import saved_activation_bytes

    B = 2
    cfg = compose(["model=deepseek_v3_tiny", f"model.q_lora_rank={q_lora_rank}", f"train.micro_batch_size={B}"])
    m = cfg.model
    core = functools.partial(ring_attention, cp_group=None, cp_ranks=[0], cp_rank=0, cp_size=1, overlap=False)
    block = Block(m, "layers.0", 1234, core_attention=core, layer_index=0)
    x = torch.randn(B, m.seq_length, m.hidden_size, generator=torch.Generator().manual_seed(0), requires_grad=True)
    cos, sin = rope_cos_sin(torch.arange(m.seq_length), m.qk_rope_head_dim, m.rope_base)

    def forward():
        with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            return block(x, cos, sin)

    measured = saved_activation_bytes(forward, block.parameters(), [cos, sin])
    est = layer_activation_bytes(cfg, build_layout(cfg, 1), 0, Conventions.for_dtype(2 if bf16 else 4), B)
    assert abs(est - measured) <= (0.10 if bf16 else 0.01) * measured, (measured, est)


def test_compiled_regions_match_eager():
    """train.compile: the block's compiled regions (the RoPE region on the q_rope heads and the
    shared key) give eager's loss and gradients (aot_eager: traced, not fused)."""
    cfg = compose(["model=deepseek_v3_tiny", "model.num_layers=2", "model.seq_length=16"]).model
    ref, got = GPT(cfg, seed=5), GPT(cfg, seed=5, compile_backend="aot_eager")
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
    out = []
    for model in (ref, got):
        loss = model.loss(model(tokens), tokens)
        loss.backward()
        out.append([loss.detach()] + [p.grad for p in model.parameters()])
    for a, b in zip(*out):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("q_lora_rank", [32, 0])
def test_zero_bubble_kept_bytes_equal_the_estimate(q_lora_rank, monkeypatch):
    """What a zero-bubble W keeps of a deepseek_v3_tiny block (the latent projections' inputs
    and output gradients) equals the estimate within 5% (measured on the queued closures, as
    tests/test_estimate.py measures the other families)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    import test_estimate

    family = f"mla_q{q_lora_rank}"
    monkeypatch.setitem(test_estimate.FAMILIES, family, ["model=deepseek_v3_tiny", f"model.q_lora_rank={q_lora_rank}"])
    measured, est = test_estimate._measure_kept(family, False), test_estimate._estimate_kept(family, 1, False, False)
    assert abs(measured - est) <= 0.05 * measured, (measured, est)


def test_checkpoint_meta_records_the_latent_shape_keys():
    """A checkpoint's meta records latent attention's shape keys, so a resume with another
    latent shape is refused by name before a tensor is read (training/resume.py)."""
    from mpoverlap.training.resume import _shape_key_defaults, shape_keys

    keys = shape_keys(compose(["model=deepseek_v3_tiny"]).model)
    assert {k: keys[k] for k in ("attention", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                 "v_head_dim")} == {"attention": "mla", "q_lora_rank": 32, "kv_lora_rank": 16,
                                                    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16}
    assert _shape_key_defaults()["attention"] == "mha"  # what a checkpoint from before the key had


def test_plan_names_the_padded_flash_block_kernel(capsys):
    from mpoverlap.check import main

    assert main(["model=deepseek_v3_tiny", "parallel.cp=2", "parallel.world_size=2"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("  attention:"))
    assert "flash_cpu" in line and "pad v from 16 to 24 channels" in line, line


def test_fp8_checks_the_latent_projections_dimensions(capsys):
    """Under train.precision=fp8 the dims rule covers MLA's GEMMs: deepseek_v3_tiny's
    kv_a_proj_with_mqa produces kv_lora_rank + qk_rope_head_dim = 24 channels, not a multiple of 16."""
    from mpoverlap.check import main

    assert main(["model=deepseek_v3_tiny", "train.precision=fp8"]) == 2
    err = capsys.readouterr().err
    assert "[fp8.gemm_dims]" in err and "model.kv_lora_rank + model.qk_rope_head_dim=24" in err, err
    # 16 + 16 = 32 channels: every latent GEMM divides by 16, and the model runs in fp8
    assert main(["model=deepseek_v3_tiny", "train.precision=fp8", "model.qk_rope_head_dim=16"]) == 0
    assert "[fp8.gemm_dims]" not in capsys.readouterr().err
