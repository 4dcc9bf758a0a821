"""train.precision=fp8 on the tensor-parallel paths at tp=2 (gloo): the column- and row-parallel
linears with and without sequence parallelism, the collective-matmul ring chunks (SP + overlap)
and the zero-bubble deferred weight gradient, each against its emulation (the same casts and
per-GEMM / per-chunk scales, dequantized, fp32 matmul): output, input gradient, weight gradients.
The emulation itself is checked against the single-process fp32 MLP (FP8's error, loosely)."""
import itertools
import os
import sys

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("torchao")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dist_harness import run_distributed  # noqa: E402
from test_fp8_paths import BF16_OUT, FP32_OUT  # noqa: E402

from mpoverlap.config import ModelConfig  # noqa: E402
from mpoverlap.models.gpt import init_tensor  # noqa: E402
from mpoverlap.precision import autocast_context  # noqa: E402

CPU = torch.device("cpu")
B, S, H, FF, SEED = 2, 32, 32, 64, 7
CFG = ModelConfig(num_layers=1, hidden_size=H, num_attention_heads=2, ffn_hidden_size=FF, seq_length=S,
                  vocab_size=64, make_vocab_size_divisible_by=16)
GU, DOWN = "layers.0.mlp.gate_up", "layers.0.mlp.down"
LAYOUTS = [(False, False), (False, True), (True, False), (True, True)]  # (sp, overlap); SP + overlap = ring


def _inputs():
    g = torch.Generator().manual_seed(1)
    return torch.randn(B, S, H, generator=g), torch.randn(B, S, H, generator=g)


def _reference():
    """The single-process fp32 MLP (gate_up -> swiglu -> down)."""
    x, gy = _inputs()
    x = x.requires_grad_()
    w_gu = init_tensor(f"{GU}.weight", (2 * FF, H), CFG, SEED).requires_grad_()
    w_down = init_tensor(f"{DOWN}.weight", (H, FF), CFG, SEED).requires_grad_()
    gate, up = F.linear(x, w_gu).chunk(2, dim=-1)
    y = F.linear(F.silu(gate) * up, w_down)
    (y * gy).sum().backward()
    return dict(y=y.detach(), x=x.grad, gu=w_gu.grad, down=w_down.grad)


def _run(state, sp, ov, recipe, emulate, deferred):
    from mpoverlap.tensor_parallel import ColumnParallelLinear, RowParallelLinear, tp_kwargs
    from mpoverlap.wgrad import WeightGradDeferral, WeightGradQueue

    r, tp = state.coords.tp, state.size("tp")
    s = S // tp if sp else S
    loc = (lambda t: t[:, r * s:(r + 1) * s]) if sp else (lambda t: t)
    kw = tp_kwargs(state, sequence_parallel=sp, overlap=ov)
    col = ColumnParallelLinear(H, 2 * FF, name=GU, cfg=CFG, seed=SEED, blocks=2, **kw)
    row = RowParallelLinear(FF, H, name=DOWN, cfg=CFG, seed=SEED, **kw)
    for m in (col, row):
        m.fp8_recipe, m.fp8_emulate = recipe, emulate
    assert col.comm.use_ring == (sp and ov)
    x, gy = _inputs()
    x = loc(x).clone().requires_grad_()
    deferral = WeightGradDeferral() if deferred else None
    for m in (col, row):
        m.comm.wgrad = deferral
    calls = _count_fp8_gemms()
    with autocast_context("fp8", CPU):
        gate, up = col(x).chunk(2, dim=-1)
        y = row(F.silu(gate) * up)
    if deferred:
        with deferral.deferring(WeightGradQueue()) as queue:
            (y.float() * loc(gy)).sum().backward()
        assert col.weight.grad is None and len(queue) == 2
        queue.run()
    else:
        (y.float() * loc(gy)).sum().backward()
    return dict(y=y.detach(), x=x.grad, gu=col.weight.grad, down=row.weight.grad, gemms=calls.pop())


