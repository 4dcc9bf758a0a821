"""Deferred weight gradients (mpoverlap/wgrad) in one process, against plain autograd: inside a
deferring region every projection of the model (attention, MLP, experts, shared expert,
embedding, tied or untied head) leaves its weight gradient to the W queue, B's input-side
gradients are unchanged, the accumulate hooks see the deferred weights only in W, and after W
every gradient equals autograd's; full recompute and bf16 compose."""
import pytest
import torch

from mpoverlap.config import compose
from mpoverlap.models.gpt import GPT
from mpoverlap.wgrad import WeightGradDeferral, WeightGradQueue, attach_deferral

SMALL = ["model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=4",
         "model.ffn_hidden_size=64", "model.seq_length=16", "model.vocab_size=96"]
CASES = {
    "dense_tied": ["model=gpt_tiny"],
    "dense_untied_recompute": ["model=gpt_tiny", "model.tie_embeddings=false", "model.recompute=full"],
    "moe_shared": ["model=moe_tiny", "model.shared_expert=true", "model.moe_ffn_hidden_size=32"],
}
# weights that stay in B: norms, and the MoE router (a small GEMM that feeds the routing)
KEPT_IN_B = ("norm", "router")


def _loss(model, tokens, targets, autocast):
    with autocast:
        return model.loss(model(tokens), targets)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_w_queue_reproduces_autograd(case, precision):
    cfg = compose([*CASES[case], *SMALL]).model
    autocast = (torch.autocast("cpu", torch.bfloat16) if precision == "bf16"
                else torch.autocast("cpu", enabled=False))
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 96, (2, 16), generator=g)
    targets = torch.randint(0, 96, (2, 16), generator=g)
    ref, zb = GPT(cfg, seed=1), GPT(cfg, seed=1)
    _loss(ref, tokens, targets, autocast).backward()

    deferral = WeightGradDeferral()
    assert attach_deferral(zb, deferral) > 0
    seen = []  # (name, hook saw a real gradient) in hook order
    for name, p in zb.named_parameters():
        p.register_post_accumulate_grad_hook(
            lambda p, name=name: seen.append((name, not deferral.withheld(p))))
    loss = _loss(zb, tokens, targets, autocast)
    with deferral.deferring(WeightGradQueue()) as queue:
        loss.backward()
    deferred = {id(p) for p, _ in queue.entries}
    names = dict(zb.named_parameters())
    # matrices, and the grouped experts' stacked [L, out, in] weights
    expected = {n for n, p in names.items() if p.dim() >= 2 and not any(k in n for k in KEPT_IN_B)}
    assert {n for n, p in names.items() if id(p) in deferred} == expected
    assert len(queue) >= len(expected)
    refs = dict(ref.named_parameters())
    tol = 1e-6 if precision == "fp32" else 2e-2
    for n, p in names.items():
        if n in expected:
            assert p.grad is None, n  # nothing accumulated in B
        else:  # B's own gradients (norms, router) are already final
            torch.testing.assert_close(p.grad, refs[n].grad, rtol=tol, atol=tol * 1e-2)
    assert all(real for n, real in seen if n not in expected)
    hooks_in_b = len(seen)
    queue.run()
    assert {n for n, real in seen[hooks_in_b:] if real} == expected  # W reports every deferred weight
    for n, p in names.items():
        torch.testing.assert_close(p.grad, refs[n].grad, rtol=tol, atol=tol * 1e-2, msg=n)
    with pytest.raises(RuntimeError, match="ran twice"):
        queue.run()


def test_outside_a_region_the_gradients_come_at_once():
    cfg = compose([*CASES["dense_tied"], *SMALL]).model
    tokens = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
    ref, zb = GPT(cfg, seed=1), GPT(cfg, seed=1)
    attach_deferral(zb, WeightGradDeferral())
    ref.loss(ref(tokens), tokens).backward()
    zb.loss(zb(tokens), tokens).backward()
    for (n, a), (_, b) in zip(ref.named_parameters(), zb.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-6, atol=1e-9, msg=n)


