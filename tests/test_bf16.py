"""The CUDA precision path on CPU: bf16 autocast through the custom autograd functions (TP
linear, collective matmul, ring attention), communication in the compute dtype, the bf16
data-parallel reduction, and tensors created on their inputs' device (the meta device).

One spawn of 2 gloo ranks (module fixture) runs the distributed checks: tp=2 (SP on/off,
overlap on/off), cp=2 ring attention and dp=2 with a bf16 gradient reduction, each against
the single-process math of the same precision.
"""
import itertools
import os
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dist_harness import run_distributed  # noqa: E402

from mpoverlap.config import ModelConfig  # noqa: E402
from mpoverlap.context_parallel import gather_from_cp, ring_attention, split_for_cp  # noqa: E402
from mpoverlap.models.gpt import GPT, init_tensor, rope_cos_sin  # noqa: E402
from mpoverlap.precision import autocast_context  # noqa: E402

CPU = torch.device("cpu")
B, S, H, FF, SEED, EPS = 2, 16, 32, 64, 7, 1e-5
CFG = ModelConfig(num_layers=2, hidden_size=H, num_attention_heads=4, ffn_hidden_size=FF, seq_length=S,
                  vocab_size=50, make_vocab_size_divisible_by=16)
GU, DOWN = "layers.0.mlp.gate_up", "layers.0.mlp.down"
NQ, DQ = 4, 8  # attention heads and head dim of the ring checks


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# ---- device placement ---------------------------------------------------------------------------

def test_rope_tables_on_the_positions_device():
    cos, sin = rope_cos_sin(torch.arange(8, device="meta"), 16, 1e4)
    assert cos.device.type == "meta" and sin.device.type == "meta"


def test_gpt_forward_on_meta_device():
    """A single-process pass on the meta device: any tensor created on the CPU by mistake
    refuses to mix with the meta activations."""
    model = GPT(CFG).to("meta")
    logits = model(torch.zeros(B, S, dtype=torch.long, device="meta"))
    assert logits.device.type == "meta" and logits.shape == (B, S, 64)


def test_estimate_dp_bytes_follow_grad_reduce_dtype():
    from mpoverlap.config import compose
    from mpoverlap.overlap.estimate import estimate

    def dp_bytes(*overrides):
        return estimate(compose(["parallel.dp=2", *overrides]), 2).comm_bytes_per_step["dp"]

    assert dp_bytes("train.grad_reduce_dtype=bf16") * 2 == dp_bytes()
    # ZeRO-1: the gradient reduce-scatter halves, the fp32 parameter all-gather does not.
    zero = ["train.distributed_optimizer=true"]
    assert dp_bytes(*zero, "train.grad_reduce_dtype=bf16") * 4 == dp_bytes(*zero) * 3


# ---- ring attention under autocast, one process --------------------------------------------------

def _qkvw(dtype):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, NQ, S, DQ, generator=g).to(dtype) for _ in range(4)]


