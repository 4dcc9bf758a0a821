"""Aux-loss-free load balancing across the run (DeepSeek-V3): the step-end update of every MoE
layer's expert bias from the GLOBAL per-expert loads, and the biases' checkpoint names.

Each MoE layer sums, over the step's training forwards, the slots routed to each expert before
drops, already summed over the ranks that share its sequences (tp under SP, cp: the router's
statistics exchange). One all-reduce of every layer's loads over dp x cp then adds the replicas;
it counts each replica's loads cp times, which is divided back exactly (the loads are integers
in fp32). Every rank thus applies bias_e += rate * sign(mean - load_e) to the same loads, at
any layout.
"""
from __future__ import annotations

from typing import Dict, List

import torch

from mpoverlap.comm import all_reduce


def biased_layers(moe_layers: List) -> List:
    return [layer for layer in moe_layers if layer.router.expert_bias is not None]


@torch.no_grad()
def update_expert_biases(moe_layers: List, state, ledger, *, apply: bool) -> None:
    """The step-end update (apply=False: a skipped step; its loads are dropped)."""
    layers = biased_layers(moe_layers)
    if not layers:
        return
    loads = torch.stack([layer.pending_load() for layer in layers])  # [layers, E] fp32
    group = state.group("dp_cp")
    if group is not None:
        all_reduce(loads, group, mode="dp", ledger=ledger).wait()
        loads /= state.grid.cp
    for layer, load in zip(layers, loads):
        if apply:
            layer.update_expert_bias(load)
        else:
            layer.discard_load()


def expert_biases(chunks: List) -> Dict[str, torch.Tensor]:
    """{layout-free name: bias buffer} of the biased MoE layers of these model chunks, the
    multi-token prediction depths' blocks (`mtp.<d>.block`, trained like the others) included."""
    blocks = [(f"layers.{i}", block) for chunk in chunks for i, block in chunk.layers.named_children()]
    blocks += [(f"mtp.{d}.block", depth.block) for chunk in chunks if getattr(chunk, "mtp", None) is not None
               for d, depth in chunk.mtp.named_children()]
    return {f"{name}.mlp.router.expert_bias": block.mlp.router.expert_bias for name, block in blocks
            if getattr(getattr(block.mlp, "router", None), "expert_bias", None) is not None}
