"""Attention block kernels: one call per (query rows, key rows) block, returning the block's
log-sum-exp, and its backward given the FINAL (merged) output and log-sum-exp.

A kernel is the compute half of ring and all-to-all attention (no communication here):

    forward(q_BNQD, k_BGKD, v_BGKD, scale, causal) -> (out_BNQD, lse_BNQ)
    backward(dout_BNQD, q_BNQD, k_BGKD, v_BGKD, out_BNQD, lse_BNQ, scale, causal)
        -> (dq_BNQD, dk_BGKD, dv_BGKD)

out is in q's dtype (fused) or the accumulation dtype (explicit); lse is fp32 (fp64 for fp64
inputs). `causal` masks key j > query i (top-left aligned: a diagonal block, or a rank's own
two chunks seen as one sequence, see ring_attention). With the final lse and output of the
query rows, the backward of every block of those rows is its share of the gradient of the
merged attention (the standard ring / flash backward): the blocks' gradients add up to the
gradient of the forward.

Backends (`select_block_kernel`, once per backend request, device and dtype):

  flash_cpu       aten._scaled_dot_product_flash_attention_for_cpu (+ _backward): fp32, bf16,
                  fp16, fp64; K/V groups of grouped-query attention read unexpanded.
  flash_cuda      aten._scaled_dot_product_flash_attention (+ _backward): bf16 / fp16 on sm80+,
                  head dim <= 256 and a multiple of 8; K/V groups read unexpanded.
  efficient_cuda  aten._scaled_dot_product_efficient_attention (+ _backward): fp32. Has no
                  grouped-query mode: K/V are expanded to the N heads for the call (O(sequence)
                  memory) and dK/dV summed back. bf16 / fp16: the output is handed to the
                  backward in the forward's layout (see _efficient_backward),
                  checked on an H200 by `make gpu-check` (docs/gpu-reports/).
  cudnn_cuda      aten._scaled_dot_product_cudnn_attention (+ _backward): bf16 / fp16, on
                  request only (`parallel.cp_attention_backend=cudnn`); K/V expanded like
                  efficient.
  explicit        attention_math.py: scores by hand in fp32 (fp64 stays fp64), c x c per
                  block and head; the fallback (fp64 references, dtypes no kernel takes).

Query/key and value head widths may differ (latent attention: 192 and 128 in DeepSeek-V3).
The flash kernels (flash_cpu, flash_cuda) require one head width for q, k and v: `BlockKernel`
pads the narrower of (q, k) and v with zero channels for the call and trims the output and the
gradients back (zero value channels give zero output channels and leave the scores, so the
result is exact; the cost is the padded channels' work). efficient_cuda and explicit take the
two widths as they are. cudnn_cuda is refused for them (rule cp.mla_backend), not padded.

No kernel is ever handed a mask tensor: blocks are either unmasked or top-left causal, so
nothing of size Q x K exists outside the kernels' own tiles.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Tuple

import torch

from mpoverlap.context_parallel.attention_math import (block_backward, block_forward, repeat_kv,
                                                        softmax_delta, sum_kv_groups)

REQUESTS = ("auto", "fused", "explicit", "cudnn")

Pair = Tuple[torch.Tensor, torch.Tensor]
Triple = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class BlockKernel:
    """One backend: its name, the aten op it calls (for the plan) and its two halves."""

    name: str
    op: str
    gqa_native: bool
    _forward: Callable[..., Pair]
    _backward: Callable[..., Triple]
    # The kernel takes one head width for q, k and v: differing ones are padded and trimmed.
    one_head_dim: bool = False

    @property
    def fused(self) -> bool:
        return self.name != "explicit"

    def forward(self, q_BNQD, k_BGKD, v_BGKD, scale: float, causal: bool) -> Pair:
        rep = q_BNQD.shape[1] // k_BGKD.shape[1]
        if not self.gqa_native:
            k_BGKD, v_BGKD = repeat_kv(k_BGKD, rep), repeat_kv(v_BGKD, rep)
        Dv = v_BGKD.shape[-1]
        if self.one_head_dim and Dv != q_BNQD.shape[-1]:
            D = max(Dv, q_BNQD.shape[-1])
            out_BNQD, lse_BNQ = self._forward(_pad(q_BNQD, D), _pad(k_BGKD, D), _pad(v_BGKD, D), scale, causal)
            return out_BNQD[..., :Dv], lse_BNQ
        return self._forward(q_BNQD, k_BGKD, v_BGKD, scale, causal)

    def backward(self, dout_BNQD, q_BNQD, k_BGKD, v_BGKD, out_BNQD, lse_BNQ, scale: float,
                 causal: bool) -> Triple:
        rep = q_BNQD.shape[1] // k_BGKD.shape[1]
        Dqk, Dv = q_BNQD.shape[-1], v_BGKD.shape[-1]
        if self.one_head_dim and Dv != Dqk:
            D = max(Dqk, Dv)
            dq, dk, dv = self.backward(_pad(dout_BNQD, D), _pad(q_BNQD, D), _pad(k_BGKD, D), _pad(v_BGKD, D),
                                       _pad(out_BNQD, D), lse_BNQ, scale, causal)
            return dq[..., :Dqk], dk[..., :Dqk], dv[..., :Dv]
        if self.gqa_native or rep == 1:
            return self._backward(dout_BNQD, q_BNQD, k_BGKD, v_BGKD, out_BNQD, lse_BNQ, scale, causal)
        dq, dk, dv = self._backward(dout_BNQD, q_BNQD, repeat_kv(k_BGKD, rep), repeat_kv(v_BGKD, rep),
                                    out_BNQD, lse_BNQ, scale, causal)
        return dq, sum_kv_groups(dk, rep), sum_kv_groups(dv, rep)


def _pad(x: torch.Tensor, D: int) -> torch.Tensor:
    """x with zero channels appended up to head width D (x itself when it has D)."""
    return x if x.shape[-1] == D else torch.nn.functional.pad(x, (0, D - x.shape[-1]))


# ---------------------------------------------------------------- explicit (the fallback)

def _explicit_forward(q, k, v, scale, causal):
    return block_forward(q, k, v, scale=scale, causal=causal)


def _explicit_backward(dout, q, k, v, out, lse, scale, causal):
    # delta = rowsum(dout * out) of the final output: the same for every block of these rows.
    return block_backward(q, k, v, dout, lse, softmax_delta(out, dout), scale=scale, causal=causal)


# ---------------------------------------------------------------- CPU flash

def _flash_cpu_forward(q, k, v, scale, causal):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def _flash_cpu_backward(dout, q, k, v, out, lse, scale, causal):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, scale=scale)


# ---------------------------------------------------------------- CUDA: flash, efficient, cuDNN

def _no_rng(device) -> torch.Tensor:
    """Philox seed / offset placeholders: dropout is 0, the kernels never read them."""
    return torch.empty((), dtype=torch.int64, device=device)


def _flash_cuda_forward(q, k, v, scale, causal):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
    return out, lse


def _flash_cuda_backward(dout, q, k, v, out, lse, scale, causal):
    rng = _no_rng(q.device)
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout.contiguous(), q, k, v, out.contiguous(), lse.contiguous(), None, None, q.shape[2], k.shape[2],
        0.0, causal, rng, rng, scale=scale)


def _efficient_forward(q, k, v, scale, causal):
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal,
                                                                      scale=scale)[:2]
    return out, lse[..., :q.shape[2]]  # the kernel pads the lse rows to a multiple of 32


def _seq_major(x_BNSD: torch.Tensor) -> torch.Tensor:
    """x with its memory laid out [B, S, N, D] (what the efficient kernel's forward returns),
    viewed as [B, N, S, D]; no copy when it already is."""
    return x_BNSD.transpose(1, 2).contiguous().transpose(1, 2)


def _efficient_backward(dout, q, k, v, out, lse, scale, causal):
    """`out` must be laid out [B, Q, N, D] in memory. torch hands the CUTLASS
    backward only out's batch and head strides; its query-row stride is taken to be N x D
    (`o_strideM() = head_dim_value * num_heads`, kernel_backward.h). For 16-bit dtypes on
    sm80+ the kernel computes delta = rowsum(dout * out) itself from that pointer
    (`kKernelComputesDelta = kIsHalf && ...`); fp32 gets delta from strided ATen ops. A
    [B, N, Q, D]-contiguous out (what `.contiguous()` or the ring's merged output gives) is
    therefore read at the wrong rows in bf16 / fp16 only: wrong gradients, fp32 right. torch's
    own autograd and its ring attention pass the forward's out unchanged, which is [B, Q, N, D]."""
    Q = q.shape[2]
    padded = (Q + 31) // 32 * 32
    lse_padded = torch.nn.functional.pad(lse, (0, padded - Q)) if padded != Q else lse.contiguous()
    rng = _no_rng(q.device)
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout.contiguous(), q, k, v, None, _seq_major(out), lse_padded, rng, rng, 0.0,
        [True, True, True, False], causal, scale=scale)
    return dq, dk, dv


def _cudnn_forward(q, k, v, scale, causal):
    if v.shape[-1] != q.shape[-1]:
        raise ValueError(f"the cudnn block kernel is not used with a value head width ({v.shape[-1]}) other than "
                         f"the query/key one ({q.shape[-1]}); use parallel.cp_attention_backend=auto")
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False,
                                                                  scale=scale)[:2]
    return out, lse.reshape(q.shape[:3])  # cuDNN returns [B, N, Q, 1]


