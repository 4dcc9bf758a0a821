"""Grouped expert GEMMs: every local expert's MLP in three products per direction, whatever
the number of experts (one kernel each on a GPU).

Rows x [N, H] are grouped by local expert; `offs` [L] int32 (device) holds the cumulative row
counts, so expert l owns rows [offs[l-1], offs[l]). Rows from offs[-1] to N (`padded`: slots
the router dropped, whose number is not read on the host) belong to no expert: their output
and input gradient are zeros.

    grouped_mm(a [N, K], b [L, K, M], offs)   -> [N, M]       row block l times b[l]
    grouped_wgrad(a [N, K], g [N, M], offs)   -> [L, K, M]    a_l^T g_l  (zeros for empty groups)

Both use `torch._grouped_mm` (CUDA bf16 on sm90/sm100, and CPU in fp32/bf16) when the dtype
and the 16-byte stride rule allow, else a fallback whose operator count does not depend on L
either and that reads nothing on the host (every row times every expert, then each row's own:
L times the FLOPs, memory N*L*M; for the small test shapes, fp64 and fp32 on a GPU; past
FALLBACK_MAX_BYTES torch's own fallback, which reads the offsets on the host).

GroupedMLPFn is the whole expert MLP (swiglu: down(silu(gate) * up); gelu: down(gelu(up))) as
one autograd Function: forward 2 grouped GEMMs; backward 2 for the input gradient and 2 for the
weight gradients, the latter handed to a zero-bubble deferral (mpoverlap/wgrad) when one is
active. The activation is recomputed from the saved pre-activation in backward. Mixed
precision as the deferrable linear (wgrad/functions.py): weights cast to the compute dtype,
once a step inside step_cast_cache (precision.step_cast), else at each use.
"""
from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F

from mpoverlap.ops.activation import activate, activation_backward
from mpoverlap.precision import added_into_grad, compute_dtype, no_autocast, step_cast

_GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _aligned(*tensors: torch.Tensor) -> bool:
    """torch._grouped_mm's rule: each operand's non-unit strides a multiple of 16 bytes."""
    for t in tensors:
        if t.dtype not in _GROUPED_DTYPES:
            return False
        if any(s % (16 // t.element_size()) for s, n in zip(t.stride(), t.shape) if s != 1 and n > 1):
            return False
    return True


@functools.lru_cache(maxsize=None)
def _grouped_kernels_on(device_index: int) -> bool:
    """CUDA device `device_index` is sm90/sm100 (asked once per device: six grouped GEMMs a
    MoE layer and microbatch would otherwise each pay the properties lookup's host time)."""
    return torch.cuda.get_device_capability(device_index)[0] in (9, 10)


def _use_library(*tensors: torch.Tensor) -> bool:
    """torch._grouped_mm's own kernels: on CPU (fp32/bf16/fp16), on CUDA bf16 on sm90/sm100
    (elsewhere torch falls back to a loop over the groups that reads the offsets on the host)."""
    dev = tensors[0].device
    if dev.type == "cuda":
        return (all(t.dtype == torch.bfloat16 for t in tensors)
                and _grouped_kernels_on(dev.index if dev.index is not None else torch.cuda.current_device())
                and _aligned(*tensors))
    return dev.type == "cpu" and _aligned(*tensors)


# The fallback holds [N, L, M] products: above this many bytes (fp32 training of a real model on
# a GPU) torch's own fallback is used instead (a host read of the offsets per
# product: train.precision=bf16 on sm90+ avoids both).
FALLBACK_MAX_BYTES = 256 * 2**20


def _small(n: int, k: int, m: int, t: torch.Tensor) -> bool:
    return n * k * m * t.element_size() <= FALLBACK_MAX_BYTES or t.dtype not in _GROUPED_DTYPES


def _library(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """torch._grouped_mm; should a CUDA kernel refuse an operand's layout (transposed views),
    once more on row-major copies (the layouts it documents), with a warning."""
    try:
        return torch._grouped_mm(a, b, offs=offs)
    except RuntimeError as err:
        if a.device.type != "cuda":
            raise
        warnings.warn(f"torch._grouped_mm refused {tuple(a.stride())} x {tuple(b.stride())} strides ({err}); "
                      "retrying on contiguous copies")
        return torch._grouped_mm(a.contiguous(), b.contiguous(), offs=offs)


def row_groups(offs: torch.Tensor, n: int) -> torch.Tensor:
    """[n] long: the group of each row (L for rows past offs[-1])."""
    return torch.searchsorted(offs, torch.arange(n, device=offs.device, dtype=offs.dtype), right=True)


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """a [N, K], b [L, K, M] (any strides), offs [L] int32 -> [N, M] (rows past offs[-1]: undefined)."""
    if a.shape[0] == 0:  # no rows on this rank (the kernels reject an empty operand's strides)
        return a.new_zeros((0, b.shape[2]))
    N, L, M = a.shape[0], b.shape[0], b.shape[2]
    if _use_library(a, b) or not _small(N, L, M, a):
        return _library(a, b, offs)
    # Every row times every expert's weight (one GEMM, L times the FLOPs), then each row's own.
    every = a.matmul(b.transpose(0, 1).reshape(b.shape[1], L * M)).view(N, L, M)
    g = row_groups(offs, N).clamp_max(L - 1)
    return every.gather(1, g.view(N, 1, 1).expand(N, 1, M)).squeeze(1)


def grouped_wgrad(a: torch.Tensor, g: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """a [N, K], g [N, M], offs [L] -> [L, K, M] = a_l^T g_l (rows past offs[-1] not read)."""
    if a.shape[0] == 0:
        return a.new_zeros((offs.shape[0], a.shape[1], g.shape[1]))
    at = a.t()
    if _use_library(at, g) or not _small(a.shape[0], a.shape[1] * offs.shape[0], 1, a):
        return _library(at, g, offs)
    L = offs.shape[0]
    rows = row_groups(offs, a.shape[0])
    a = a.masked_fill((rows == L).unsqueeze(1), 0)  # rows past offs[-1] may hold anything
    onehot = F.one_hot(rows, L + 1)[:, :L].to(a.dtype)  # [N, L]
    return (onehot.unsqueeze(2) * a.unsqueeze(1)).flatten(1).t().matmul(g.masked_fill((rows == L).unsqueeze(1), 0)
                                                                         ).view(L, a.shape[1], g.shape[1])


class _WeightGrad:
    """A deferred grouped weight gradient: called, returns dW [L, out, in] = (g_l^T a_l)."""

    __slots__ = ("g", "a", "offs")

    def __init__(self, g, a, offs) -> None:
        self.g, self.a, self.offs = g, a, offs

    def __call__(self) -> torch.Tensor:
        return grouped_wgrad(self.g, self.a, self.offs)

    def accumulate_into(self, grad: torch.Tensor) -> None:
        """The W queue's in-place path (wgrad/deferral.py): dW added into the fp32 gradient
        `grad` by one add_, a bf16 product promoted inside it (no fp32 copy of the stack)."""
        grad.add_(self())


class GroupedMLPFn(torch.autograd.Function):
    """x [N, H] grouped by expert, w_in [L, W, H], w_out [L, H, F], offs [L] int32 -> [N, H]."""

    @staticmethod
    def forward(ctx, x, w_in, w_out, offs, activation: str, padded: bool, deferral):
        ctx.activation, ctx.padded, ctx.deferral = activation, padded, deferral
        ctx.params = (w_in, w_out)  # the parameters themselves (see DeferrableLinearFn)
        ctx.dtype = dtype = compute_dtype(x)
        x = x.to(dtype)
        with no_autocast(x):
            h = grouped_mm(x, step_cast(w_in, dtype).transpose(1, 2), offs)  # [N, W]
            y = grouped_mm(activate(h, activation), step_cast(w_out, dtype).transpose(1, 2), offs)  # [N, H]
            if padded:
                y = _zero_rows_past(y, offs)
        ctx.save_for_backward(x, h, w_in, w_out, offs)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, h, w_in, w_out, offs = ctx.saved_tensors
        dtype, act = ctx.dtype, ctx.activation
        with no_autocast(x):
            grad_y = grad_y.to(dtype).contiguous()
            grad_a = grouped_mm(grad_y, step_cast(w_out, dtype), offs)  # [N, F]
            grad_h = activation_backward(grad_a, h, act)  # [N, W]
            grad_x = grouped_mm(grad_h, step_cast(w_in, dtype), offs)  # [N, H]
            if ctx.padded:
                grad_x = _zero_rows_past(grad_x, offs)
            grads = []
            for param, g, a in ((ctx.params[0], grad_h, x), (ctx.params[1], grad_y, None)):
                wg = _WeightGrad(g, a if a is not None else activate(h, act), offs)
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
        return grad_x, grads[0], grads[1], None, None, None, None


def _zero_rows_past(y: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    valid = torch.arange(y.shape[0], device=y.device) < offs[-1:]
    return torch.where(valid.unsqueeze(1), y, y.new_zeros(()))


def grouped_mlp(x: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor, counts: torch.Tensor, *,
                activation: str, padded: bool, deferral=None) -> torch.Tensor:
    """x [N, H] grouped by expert, counts [L] (device) rows per expert -> [N, H]."""
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    return GroupedMLPFn.apply(x, w_in, w_out, offs, activation, padded, deferral)
