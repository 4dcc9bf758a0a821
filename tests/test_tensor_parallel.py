"""Tensor/sequence parallel layers against the single-process reference.

One spawn of 4 gloo ranks builds two layouts in the same processes: tp=4 (grid tp=4) and
tp=2 (grid tp=2 x dp=2). For each tp, SP on/off and overlap on/off, every rank runs
  - an MLP block: RMSNorm -> ColumnParallelLinear(gate_up, blocks=2, SwiGLU) -> RowParallelLinear
  - attention: ColumnParallelLinear(qkv, blocks=3) -> causal SDPA on local heads -> RowParallelLinear
  - embedding + output head (tied and untied) + vocab-parallel cross entropy
against the same math on the full weights from `init_tensor`, comparing outputs, local weight
gradient shards, input gradients and losses. Workers return the measurements; the tests below
assert on them.
"""
from __future__ import annotations

import itertools
import os
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dist_harness import run_distributed  # noqa: E402

from mpoverlap.comm.ledger import CommLedger  # noqa: E402
from mpoverlap.config import ModelConfig  # noqa: E402
from mpoverlap.models.gpt import init_tensor, padded_vocab_size  # noqa: E402
from mpoverlap.parallel import ParallelState, RankGrid  # noqa: E402
from mpoverlap.tensor_parallel import (  # noqa: E402
    ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, allreduce_sequence_parallel_grads,
    column_parallel_linear, copy_to_tensor_parallel_region, gather_from_sequence_parallel,
    reduce_from_tensor_parallel_region, make_comm, reduce_scatter_to_sequence_parallel,
    scatter_to_sequence_parallel, shard_tensor, tp_kwargs, vocab_parallel_cross_entropy)

B, S, H, N, FF, VOCAB = 2, 16, 32, 4, 64, 50
CFG = ModelConfig(num_layers=2, hidden_size=H, num_attention_heads=N, ffn_hidden_size=FF,
                  seq_length=S, vocab_size=VOCAB, make_vocab_size_divisible_by=16)
VPAD = padded_vocab_size(VOCAB, 16)  # 64: 32 per rank at tp=2, 16 at tp=4
SEED = 7
EPS = 1e-5
GU, DOWN, QKV, PROJ = "layers.0.mlp.gate_up", "layers.0.mlp.down", "layers.0.attn.qkv", "layers.0.attn.proj"


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def full(name, shape):
    return init_tensor(f"{name}.weight", shape, CFG, SEED)


def data(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, S, H, generator=g), torch.randn(B, S, H, generator=g)


# ---- single-process references ----------------------------------------------------------------

def mlp_ref(x, norm_w, w_gu, b_gu, w_down, b_down):
    gate, up = F.linear(F.rms_norm(x, (H,), norm_w, EPS), w_gu, b_gu).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w_down, b_down)