def _cudnn_backward(dout, q, k, v, out, lse, scale, causal):
    rng = _no_rng(q.device)
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        dout.contiguous(), q, k, v, out.contiguous(), lse.reshape(*lse.shape, 1).contiguous(), rng, rng,
        None, None, None, q.shape[2], k.shape[2], 0.0, causal, scale=scale)


EXPLICIT = BlockKernel("explicit", "attention_math (fp32 by hand)", False, _explicit_forward, _explicit_backward)
FLASH_CPU = BlockKernel("flash_cpu", "aten._scaled_dot_product_flash_attention_for_cpu", True,
                        _flash_cpu_forward, _flash_cpu_backward, one_head_dim=True)
FLASH_CUDA = BlockKernel("flash_cuda", "aten._scaled_dot_product_flash_attention", True,
                         _flash_cuda_forward, _flash_cuda_backward, one_head_dim=True)
EFFICIENT_CUDA = BlockKernel("efficient_cuda", "aten._scaled_dot_product_efficient_attention", False,
                             _efficient_forward, _efficient_backward)
CUDNN_CUDA = BlockKernel("cudnn_cuda", "aten._scaled_dot_product_cudnn_attention", False,
                         _cudnn_forward, _cudnn_backward)
KERNELS = {k.name: k for k in (EXPLICIT, FLASH_CPU, FLASH_CUDA, EFFICIENT_CUDA, CUDNN_CUDA)}

_CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_HALF = (torch.bfloat16, torch.float16)


class NoFusedKernelError(ValueError):
    """A fused kernel was required (`fused` or `cudnn`) where none takes this device and dtype."""


def _cuda_flash_ok(device, dtype: torch.dtype, head_dim: int) -> bool:
    if dtype not in _HALF or head_dim > 256 or head_dim % 8:
        return False
    major, _ = torch.cuda.get_device_capability(device)  # a property of the device, no stream sync
    return major >= 8


@lru_cache(maxsize=None)
def _select(request: str, device_type: str, device_index, dtype: torch.dtype, head_dim: int) -> BlockKernel:
    if request not in REQUESTS:
        raise ValueError(f"parallel.cp_attention_backend={request!r}: use one of {'|'.join(REQUESTS)}")
    if request == "explicit":
        return EXPLICIT
    fused = None
    if device_type == "cpu" and dtype in _CPU_DTYPES and request != "cudnn":
        fused = FLASH_CPU
    elif device_type == "cuda":
        device = torch.device("cuda", device_index)
        if request == "cudnn":
            fused = CUDNN_CUDA if dtype in _HALF else None
        elif _cuda_flash_ok(device, dtype, head_dim):
            fused = FLASH_CUDA
        elif dtype in (torch.float32,) + _HALF:
            fused = EFFICIENT_CUDA
    if fused is not None:
        return fused
    if request == "auto":
        return EXPLICIT
    raise NoFusedKernelError(
        f"parallel.cp_attention_backend={request}: no fused attention kernel takes {dtype} on "
        f"{device_type} (cudnn: bf16/fp16 on CUDA only); use parallel.cp_attention_backend=auto "
        "(fused where a kernel exists, explicit math otherwise) or =explicit")


def select_block_kernel(request: str, q_BNSD: torch.Tensor) -> BlockKernel:
    """The kernel for `request` (parallel.cp_attention_backend) and q's device and dtype:
    auto = the device's fused kernel for the dtype, else explicit; fused / cudnn = that kernel
    or NoFusedKernelError; explicit = the fp32 math."""
    return _select(request, q_BNSD.device.type, q_BNSD.device.index, q_BNSD.dtype, q_BNSD.shape[-1])


def describe_block_backend(request: str, device_type: str, dtype: torch.dtype, head_dim: int) -> str:
    """For the start-up plan: the kernel a CP block uses, named with its aten op, without a GPU
    at hand (on CUDA the choice depends on the GPU's generation: flash on sm80+ and what runs
    otherwise are both named)."""
    efficient = f"{EFFICIENT_CUDA.name} ({EFFICIENT_CUDA.op}; K/V expanded for grouped-query attention)"
    if device_type == "cuda" and request in ("auto", "fused"):
        if dtype in (torch.float32,) + _HALF:
            if dtype in _HALF and head_dim <= 256 and head_dim % 8 == 0:
                return f"{FLASH_CUDA.name} ({FLASH_CUDA.op}) on sm80+, else {efficient}"
            return efficient
    try:
        kernel = _select(request, device_type, None, dtype, head_dim)
    except NoFusedKernelError as e:
        return f"none: {e}"
    return f"{kernel.name} ({kernel.op})"


def describe_sdpa_backend(device_type: str, dtype: torch.dtype, num_heads: int, num_groups: int,
                          head_dim: int, v_head_dim: int | None = None) -> str:
    """The kernel F.scaled_dot_product_attention picks for the attention without context
    parallelism (models/gpt.py causal_sdpa): asked of torch itself on CPU; on CUDA torch
    decides per GPU at run time. `v_head_dim`: the value heads' width when it differs (latent
    attention)."""
    if device_type != "cpu":
        return "F.scaled_dot_product_attention (torch picks flash / cuDNN / efficient per GPU and dtype)"
    from torch.nn.attention import SDPBackend

    q = torch.empty(1, num_heads, 8, head_dim, dtype=dtype, device="cpu")
    kv = torch.empty(1, num_groups, 8, head_dim, dtype=dtype, device="cpu")
    v = torch.empty(1, num_groups, 8, v_head_dim or head_dim, dtype=dtype, device="cpu")
    choice = SDPBackend(torch._fused_sdp_choice(q, kv, v, is_causal=True, enable_gqa=num_groups != num_heads))
    return f"F.scaled_dot_product_attention -> {choice.name.lower()}"
