"""Grouped expert GEMMs: every local expert's MLP in three products per direction.

Rows x [N, H] are grouped by local expert; `offs` [L] int32 (device) holds the cumulative row
counts, so expert l owns rows [offs[l-1], offs[l]). Rows from offs[-1] to N (`padded`: slots
the router dropped, whose number is not read on the host) belong to no expert: their output
and input gradient are zeros.

    grouped_mm(a [N, K], b [L, K, M], offs)   -> [N, M]       row block l times b[l]
    grouped_wgrad(a [N, K], g [N, M], offs)   -> [L, K, M]    a_l^T g_l  (zeros for empty groups)

Three paths compute them (moe/grouped_path.py chooses one per expert-MLP call, the start-up
plan names it): torch._grouped_mm (one kernel a product, no host read: CPU, and bf16 on
sm90/sm100); the dense fallback (every row times every expert, then each row's own: L times
the FLOPs, an [N, L, M] product, no host read; where the kernel cannot run and the product is
small); the looped fallback (past that: the offsets read on the host once per call, then one
GEMM per expert).

GroupedMLPFn is the whole expert MLP (swiglu: down(silu(gate) * up); gelu: down(gelu(up))) as
one autograd Function: forward 2 grouped GEMMs; backward 2 for the input gradient and 2 for the
weight gradients, the latter handed to a zero-bubble deferral (mpoverlap/wgrad) when one is
active. The activation is recomputed from the saved pre-activation in backward. Mixed
precision as the deferrable linear (wgrad/functions.py): weights cast to the compute dtype,
once a step inside step_cast_cache (precision.step_cast), else at each use. Under
train.precision=fp8 the six products are precision/fp8_grouped.py's instead (torchao's rowwise
FP8 grouped recipe; torch._scaled_grouped_mm on CUDA).
"""
from __future__ import annotations

import warnings
from typing import List, Optional

import torch
import torch.nn.functional as F

from mpoverlap.moe import grouped_path
from mpoverlap.moe.grouped_path import KERNEL, LOOPED
from mpoverlap.ops.activation import activate, activation_backward
from mpoverlap.precision import added_into_grad, compute_dtype, no_autocast, step_cast


