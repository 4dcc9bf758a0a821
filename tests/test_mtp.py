"""Multi-token prediction (model.mtp_num_layers, model.mtp_loss_scale) on one process: the
model's masked, full-length MTP loss against a reference written here that TRUNCATES each
depth's sequence to its valid positions instead (causal attention makes the two equal), in
loss and in every weight and input gradient; the shifted targets; the config refusals."""
import pytest
import torch
import torch.nn.functional as F

from mpoverlap.config import compose


def _model(overrides=(), seed=3):
    from mpoverlap.models.gpt import GPT

    cfg = compose(["model.num_layers=2", "model.seq_length=16", "model.mtp_num_layers=2",
                   "model.mtp_loss_scale=0.3", *overrides]).model
    return GPT(cfg, seed=seed), cfg


def _reference_loss(m, cfg, w, x_embed):
    """LM loss + scale * mean_d loss_d, each depth run on its S - d valid positions only."""
    from mpoverlap.models.rope import rope_cos_sin

    S = w.shape[1] - 1
    D = cfg.mtp_num_layers

    def tables(n):
        cos, sin = rope_cos_sin(torch.arange(n), cfg.hidden_size // cfg.num_attention_heads, cfg.rope_base, None)
        return cos, sin

    def head(x):
        return x @ (m.embedding.weight if cfg.tie_embeddings else m.output.weight).t()

    cos, sin = tables(S)
    h = x_embed
    for block in m.layers.values():
        h = block(h, cos, sin)
    V = m.vocab_size
    main = F.cross_entropy(head(m.final_norm(h)).reshape(-1, V), w[:, 1:].reshape(-1))
    losses = []
    for d in range(1, D + 1):
        n = S - d
        depth = m.mtp[str(d - 1)]
        e = m.embedding(w[:, d:d + n])
        x = depth.eh_proj(torch.cat([depth.hidden_norm(h[:, :n]), depth.embed_norm(e)], dim=-1))
        h = depth.block(x, *tables(n))
        logits = head(depth.final_norm(h))
        losses.append(F.cross_entropy(logits.reshape(-1, V), w[:, d + 1:d + 1 + n].reshape(-1)))
    return main + cfg.mtp_loss_scale * sum(losses) / D, main, sum(losses) / D


@pytest.mark.parametrize("overrides", [[], ["model.tie_embeddings=false"], ["model.mtp_num_layers=1"]])
def test_mtp_loss_and_gradients_match_the_truncated_reference(overrides):
    from mpoverlap.models.mtp import mtp_targets

    torch.manual_seed(0)
    m, cfg = _model(overrides)
    w = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length + 1))

    def grads(loss, x):
        m.zero_grad()
        gx, = torch.autograd.grad(loss, x, retain_graph=True)
        loss.backward()
        return gx, {n: p.grad.clone() for n, p in m.named_parameters()}

    # the model's way: full-length depths, masked past the window's end
    x = m.embedding(w[:, :-1]).detach().requires_grad_(True)  # the input gradient is taken here
    m.embedding.forward_orig = m.embedding.forward
    targets = mtp_targets(w, cfg.mtp_num_layers)
    first = [True]

    def embed_once(tokens):  # the main embedding's output is the leaf x; the depths' go through
        if first[0]:
            first[0] = False
            return x
        return m.embedding.forward_orig(tokens)

    m.embedding.forward = embed_once
    logits = m(w[:, :-1], mtp_targets=targets)
    loss = m.loss(logits, targets)
    main, extra = m.last_loss_parts
    gx, g = grads(loss, x)
    m.embedding.forward = m.embedding.forward_orig

    xr = x.detach().clone().requires_grad_(True)
    ref, ref_main, ref_extra = _reference_loss(m, cfg, w, xr)
    gxr, gr = grads(ref, xr)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=0)
    torch.testing.assert_close(main, ref_main.detach(), rtol=1e-5, atol=0)
    torch.testing.assert_close(extra, ref_extra.detach(), rtol=1e-5, atol=0)
    # fp32: 1e-5 of the tensor's largest entry (sums in another order round differently)
    torch.testing.assert_close(gx, gxr, rtol=1e-5, atol=1e-5 * float(gxr.abs().max()))
    assert set(g) == set(gr) and any(n.startswith("mtp.") for n in g)
    for n in g:
        torch.testing.assert_close(g[n], gr[n], rtol=1e-5, atol=1e-5 * float(gr[n].abs().max()), msg=n)
        assert g[n].abs().sum() > 0, n


