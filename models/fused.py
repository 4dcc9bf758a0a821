"""train.compile=true: each block's elementwise math through torch.compile, region by region.

A block is GEMMs (column/row-parallel layers: their communication, async handles, the ledger
and the zero-bubble W deferral), core attention (SDPA, or context parallelism's ring) and the
MLP or the experts, all left eager, with elementwise math between them that eager PyTorch runs
as one kernel per operator, each reading and writing whole activations. The compiled regions
are that math alone, as pure functions of tensors (no module, no process group, no hook):
  - `norm`: the first norm of a block, cast to the GEMM's dtype in the same kernel;
  - `add_norm`: the residual add of the attention's output and the MLP's norm (and cast);
  - `rope`: RoPE on q and k (the fp32 cos/sin products and the cast back, one kernel each);
  - `activation`: SwiGLU's silu and product, or GeLU;
  - `loss`: the token cross entropy from the head's logits as the GEMM made them (bf16 under
    bf16 autocast): the fp32 upcast, log-softmax and pick in one reduction, and in backward the
    logits' gradient (softmax - one-hot) written in the logits' dtype by one kernel (models/loss.py:
    ~8 bytes moved per logit against the eager Function's ~34). At tp 1 only: under TP the vocabulary-parallel
    loss exchanges the rows' max and sum between its steps and stays eager.
So whatever happens around them (TP/SP collectives, DP and ZeRO hooks on parameters, pipeline
p2p, EP all-to-alls, recomputation, W deferral) sees the same module calls as eager; the
parameters (norm weights) are arguments, whose gradients leave the compiled backward into
their AccumulateGrad hooks as eager ones do.

One compile per region and distinct shape/dtype, not per layer: the functions are module level
(one code object each) and guard on their arguments' shapes and dtypes, not on which layer's
weight they get (`dynamic=False`: a new shape compiles its own graph rather than a dynamic one).
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from mpoverlap.models import loss
from mpoverlap.ops.activation import swiglu, swiglu_reference
from mpoverlap.models.rope import apply_rope_qk, rope_reference

BACKENDS = ("inductor", "aot_eager", "eager")


def _norm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float, rms: bool,
          dtype: torch.dtype) -> torch.Tensor:
    shape = (x.shape[-1],)
    y = F.rms_norm(x, shape, weight, eps) if rms else F.layer_norm(x, shape, weight, bias, eps)
    return y.to(dtype)


def _add_norm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float,
              rms: bool, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    x = x + y
    return x, _norm(x, weight, bias, eps, rms, dtype)


def _rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    return apply_rope_qk(q, k, cos, sin)


def _rope_traced(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    return rope_reference(q, cos, sin), rope_reference(k, cos, sin)


def _swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    return swiglu(gate_up)


def _gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x)


_EAGER = {"norm": _norm, "add_norm": _add_norm, "rope": _rope, "swiglu": _swiglu, "gelu": _gelu,
          "loss": loss.token_loss}
# what torch.compile traces where it differs from the eager function: RoPE, SwiGLU and the loss in
# their plain formulas (inductor fuses them; the eager Functions' hand-written passes are for eager)
_TRACED = {**_EAGER, "rope": _rope_traced, "swiglu": swiglu_reference, "loss": loss.cross_entropy}
_COMPILED: Dict[str, Dict[str, Callable]] = {}


def regions(backend: Optional[str]) -> Dict[str, Callable]:
    """The block's math regions: eager functions (backend None) or torch.compile'd ones, made
    once per process and backend (so every layer shares one compiled function per region)."""
    if backend is None:
        return _EAGER
    if backend not in BACKENDS:
        raise ValueError(f"train.compile_backend={backend!r} is not one of {', '.join(BACKENDS)}; "
                         f"fix: train.compile_backend=inductor")
    if backend not in _COMPILED:
        import torch._dynamo.config as dynamo

        # Past dynamo's recompile limit a function would silently run eager: nothing requested
        # is turned off silently, so hitting it raises instead; and the limit leaves room for
        # the variants a run needs (training and no-grad evaluation, fp32 and bf16, a few shapes).
        dynamo.recompile_limit = max(dynamo.recompile_limit, 32)
        dynamo.fail_on_recompile_limit_hit = True
        _COMPILED[backend] = {name: torch.compile(fn, backend=backend, dynamic=False, fullgraph=True)
                              for name, fn in _TRACED.items()}
    return _COMPILED[backend]


def norm_args(norm: torch.nn.Module) -> tuple:
    """(weight, bias, eps, rms) of an nn.RMSNorm or nn.LayerNorm, as the regions take them."""
    rms = isinstance(norm, torch.nn.RMSNorm)
    eps = norm.eps if norm.eps is not None else torch.finfo(torch.float32).eps
    return norm.weight, (None if rms else norm.bias), float(eps), rms
