"""The SwiGLU Functions the model runs; they live in mpoverlap/ops/activation.py, below both the
model and the MoE layers that use them too (this module keeps their names importable here)."""
from mpoverlap.ops.activation import swiglu, swiglu_backward, swiglu_reference

__all__ = ["swiglu", "swiglu_backward", "swiglu_reference"]