def test_shifted_targets_hold_the_next_tokens_and_mask_past_the_end():
    from mpoverlap.models.mtp import mtp_targets

    w = torch.arange(10).view(1, 10)  # S = 9
    t = mtp_targets(w, 2)
    assert t.shape == (1, 9, 3)
    assert t[0, 0].tolist() == [1, 2, 3] and t[0, 6].tolist() == [7, 8, 9]
    assert t[0, 7].tolist() == [8, 9, -1] and t[0, 8].tolist() == [9, -1, -1]


def test_mtp_moe_depths_join_the_moe_layers():
    m, _ = _model(["model=moe_tiny", "model.num_layers=2", "model.moe_layer_freq=1"])
    assert len(m.moe_layers()) == 2 + 2


@pytest.mark.parametrize("schedule,vpp,mtp_stage", [("1f1b", 1, 1), ("zbv", 2, 0)])
def test_depths_live_on_the_head_stage(schedule, vpp, mtp_stage):
    """The loop layouts put the head, and so the depths, on the last stage; zbv's V on stage 0
    (parallel.mtp_stage=0), where the depths share the one embedding module."""
    from mpoverlap.overlap import validate
    from mpoverlap.training.pipeline_glue import build_chunks, schedule_layout

    ov = ["model.num_layers=4", "model.mtp_num_layers=1", "parallel.pp=2", f"parallel.vpp={vpp}",
          f"parallel.pp_schedule={schedule}", f"parallel.mtp_stage={mtp_stage}"]
    cfg = compose(ov)
    assert [p.render() for p in validate(cfg, 2) if p.rule.startswith("mtp.")] == []
    layout = schedule_layout(cfg.parallel, vpp)
    for stage in (0, 1):
        chunks = build_chunks(cfg.model, 2, vpp, stage, 1, layout=layout)
        holders = [c for c in chunks if c.mtp is not None]
        assert len(holders) == (1 if stage == mtp_stage else 0), (schedule, stage)
        if holders and stage == 0:
            assert holders[0].embedding is chunks[0].embedding


@pytest.mark.parametrize("overrides", [["model.tie_embeddings=false"], ["model=moe_fine_tiny", "model.num_layers=2",
                                                                         "model.mtp_num_layers=1"]])
def test_parameter_counts_include_the_depths_exactly(overrides):
    """The estimate's counts (overlap/estimate/params.py) against the built model and chunks:
    the whole model, and per stage of pp 2 (the depths and the untied model's embedding copy on
    the last stage)."""
    from mpoverlap.models.flops import flops_per_token, mtp_flops_per_token
    from mpoverlap.models.gpt import GPT, num_parameters
    from mpoverlap.overlap.estimate.params import model_params, stage_params
    from mpoverlap.overlap.layout import build_layout
    from mpoverlap.training.pipeline_glue import build_chunks

    ov = ["model.num_layers=2", "model.seq_length=16", "model.mtp_num_layers=2", *overrides]
    cfg = compose(ov)
    assert model_params(cfg)[0] == num_parameters(GPT(cfg.model, seed=1))
    cfg2 = compose([*ov, "parallel.pp=2"])
    lo = build_layout(cfg2, 2)
    for stage in (0, 1):
        chunks = build_chunks(cfg2.model, 2, 1, stage, 1)
        assert stage_params(cfg2, lo, stage) == sum(num_parameters(c) for c in chunks), stage
    assert mtp_flops_per_token(cfg.model) > 0
    plain = compose([o for o in ov if not o.startswith("model.mtp_num_layers")])
    assert flops_per_token(cfg.model) == flops_per_token(plain.model) + mtp_flops_per_token(cfg.model)
