"""train.compile's default backend, inductor, on CPU, where inductor finds its C++ compiler.

tests/test_compile.py trains the compiled layouts with `aot_eager` (inductor's C++ builds of every
region of two models take minutes on 2 cores); this builds one region with inductor itself: the
residual add and the MLP's norm (`add_norm`, RMSNorm), forward and backward, as
`train.compile=true` with its default backend hands it to every block (models/fused.py), against
the eager function. About 15 s on a loaded 2-core machine with inductor's cache empty (most of it
inductor's first compile in the process), under 2 s with it warm.

The bound: both sides are fp32 evaluations of the same sums in different orders. Each value is a
sum of n products (n = the hidden size for the norm and the activations' gradients, the tokens for
the weight's gradient) and a few roundings more (the square, the mean, the reciprocal square
root, the products: at most 8), so each lies within (n + 8) u M of the exact value, u = 2^-24 and
M the largest magnitude of the float64 result; the two sides within twice that of each other.
"""
from __future__ import annotations

import shutil

import pytest
import torch


def _inductor_cxx():
    """The C++ compiler inductor runs on CPU (torch._inductor.config.cpp.cxx: $CXX, else g++)
    where it is on PATH, else None."""
    from torch._inductor import config

    names = config.cpp.cxx if isinstance(config.cpp.cxx, (list, tuple)) else (config.cpp.cxx,)
    return next((shutil.which(name) for name in names if name and shutil.which(name)), None)


U = 2.0 ** -24  # fp32's unit roundoff


@pytest.mark.skipif(_inductor_cxx() is None,
                    reason="inductor builds its CPU kernels with a C++ compiler ($CXX, else g++: "
                           "torch._inductor.config.cpp.cxx) and none is on PATH")
def test_inductor_add_norm_matches_eager():
    import torch._dynamo

    from mpoverlap.config import compose
    from mpoverlap.models import fused
    from mpoverlap.overlap.rules import validate

    cfg = compose(["train.compile=true", "train.device=cpu"])
    assert cfg.train.compile_backend == "inductor"  # the default backend
    assert not validate(cfg, 1)  # the rule engine lets it run on this machine
    B, S, H = 2, 16, 64
    g = torch.Generator().manual_seed(0)
    x, y, cotangent_x, cotangent_h = (torch.randn(B, S, H, generator=g) for _ in range(4))
    weight = 1 + 0.1 * torch.randn(H, generator=g)
    eps = 1e-5

    def run(add_norm, dtype):
        inputs = [t.to(dtype, copy=True).requires_grad_(True) for t in (x, y, weight)]
        summed, normed = add_norm(inputs[0], inputs[1], inputs[2], None, eps, True, dtype)
        torch.autograd.backward([summed, normed], [cotangent_x.to(dtype), cotangent_h.to(dtype)])
        return [summed.detach(), normed.detach()] + [t.grad for t in inputs]

    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled = run(fused.regions(cfg.train.compile_backend)["add_norm"], torch.float32)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs  # compiled, not run eager
    eager = run(fused.regions(None)["add_norm"], torch.float32)
    exact = run(fused.regions(None)["add_norm"], torch.float64)
    # the reduction length behind each result: x + y, the norm, dx, dy (over H), dweight (over tokens)
    lengths = [1, H, H, H, B * S]
    for name, n, c, e, ref in zip(["x + y", "norm", "grad x", "grad y", "grad weight"], lengths, compiled, eager,
                                  exact):
        assert c.dtype == e.dtype == torch.float32 and c.shape == e.shape
        bound = (n + 8) * U * float(ref.abs().max())
        for side, value in (("inductor", c), ("eager", e)):
            err = float((value.double() - ref).abs().max())
            assert err <= bound, (name, side, err, bound)
        gap = float((c - e).abs().max())
        assert gap <= 2 * bound, (name, gap, 2 * bound)
