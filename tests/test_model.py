"""Single-process tests of the reference GPT (models/gpt.py)."""
import math

import pytest
import torch

from mpoverlap.config import ModelConfig
from mpoverlap.models.flops import flops_per_token
from mpoverlap.models.gpt import GPT, num_parameters, padded_vocab_size


def tiny(**kw):
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                seq_length=16)
    base.update(kw)
    return ModelConfig(**base)


def tokens(B=2, S=16, seed=0, V=256):
    return torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(seed))


def test_padded_vocab_size():
    assert padded_vocab_size(256, 128) == 256
    assert padded_vocab_size(257, 128) == 384
    assert padded_vocab_size(50257, 128) == 50304


def test_shapes_and_dtype():
    model = GPT(tiny())
    logits = model(tokens())
    assert logits.shape == (2, 16, 256) and logits.dtype == torch.float32
    pos = model(tokens(), position_ids=torch.arange(16))
    torch.testing.assert_close(pos, logits, rtol=0, atol=0)


def test_causal():
    model = GPT(tiny())
    x = tokens(B=1)
    y = x.clone()
    y[0, 10:] = (y[0, 10:] + 7) % 256
    a, b = model(x), model(y)
    torch.testing.assert_close(a[:, :10], b[:, :10], rtol=0, atol=0)
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_tied_head_shares_embedding():
    model = GPT(tiny(tie_embeddings=True))
    assert model.output is None
    names = [n for n, _ in model.named_parameters()]
    assert "embedding.weight" in names and not any(n.startswith("output") for n in names)
    model(tokens()).sum().backward()
    assert model.embedding.weight.grad is not None
    untied = GPT(tiny(tie_embeddings=False))
    assert untied.output.weight is not untied.embedding.weight
    assert num_parameters(untied) == num_parameters(model) + 256 * 32


def test_init_depends_only_on_seed_and_shape():
    a, b, c = GPT(tiny(), seed=7), GPT(tiny(), seed=7), GPT(tiny(), seed=8)
    torch.manual_seed(123)  # global RNG state must not matter
    d = GPT(tiny(), seed=7)
    for (n, pa), pb, pc, pd in zip(a.named_parameters(), b.parameters(), c.parameters(),
                                   d.parameters()):
        assert torch.equal(pa, pb) and torch.equal(pa, pd), n
        if pa.dim() == 2:
            assert not torch.equal(pa, pc), n
    # A parameter's value depends on its name and shape, not on the rest of the model.
    deeper = GPT(tiny(num_layers=3), seed=7)
    torch.testing.assert_close(deeper.layers["0"].attn.qkv.weight, a.layers["0"].attn.qkv.weight)
    # Re-initialising reproduces the same weights.
    before = a.layers["1"].mlp.gate_up.weight.clone()
    with torch.no_grad():
        a.layers["1"].mlp.gate_up.weight.zero_()
    a.init_weights(7)
    assert torch.equal(a.layers["1"].mlp.gate_up.weight, before)


def test_init_std():
    cfg = tiny(hidden_size=64, ffn_hidden_size=128, init_std=0.05)
    model = GPT(cfg)
    assert abs(model.embedding.weight.std().item() - 0.05) < 0.005
    assert abs(model.layers["0"].attn.qkv.weight.std().item() - 0.05) < 0.005
    out_std = 0.05 / math.sqrt(2 * cfg.num_layers)
    assert abs(model.layers["0"].attn.proj.weight.std().item() - out_std) < 0.1 * out_std
    assert abs(model.layers["0"].mlp.down.weight.std().item() - out_std) < 0.1 * out_std
    assert torch.equal(model.final_norm.weight, torch.ones(64))


def test_untrained_loss_near_log_vocab():
    model = GPT(tiny())
    x = tokens(B=4, S=17)
    loss = model.loss(model(x[:, :-1]), x[:, 1:])
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert abs(loss.item() - math.log(256)) < 0.1


