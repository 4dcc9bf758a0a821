"""Which path runs the grouped expert GEMMs (moe/grouped.py), and what it costs on the host.

One function, `choose`, decides: the grouped experts call it once per expert-MLP call (one
chunk of a MoE layer's tokens, forward and backward together), and the start-up plan
(overlap/plan.py, `mpoverlap-check`) calls it with the shapes the configuration gives, so the
plan names the path that runs and its host reads. The paths:

  torch._grouped_mm  torch's grouped GEMM: on CPU for fp32/bf16/fp16, on CUDA for bf16 on sm90
                     and sm100 only, the hidden and expert widths a multiple of 16 bytes (8
                     elements in bf16, 4 in fp32). The offsets stay on the device: no host read.
                     (torch's CUDA op for other dtypes and GPUs loops over the experts reading
                     the offsets on the host, once per product, six products a call: it is
                     never called there.)
  dense              every row times every expert's weight in one GEMM, then each row's own
                     (L times the FLOPs, an [N, L, M] product in memory): no host read. Taken
                     where the kernel cannot run while that product stays within
                     FALLBACK_MAX_BYTES (small models, fp32 on a GPU, the tests).
  looped             past that: the offsets read on the host once per call (kept for the
                     backward and the deferred weight gradients), then one GEMM per expert:
                     1 host read per call, L GEMMs per product.

A call's host reads times the calls of a MoE layer (its chunks) are the layer's per microbatch;
a recomputed forward (model.recompute=full) reads them again.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

KERNEL, DENSE, LOOPED = "torch._grouped_mm", "dense", "looped"
# The dtypes torch._grouped_mm takes (on CPU; on CUDA its kernel runs bf16 only).
GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# GPU generations (major compute capability) with torch's grouped kernel: Hopper, Blackwell.
KERNEL_MAJORS = (9, 10)
# The dense fallback holds [N, L, M] products: past this many bytes the looped path runs.
FALLBACK_MAX_BYTES = 256 * 2**20


@dataclass(frozen=True)
class GroupedPath:
    name: str  # KERNEL | DENSE | LOOPED
    host_reads: int  # per expert-MLP call (forward and backward together)
    why: str  # why this path runs here, in words


def widths_aligned(dtype: torch.dtype, *widths: int) -> bool:
    """torch._grouped_mm's rule on the operands' strides for row-major [.., width] operands:
    each width a multiple of 16 bytes."""
    return all((w * dtype.itemsize) % 16 == 0 for w in widths)


def product_bytes(rows: int, experts: int, hidden: int, width: int, dtype: torch.dtype) -> int:
    """The dense fallback's largest product of a call: rows x experts x max(hidden, width)."""
    return rows * experts * max(hidden, width) * dtype.itemsize


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))


def _kernel_refusal(device_type: str, capability: Optional[Tuple[int, int]], dtype: torch.dtype,
                    aligned: bool) -> Optional[str]:
    """None where torch's grouped kernel runs, else why it does not."""
    if dtype not in GROUPED_DTYPES:
        return f"torch._grouped_mm takes fp32/bf16/fp16, not {_dtype_name(dtype)}"
    if device_type == "cuda":
        if dtype != torch.bfloat16:
            return (f"torch's CUDA grouped kernel runs bf16 only, not {_dtype_name(dtype)} (train.precision=bf16 "
                    "runs it on sm90/sm100)")
        if capability is None or capability[0] not in KERNEL_MAJORS:
            sm = "an unknown GPU" if capability is None else f"sm{capability[0]}{capability[1]}"
            return f"torch's CUDA grouped kernel runs on sm90/sm100 only, not {sm}"
    elif device_type != "cpu":
        return f"torch._grouped_mm is not used on {device_type}"
    if not aligned:
        return "the hidden or expert width is not a multiple of 16 bytes (torch._grouped_mm's stride rule)"
    return None


def choose(device_type: str, capability: Optional[Tuple[int, int]], dtype: torch.dtype, *, aligned: bool,
           product_bytes: int) -> GroupedPath:
    """The grouped path for one expert-MLP call. `capability`: the CUDA device's (major, minor)
    (None on CPU, or unknown); `dtype`: the compute dtype; `aligned`: widths_aligned of the
    hidden and expert widths; `product_bytes`: the dense fallback's largest product."""
    refusal = _kernel_refusal(device_type, capability, dtype, aligned)
    if refusal is None:
        where = device_type if capability is None else f"{device_type} sm{capability[0]}{capability[1]}"
        return GroupedPath(KERNEL, 0, f"one kernel a product on {where} in {_dtype_name(dtype)}")
    if product_bytes <= FALLBACK_MAX_BYTES:
        return GroupedPath(DENSE, 0, f"{refusal}; every row times every expert, products of "
                                     f"{product_bytes / 2**20:.1f} MiB <= {FALLBACK_MAX_BYTES // 2**20} MiB")
    return GroupedPath(LOOPED, 1, f"{refusal}; products of {product_bytes / 2**30:.2f} GiB are past the dense "
                                  f"fallback's {FALLBACK_MAX_BYTES // 2**20} MiB: one GEMM per expert, the offsets "
                                  "read on the host once per call")


@functools.lru_cache(maxsize=None)
def _capability_of(index: int) -> Tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(index))


def device_capability(device: torch.device) -> Optional[Tuple[int, int]]:
    """A CUDA device's (major, minor), asked once per device (a grouped call would otherwise pay
    the properties lookup's host time); None for any other device."""
    if device.type != "cuda":
        return None
    return _capability_of(device.index if device.index is not None else torch.cuda.current_device())


def call_path(x: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor, dtype: torch.dtype) -> GroupedPath:
    """The path of one expert-MLP call: x [N, H] grouped by expert, w_in [L, W, H], w_out
    [L, H, F], computed in `dtype`."""
    L, W, H = w_in.shape
    F = w_out.shape[2]
    return choose(x.device.type, device_capability(x.device), dtype, aligned=widths_aligned(dtype, H, W, F),
                  product_bytes=product_bytes(x.shape[0], L, H, W, dtype))