def _sdpa_fp32(q, k, v, w):
    """fp32 causal attention on (upcast) inputs: out and dq, dk, dv of sum(out * w)."""
    q, k, v = (t.float().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return [out.detach(), *torch.autograd.grad((out * w.float()).sum(), (q, k, v))]


def _ring_cp1(q, k, v, w, precision):
    qkv = [t.clone().requires_grad_() for t in (q, k, v)]
    with autocast_context(precision, CPU):
        out = ring_attention(*qkv, cp_group=None, cp_ranks=[0], cp_rank=0, cp_size=1, overlap=True)
    return [out.detach(), *torch.autograd.grad((out.float() * w.float()).sum(), qkv)]


def test_ring_attention_block_math_ignores_autocast():
    """fp32 inputs: autocast must not push the block GEMMs to bf16 (the backward recomputes
    them in fp32): results bitwise equal to the run without autocast."""
    q, k, v, w = _qkvw(torch.float32)
    for got, want in zip(_ring_cp1(q, k, v, w, "bf16"), _ring_cp1(q, k, v, w, "fp32")):
        assert torch.equal(got, want)


def test_ring_attention_bf16_gradient_is_gradient_of_forward():
    """bf16 q, k, v under autocast: output and gradients match fp32 attention on the same
    (bf16-valued) inputs within bf16 output rounding."""
    q, k, v, w = _qkvw(torch.bfloat16)
    got = _ring_cp1(q, k, v, w, "bf16")
    assert all(t.dtype == torch.bfloat16 for t in got)
    for g, want in zip(got, _sdpa_fp32(q, k, v, w)):
        assert rel(g, want) < 4e-3  # bf16 output rounding alone: 1.6e-3


# ---- distributed: tp=2, cp=2, dp=2 in one spawn --------------------------------------------------

def _mlp_inputs():
    g = torch.Generator().manual_seed(1)
    return torch.randn(B, S, H, generator=g), torch.randn(B, S, H, generator=g)


def _mlp_reference(precision):
    """Single-process MLP (norm -> gate_up -> swiglu -> down) under `precision`."""
    x, gy = _mlp_inputs()
    x = x.requires_grad_()
    w_gu = init_tensor(f"{GU}.weight", (2 * FF, H), CFG, SEED).requires_grad_()
    w_down = init_tensor(f"{DOWN}.weight", (H, FF), CFG, SEED).requires_grad_()
    with autocast_context(precision, CPU):
        gate, up = F.linear(F.rms_norm(x, (H,)), w_gu).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w_down)
    (y.float() * gy).sum().backward()
    return dict(y=y.detach().float(), x=x.grad, gu=w_gu.grad, down=w_down.grad)


def _tp_checks(state):
    from mpoverlap.comm.ledger import CommLedger
    from mpoverlap.tensor_parallel import ColumnParallelLinear, RowParallelLinear, shard_tensor, tp_kwargs

    r, tp = state.coords.tp, state.size("tp")
    refs = {p: _mlp_reference(p) for p in ("fp32", "bf16")}
    out = {}
    for sp, ov, precision in itertools.product((False, True), (False, True), ("fp32", "bf16")):
        s = S // tp if sp else S
        loc = (lambda t: t[:, r * s:(r + 1) * s]) if sp else (lambda t: t)
        ledger = CommLedger()
        kw = tp_kwargs(state, sequence_parallel=sp, overlap=ov, ledger=ledger)
        col = ColumnParallelLinear(H, 2 * FF, name=GU, cfg=CFG, seed=SEED, blocks=2, **kw)
        row = RowParallelLinear(FF, H, name=DOWN, cfg=CFG, seed=SEED, **kw)
        x, gy = _mlp_inputs()
        x = loc(x).clone().requires_grad_()
        with autocast_context(precision, CPU):
            gate, up = col(F.rms_norm(x, (H,))).chunk(2, dim=-1)
            y = row(F.silu(gate) * up)
        (y.float() * loc(gy)).sum().backward()
        ref = refs[precision]
        out[(sp, ov, precision)] = dict(
            y_dtype=str(y.dtype), grad_dtypes={str(col.weight.grad.dtype), str(row.weight.grad.dtype)},
            errors=dict(y=rel(y, loc(ref["y"])), x=rel(x.grad, loc(ref["x"])),
                        gu=rel(col.weight.grad, shard_tensor(ref["gu"], 0, r, tp, blocks=2)),
                        down=rel(row.weight.grad, shard_tensor(ref["down"], 1, r, tp))),
            tp_bytes=ledger.summary()["tp"]["bytes"])
    return out


