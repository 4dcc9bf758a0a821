"""The fp8 GEMMs (mpoverlap/precision/fp8.py) against their emulation (the same casts and scales,
dequantized, fp32 matmul) and against the fp32 reference."""
import pytest
import torch

pytest.importorskip("torchao")
from mpoverlap.precision.fp8 import fp8_linear  # noqa: E402


def _run(recipe, emulate, x, w, g):
    x = x.clone().requires_grad_(True)
    w = w.clone().requires_grad_(True)
    y = fp8_linear(x, w, recipe, emulate)
    y.backward(g)
    return y.float(), x.grad.float(), w.grad.float()


def _close_bf16(a, b):
    """a (a bf16 result) equals b (its fp32 emulation) up to bf16's rounding of the output."""
    tol = b.abs() * 2.0 ** -8 + 1e-6 * b.abs().max()
    assert ((a - b).abs() <= tol).all(), (a - b).abs().max()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_linear_equals_emulation(recipe):
    torch.manual_seed(0)
    x, w, g = torch.randn(2, 16, 32), torch.randn(48, 32), torch.randn(2, 16, 48)
    real, emu = _run(recipe, False, x, w, g), _run(recipe, True, x, w, g)
    for a, b in zip(real, emu):
        _close_bf16(a, b)
    # fp8 really ran: away from the fp32 reference by more than bf16 rounding, yet near it.
    xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    yr = xr @ wr.t()
    yr.backward(g)
    for a, b in zip(real, (yr, xr.grad, wr.grad)):
        rel = (a - b).norm() / b.norm()
        assert 2.0 ** -8 < rel < 0.1, rel


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_grad_dtype_follows_torchao_recipe(recipe):
    """The output gradient's fp8 dtype is torchao's for the recipe (e5m2 tensorwise, e4m3 rowwise)."""
    from mpoverlap.precision.fp8 import Float8LinearConfig, grad_dtype

    assert grad_dtype(recipe) == Float8LinearConfig.from_recipe_name(recipe).cast_config_grad_output.target_dtype


def test_fp8_linear_refuses_unknown_recipe():
    with pytest.raises(ValueError, match="train.fp8_recipe=tensorwise"):
        fp8_linear(torch.randn(16, 16), torch.randn(16, 16), "blockwise")