def _count_fp8_gemms():
    """Counts the FP8 GEMMs from here on (precision.fp8.fp8_gemm calls); `.pop()` stops and returns it."""
    from mpoverlap.precision import fp8

    original, count = fp8.fp8_gemm, [0]

    def counted(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)

    fp8.fp8_gemm = counted

    class Counter:
        @staticmethod
        def pop():
            fp8.fp8_gemm = original
            return count[0]

    return Counter


def _excess(a, b, rel):
    """max |a - b| / (rel |b| + rel max|b|): at most 1 when a is within rel of b (test_fp8_paths.close)."""
    a, b = a.double(), b.double()
    return float(((a - b).abs() / (b.abs() * rel + rel * b.abs().max())).max())


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _worker(rank, world):
    """Per layout and recipe, what the tests check (plain numbers: tensors do not cross back)."""
    from mpoverlap.parallel import ParallelState, RankGrid
    from mpoverlap.tensor_parallel import shard_tensor

    state = ParallelState.create(RankGrid(tp=2), CPU)
    r, tp = state.coords.tp, state.size("tp")
    ref = _reference()
    out = {}
    for (sp, ov), recipe in itertools.product(LAYOUTS, ("tensorwise", "rowwise")):
        real, emu, deferred = (_run(state, sp, ov, recipe, emulate, defer)
                               for emulate, defer in ((False, False), (True, False), (False, True)))
        s = S // tp if sp else S
        local = dict(y=ref["y"][:, r * s:(r + 1) * s] if sp else ref["y"],
                     x=ref["x"][:, r * s:(r + 1) * s] if sp else ref["x"],
                     gu=shard_tensor(ref["gu"], 0, r, tp, blocks=2), down=shard_tensor(ref["down"], 1, r, tp))
        tol = dict(y=BF16_OUT, x=BF16_OUT, gu=FP32_OUT, down=FP32_OUT)
        out[(sp, ov, recipe)] = dict(
            gemms=(real["gemms"], deferred["gemms"]),
            dtypes=(str(real["y"].dtype), str(real["gu"].dtype), str(real["down"].dtype)),
            excess={k: _excess(real[k], emu[k], tol[k]) for k in tol},
            emu_vs_fp32={k: _rel(emu[k], local[k]) for k in tol},
            deferred_equal={k: torch.equal(deferred[k], real[k]) for k in tol},
            deferred_excess={k: _excess(deferred[k], emu[k], tol[k]) for k in ("gu", "down")})
    return out


@pytest.fixture(scope="module")
def reports():
    return run_distributed(_worker, 2, timeout_s=300)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("sp,ov", LAYOUTS, ids=lambda v: str(v))
def test_tp_fp8_equals_emulation(reports, sp, ov, recipe):
    """Column + row parallel at tp=2 in FP8 (SP off/on; SP + overlap = the ring's per-chunk GEMMs):
    output and input gradient within bf16 output rounding of the emulation, weight gradients
    within fp32 rounding; the emulation within FP8's error of the single-process fp32 MLP."""
    for rep in reports:
        case = rep[(sp, ov, recipe)]
        assert case["dtypes"] == (str(torch.bfloat16), str(torch.float32), str(torch.float32))
        # Every GEMM in FP8: forward, dgrad and wgrad of both linears, per ring chunk on the ring.
        assert case["gemms"] == (6 * (2 if sp and ov else 1),) * 2, case["gemms"]
        assert max(case["excess"].values()) <= 1, case["excess"]
        assert all(2.0 ** -8 < e < 0.15 for e in case["emu_vs_fp32"].values()), case["emu_vs_fp32"]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("sp,ov", LAYOUTS, ids=lambda v: str(v))
def test_tp_fp8_deferred_weight_grad(reports, sp, ov, recipe):
    """The zero-bubble W action's FP8 weight gradients (the bf16 operands kept, quantized in W)
    equal the immediate ones bit for bit, so the emulation's within fp32 rounding."""
    for rep in reports:
        case = rep[(sp, ov, recipe)]
        assert all(case["deferred_equal"].values()), case["deferred_equal"]
        assert max(case["deferred_excess"].values()) <= 1, case["deferred_excess"]
