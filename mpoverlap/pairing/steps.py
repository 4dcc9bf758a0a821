"""A GPT microbatch's forward as sub-steps on a Tape (see tape.py), as a generator.

Sub-steps of an MoE block (n = the layer's token chunks, overlap.ep_chunks; the all-to-all
dispatcher's exchanges shown, the all-gather dispatcher gathers tokens, router weights and ids
and reduce-scatters the weighted partial sums instead, see _AllGatherChunk):

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

from mpoverlap.moe.dispatcher import AllGatherDispatcher
from mpoverlap.moe.layer import MoELayer
from mpoverlap.pairing.tape import YIELD, Exchange, Tape, UnitUse


def is_paired_moe(block) -> bool:
    return isinstance(block.mlp, MoELayer)


def microbatch_forward(tape: Tape, model, tokens_BS: torch.Tensor, targets_BS: torch.Tensor,
                       position_ids: torch.Tensor, num_microbatches: int, pins=None, result: Optional[dict] = None):
    """Generator: the forward of one microbatch on `tape`, yielding while its exchanges are in
    flight. At the end `result["loss"]` holds the loss / num_microbatches (detached), and the tape holds
    the loss's seed gradient, ready for `tape.backward_steps()`.

    A pipeline chunk (models/gpt.py, pairing/pipeline.py): without `pre_process` `tokens_BS`
    is the received hidden state [B, S, H] (requires grad) and the backward leaves its
    gradient in `result["input_grad"]`; without `post_process` the forward ends with
    `result["output"]` (the hidden state to send), whose gradient the caller seeds on the tape
    (`tape.add_grad`) before the backward."""
    if model.pre_process:
        UnitUse.mark(tape, pins, "embedding", True)
        seg = tape.segment("embedding", [])
        x, cos, sin = model.embed(tokens_BS, position_ids)
        seg.close(tape, [x])
        UnitUse.mark(tape, pins, "embedding", False)
    else:
        x, cos, sin = model.embed(tokens_BS, position_ids)  # x is tokens_BS itself: the received hidden
        tape.entries.append(_InputGrad(x, result))
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
    if not model.post_process:
        if result is not None:
            result["output"] = x
        return
    UnitUse.mark(tape, pins, "head", True)
    seg = tape.segment("head", [x])
    x_in, = seg.leaves
    logits = model.head(x_in)
    with torch.autocast(logits.device.type, enabled=False):  # as the unpaired loop: the loss outside autocast
        loss = model.loss(logits.float(), targets_BS) / num_microbatches
    seg.close(tape, [loss])
    UnitUse.mark(tape, pins, "head", False)
    tape.add_grad(loss, torch.ones_like(loss))
    if result is not None:
        result["loss"] = loss.detach()


class _InputGrad:
    """The first tape entry of a chunk that receives its input: its backward (the tape's last
    step) hands the input's gradient to `result["input_grad"]`."""

    def __init__(self, x: torch.Tensor, result: Optional[dict]) -> None:
        self.x, self.result = x, result

    def backward(self, tape: Tape) -> None:
        grad = tape.take_grad(self.x)
        if self.result is not None:
            self.result["input_grad"] = grad
        self.x = None


class _AllToAllChunk:
    """One chunk through the all-to-all dispatcher: its sorted slots go out in one all-to-all,
    the expert outputs come back in one; the router weights fold them in the combine segment."""

    def __init__(self, d, part, counts) -> None:
        self.d = d
        self.x_perm, self.ctx = d.sort_for_dispatch(*part, counts=counts)
        self.sent = [self.x_perm]
        self.post_inputs = [self.ctx["weights"]]  # used by the combine segment

    def dispatch(self, tape: Tape, name: str) -> list:
        c = self.ctx
        return [Exchange(tape, name, self.x_perm, self.d.group, self.d.ledger, splits=(c["out_splits"], c["in_splits"]))]

    def experts(self, layer, received: list):
        tokens, rows_per_expert = self.d.received_to_experts(received[0], self.ctx)
        return self.d.experts_to_send(layer.experts(tokens, rows_per_expert), self.ctx)

    def combine(self, tape: Tape, name: str, back) -> "Exchange":
        c = self.ctx
        return Exchange(tape, name, back, self.d.group, self.d.ledger, splits=(c["in_splits"], c["out_splits"]),
                        record=False)

    def combined(self, out, post_inputs: list):
        return self.d.combined_tokens(out, dict(self.ctx, weights=post_inputs[0]))


