"""Which GEMMs run in FP8 under train.precision=fp8, and the check that torchao is there.

Selection is per module, explicit: the covered linears (wgrad/functions.py `Linear`, the
tensor-parallel `ColumnParallelLinear` / `RowParallelLinear`) carry `fp8_recipe` (None: bf16
GEMMs; "tensorwise" / "rowwise": FP8) and `fp8_emulate` (tests: the same casts dequantized,
fp32 matmul). `mark_fp8_gemms` sets it on the transformer blocks' attention q/k/v and output
projections and MLP linears; the embedding, the output head, the router, norms and attention's
softmax stay bf16, as in the peers (torchao's Float8Linear conversion, Megatron's FP8 layers).
No torchao import here: the trainer and the validator use it to refuse fp8 without torchao.
"""
from __future__ import annotations

import importlib.util
from typing import List

import torch.nn.functional as F
from torch import nn

INSTALL = "pip install -e '.[fp8]'"


def torchao_missing() -> str:
    """'' when torchao is installed, else the reason with the install command. Looked up, not
    imported: importing torchao loads its extensions, which costs time and logs."""
    try:
        found = importlib.util.find_spec("torchao") is not None
    except (ImportError, ValueError):  # a broken or blocked installation
        found = False
    if found:
        return ""
    return ("train.precision=fp8 needs torchao (its float8 casts and scales), which is not installed: "
            f"install it with {INSTALL}, or run train.precision=bf16")


def mark_fp8_gemms(model: nn.Module, recipe: str, emulate: bool = False) -> List[str]:
    """Set `fp8_recipe` (and `fp8_emulate`) on every module with an `fp8_recipe` attribute inside
    a transformer block of `model` (q/k/v, the attention output projection, the MLP's and a
    shared expert's linears) except the MoE router; returns their names. Modules outside the
    blocks (embedding, head) are never marked."""
    from mpoverlap.models.gpt import Block

    marked = []
    for name, sub in model.named_modules():
        if not isinstance(sub, Block):
            continue
        for inner, mod in sub.named_modules():
            if hasattr(mod, "fp8_recipe") and "router" not in inner.split("."):
                mod.fp8_recipe, mod.fp8_emulate = recipe, emulate
                marked.append(f"{name}.{inner}")
    return marked


def fp8_gemms(module: nn.Module):
    """The module's FP8 GEMMs (precision.fp8.Fp8Gemms) when it is marked, else None (bf16); with
    its weight's FP8 ZeRO-3 gather (`fp8_gathered`, set by data_parallel/fp8_gather.py) if any."""
    recipe = getattr(module, "fp8_recipe", None)
    if recipe is None:
        return None
    from mpoverlap.precision.fp8 import Fp8Gemms

    return Fp8Gemms(recipe, getattr(module, "fp8_emulate", False), getattr(module.weight, "fp8_gathered", None))


def linear_or_fp8(fp8, x, weight, bias=None):
    """x W^T (+ b) inside a linear Function: F.linear, or the FP8 forward GEMM when `fp8` is set."""
    return F.linear(x, weight, bias) if fp8 is None else fp8.forward(x, weight, bias)


def dgrad_or_fp8(fp8, grad, weight):
    """grad W, the input gradient inside a linear Function's backward, in FP8 when `fp8` is set."""
    return grad.matmul(weight) if fp8 is None else fp8.dgrad(grad, weight)