def _aligned(*tensors: torch.Tensor) -> bool:
    """torch._grouped_mm's rule: each operand's non-unit strides a multiple of 16 bytes."""
    for t in tensors:
        if t.dtype not in grouped_path.GROUPED_DTYPES:
            return False
        if any(s % (16 // t.element_size()) for s, n in zip(t.stride(), t.shape) if s != 1 and n > 1):
            return False
    return True


def _library(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """torch._grouped_mm; should the kernel refuse an operand's layout (a CUDA kernel, transposed
    views; on CPU, a view whose strides break the 16-byte rule), once more on row-major copies
    (the layouts it documents), with a warning."""
    try:
        return torch._grouped_mm(a, b, offs=offs)
    except RuntimeError as err:
        if a.device.type != "cuda" and _aligned(a, b):
            raise
        warnings.warn(f"torch._grouped_mm refused {tuple(a.stride())} x {tuple(b.stride())} strides ({err}); "
                      "retrying on contiguous copies")
        return torch._grouped_mm(a.contiguous(), b.contiguous(), offs=offs)


def row_groups(offs: torch.Tensor, n: int) -> torch.Tensor:
    """[n] long: the group of each row (L for rows past offs[-1])."""
    return torch.searchsorted(offs, torch.arange(n, device=offs.device, dtype=offs.dtype), right=True)


def _operand_path(a: torch.Tensor, experts: int, width: int, *operands: torch.Tensor) -> str:
    """The path of one product called on its own (not from GroupedMLPFn, which chooses once a
    call): the dense fallback's product [N, experts, width]."""
    p = grouped_path.choose(a.device.type, grouped_path.device_capability(a.device), a.dtype,
                            aligned=_aligned(*operands),
                            product_bytes=a.shape[0] * experts * width * a.element_size())
    return p.name


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, path: Optional[str] = None,
               bounds: Optional[List[int]] = None) -> torch.Tensor:
    """a [N, K], b [L, K, M] (any strides), offs [L] int32 -> [N, M] (rows past offs[-1]: undefined).
    `path`: grouped_path's KERNEL / DENSE / LOOPED (None: chosen for this product); `bounds`:
    the looped path's offsets on the host (None: read here)."""
    if a.shape[0] == 0:  # no rows on this rank (the kernels reject an empty operand's strides)
        return a.new_zeros((0, b.shape[2]))
    N, L, M = a.shape[0], b.shape[0], b.shape[2]
    path = path or _operand_path(a, L, M, a, b)
    if path == KERNEL:
        return _library(a, b, offs)
    if path == LOOPED:
        return _looped_mm(a, b, offs.tolist() if bounds is None else bounds)
    # Every row times every expert's weight (one GEMM, L times the FLOPs), then each row's own.
    every = a.matmul(b.transpose(0, 1).reshape(b.shape[1], L * M)).view(N, L, M)
    g = row_groups(offs, N).clamp_max(L - 1)
    return every.gather(1, g.view(N, 1, 1).expand(N, 1, M)).squeeze(1)


def grouped_wgrad(a: torch.Tensor, g: torch.Tensor, offs: torch.Tensor, path: Optional[str] = None,
                  bounds: Optional[List[int]] = None) -> torch.Tensor:
    """a [N, K], g [N, M], offs [L] -> [L, K, M] = a_l^T g_l (rows past offs[-1] not read).
    `path`, `bounds`: as grouped_mm's."""
    if a.shape[0] == 0:
        return a.new_zeros((offs.shape[0], a.shape[1], g.shape[1]))
    L = offs.shape[0]
    at = a.t()
    path = path or _operand_path(a, L, a.shape[1], at, g)
    if path == KERNEL:
        return _library(at, g, offs)
    if path == LOOPED:
        return _looped_wgrad(a, g, offs.tolist() if bounds is None else bounds)
    rows = row_groups(offs, a.shape[0])
    past = (rows == L).unsqueeze(1)
    a = a.masked_fill(past, 0)  # rows past offs[-1] may hold anything
    onehot = F.one_hot(rows, L + 1)[:, :L].to(a.dtype)  # [N, L]
    every = (onehot.unsqueeze(2) * a.unsqueeze(1)).flatten(1)  # [N, L * K]: row n in its group's block
    return every.t().matmul(g.masked_fill(past, 0)).view(L, a.shape[1], g.shape[1])


@torch.no_grad()  # GEMMs into slices of one output (out=); nothing differentiates them
def _looped_mm(a: torch.Tensor, b: torch.Tensor, bounds: List[int]) -> torch.Tensor:
    """One GEMM per non-empty group, written into its rows; rows past bounds[-1] are zeros."""
    out = a.new_zeros((a.shape[0], b.shape[2]))
    start = 0
    for l, end in enumerate(bounds):
        if end > start:
            torch.mm(a[start:end], b[l], out=out[start:end])
        start = end
    return out


@torch.no_grad()  # a deferred W runs outside autograd's backward, its saved inputs requiring grad
def _looped_wgrad(a: torch.Tensor, g: torch.Tensor, bounds: List[int]) -> torch.Tensor:
    """One GEMM per non-empty group, a_l^T g_l into its slice; empty groups are zeros."""
    out = a.new_zeros((len(bounds), a.shape[1], g.shape[1]))
    start = 0
    for l, end in enumerate(bounds):
        if end > start:
            torch.mm(a[start:end].t(), g[start:end], out=out[l])
        start = end
    return out


class _WeightGrad:
    """A deferred grouped weight gradient: called, returns dW [L, out, in] = (g_l^T a_l) by
    `products` (this module's grouped GEMMs, or the FP8 ones: precision/fp8_grouped.py)."""

    __slots__ = ("g", "a", "offs", "products")

    def __init__(self, g, a, offs, products) -> None:
        self.g, self.a, self.offs, self.products = g, a, offs, products

    def __call__(self) -> torch.Tensor:
        return self.products.wgrad(self.g, self.a, self.offs)

    def accumulate_into(self, grad: torch.Tensor) -> None:
        """The W queue's in-place path (wgrad/deferral.py): dW added into the fp32 gradient
        `grad` by one add_, a bf16 product promoted inside it (no fp32 copy of the stack)."""
        grad.add_(self())


class _Products:
    """grouped_mm / grouped_wgrad on one call's path and host bounds (the interface
    precision.fp8_grouped.Fp8Grouped also has)."""

    __slots__ = ("path", "bounds")

    def __init__(self, path: str, bounds: Optional[List[int]]) -> None:
        self.path, self.bounds = path, bounds

    def mm(self, a, b, offs):
        return grouped_mm(a, b, offs, self.path, self.bounds)

    def wgrad(self, a, g, offs):
        return grouped_wgrad(a, g, offs, self.path, self.bounds)


class GroupedMLPFn(torch.autograd.Function):
    """x [N, H] grouped by expert, w_in [L, W, H], w_out [L, H, F], offs [L] int32 -> [N, H].
    The grouped path is chosen once per call (moe/grouped_path.py); the looped one reads the
    offsets on the host here, once, for the forward, the backward and the deferred W. `fp8`
    (a precision.fp8_grouped.Fp8Grouped, or None): the six products in FP8 instead, from the
    parameters themselves (their quantization is their cast)."""

    @staticmethod
    def forward(ctx, x, w_in, w_out, offs, activation: str, padded: bool, deferral, fp8=None):
        ctx.activation, ctx.padded, ctx.deferral = activation, padded, deferral
        ctx.params = (w_in, w_out)  # the parameters themselves (see DeferrableLinearFn)
        ctx.dtype = dtype = compute_dtype(x)
        if fp8 is None:
            path = grouped_path.call_path(x, w_in, w_out, dtype).name
            bounds = offs.tolist() if path == LOOPED else None  # the looped path's one host read
            ctx.products = _Products(path, bounds)
        else:
            ctx.products = fp8
        mm = ctx.products.mm
        x = x.to(dtype)
        with no_autocast(x):
            h = mm(x, _weight(w_in, dtype, fp8).transpose(1, 2), offs)  # [N, W]
            y = mm(activate(h.to(dtype), activation), _weight(w_out, dtype, fp8).transpose(1, 2), offs)  # [N, H]
            if padded:
                y = _zero_rows_past(y, offs)
        ctx.save_for_backward(x, h, w_in, w_out, offs)
        return y.to(dtype)

    @staticmethod
    def backward(ctx, grad_y):
        x, h, w_in, w_out, offs = ctx.saved_tensors
        dtype, act, products = ctx.dtype, ctx.activation, ctx.products
        fp8 = None if isinstance(products, _Products) else products
        with no_autocast(x):
            grad_y = grad_y.to(dtype).contiguous()
            grad_a = products.mm(grad_y, _weight(w_out, dtype, fp8), offs).to(dtype)  # [N, F]
            grad_h = activation_backward(grad_a, h.to(dtype), act)  # [N, W]
            grad_x = products.mm(grad_h, _weight(w_in, dtype, fp8), offs).to(dtype)  # [N, H]
            if ctx.padded:
                grad_x = _zero_rows_past(grad_x, offs)
            grads = []
            for param, g, a in ((ctx.params[0], grad_h, x), (ctx.params[1], grad_y, None)):
                wg = _WeightGrad(g, a if a is not None else activate(h.to(dtype), act), offs, products)
                if ctx.deferral is not None and ctx.deferral.defer(param, wg):
                    grads.append(None)
                    continue
                grad_w = wg()
                # bf16 dW into the fp32 master gradient by one promoting add: autograd would cast
                # it to a whole fp32 copy of the expert stack first, then add (as
                # precision._FoldedCast does for the linears)
                if grad_w.dtype != param.dtype and added_into_grad(param, grad_w):
                    grad_w = None
                grads.append(grad_w)
        return grad_x, grads[0], grads[1], None, None, None, None, None


def _weight(w: torch.Tensor, dtype: torch.dtype, fp8) -> torch.Tensor:
    """A stacked weight as the products take it: cast to the compute dtype (once a step inside
    step_cast_cache), or the parameter itself for the FP8 products (which quantize it)."""
    return w if fp8 is not None else step_cast(w, dtype)


def _zero_rows_past(y: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    valid = torch.arange(y.shape[0], device=y.device) < offs[-1:]
    return torch.where(valid.unsqueeze(1), y, y.new_zeros(()))


def grouped_mlp(x: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor, counts: torch.Tensor, *,
                activation: str, padded: bool, deferral=None, fp8=None) -> torch.Tensor:
    """x [N, H] grouped by expert, counts [L] (device) rows per expert -> [N, H]; `fp8`: the
    FP8 products (precision.fp8_grouped.Fp8Grouped) or None."""
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    return GroupedMLPFn.apply(x, w_in, w_out, offs, activation, padded, deferral, fp8)