def attn_core(qkv_BS3h, n_heads):
    """[q|k|v] each n_heads*D wide -> causal SDPA -> [B, S, n_heads*D]."""
    Bq, Sq, three_h = qkv_BS3h.shape
    h = three_h // 3
    q, k, v = (t.reshape(Bq, Sq, n_heads, h // n_heads).transpose(1, 2) for t in qkv_BS3h.split(h, dim=-1))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(Bq, Sq, h)


def leaf(t):
    return t.detach().clone().requires_grad_(True)


def reference():
    out = {}
    x, gy = data(1)
    x, norm_w = leaf(x), leaf(torch.ones(H))
    w_gu, w_down = leaf(full(GU, (2 * FF, H))), leaf(full(DOWN, (H, FF)))
    b_gu, b_down = leaf(torch.zeros(2 * FF)), leaf(torch.zeros(H))
    y = mlp_ref(x, norm_w, w_gu, b_gu, w_down, b_down)
    (y * gy).sum().backward()
    out["mlp"] = dict(y=y.detach(), x=x.grad, norm=norm_w.grad, gu=w_gu.grad, down=w_down.grad,
                      b_gu=b_gu.grad, b_down=b_down.grad)
    x, gy = data(2)
    x, w_qkv, w_proj = leaf(x), leaf(full(QKV, (3 * H, H))), leaf(full(PROJ, (H, H)))
    y = F.linear(attn_core(F.linear(x, w_qkv), N), w_proj)
    (y * gy).sum().backward()
    out["attn"] = dict(y=y.detach(), x=x.grad, qkv=w_qkv.grad, proj=w_proj.grad)
    g = torch.Generator().manual_seed(3)
    tokens, targets = (torch.randint(0, VOCAB, (B, S), generator=g) for _ in range(2))
    for tied in (True, False):
        x = leaf(torch.randn(B, S, H, generator=g))
        emb = leaf(full("embedding", (VPAD, H)))
        head = emb if tied else leaf(full("output", (VPAD, H)))
        logits = F.linear(F.embedding(tokens, emb) + x, head)
        loss = F.cross_entropy(logits.reshape(-1, VPAD), targets.reshape(-1), reduction="none").view(B, S)
        loss.mean().backward()
        out[f"ce_tied={tied}"] = dict(loss=loss.detach(), x=x.grad, emb=emb.grad, tokens=tokens,
                                      head=None if tied else head.grad, targets=targets,
                                      xin=x.detach())
    return out


# ---- the tensor-parallel side -----------------------------------------------------------------

def run_config(state, ref, sp, ov):
    r, tp = state.coords.tp, state.size("tp")
    s = S // tp
    loc = (lambda t: t[:, r * s:(r + 1) * s]) if sp else (lambda t: t)
    res, tensors, trace = {}, {}, []
    ledger = CommLedger()
    kw = tp_kwargs(state, sequence_parallel=sp, overlap=ov, ledger=ledger)

    # MLP block
    x, gy = data(1)
    x, norm_w = leaf(loc(x)), torch.nn.Parameter(torch.ones(H))
    col = ColumnParallelLinear(H, 2 * FF, name=GU, cfg=CFG, seed=SEED, blocks=2, bias=True,
                               trace=trace, **kw)
    row = RowParallelLinear(FF, H, name=DOWN, cfg=CFG, seed=SEED, bias=True, trace=trace, **kw)
    gate, up = col(F.rms_norm(x, (H,), norm_w, EPS)).chunk(2, dim=-1)
    y = row(F.silu(gate) * up)
    (y * loc(gy)).sum().backward()
    if sp:
        sp_params = [norm_w] + [p for p in row.parameters() if getattr(p, "sequence_parallel", False)]
        assert len(sp_params) == 2  # the norm weight and the row-parallel bias
        for h in allreduce_sequence_parallel_grads(sp_params, state.group("tp"), ledger, overlap=ov):
            h.wait()
    m = ref["mlp"]
    res["mlp"] = dict(y=rel(y, loc(m["y"])), x=rel(x.grad, loc(m["x"])), norm=rel(norm_w.grad, m["norm"]),
                      gu=rel(col.weight.grad, shard_tensor(m["gu"], 0, r, tp, blocks=2)),
                      down=rel(row.weight.grad, shard_tensor(m["down"], 1, r, tp)),
                      b_gu=rel(col.bias.grad, shard_tensor(m["b_gu"], 0, r, tp, blocks=2)),
                      b_down=rel(row.bias.grad, m["b_down"]))
    tensors["mlp"] = [y, x.grad, norm_w.grad, col.weight.grad, row.weight.grad, col.bias.grad, row.bias.grad]
    res["ledger"] = {k: dict(v) for k, v in ledger.summary().items()}
    # SP: the norm weight's and the bias's gradients travel in one flat all-reduce.
    res["expected_tp_ops"] = (2 if not sp else 6 if not ov else 4 * (tp - 1) + 1)
    res["trace"] = list(trace)

    # attention
    x, gy = data(2)
    x = leaf(loc(x))
    qkv = ColumnParallelLinear(H, 3 * H, name=QKV, cfg=CFG, seed=SEED, blocks=3, **kw)
    proj = RowParallelLinear(H, H, name=PROJ, cfg=CFG, seed=SEED, **kw)
    y = proj(attn_core(qkv(x), N // tp))
    (y * loc(gy)).sum().backward()
    a = ref["attn"]
    res["attn"] = dict(y=rel(y, loc(a["y"])), x=rel(x.grad, loc(a["x"])),
                       qkv=rel(qkv.weight.grad, shard_tensor(a["qkv"], 0, r, tp, blocks=3)),
                       proj=rel(proj.weight.grad, shard_tensor(a["proj"], 1, r, tp)))
    tensors["attn"] = [y, x.grad, qkv.weight.grad, proj.weight.grad]
    # column without an input gradient (first layer of a stage): weight gradient only
    x2 = loc(data(2)[0])
    qkv.weight.grad = None
    qkv(x2).sum().backward()
    xf = data(2)[0]
    res["attn"]["qkv_no_dgrad"] = rel(qkv.weight.grad, shard_tensor(
        torch.ones(B, S, 3 * H).reshape(-1, 3 * H).t() @ xf.reshape(-1, H), 0, r, tp, blocks=3))

    # embedding + head + vocab-parallel CE
    for tied in (True, False):
        c = ref[f"ce_tied={tied}"]
        emb = VocabParallelEmbedding(VPAD, H, name="embedding", cfg=CFG, seed=SEED, **kw)
        x = leaf(loc(c["xin"]))
        h = emb(c["tokens"]) + x
        if tied:
            logits = column_parallel_linear(h, emb.weight, None, emb.comm)
        else:
            head = ColumnParallelLinear(H, VPAD, name="output", cfg=CFG, seed=SEED, **kw)
            logits = head(h)
        loss = vocab_parallel_cross_entropy(logits, c["targets"], tp_group=kw["tp_group"], tp_rank=r,
                                            tp_size=tp, ledger=ledger)
        loss.mean().backward()
        key = f"ce_tied={tied}"
        res[key] = dict(loss=rel(loss, c["loss"]), x=rel(x.grad, loc(c["x"])),
                        emb=rel(emb.weight.grad, shard_tensor(c["emb"], 0, r, tp)))
        tensors[key] = [loss, x.grad, emb.weight.grad]
        if not tied:
            res[key]["head"] = rel(head.weight.grad, shard_tensor(c["head"], 0, r, tp))
            tensors[key].append(head.weight.grad)
    res["modes"] = sorted(ledger.summary())
    return res, tensors


def sp_helpers(state):
    """scatter / gather / reduce-scatter mappings and their backwards."""
    r, tp = state.coords.tp, state.size("tp")
    s = S // tp
    comm = make_comm(**tp_kwargs(state, sequence_parallel=True, overlap=False, ledger=None))
    x, gy = data(5)
    out = {}
    xl = leaf(x)
    xs = scatter_to_sequence_parallel(xl, comm)
    y = gather_from_sequence_parallel(xs * 2, comm, grad_is_partial=False)
    (y * gy).sum().backward()
    out["scatter_gather"] = (rel(xs, x[:, r * s:(r + 1) * s]), rel(y, 2 * x), rel(xl.grad, 2 * gy))
    xl = leaf(x)
    z = reduce_scatter_to_sequence_parallel(xl * (r + 1), comm)
    (z * gy[:, r * s:(r + 1) * s]).sum().backward()
    total = tp * (tp + 1) / 2
    out["reduce_scatter"] = (rel(z, total * x[:, r * s:(r + 1) * s]), rel(xl.grad, (r + 1) * gy))
    xl = leaf(x[:, r * s:(r + 1) * s])
    y = gather_from_sequence_parallel(xl, comm, grad_is_partial=True)
    (y * gy * (r + 1)).sum().backward()  # partial grads: their sum is total * gy
    out["gather_partial"] = (rel(xl.grad, total * gy[:, r * s:(r + 1) * s]),)
    xl = leaf(x)
    y = reduce_from_tensor_parallel_region(copy_to_tensor_parallel_region(xl, comm) * (r + 1), comm)
    (y * gy).sum().backward()
    out["copy_reduce"] = (rel(y, total * x), rel(xl.grad, total * gy))
    return out


def worker(rank, world):
    ref = reference()
    out = {}
    for tp, grid in ((4, RankGrid(tp=4)), (2, RankGrid(tp=2, dp=2))):
        state = ParallelState.create(grid, torch.device("cpu"))
        results, tensors = {}, {}
        for sp, ov in itertools.product((False, True), repeat=2):
            results[(sp, ov)], tensors[(sp, ov)] = run_config(state, ref, sp, ov)
        on_off = {}
        for sp in (False, True):
            a, b = tensors[(sp, False)], tensors[(sp, True)]
            on_off[sp] = {k: (all(torch.equal(p, q) for p, q in zip(a[k], b[k])),
                              max(rel(q, p) for p, q in zip(a[k], b[k]))) for k in a}
        out[tp] = dict(results=results, on_off=on_off, helpers=sp_helpers(state), gqa=gqa_attention(state))
    return out


GQA_N = 8  # query heads of the grouped-query cases (head dim 4)


def placed_exactly(p, tp_rank, tp, full) -> bool:
    """Each checkpoint chunk of tp-sharded parameter `p` equals the full tensor at its offsets."""
    from mpoverlap.checkpoint.train_state import partition_of, range_chunks

    local = p.detach()
    chunks = range_chunks(local.reshape(-1), local.shape, partition_of(p, tp_rank, tp), 0, local.numel())
    return sum(t.numel() for _, t in chunks) == local.numel() and all(
        torch.equal(full[tuple(slice(o, o + n) for o, n in zip(offsets, t.shape))], t) for offsets, t in chunks)


def gqa_attention(state):
    """The model's attention with G K/V groups (G = tp, 2 tp and N), tp-sharded (SP on and off,
    overlap on and off) against the same layer on one process: output, input gradient and the
    local shards of the qkv ([q | k | v] of sizes N D, G D, G D) and proj weight gradients."""
    from mpoverlap.models.gpt import CausalSelfAttention, rope_cos_sin
    from mpoverlap.models.init import qkv_rows
    r, tp = state.coords.tp, state.size("tp")
    cos, sin = rope_cos_sin(torch.arange(S), H // GQA_N, 10000.0)
    x_full, gy = data(4)
    out = {}
    for groups in sorted({tp, 2 * tp, GQA_N}):
        cfg = ModelConfig(num_layers=2, hidden_size=H, num_attention_heads=GQA_N, num_query_groups=groups,
                          ffn_hidden_size=FF, seq_length=S, vocab_size=VOCAB)
        ref = CausalSelfAttention(cfg, "layers.0.attn", SEED)
        with torch.no_grad():  # one process: plain nn.Linear, given the GPT's initial values
            for name, p in ref.named_parameters():
                p.copy_(init_tensor(f"layers.0.attn.{name}", p.shape, cfg, SEED))
        xr = leaf(x_full)
        (ref(xr, cos, sin) * gy).sum().backward()
        y_ref = ref(x_full, cos, sin).detach()
        for sp, ov in itertools.product((False, True), repeat=2):
            loc = (lambda t: t[:, r * (S // tp):(r + 1) * (S // tp)]) if sp else (lambda t: t)
            kw = tp_kwargs(state, sequence_parallel=sp, overlap=ov, ledger=CommLedger())
            layer = CausalSelfAttention(cfg, "layers.0.attn", SEED, tp=kw)
            x = leaf(loc(x_full))
            y = layer(x, cos, sin)
            (y * loc(gy)).sum().backward()
            out[(groups, sp, ov)] = dict(
                y=rel(y, loc(y_ref)), x=rel(x.grad, loc(xr.grad)),
                qkv=rel(layer.qkv.weight.grad, shard_tensor(ref.qkv.weight.grad, 0, r, tp, blocks=qkv_rows(cfg))),
                proj=rel(layer.proj.weight.grad, shard_tensor(ref.proj.weight.grad, 1, r, tp)),
                local_rows=layer.qkv.weight.shape[0],
                # a checkpoint places this rank's [q_r | k_r | v_r] at those rows of the full weight
                placed_exact=placed_exactly(layer.qkv.weight, r, tp, ref.qkv.weight.detach()))
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(worker, 4, timeout_s=150)


def _configs(results):
    for rank, out in enumerate(results):
        for tp, r in out.items():
            for (sp, ov), res in r["results"].items():
                yield f"rank{rank}/tp{tp}/sp={sp}/ov={ov}", tp, sp, ov, res


def test_layers_match_reference(results):
    n = 0
    for where, _tp, _sp, _ov, res in _configs(results):
        for block in ("mlp", "attn", "ce_tied=True", "ce_tied=False"):
            for what, err in res[block].items():
                assert err < 1e-5, (where, block, what, err)
                n += 1
    assert n == 4 * 2 * 4 * (7 + 5 + 3 + 4)


def test_gqa_attention_matches_reference(results):
    """Grouped-query attention under tp 2 and 4, SP and overlap on and off: each rank holds
    N/tp query heads and G/tp K/V groups ((N + 2G) D / tp qkv rows) and matches one process."""
    n = 0
    for rank, out in enumerate(results):
        for tp, r in out.items():
            assert {g for g, _, _ in r["gqa"]} == {tp, 2 * tp, GQA_N}
            for (groups, sp, ov), errs in r["gqa"].items():
                assert errs.pop("local_rows") == (GQA_N + 2 * groups) * (H // GQA_N) // tp
                assert errs.pop("placed_exact")
                for what, err in errs.items():
                    assert err < 1e-5, (rank, tp, groups, sp, ov, what, err)
                    n += 1
    assert n == 4 * (3 + 2) * 4 * 4  # ranks x (groups at tp 2, at tp 4) x (sp, ov) x checks


def test_shard_tensor_uneven_blocks():
    """GQA's [q | k | v] blocks of unequal sizes: shard_tensor slices each block (the
    checkpoint places them back: gqa_attention's `placed_exact` check)."""
    t = torch.arange(16.0).view(16, 1)  # q 8 rows, k 4, v 4
    shards = [shard_tensor(t, 0, r, 2, blocks=(8, 4, 4)) for r in range(2)]
    assert shards[1].view(-1).tolist() == [4, 5, 6, 7, 10, 11, 14, 15]
    with pytest.raises(ValueError, match="tp_size=4"):
        shard_tensor(t, 0, 0, 4, blocks=(8, 6, 2))


def test_overlap_on_off(results):
    """No SP: the same arithmetic, waited later -> bitwise. SP: collective matmul sums chunk
    GEMMs in ring order -> equal up to fp32 rounding."""
    for rank, out in enumerate(results):
        for tp, r in out.items():
            for sp, blocks in r["on_off"].items():
                for block, (bitwise, err) in blocks.items():
                    if not sp:
                        assert bitwise, (rank, tp, block, err)
                    assert err < 1e-6, (rank, tp, sp, block, err)


def test_ledger_sees_tp_ops(results):
    for where, _tp, _sp, _ov, res in _configs(results):
        assert res["modes"] == ["tp"], where
        assert res["ledger"]["tp"]["ops"] == res["expected_tp_ops"], (where, res["ledger"])
        assert res["ledger"]["tp"]["bytes"] > 0


def _transfers(trace, label):
    """For each issued transfer of `label`: the events between its issue and its wait."""
    ev = [(step, event) for lab, step, event, _ in trace if lab == label]
    out = []
    for i, (step, event) in enumerate(ev):
        if event == "issue":
            j = next(j for j in range(i + 1, len(ev)) if ev[j] == (step, "wait"))
            out.append([e for _, e in ev[i + 1:j]])
    return out


def test_collective_matmul_overlaps_transfers_with_gemms(results):
    for where, tp, sp, ov, res in _configs(results):
        trace = res["trace"]
        times = [e[3] for e in trace]
        assert times == sorted(times)
        if not (sp and ov):
            continue
        labels = {e[0] for e in trace}
        assert labels == {"column.fwd", "column.bwd", "row.fwd", "row.bwd"}, where
        for label in labels:
            transfers = _transfers(trace, label)
            assert len(transfers) == tp - 1, (where, label)
            for between in transfers:
                # each p2p step is issued before a chunk GEMM and waited only after it
                assert "gemm_start" in between and "gemm_end" in between, (where, label, between)


def test_backward_collectives_hidden_under_gemms(results):
    """Plain path (no ring): column backward's all-gather (SP) runs under the dgrad GEMM and
    the dgrad reduction under the wgrad GEMM with overlap; without overlap each is waited
    at once."""
    for where, tp, sp, ov, res in _configs(results):
        if sp and ov:
            continue
        trace = res["trace"]
        assert {e[0] for e in trace} == {"column.bwd"}, where
        transfers = _transfers(trace, "column.bwd")
        assert len(transfers) == (2 if sp else 1), where
        for between in transfers:
            assert between == (["gemm_start", "gemm_end"] if ov else []), (where, between)


def test_sp_helpers(results):
    for rank, out in enumerate(results):
        for tp, r in out.items():
            for name, errs in r["helpers"].items():
                assert max(errs) < 1e-6, (rank, tp, name, errs)


# ---- single process: tp = 1 (group None) -----------------------------------------------------

def test_tp1_layers_are_plain_modules():
    x, gy = data(1)
    col = ColumnParallelLinear(H, 3 * H, name=QKV, cfg=CFG, seed=SEED, blocks=3)
    assert torch.equal(col.weight, full(QKV, (3 * H, H)))
    # Forward and backward against torch.nn.Linear holding the same weight (its autograd, not
    # the layers' hand-written backward): outputs, input and weight gradients, bias gradient.
    plain = torch.nn.Linear(H, 3 * H, bias=False)
    with torch.no_grad():
        plain.weight.copy_(full(QKV, (3 * H, H)))
    xl, xr = leaf(x), leaf(x)
    gy3 = torch.randn(B, S, 3 * H, generator=torch.Generator().manual_seed(3))
    y = col(xl)
    torch.testing.assert_close(y, plain(xr), rtol=0, atol=0)
    y.backward(gy3)
    plain(xr).backward(gy3)
    torch.testing.assert_close(xl.grad, xr.grad, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(col.weight.grad, plain.weight.grad, rtol=1e-6, atol=1e-7)
    row = RowParallelLinear(H, H, name=PROJ, cfg=CFG, seed=SEED, bias=True)
    plain_row = torch.nn.Linear(H, H)
    with torch.no_grad():
        plain_row.weight.copy_(row.weight)
        plain_row.bias.copy_(row.bias)
    xl, xr = leaf(x), leaf(x)
    y = row(xl)
    torch.testing.assert_close(y, plain_row(xr), rtol=1e-6, atol=1e-7)
    y.backward(gy)
    plain_row(xr).backward(gy)
    for got, want in ((xl.grad, xr.grad), (row.weight.grad, plain_row.weight.grad), (row.bias.grad, plain_row.bias.grad)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    emb = VocabParallelEmbedding(VPAD, H, name="embedding", cfg=CFG, seed=SEED, sequence_parallel=False)
    tokens = torch.randint(0, VOCAB, (B, S))
    torch.testing.assert_close(emb(tokens), F.embedding(tokens, full("embedding", (VPAD, H))))
    logits = torch.randn(B, S, VPAD, requires_grad=True)
    loss = vocab_parallel_cross_entropy(logits, tokens)
    ref = F.cross_entropy(logits.reshape(-1, VPAD), tokens.reshape(-1), reduction="none").view(B, S)
    torch.testing.assert_close(loss, ref)
    g1, = torch.autograd.grad(loss.mean(), logits)
    g2, = torch.autograd.grad(ref.mean(), logits)
    torch.testing.assert_close(g1, g2)


def test_shard_tensor_fused_blocks():
    t = torch.arange(12.0).view(12, 1)
    assert shard_tensor(t, 0, 1, 2, blocks=3).view(-1).tolist() == [2, 3, 6, 7, 10, 11]
    with pytest.raises(ValueError, match="tp_size"):
        shard_tensor(t, 0, 0, 5)
