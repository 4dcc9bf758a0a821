"""The FP8 grouped expert GEMMs (mpoverlap/precision/fp8_grouped.py): the CPU path (padded
layout, dequantized operands, the project's grouped GEMM) against the emulation (the same casts
and scales on the unpadded rows, dense fp32 product), the emulation against torchao's
quantization applied expert by expert, and the CUDA kernel against the emulation (cuda tier)."""
import pytest
import torch

pytest.importorskip("torchao")
from torchao.float8.config import ScalingGranularity  # noqa: E402
from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated  # noqa: E402

from mpoverlap.precision.fp8_grouped import ALIGN, Fp8Grouped, _pad_layout  # noqa: E402

E4M3 = torch.float8_e4m3fn
COUNTS = [5, 0, 19, 7]  # an empty expert, groups off the 16-row alignment


MAGNITUDES = [1e-3, 1.0, 1e3, 1e-4]  # per expert: 1e7 apart, past e4m3's range under one scale


def _fp32_close(a, b):
    """Equal up to fp32 rounding (accumulation order) of the same dequantized products."""
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())


def _groups_close(a, b, dim=0):
    """_fp32_close expert by expert (rows of each expert along `dim` 0, or experts along dim 1 of
    a stacked [L, ...] result): each expert's error measured against its own magnitude."""
    if dim:
        for l in range(len(COUNTS)):
            _fp32_close(a[l], b[l])
        return
    start = 0
    for end in torch.cumsum(torch.tensor(COUNTS), 0).tolist() + [a.shape[0]]:
        if end > start:
            _fp32_close(a[start:end], b[start:end])
        start = end


