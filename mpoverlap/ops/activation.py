"""The MLP activations, eager: SwiGLU, silu(gate) * up over the halves of the gate/up GEMM's
output [.., 2F], and GeLU.

`swiglu_reference` is the plain formula (what train.compile's activation region traces, and the
tests' reference). Autograd on it computes both halves' gradients as their own tensors and then
copies them into the [.., 2F] gradient of the GEMM's output (the chunk's backward, a cat: a read
and a write of 2F per token). `swiglu` is one autograd Function with the same operators in the
same dtypes, whose backward writes the two halves straight into that gradient (`out=`): the same
values bit for bit, ~26 -> ~18 bytes moved per element of F in bf16.

`activate` / `activation_backward` are the two directions by name ("swiglu" | "gelu") for code
that runs its own backward (the grouped experts, moe/grouped.py, recompute the activation from
the saved pre-activation).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        silu = F.silu(gate)
        ctx.save_for_backward(gate_up, silu)
        return silu * up

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        gate_up, silu = ctx.saved_tensors
        return swiglu_backward(grad, gate_up, silu)


def swiglu_backward(grad: torch.Tensor, gate_up: torch.Tensor, silu=None) -> torch.Tensor:
    """The gradient at gate_up [.., 2F] of silu(gate) * up for the output gradient `grad`
    [.., F], both halves written into one tensor: [silu'(gate) grad up | grad silu(gate)].
    `silu`: silu(gate) kept from the forward, else recomputed (the grouped experts)."""
    gate, up = gate_up.chunk(2, dim=-1)
    grad_gate_up = torch.empty_like(gate_up)
    grad_gate, grad_up = grad_gate_up.chunk(2, dim=-1)
    torch.ops.aten.silu_backward.grad_input(grad * up, gate, grad_input=grad_gate)
    torch.mul(grad, F.silu(gate) if silu is None else silu, out=grad_up)
    return grad_gate_up


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, gate and up the two halves of the last dimension."""
    return _SwiGLU.apply(gate_up)


def activate(h: torch.Tensor, activation: str) -> torch.Tensor:
    """The activation of the pre-activation h: "swiglu" (h = [gate | up]) or "gelu"."""
    if activation == "swiglu":
        return swiglu_reference(h)
    return F.gelu(h)


def activation_backward(grad_a: torch.Tensor, h: torch.Tensor, activation: str) -> torch.Tensor:
    """The gradient at h of `activate(h, activation)` for the output gradient grad_a; swiglu's
    two halves written into one gradient (no cat), silu recomputed."""
    if activation == "swiglu":
        return swiglu_backward(grad_a, h)
    return torch.ops.aten.gelu_backward(grad_a, h)