def _embedding_checks(state):
    """The vocab-parallel embedding at tp=2 (SP on/off, overlap on/off) under bf16
    autocast against the single process's embedding (models/layers.py at tp=1, autocast leaves
    it fp32): the output (the residual stream's start) and the weight gradient, each rank's
    part, bitwise; the reduction moves fp32 (the bytes of the fp32 run)."""
    from mpoverlap.comm.ledger import CommLedger
    from mpoverlap.models.layers import embedding
    from mpoverlap.tensor_parallel import VocabParallelEmbedding, shard_tensor, tp_kwargs

    r, tp, V = state.coords.tp, state.size("tp"), 64
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, V, (B, S), generator=g)
    gy = torch.randn(B, S, H, generator=g)

    def run(module, loc, precision):
        with autocast_context(precision, CPU):
            y = module(tokens)
        (y * loc(gy)).sum().backward()
        return y.detach(), module.weight.grad

    ref = {}
    for precision in ("fp32", "bf16"):
        single = embedding(V, H, CFG, SEED, None)
        with torch.no_grad():
            single.weight.copy_(init_tensor("embedding.weight", (V, H), CFG, SEED))
        ref[precision] = run(single, lambda t: t, precision)
    out = {}
    for sp, ov, precision in itertools.product((False, True), (False, True), ("fp32", "bf16")):
        loc = (lambda t: t[:, r * (S // tp):(r + 1) * (S // tp)]) if sp else (lambda t: t)
        ledger = CommLedger()
        emb = VocabParallelEmbedding(V, H, name="embedding", cfg=CFG, seed=SEED,
                                     **tp_kwargs(state, sequence_parallel=sp, overlap=ov, ledger=ledger))
        y, grad = run(emb, loc, precision)
        y_ref, grad_ref = ref[precision]
        out[(sp, ov, precision)] = dict(dtype=str(y.dtype), y_equal=torch.equal(y, loc(y_ref)),
                                        grad_equal=torch.equal(grad, shard_tensor(grad_ref, 0, r, tp)),
                                        y_err=rel(y, loc(y_ref)), tp_bytes=ledger.summary()["tp"]["bytes"])
    return out


def _cp_checks(state):
    from mpoverlap.comm.ledger import CommLedger

    group, ranks, r = state.group("cp"), state.ranks("cp"), state.coords.cp
    out = {}
    for dtype, precision in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        q, k, v, w = _qkvw(dtype)
        ledger = CommLedger()
        local = [split_for_cp(t, r, 2, seq_dim=2).requires_grad_() for t in (q, k, v)]
        with autocast_context(precision, CPU):
            o = ring_attention(*local, cp_group=group, cp_ranks=ranks, cp_rank=r, cp_size=2,
                               overlap=True, ledger=ledger)
        grads = torch.autograd.grad((o.float() * split_for_cp(w, r, 2, 2).float()).sum(), local)
        full = [gather_from_cp(t.detach().float(), cp_group=group, cp_size=2, seq_dim=2) for t in (o, *grads)]
        out[precision] = dict(errors=[rel(a, b) for a, b in zip(full, _sdpa_fp32(q, k, v, w))],
                              cp_bytes=ledger.summary()["cp"]["bytes"])
    return out


def _dp_checks(state):
    from mpoverlap.comm.ledger import CommLedger
    from mpoverlap.data_parallel import DataParallel

    out = {}
    for reduce_dtype, ov in itertools.product((torch.float32, torch.bfloat16), (False, True)):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(H, FF), torch.nn.Linear(FF, H))
        ledger = CommLedger()
        ddp = DataParallel(model, state, group_kind="dp", overlap=ov, bucket_mb=0.005,
                           distributed_optimizer=False, ledger=ledger, reduce_dtype=reduce_dtype)
        ddp.start_step()
        x = torch.randn(B, H, generator=torch.Generator().manual_seed(10 + state.rank))
        ddp(x).square().sum().backward()
        ddp.finish_grad_sync()
        out[(str(reduce_dtype), ov)] = dict(grads=[p.grad.clone() for p in model.parameters()],
                                            dp_bytes=ledger.summary()["dp"]["bytes"])
    fp, bf = str(torch.float32), str(torch.bfloat16)
    # Plain values back to the parent (tensors would travel through shared memory that dies
    # with the worker).
    return dict(bytes={k: v["dp_bytes"] for k, v in out.items()},
                grad_dtypes={str(g.dtype) for g in out[(bf, True)]["grads"]},
                bf16_vs_fp32=[rel(a, b) for a, b in zip(out[(bf, True)]["grads"], out[(fp, True)]["grads"])],
                on_off_equal={red: all(torch.equal(a, b) for a, b in zip(out[(red, True)]["grads"],
                                                                         out[(red, False)]["grads"]))
                              for red in (fp, bf)})


def _worker(rank, world):
    from mpoverlap.parallel import ParallelState, RankGrid

    torch.manual_seed(0)
    tp_state = ParallelState.create(RankGrid(tp=2), CPU)
    return dict(tp=_tp_checks(tp_state), embedding=_embedding_checks(tp_state),
                cp=_cp_checks(ParallelState.create(RankGrid(cp=2), CPU)),
                dp=_dp_checks(ParallelState.create(RankGrid(dp=2), CPU)))


@pytest.fixture(scope="module")
def reports():
    return run_distributed(_worker, 2, timeout_s=150)


@pytest.mark.parametrize("sp,ov", list(itertools.product((False, True), repeat=2)))
def test_tp_functions_under_bf16_autocast(reports, sp, ov):
    """Forward and backward at tp=2 under CPU bf16 autocast: bf16 activations, fp32 weight
    gradients (into the fp32 master parameters), within bf16 rounding of the single-process
    bf16 MLP; the fp32 runs stay at fp32 rounding."""
    for rep in reports:
        fp32, bf16 = rep["tp"][(sp, ov, "fp32")], rep["tp"][(sp, ov, "bf16")]
        assert max(fp32["errors"].values()) < 1e-5, fp32["errors"]
        assert bf16["y_dtype"] == str(torch.bfloat16) and bf16["grad_dtypes"] == {str(torch.float32)}
        assert max(bf16["errors"].values()) < 2e-2, bf16["errors"]


@pytest.mark.parametrize("sp,ov", list(itertools.product((False, True), repeat=2)))
def test_tp_activations_travel_in_bf16(reports, sp, ov):
    for rep in reports:
        assert rep["tp"][(sp, ov, "bf16")]["tp_bytes"] * 2 == rep["tp"][(sp, ov, "fp32")]["tp_bytes"]


@pytest.mark.parametrize("sp,ov", list(itertools.product((False, True), repeat=2)))
def test_tp_embedding_keeps_the_fp32_residual_stream(reports, sp, ov):
    """Under bf16 autocast the tp=2 embedding output and weight gradient
    are bitwise those of tp=1 (fp32: the residual stream is rounded in no layout where the
    single process keeps it); its reduction moves the fp32 bytes."""
    for rep in reports:
        for precision in ("fp32", "bf16"):
            got = rep["embedding"][(sp, ov, precision)]
            assert got["dtype"] == str(torch.float32), (precision, got)
            assert got["y_equal"] and got["grad_equal"], (precision, got)
        assert rep["embedding"][(sp, ov, "bf16")]["tp_bytes"] == rep["embedding"][(sp, ov, "fp32")]["tp_bytes"]


def test_ring_attention_cp2_under_autocast(reports):
    """cp=2: bf16 K/V and dK/dV travel (half the bytes); the gradient is the gradient of the
    forward (fp32 block math), against fp32 attention on the same bf16 values."""
    for rep in reports:
        assert max(rep["cp"]["fp32"]["errors"]) < 1e-5
        assert max(rep["cp"]["bf16"]["errors"]) < 4e-3, rep["cp"]["bf16"]["errors"]
        assert rep["cp"]["bf16"]["cp_bytes"] * 2 == rep["cp"]["fp32"]["cp_bytes"]


def test_dp_bf16_gradient_reduction(reports):
    """train.grad_reduce_dtype=bf16: half the dp bytes, fp32 gradients in the buffer within
    bf16 rounding of the fp32 reduction; overlap on/off bitwise equal."""
    fp, bf = str(torch.float32), str(torch.bfloat16)
    for rep in reports:
        dp = rep["dp"]
        assert dp["bytes"][(bf, True)] * 2 == dp["bytes"][(fp, True)]
        assert dp["grad_dtypes"] == {str(torch.float32)}
        assert all(0 < e < 1e-2 for e in dp["bf16_vs_fp32"]), dp["bf16_vs_fp32"]
        assert dp["on_off_equal"] == {fp: True, bf: True}