class _AllGatherChunk:
    """One chunk through the all-gather dispatcher: tokens, router weights and ids gathered over
    the ep group, the weighted partial sums reduce-scattered back (nothing left to fold)."""

    def __init__(self, d, part, counts) -> None:
        self.d = d
        self.sent = list(part)  # x [T, H], ids [T, k], weights [T, k]
        self.ctx = dict(T=part[1].shape[0], k=part[1].shape[1], counts=counts)
        self.post_inputs = []

    def dispatch(self, tape: Tape, name: str) -> list:
        x, ids, w = self.sent
        return [Exchange(tape, f"{name}.{what}", t, self.d.group, self.d.ledger, kind="gather", size=self.d.size)
                for what, t in (("x", x), ("weights", w), ("ids", ids))]

    def experts(self, layer, received: list):
        xs, ws, self.ctx["ids"] = received
        tokens, rows_per_expert = self.d.gathered_to_experts(xs, ws, self.ctx)
        return self.d.experts_to_partial_sums(layer.experts(tokens, rows_per_expert), self.ctx)

    def combine(self, tape: Tape, name: str, partial) -> "Exchange":
        return Exchange(tape, name, partial, self.d.group, self.d.ledger, kind="scatter", size=self.d.size,
                        record=False)

    def combined(self, out, post_inputs: list):
        return out


def _moe_block(tape: Tape, name: str, block, x, cos, sin):
    layer: MoELayer = block.mlp
    d = layer.dispatcher
    chunk_kind = _AllGatherChunk if isinstance(d, AllGatherDispatcher) else _AllToAllChunk
    seg = tape.segment(f"layers.{name}.pre_dispatch", [x])
    x_in, = seg.leaves
    x1 = x_in + block.attn(block.attn_norm(x_in), cos, sin)
    h = block.mlp_norm(x1)
    x_own, parts, r = layer.route(h)
    counts = d.exchange_counts([ids for _, ids, _ in parts])  # the layer's one host read
    chunks = [chunk_kind(d, part, c) for part, c in zip(parts, counts)]
    if layer.training and not layer.recomputing:
        layer._record(r)
    aux = r.aux_loss + r.z_loss if layer.attaches_aux() else None
    post_inputs = [t for c in chunks for t in c.post_inputs]
    seg.close(tape, [x1, x_own, aux] + [t for c in chunks for t in c.sent] + post_inputs)

    dispatches = [c.dispatch(tape, f"layers.{name}.dispatch{i}") for i, c in enumerate(chunks)]
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
    for i, (c, exchanges) in enumerate(zip(chunks, dispatches)):
        received = [seg.input(ex.wait(tape, record=False)) for ex in exchanges]
        backs.append(c.experts(layer, received))
        combines.append(c.combine(tape, f"layers.{name}.combine{i}", backs[-1]))
    tape.entries.extend(ex.waited_entry() for exchanges in dispatches for ex in exchanges)
    seg.close(tape, backs)
    tape.entries.extend(ex.issued_entry() for ex in combines)
    tape.entries.append(YIELD)
    yield

    outs = [ex.wait(tape) for ex in combines]
    seg = tape.segment(f"layers.{name}.combine", [x1, shared, aux] + outs + post_inputs)
    x1_in, shared_in, aux_in = seg.leaves[:3]
    n = len(outs)
    outs_in, post_in = seg.leaves[3:3 + n], seg.leaves[3 + n:]
    per = [len(c.post_inputs) for c in chunks]
    starts = [sum(per[:i]) for i in range(n)]
    y = torch.cat([c.combined(o, post_in[a:a + k]) for c, o, a, k in zip(chunks, outs_in, starts, per)], dim=0)
    x2 = x1_in + layer.output(y, shared_in, aux_in, h.shape)
    seg.close(tape, [x2])
    return x2