def test_w_accumulates_each_gradient_before_computing_the_next():
    """Memory: W holds one weight-sized gradient at a time (the backward it replaces does too),
    not the whole chunk's: each parameter is accumulated (its hook fires) before the next
    entry's GEMM runs, and each closure is dropped once it ran."""
    cfg = compose([*CASES["dense_untied_recompute"][:2], *SMALL]).model
    tokens = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(2))
    model, deferral = GPT(cfg, seed=1), WeightGradDeferral()
    attach_deferral(model, deferral)
    log = []
    names = {id(p): n for n, p in model.named_parameters()}
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: log.append(("accumulate", names[id(p)])))
    loss = model.loss(model(tokens), tokens)
    with deferral.deferring(WeightGradQueue()) as queue:
        loss.backward()
    log.clear()

    def logged(param, compute):
        def run():
            log.append(("compute", names[id(param)]))
            return compute()
        return run

    queue.entries = [(p, logged(p, c)) for p, c in queue.entries]
    queue.run()
    assert [kind for kind, _ in log] == ["compute", "accumulate"] * (len(log) // 2)
    assert all(a[1] == b[1] for a, b in zip(log[::2], log[1::2]))


# per case, a deferred weight given a tensor hook (it must take autograd's path)
HOOKED = {"dense_untied_recompute": "layers.0.mlp.down.weight", "moe_shared": "layers.0.mlp.experts.w_out"}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("case", list(HOOKED))
def test_w_accumulates_into_an_existing_gradient_buffer_and_reports_once(case, precision, monkeypatch):
    """The data-parallel case: every weight already has a gradient (the buffer's view, holding
    earlier microbatches' sums). W adds its GEMM into that very tensor (no new .grad), the
    sum equals autograd's accumulation, and each deferred weight's post-accumulate hook fires
    exactly once, in W. bf16: the bf16 product is added into the fp32 buffer by one promoting
    add_ (no fp32 copy of it, no autograd call): bit for bit what autograd's cast-then-add
    gives, so the bound is 0 there (fp32: addmm_ fuses the product and the sum, 1e-6). moe_shared:
    the grouped experts' stacked weights (moe/grouped.py) too; its tied embedding, used twice in
    the chunk, sums its two gradients first and takes autograd's path."""
    cfg = compose([*CASES[case], *SMALL]).model
    g = torch.Generator().manual_seed(2)
    tokens, targets = (torch.randint(0, 96, (2, 16), generator=g) for _ in range(2))
    ref, zb = GPT(cfg, seed=1), GPT(cfg, seed=1)
    deferral = WeightGradDeferral()
    attach_deferral(zb, deferral)
    for model in (ref, zb):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()))
    buffers = {n: p.grad for n, p in zb.named_parameters()}
    autocast = (torch.autocast("cpu", torch.bfloat16) if precision == "bf16"
                else torch.autocast("cpu", enabled=False))
    # the reference: the same Functions outside a deferring region (B computes each weight
    # gradient and autograd casts and accumulates it, but for the grouped experts' bf16 stacks,
    # which B adds in place chunk by chunk), so only the accumulation differs; the hooked weight
    # takes autograd's path in both
    attach_deferral(ref, WeightGradDeferral())
    dict(ref.named_parameters())[HOOKED[case]].register_hook(lambda g: g)
    _loss(ref, tokens, targets, autocast).backward()
    seen = []
    for name, p in zb.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: seen.append(name) if not deferral.withheld(p) else None)
    loss = _loss(zb, tokens, targets, autocast)
    with deferral.deferring(WeightGradQueue()) as queue:
        loss.backward()
    deferred = {n for n, p in zb.named_parameters() if any(p is q for q, _ in queue.entries)}
    # a weight with a tensor hook (ZeRO-2/3's pre-accumulate hook) must see its gradient: autograd path
    hooked = HOOKED[case]
    assert hooked in deferred
    pre = []
    dict(zb.named_parameters())[hooked].register_hook(lambda g: pre.append(g.shape))
    in_b = len(seen)
    through_autograd = []  # the parameters W hands to torch.autograd.backward
    real_backward = torch.autograd.backward
    monkeypatch.setattr(torch.autograd, "backward",
                        lambda tensors, *a, **k: (through_autograd.extend(tensors), real_backward(tensors, *a, **k)))
    from mpoverlap.moe.grouped import _WeightGrad
    from mpoverlap.wgrad.deferral import WeightGradGemm
    names = {id(p): n for n, p in zb.named_parameters()}
    in_place_kinds = (WeightGradGemm, _WeightGrad)
    not_in_place = {names[id(p)] for p, c in queue.entries if not isinstance(c, in_place_kinds)}
    if case == "moe_shared":  # each expert stack queued once per expert chunk (2 here)
        assert sum(isinstance(c, _WeightGrad) for _, c in queue.entries) == 8
    queue.run()
    monkeypatch.undo()
    # in place: every one-GEMM or grouped weight but the hooked one (the embedding's scatter takes autograd)
    assert sorted(names[id(p)] for p in through_autograd) == sorted(not_in_place | {hooked}), not_in_place
    assert sorted(seen[in_b:]) == sorted(deferred)
    assert len(pre) == 1
    for n, p in zb.named_parameters():
        if n != hooked:
            assert p.grad is buffers[n], n  # accumulated in place
        tol = 1e-6 if precision == "fp32" else 0.0
        torch.testing.assert_close(p.grad, dict(ref.named_parameters())[n].grad, rtol=tol, atol=tol, msg=n)
