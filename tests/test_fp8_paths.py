"""train.precision=fp8 on the dense GEMM paths: each path's FP8 GEMMs against their emulation
(precision.fp8: the same casts and scales, dequantized, fp32 matmul), output, input gradient
and weight gradient; which modules run in FP8; the trainer's and validator's fp8 handling."""
import os
import sys

import pytest
import torch

pytest.importorskip("torchao")
from mpoverlap.precision import autocast_context  # noqa: E402
from mpoverlap.precision.fp8_select import mark_fp8_gemms  # noqa: E402

CPU = torch.device("cpu")
RECIPES = ("tensorwise", "rowwise")


def close(a, b, rel):
    """a within rel of b elementwise, relative to each element and to b's largest one."""
    a, b = a.float(), b.float()
    tol = b.abs() * rel + rel * b.abs().max()
    assert ((a - b).abs() <= tol).all(), f"max |a - b| = {(a - b).abs().max()}, max |b| = {b.abs().max()}"


# Outputs and input gradients come out of the GEMM in bf16 (both the real one and the emulation
# round their fp32 sums to bf16): one bf16 rounding apart at most. Weight gradients come out in
# fp32: the two differ by fp32 summation order only.
BF16_OUT, FP32_OUT = 2.0 ** -8, 1e-5
# A GPT small enough for bf16 GEMMs on CPU, every FP8 dimension a multiple of 16.
SMALL = ["model.hidden_size=32", "model.num_attention_heads=2", "model.ffn_hidden_size=64", "model.vocab_size=128"]


def _linear_run(recipe, emulate, x, w, b, g, deferral=None, x_dtype=None):
    from mpoverlap.wgrad.functions import Linear

    lin = Linear(w.shape[1], w.shape[0], bias=b is not None)
    with torch.no_grad():
        lin.weight.copy_(w)
        if b is not None:
            lin.bias.copy_(b)
    lin.fp8_recipe, lin.fp8_emulate, lin.wgrad = recipe, emulate, deferral
    x = x.clone().to(x_dtype or x.dtype).requires_grad_(True)
    with autocast_context("fp8", CPU):
        y = lin(x)
    y.backward(g)
    return lin, y, x.grad


def check_equals_emulation(real, emu):
    """(y, input grad, weight grad) of the real FP8 path against its emulation."""
    (y, gx, gw), (ey, egx, egw) = real, emu
    assert y.dtype == torch.bfloat16
    close(y, ey, BF16_OUT)
    close(gx, egx, BF16_OUT)
    assert gw.dtype == torch.float32
    close(gw, egw, FP32_OUT)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16], ids=["fp32_in", "bf16_in"])
def test_plain_linear_equals_emulation(recipe, x_dtype):
    """The plain Linear (wgrad/functions.py) marked fp8, under bf16 autocast, with a bias; fp32
    inputs (autocast's cast inside the Function) and bf16 inputs alike."""
    torch.manual_seed(0)
    x, w, b, g = torch.randn(2, 16, 32), torch.randn(48, 32), torch.randn(48), torch.randn(2, 16, 48)
    runs = {}
    for emulate in (False, True):
        lin, y, gx = _linear_run(recipe, emulate, x, w, b, g, x_dtype=x_dtype)
        runs[emulate] = (y, gx, lin.weight.grad, lin.bias.grad)
    check_equals_emulation(runs[False][:3], runs[True][:3])
    torch.testing.assert_close(runs[False][3], runs[True][3])
    # FP8 really ran: the bf16 GEMMs give another output.
    lin, y, _ = _linear_run(None, False, x, w, b, g, x_dtype=x_dtype)
    assert not torch.allclose(y.float(), runs[False][0].float(), rtol=2.0 ** -8, atol=0)


def test_mark_fp8_gemms_covers_the_blocks_linears_only():
    """q/k/v, attention output, MLP fc1/fc2 of every block in FP8; embedding and head not."""
    from mpoverlap.config import compose
    from mpoverlap.models.gpt import GPT

    cfg = compose(["model.num_layers=2", "model.tie_embeddings=false"]).model
    model = GPT(cfg)
    marked = mark_fp8_gemms(model, "rowwise")
    assert sorted(marked) == sorted(f"layers.{i}.{n}" for i in range(2)
                                    for n in ("attn.qkv", "attn.proj", "mlp.gate_up", "mlp.down"))
    recipes = {n: getattr(m, "fp8_recipe", None) for n, m in model.named_modules()}
    assert recipes["layers.0.attn.qkv"] == "rowwise"
    assert all(recipes[n] is None for n in recipes if not n.startswith("layers."))


