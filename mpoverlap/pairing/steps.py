"""A GPT microbatch's forward as sub-steps on a Tape (see tape.py), as a generator.

Sub-steps of an MoE block (a2a dispatcher; n = the layer's token chunks, overlap.ep_chunks):

    pre-dispatch   segment: x1 = x + attn(attn_norm(x)); h = mlp_norm(x1); router; tokens to the
                   compute dtype (and gathered over the expert-tp group); the chunks' counts
                   exchanged (the layer's one host read); each chunk's slots sorted by expert
    dispatch       n all-to-alls issued                                  -> YIELD
    shared expert  segment (under the dispatch), if the model has one
    experts        one segment over the chunks: per chunk wait its dispatch, regroup, experts,
                   back to the received order, issue its combine (the next chunk's dispatch is in
                   flight meanwhile)
                                                                         -> YIELD
    combine        wait the n combines; segment: unpermute with the router weights (+ the
                   expert-tp reduce, + shared, router losses attached) + residual

The backward mirrors it (tape.py): post-combine backward, reverse combines issued, YIELD,
reverse combines waited, experts backward (all chunks in one autograd call), reverse dispatches
issued, shared expert backward, YIELD,
reverse dispatches waited, pre-dispatch backward. Dense blocks, the embedding and the head
(with the loss) are one segment each: compute only, no YIELD.
"""
from __future__ import annotations

from typing import Optional

import torch

from mpoverlap.moe.layer import MoELayer
from mpoverlap.pairing.tape import YIELD, Exchange, Tape, UnitUse


def is_paired_moe(block) -> bool:
    return isinstance(block.mlp, MoELayer)


def microbatch_forward(tape: Tape, model, tokens_BS: torch.Tensor, targets_BS: torch.Tensor,
                       position_ids: torch.Tensor, loss_scale: float, pins=None, result: Optional[dict] = None):
    """Generator: the forward of one microbatch on `tape`, yielding while its exchanges are in
    flight. At the end `result["loss"]` holds the scaled loss (detached), and the tape holds
    the loss's seed gradient, ready for `tape.backward_steps()`."""
    UnitUse.mark(tape, pins, "embedding", True)
    seg = tape.segment("embedding", [])
    x, cos, sin = model.embed(tokens_BS, position_ids)
    seg.close(tape, [x])
    UnitUse.mark(tape, pins, "embedding", False)
    for name, block in model.layers.items():
        UnitUse.mark(tape, pins, f"layers.{name}", True)
        if is_paired_moe(block):
            x = yield from _moe_block(tape, name, block, x, cos, sin)
        else:
            seg = tape.segment(f"layers.{name}", [x])
            x_in, = seg.leaves
            x = block(x_in, cos, sin)
            seg.close(tape, [x])
        UnitUse.mark(tape, pins, f"layers.{name}", False)
    UnitUse.mark(tape, pins, "head", True)
    seg = tape.segment("head", [x])
    x_in, = seg.leaves
    loss = model.loss(model.head(x_in).float(), targets_BS) * loss_scale
    seg.close(tape, [loss])
    UnitUse.mark(tape, pins, "head", False)
    tape.add_grad(loss, torch.ones_like(loss))
    if result is not None:
        result["loss"] = loss.detach()


def _moe_block(tape: Tape, name: str, block, x, cos, sin):
    layer: MoELayer = block.mlp
    d = layer.dispatcher
    seg = tape.segment(f"layers.{name}.pre_dispatch", [x])
    x_in, = seg.leaves
    x1 = x_in + block.attn(block.attn_norm(x_in), cos, sin)
    h = block.mlp_norm(x1)
    x_own, parts, r = layer.route(h)
    counts = d.exchange_counts([ids for _, ids, _ in parts])  # the layer's one host read
    sorted_parts = [d.sort_for_dispatch(*part, counts=c) for part, c in zip(parts, counts)]
    if layer.training and not layer.recomputing:
        layer._record(r)
    aux = r.aux_loss + r.z_loss if layer.attaches_aux() else None
    weights = [ctx["weights"] for _, ctx in sorted_parts]
    seg.close(tape, [x1, x_own, aux] + [xp for xp, _ in sorted_parts] + weights)

    dispatches = [Exchange(tape, f"layers.{name}.dispatch{i}", xp, ctx["out_splits"], ctx["in_splits"],
                           d.group, d.ledger) for i, (xp, ctx) in enumerate(sorted_parts)]
    tape.entries.append(YIELD)
    yield

    shared = None
    if layer.shared_expert is not None:  # runs while the dispatches are in flight
        seg = tape.segment(f"layers.{name}.shared_expert", [x_own])
        own, = seg.leaves
        shared = layer.shared_expert(own.view(h.shape))
        seg.close(tape, [shared])
    # The chunks run one after another, each chunk's combine issued at once, but as ONE segment:
    # an expert's weights then receive their gradient in one autograd call (accumulated once, as
    # the DP readiness hooks expect). On the tape: the waits, the segment, the issues, so the
    # backward waits every reverse combine, runs the experts' backward, issues the reverse
    # dispatches.
    seg = tape.segment(f"layers.{name}.experts", [])
    combines, backs = [], []
    for i, (ex, (_, ctx)) in enumerate(zip(dispatches, sorted_parts)):
        recv_in = seg.input(ex.wait(tape, record=False))
        tokens, rows_per_expert = d.received_to_experts(recv_in, ctx)
        backs.append(d.experts_to_send(layer.experts(tokens, rows_per_expert), ctx))
        combines.append(Exchange(tape, f"layers.{name}.combine{i}", backs[-1], ctx["in_splits"],
                                 ctx["out_splits"], d.group, d.ledger, record=False))
    tape.entries.extend(ex.waited_entry() for ex in dispatches)
    seg.close(tape, backs)
    tape.entries.extend(ex.issued_entry() for ex in combines)
    tape.entries.append(YIELD)
    yield

    outs = [ex.wait(tape) for ex in combines]
    seg = tape.segment(f"layers.{name}.combine", [x1, shared, aux] + outs + weights)
    x1_in, shared_in, aux_in = seg.leaves[:3]
    n = len(outs)
    outs_in, weights_in = seg.leaves[3:3 + n], seg.leaves[3 + n:]
    y = torch.cat([d.combined_tokens(o, dict(ctx, weights=w))
                   for o, w, (_, ctx) in zip(outs_in, weights_in, sorted_parts)], dim=0)
    x2 = x1_in + layer.output(y, shared_in, aux_in, h.shape)
    seg.close(tape, [x2])
    return x2