@pytest.mark.parametrize("norm,act", [("rmsnorm", "swiglu"), ("layernorm", "gelu")])
def test_sgd_lowers_loss(norm, act):
    torch.manual_seed(0)
    model = GPT(tiny(norm=norm, activation=act))
    x = tokens(B=4, S=17)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(5):
        loss = model.loss(model(x[:, :-1]), x[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.05, losses


def test_variant_modules():
    model = GPT(tiny(norm="layernorm", activation="gelu", tie_embeddings=False))
    assert isinstance(model.final_norm, torch.nn.LayerNorm)
    assert model.layers["0"].mlp.up.weight.shape == (64, 32)
    assert model(tokens()).shape == (2, 16, 256)


def test_bad_names_raise():
    with pytest.raises(ValueError, match="model.norm"):
        GPT(tiny(norm="batchnorm"))
    with pytest.raises(ValueError, match="model.activation"):
        GPT(tiny(activation="relu"))


def test_flops_per_token():
    cfg = tiny()
    H, L, S, Fh = 32, 2, 16, 64
    assert flops_per_token(cfg) == 6 * (L * (4 * H * H + 3 * H * Fh) + H * 256) + 12 * L * H * S
    # GQA with 1 group: qkv is (N + 2) D x H = (H + 2 D) x H, D = 8
    gqa = tiny(num_query_groups=1)
    assert flops_per_token(gqa) == 6 * (L * ((H + 16) * H + H * H + 3 * H * Fh) + H * 256) + 12 * L * H * S


def test_pipeline_chunks_compose_to_the_full_model():
    """Chunks cut by layer_ids/pre_process/post_process, run in sequence, equal the full model."""
    cfg = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, seq_length=16)
    full = GPT(cfg, seed=3)
    first = GPT(cfg, seed=3, layer_ids=[0, 1], pre_process=True, post_process=False)
    last = GPT(cfg, seed=3, layer_ids=[2, 3], pre_process=False, post_process=True)
    assert set(dict(first.named_parameters())) | set(dict(last.named_parameters())) == set(dict(full.named_parameters()))
    assert getattr(last.embedding.weight, "pipeline_duplicate", False)
    x = torch.randint(0, 256, (2, 16))
    pos = torch.arange(16)
    torch.testing.assert_close(last(first(x, position_ids=pos), position_ids=pos), full(x), rtol=0, atol=0)


FAMILIES = {
    "gpt (gelu, layernorm, tied)": dict(activation="gelu", norm="layernorm"),
    "llama-style (swiglu, rmsnorm, untied)": dict(activation="swiglu", norm="rmsnorm", tie_embeddings=False),
    "llama 3 (grouped-query attention)": dict(activation="swiglu", norm="rmsnorm", tie_embeddings=False,
                                              num_query_groups=2),
    "moe (shared expert, all-to-all)": dict(num_experts=4, moe_top_k=2, shared_expert=True),
    "moe (all-gather, capacity, every other layer)": dict(num_experts=4, moe_top_k=2, moe_dispatcher="allgather",
                                                          moe_capacity_factor=1.0, moe_layer_freq=2),
}


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("bf16", [False, True])
def test_every_tensor_is_made_on_its_inputs_device(family, bf16):
    """The device check (training/device_check.py) for every model family, forward and backward, fp32 and bf16
    autocast: with the default device switched to meta while the model runs on the CPU, a
    tensor created without `device=` (which on CUDA would land on the CPU) shows up."""
    from mpoverlap.training.device_check import stray_device_tensors

    model = GPT(tiny(**FAMILIES[family]))
    x = tokens()
    with stray_device_tensors() as strays:
        with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            logits = model(x)
        model.loss(logits, x).backward()
    assert not strays.events, strays.summary()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_grouped_query_attention(groups):
    """model.num_query_groups: qkv holds [q | k | v] rows (N + 2G) D; query head n reads K/V
    group n // (N / G) (the same as expanding each group to its heads), and G = N is MHA."""
    import torch.nn.functional as F

    from mpoverlap.models.gpt import CausalSelfAttention, apply_rope, rope_cos_sin

    cfg = tiny(num_query_groups=groups)
    N, D, H, S = 4, 8, 32, 16
    attn = CausalSelfAttention(cfg, "layers.0.attn", seed=3)
    assert attn.qkv.weight.shape == ((N + 2 * groups) * D, H)
    x = torch.randn(2, S, H, generator=torch.Generator().manual_seed(1))
    cos, sin = rope_cos_sin(torch.arange(S), D, cfg.rope_base)
    q, k, v = F.linear(x, attn.qkv.weight).split([N * D, groups * D, groups * D], dim=-1)
    q, k, v = (t.view(2, S, -1, D).transpose(1, 2) for t in (q, k, v))
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    k, v = (t.repeat_interleave(N // groups, dim=1) for t in (k, v))  # head n -> group n // (N/G)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, S, H)
    torch.testing.assert_close(attn(x, cos, sin), F.linear(y, attn.proj.weight))
    model = GPT(tiny(num_query_groups=groups))
    model.loss(model(tokens()), tokens(seed=1)).backward()
    assert all(p.grad is not None for p in model.parameters())
    assert num_parameters(model) == num_parameters(GPT(tiny())) - 2 * 2 * (N - groups) * D * H
    if groups == N:  # null and N are the same model, bitwise
        mha = GPT(tiny())
        torch.testing.assert_close(GPT(tiny(num_query_groups=N))(tokens()), mha(tokens()), rtol=0, atol=0)


def test_grouped_query_attention_init_is_layout_independent():
    """The qkv weight is drawn whole from (seed, name) and then sliced: a tp shard is exactly
    the rows [q_r | k_r | v_r] of the one-process weight."""
    from mpoverlap.models.init import init_tensor, qkv_rows
    from mpoverlap.tensor_parallel import shard_tensor

    cfg = tiny(num_query_groups=2)
    full = GPT(cfg, seed=5).layers["0"].attn.qkv.weight.detach()
    assert qkv_rows(cfg) == (32, 16, 16)
    assert torch.equal(full, init_tensor("layers.0.attn.qkv.weight", (64, 32), cfg, 5))
    shard = shard_tensor(full, 0, 1, 2, blocks=qkv_rows(cfg))
    assert torch.equal(shard, torch.cat([full[16:32], full[40:48], full[56:64]]))


def test_grouped_query_attention_refuses_uneven_groups():
    with pytest.raises(ValueError, match="num_query_groups=3 must divide"):
        GPT(tiny(num_query_groups=3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eager_rope_function_is_the_rotation(dtype):
    """apply_rope (one autograd Function over the two halves) against rope_reference (x cos +
    rotate_half(x) sin in fp32, cast back), on q as attention takes it (a transposed view of the
    qkv GEMM's output): the output in the reference's layout (attention sees the same strides),
    values and input gradient within the rounding both make. Each element is a sum of two
    products of magnitude T = |a| |c| + |b| |s| (a, b the element and its partner in the other
    half): the Function rounds the sum once to x's dtype (unit u), the reference's forward too,
    its backward rounds each product's gradient and then their sum: at most 3 u T apart (a
    relative bound fails where the two products cancel). In fp64, autograd's gradcheck."""
    from mpoverlap.models.rope import apply_rope, rope_cos_sin, rope_reference

    B, S, N, G, D = 2, 16, 4, 2, 8
    cos, sin = rope_cos_sin(torch.arange(S), D, 1e4)
    qkv = torch.randn(B, S, (N + 2 * G) * D, generator=torch.Generator().manual_seed(0)).to(dtype)
    grad = torch.randn(B, N, S, D, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = []
    for fn in (rope_reference, apply_rope):
        x = qkv.clone().requires_grad_(True)
        y = fn(x[..., :N * D].view(B, S, N, D).transpose(1, 2), cos, sin)
        y.backward(grad)
        out.append((y.detach(), x.grad[..., :N * D].view(B, S, N, D).transpose(1, 2)))
    (ref, gref), (got, ggot) = out
    assert got.stride() == ref.stride() and got.dtype == dtype and ggot.dtype == dtype
    u = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -24

    def magnitude(v):  # T per element: |v| |cos| + |partner| |sin|
        v = v.float().abs()
        return v * cos.abs() + torch.cat(v.chunk(2, dim=-1)[::-1], dim=-1) * sin.abs()

    q = qkv[..., :N * D].view(B, S, N, D).transpose(1, 2)
    # + the fp32 arithmetic's own rounding (2^-22 T: a few fp32 steps, second order beside u)
    slack = 3 * u + 2.0 ** -22
    assert ((got.float() - ref.float()).abs() <= slack * magnitude(q) + 1e-12).all()
    assert ((ggot.float() - gref.float()).abs() <= slack * magnitude(grad) + 1e-12).all()
    x64 = torch.randn(B, N, S, D, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: apply_rope(x, cos.double(), sin.double()), (x64,))
    # q and k in one Function (what the model calls): bit for bit apply_rope on each, both ways
    from mpoverlap.models.rope import apply_rope_qk

    gk = torch.randn(B, G, S, D, generator=torch.Generator().manual_seed(2)).to(dtype)
    res = []
    for both in (False, True):
        x = qkv.clone().requires_grad_(True)
        q_, k_ = (x[..., :N * D].view(B, S, N, D).transpose(1, 2),
                  x[..., N * D:(N + G) * D].view(B, S, G, D).transpose(1, 2))
        yq, yk = apply_rope_qk(q_, k_, cos, sin) if both else (apply_rope(q_, cos, sin), apply_rope(k_, cos, sin))
        torch.autograd.backward([yq, yk], [grad, gk])
        res.append((yq.detach(), yk.detach(), yq.stride(), yk.stride(), x.grad))
    assert all((torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b) for a, b in zip(*res))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eager_swiglu_function_is_the_formula_bit_for_bit(dtype):
    """mpoverlap/ops/activation.py `swiglu` (its backward writes both halves' gradients into the GEMM
    output's gradient) against silu(gate) * up under autograd: the same operators in the same
    dtypes, so the output and the input gradient are bitwise equal."""
    from mpoverlap.ops.activation import swiglu, swiglu_reference

    x = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(0)).to(dtype)
    grad = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = []
    for fn in (swiglu_reference, swiglu):
        xi = x.clone().requires_grad_(True)
        y = fn(xi)
        y.backward(grad)
        out.append((y.detach(), xi.grad))
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])
    assert out[1][1].dtype == dtype and out[1][1].is_contiguous()