def test_fp8_model_differs_from_bf16_and_stays_near():
    """A GPT forward and backward with its blocks in FP8 against the same model in bf16: the loss
    differs (FP8 ran), by little."""
    from mpoverlap.config import compose
    from mpoverlap.models.gpt import GPT

    cfg = compose(["model.num_layers=1", "model.seq_length=32", *SMALL]).model
    tokens = torch.randint(0, cfg.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
    losses = {}
    for precision in ("bf16", "fp8"):
        model = GPT(cfg)
        if precision == "fp8":
            mark_fp8_gemms(model, "tensorwise")
        with autocast_context(precision, CPU):
            loss = model.loss(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        losses[precision] = loss.item()
    assert losses["fp8"] != losses["bf16"]
    assert abs(losses["fp8"] - losses["bf16"]) < 0.02 * losses["bf16"], losses


def test_fp8_without_torchao_exits_2(monkeypatch, capsys):
    """torchao missing (its import blocked): the validator refuses train.precision=fp8 with the
    install command and the CLI's validation exits 2; the Trainer refuses it as well."""
    from mpoverlap import train
    from mpoverlap.config import ConfigError

    monkeypatch.setitem(sys.modules, "torchao", None)
    cfg, code = train._compose_and_validate(["train.precision=fp8"], 1)
    assert code == 2 and cfg is None
    err = capsys.readouterr().err
    assert "[fp8.torchao]" in err and "pip install -e '.[fp8]'" in err
    assert train._compose_and_validate(["train.precision=bf16"], 1)[1] is None
    from mpoverlap.config import compose
    from mpoverlap.training.loop import Trainer

    with pytest.raises(ConfigError, match=r"pip install -e '\.\[fp8\]'"):
        Trainer(compose(["train.precision=fp8", "train.device=cpu"]), None, None)


def test_plan_names_the_fp8_gemms():
    from mpoverlap.config import compose
    from mpoverlap.overlap.plan import render_plan

    plan = render_plan(compose(["train.precision=fp8", "train.fp8_recipe=rowwise"]), 1)
    line = next(ln for ln in plan.splitlines() if "fp8 GEMMs" in ln)
    assert "rowwise" in line and "attn.qkv" in line and "attn.proj" in line and "mlp gate_up" in line
    assert "bf16: embedding, output head, router" in line
    assert "fp8 GEMMs" not in render_plan(compose(["train.precision=bf16"]), 1)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("grad_there", [True, False], ids=["in_place", "autograd"])
def test_plain_linear_deferred_weight_grad(recipe, grad_there):
    """The zero-bubble W action's FP8 weight gradient of the plain Linear (the bf16 operands kept,
    quantized when W runs): bit for bit the immediate one, so the emulation's within fp32
    rounding; the input gradient unchanged. Both of W's ways in: added into an existing
    gradient in place, and through autograd (no .grad yet)."""
    from mpoverlap.wgrad import WeightGradDeferral, WeightGradQueue

    torch.manual_seed(0)
    x, w, g = torch.randn(2, 16, 32), torch.randn(48, 32), torch.randn(2, 16, 48)
    now, gx_now = _linear_run(recipe, False, x, w, None, g)[::2]
    emu = _linear_run(recipe, True, x, w, None, g)[0]
    deferral = WeightGradDeferral()
    from mpoverlap.wgrad.functions import Linear

    lin = Linear(32, 48, bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    if grad_there:
        lin.weight.grad = torch.zeros_like(lin.weight)
    lin.fp8_recipe, lin.wgrad = recipe, deferral
    xr = x.clone().requires_grad_(True)
    with autocast_context("fp8", CPU):
        y = lin(xr)
    with deferral.deferring(WeightGradQueue()) as queue:
        y.backward(g)
    assert len(queue) == 1 and (lin.weight.grad is None or not lin.weight.grad.any())
    queue.run()
    assert torch.equal(lin.weight.grad, now.weight.grad)
    assert torch.equal(xr.grad, gx_now)
    close(lin.weight.grad, emu.weight.grad, FP32_OUT)


def _gpt_grads(recompute, recipe, emulate, count=None):
    from mpoverlap.config import compose
    from mpoverlap.models.gpt import GPT

    cfg = compose(["model.num_layers=2", "model.seq_length=16", f"model.recompute={recompute}", *SMALL]).model
    tokens = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    model = GPT(cfg)
    mark_fp8_gemms(model, recipe, emulate)
    with autocast_context("fp8", CPU):
        loss = model.loss(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("recipe", RECIPES)
def test_recompute_reproduces_the_fp8_casts(recipe, monkeypatch):
    """model.recompute=full and selective with the blocks in FP8: the recomputed forward runs its
    FP8 GEMMs again (counted) with the same casts and scales (the same amax of the same
    inputs), so every gradient equals the run without recompute bit for bit; the full-recompute
    run's weight gradients equal its emulation's within fp32 rounding, and bf16 output rounding
    carried through the block's backward."""
    from mpoverlap.precision import fp8

    calls, original = [0], fp8.fp8_gemm

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(fp8, "fp8_gemm", counted)
    base = _gpt_grads("none", recipe, False)
    per_run = calls[0]
    assert per_run == 2 * 4 * 3  # 2 blocks x 4 linears x (forward, dgrad, wgrad)
    runs = {}
    for mode, extra in (("full", 2 * 4), ("selective", 0)):
        calls[0] = 0
        runs[mode] = _gpt_grads(mode, recipe, False)
        assert calls[0] == per_run + extra, (mode, calls[0])
        for name, grad in runs[mode].items():
            assert torch.equal(grad, base[name]), (mode, name)
    emu = _gpt_grads("full", recipe, True)
    for name in ("layers.0.attn.qkv.weight", "layers.1.mlp.down.weight"):
        assert (runs["full"][name] - emu[name]).norm() <= 2.0 ** -6 * emu[name].norm(), name


COMPILE_BACKENDS = ["aot_eager"] + (["inductor"] if os.environ.get("MPOVERLAP_TEST_INDUCTOR") == "1" else [])


@pytest.mark.parametrize("backend", COMPILE_BACKENDS)
def test_compiled_fp8_matches_eager_fp8(backend):
    """train.compile=true with fp8: the compiled regions are the blocks' elementwise math only
    (models/fused.py), the FP8 GEMMs stay eager between them; the loss within 1e-4 (relative)
    of the eager fp8 model's and every gradient within 2% (norm): a fused norm can round its bf16
    output an ulp apart, which moves an FP8 cast of the next GEMM now and then. aot_eager (the
    graphs inductor compiles, without its C++ build: inductor takes ~70 s here on 2 cores);
    MPOVERLAP_TEST_INDUCTOR=1 adds inductor."""
    from mpoverlap.config import compose
    from mpoverlap.models.gpt import GPT

    cfg = compose(["model.num_layers=2", "model.seq_length=32", *SMALL]).model
    tokens = torch.randint(0, cfg.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
    runs = []
    for compile_backend in (None, backend):
        model = GPT(cfg, seed=3, compile_backend=compile_backend)
        mark_fp8_gemms(model, "tensorwise")
        with autocast_context("fp8", CPU):
            loss = model.loss(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        runs.append((loss.item(), [p.grad for p in model.parameters()]))
    (ref, ref_grads), (got, grads) = runs
    assert got == pytest.approx(ref, rel=1e-4)
    for g, r in zip(grads, ref_grads):
        assert (g - r).norm() <= 0.02 * r.norm()


def test_fp8_counts_as_bf16_for_the_attention_kernel_rule():
    """fp8 runs attention in bf16: the cuDNN CP attention kernel (bf16 only) is allowed under it."""
    from mpoverlap.config import compose
    from mpoverlap.overlap import validate

    def fired(precision):
        cfg = compose(["parallel.cp=2", "parallel.cp_attention_backend=cudnn", "train.device=cuda",
                       f"train.precision={precision}"])
        return any(p.rule == "cp.attention_backend_kernel" for p in validate(cfg, 2))

    assert fired("fp32") and not fired("bf16") and not fired("fp8")


def test_plan_names_the_fp8_experts_and_latent_projections():
    """Under fp8 an MoE model's plan names the routed experts' FP8 grouped GEMMs (and not the bf16
    torch._grouped_mm), and an MLA model's the latent projections instead of attn.qkv."""
    from mpoverlap.config import compose
    from mpoverlap.overlap.plan import render_plan

    plan = render_plan(compose(["model=moe_tiny", "train.precision=fp8"]), 1)
    line = next(ln for ln in plan.splitlines() if "fp8 GEMMs" in ln)
    assert "routed experts' grouped GEMMs" in line
    grouped = next(ln for ln in plan.splitlines() if ln.startswith("  grouped GEMM"))
    assert "FP8" in grouped and "torch._scaled_grouped_mm" in grouped, grouped
    plan = render_plan(compose(["model=deepseek_v3_tiny", "model.qk_rope_head_dim=16", "train.precision=fp8"]), 1)
    line = next(ln for ln in plan.splitlines() if "fp8 GEMMs" in ln)
    assert "attn.kv_a_proj_with_mqa" in line and "attn.q_b_proj" in line and "attn.qkv" not in line, line