def _operands(rows_past=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = sum(COUNTS) + rows_past
    scale = torch.repeat_interleave(torch.tensor(MAGNITUDES + [1.0]), torch.tensor(COUNTS + [rows_past]))
    a = torch.randn(n, 32, generator=g) * torch.logspace(-1, 1, n).unsqueeze(1) * scale.unsqueeze(1)
    b = torch.randn(len(COUNTS), 32, 48, generator=g)
    offs = torch.cumsum(torch.tensor(COUNTS), 0, dtype=torch.int32)
    return a, b, offs


def _rowwise(t, dim):
    """torchao's rowwise cast (e4m3, power-of-two scales along `dim`), dequantized."""
    s = tensor_to_scale(t, E4M3, scaling_granularity=ScalingGranularity.AXISWISE, axiswise_dim=dim,
                        round_scales_to_power_of_2=True)
    return to_fp8_saturated(t.float() * s, E4M3).float() / s


def test_pad_layout_starts_every_group_at_a_multiple_of_16_rows():
    offs = torch.cumsum(torch.tensor(COUNTS), 0, dtype=torch.int32)
    pos, valid, padded_offs, rows = _pad_layout(offs, sum(COUNTS) + 3)
    assert padded_offs.tolist() == [16, 16, 48, 64] and rows >= 64
    assert pos[:5].tolist() == list(range(5)) and pos[5:24].tolist() == list(range(16, 35))
    assert pos[24:31].tolist() == list(range(48, 55)) and pos[31:].tolist() == [rows] * 3
    assert valid.tolist() == [True] * 31 + [False] * 3
    assert all(int(o) % ALIGN == 0 for o in padded_offs)


@pytest.mark.parametrize("rows_past", [0, 3])
def test_grouped_mm_cpu_path_equals_emulation_and_torchao_casts(rows_past):
    a, b, offs = _operands(rows_past)
    cpu = Fp8Grouped(torch.float32).mm(a, b, offs)
    emu = Fp8Grouped(torch.float32, emulate=True).mm(a, b, offs)
    _groups_close(cpu, emu)
    # the emulation is torchao's rowwise casts, expert by expert; rows past offs[-1] are zeros
    ref, start = torch.zeros(a.shape[0], 48), 0
    qa, qb = _rowwise(a, -1), _rowwise(b, 1)
    for l, end in enumerate(offs.tolist()):
        ref[start:end] = qa[start:end] @ qb[l]
        start = end
    _groups_close(emu, ref)
    # fp8 really ran: away from the fp32 product by more than fp32 rounding, yet near it
    exact = torch.zeros_like(ref)
    start = 0
    for l, end in enumerate(offs.tolist()):
        exact[start:end] = a[start:end] @ b[l]
        start = end
    rel = (emu - exact).norm() / exact.norm()
    assert 1e-3 < rel < 0.1, rel


@pytest.mark.parametrize("rows_past", [0, 3])
def test_grouped_wgrad_cpu_path_equals_emulation_with_per_expert_scales(rows_past):
    a, _, offs = _operands(rows_past)
    g = torch.randn(a.shape[0], 24, generator=torch.Generator().manual_seed(1)) * a[:, :1].abs()
    if rows_past:  # rows past offs[-1] hold anything and are not read
        a[-rows_past:], g[-rows_past:] = 1e4, -1e4
    cpu = Fp8Grouped(torch.float32).wgrad(a, g, offs)
    emu = Fp8Grouped(torch.float32, emulate=True).wgrad(a, g, offs)
    _groups_close(cpu, emu, 1)
    ref, start = torch.zeros(len(COUNTS), 32, 24), 0
    for l, end in enumerate(offs.tolist()):  # each expert's rows cast on their own (per-group scales)
        if end > start:
            ref[l] = _rowwise(a[start:end], 0).t() @ _rowwise(g[start:end], 0)
        start = end
    _groups_close(emu, ref, 1)
    assert torch.equal(emu[1], torch.zeros(32, 24))  # the empty expert


def _experts(recipe, emulate, activation, ffn=16):
    from mpoverlap.config import compose
    from mpoverlap.moe.experts import GroupedExperts

    cfg = compose(["model=moe_tiny"]).model
    e = GroupedExperts(len(COUNTS), 32, ffn, first_expert_index=0, name_prefix="layers.0.mlp", cfg=cfg, seed=3,
                       activation=activation)
    e.fp8_recipe, e.fp8_emulate = recipe, emulate
    return e


def _mlp_run(recipe, emulate, activation, x, gy, autocast=False):
    e = _experts(recipe, emulate, activation)
    x = x.clone().requires_grad_(True)
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        y = e(x, torch.tensor(COUNTS))
    y.backward(gy)
    return [y.float(), x.grad.float(), e.w_in.grad, e.w_out.grad]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_grouped_experts_fp8_equal_emulation_output_and_gradients(recipe, activation):
    torch.manual_seed(0)
    x, gy = torch.randn(sum(COUNTS), 32), torch.randn(sum(COUNTS), 32)
    cpu = _mlp_run(recipe, False, activation, x, gy)
    emu = _mlp_run(recipe, True, activation, x, gy)
    for a, b in zip(cpu, emu):
        _fp32_close(a, b)
    assert torch.equal(cpu[2][1], torch.zeros_like(cpu[2][1]))  # no tokens, no gradient
    assert torch.equal(cpu[3][1], torch.zeros_like(cpu[3][1]))
    # fp8 really ran: away from the same experts in fp32, yet near them
    ref = _mlp_run(None, False, activation, x, gy)
    for a, b in zip(cpu, ref):
        rel = (a - b).norm() / b.norm()
        assert 1e-3 < rel < 0.2, rel


def test_grouped_experts_fp8_bf16_inputs_equal_emulation():
    """Under bf16 autocast the products come out in bf16 (as the CUDA kernel's): both paths round
    the same fp32 sums, so they agree up to bf16 rounding."""
    torch.manual_seed(0)
    x, gy = torch.randn(sum(COUNTS), 32).bfloat16(), torch.randn(sum(COUNTS), 32).bfloat16()
    cpu = _mlp_run("rowwise", False, "swiglu", x, gy, autocast=True)
    emu = _mlp_run("rowwise", True, "swiglu", x, gy, autocast=True)
    for a, b in zip(cpu, emu):
        tol = b.abs() * 2.0 ** -7 + 2.0 ** -7 * b.abs().max()
        assert ((a - b).abs() <= tol).all(), (a - b).abs().max()


def test_grouped_experts_refuse_widths_off_16_on_every_device():
    e = _experts("rowwise", False, "swiglu", ffn=24)
    with pytest.raises(ValueError, match=r"the expert width 24 .*fix: model.moe_ffn_hidden_size=32"):
        e(torch.randn(sum(COUNTS), 32), torch.tensor(COUNTS))


def test_grouped_experts_refuse_an_unknown_recipe():
    e = _experts("blockwise", False, "swiglu")
    with pytest.raises(ValueError, match="train.fp8_recipe=blockwise"):
        e(torch.randn(sum(COUNTS), 32), torch.tensor(COUNTS))


@pytest.mark.cuda
@pytest.mark.parametrize("rows_past", [0, 3])
def test_scaled_grouped_mm_equals_emulation_on_cuda(rows_past):
    """torch._scaled_grouped_mm on the padded quantized operands (bf16 out, fast accumulation)
    against the emulation of the same casts: forward product and weight gradient."""
    a, b, offs = (t.cuda() for t in _operands(rows_past))
    g = torch.randn(a.shape[0], 48, device="cuda")
    real, emu = Fp8Grouped(torch.bfloat16), Fp8Grouped(torch.float32, emulate=True)
    for got, want in ((real.mm(a, b, offs), emu.mm(a, b, offs)),
                      (real.wgrad(a, g, offs), emu.wgrad(a, g, offs))):
        assert got.dtype == torch.bfloat16
        tol = want.abs() * 2.0 ** -7 + 2.0 ** -10 * want.abs().max()
        assert ((got.float() - want).abs() <= tol).all(), (got.float() - want).abs().max()


@pytest.mark.cuda
def test_grouped_experts_fp8_on_cuda_equal_emulation():
    """The whole expert MLP on CUDA (the kernel's six products under bf16 autocast) against its
    emulation on the same GPU: output, input gradient, w_in and w_out gradients."""
    torch.manual_seed(0)
    x, gy = torch.randn(sum(COUNTS), 32, device="cuda"), torch.randn(sum(COUNTS), 32, device="cuda")
    runs = []
    for emulate in (False, True):
        e = _experts("rowwise", emulate, "swiglu").cuda()
        xi = x.clone().requires_grad_(True)
        with torch.autocast("cuda", torch.bfloat16):
            y = e(xi, torch.tensor(COUNTS, device="cuda"))
        y.backward(gy)
        runs.append([y.float(), xi.grad.float(), e.w_in.grad, e.w_out.grad])
    for a, b in zip(*runs):
        tol = b.abs() * 2.0 ** -6 + 2.0 ** -6 * b.abs().max()
        assert ((a - b).abs() <= tol).all(), (a - b).abs().max()


def test_fp8_grouped_mlp_deferred_and_padded_equal_emulation():
    """The FP8 products through a zero-bubble deferral (the W GEMMs queued, run later) and with
    dropped slots past the last expert's rows: the gradients of the direct emulated run; the
    dropped rows get zeros out and no gradient."""
    from mpoverlap.moe.grouped import grouped_mlp
    from mpoverlap.wgrad import WeightGradDeferral, WeightGradQueue

    g = torch.Generator().manual_seed(5)
    n = sum(COUNTS) + 3
    x0, dy = torch.randn(n, 32, generator=g), torch.randn(n, 32, generator=g)
    w_in0, w_out0 = torch.randn(len(COUNTS), 32, 32, generator=g), torch.randn(len(COUNTS), 32, 16, generator=g)
    runs = []
    for fp8, deferred in ((Fp8Grouped(torch.float32, emulate=True), False), (Fp8Grouped(torch.float32), True)):
        x, w_in, w_out = (t.clone().requires_grad_(True) for t in (x0, w_in0, w_out0))
        deferral = WeightGradDeferral() if deferred else None
        y = grouped_mlp(x, w_in, w_out, torch.tensor(COUNTS), activation="swiglu", padded=True, deferral=deferral,
                        fp8=fp8)
        if deferred:
            queue = WeightGradQueue()
            with deferral.deferring(queue):
                y.backward(dy)
            assert w_in.grad is None and len(queue) == 2
            queue.run()
        else:
            y.backward(dy)
        assert torch.equal(y[-3:], torch.zeros(3, 32)) and torch.equal(x.grad[-3:], torch.zeros(3, 32))
        runs.append([y, x.grad, w_in.grad, w_out.grad])
    for a, b in zip(*runs):
        _fp32_close(a, b)
    # the down projection's weight gradient is the FP8 wgrad of its own inputs (both paths)
    emu, offs = Fp8Grouped(torch.float32, emulate=True), torch.cumsum(torch.tensor(COUNTS), 0, dtype=torch.int32)
    gate, up = emu.mm(x0, w_in0.transpose(1, 2), offs).chunk(2, dim=-1)
    want = emu.wgrad(dy, torch.nn.functional.silu(gate) * up, offs)
    for run in runs:
        _groups_close(run[3], want, 1)
