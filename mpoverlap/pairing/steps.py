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
(with the loss, and the MTP depths before it) are one segment each: compute only, no YIELD.

model.recompute=full (the chunk's first model.recompute_num_layers blocks): a dense block's
segment runs it under torch's checkpoint (mpoverlap/recompute). A MoE block's forward runs the
sub-steps above without autograd on a scratch tape (its exchanges in flight at the same YIELDs),
keeping only its input; its backward (`_Replayed`, one tape entry that yields) first replays the
forward sub-steps with autograd - pre-dispatch, dispatch issued, YIELD, shared expert and
experts, combines issued, YIELD, combine - then runs their mirrored backward: the replay's
exchanges are in flight under the other program's compute like the forward's, and the replay
reuses the forward's chunk counts (no second counts exchange or host read, the router
statistics recorded once). The trace names the replay's events direction "R". A paired backward
has twice its forward's exchange points then: its last ones (the chunk's first MoE blocks) run
after the forward's last sub-step, with nothing of the other side to hide under.
"""
from __future__ import annotations

from typing import Optional

import torch

from mpoverlap.moe.dispatcher import AllGatherDispatcher
from mpoverlap.moe.layer import MoELayer
from mpoverlap.pairing.tape import YIELD, Exchange, Tape, UnitUse, stepwise
from mpoverlap.recompute import recomputed


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
    replayed = getattr(model, "num_recomputed", 0)  # model.recompute=full: the chunk's first blocks
    for j, (name, block) in enumerate(model.layers.items()):
        UnitUse.mark(tape, pins, f"layers.{name}", True)
        if is_paired_moe(block):
            if j < replayed:
                x = yield from _replayed_moe_block(tape, name, block, x, cos, sin)
            else:
                x = yield from _moe_block(tape, name, block, x, cos, sin)
        else:
            seg = tape.segment(f"layers.{name}", [x])
            x_in, = seg.leaves
            x = recomputed(block, x_in, cos, sin, replaying=[block.mlp]) if j < replayed else block(x_in, cos, sin)
            seg.close(tape, [x])
        UnitUse.mark(tape, pins, f"layers.{name}", False)
    if not model.post_process:
        if result is not None:
            result["output"] = x
        return
    # With MTP targets [B, S, 1 + D] the depths (models/mtp.py) run in the head's segment, after
    # the last block as in the unpaired forward: compute only, their exchanges (a MoE depth's)
    # not paired. Under ZeRO-3 their units' own hooks gather and free them as unpaired: only
    # this segment uses them, and nothing of the other program runs inside it.
    with_mtp = model.mtp is not None and targets_BS.dim() == 3
    UnitUse.mark(tape, pins, "head", True)
    seg = tape.segment("head", [x])
    x_in, = seg.leaves
    if with_mtp:
        model.run_mtp(x_in, targets_BS, cos, sin)
    logits = model.head(x_in, fp32_logits=False)
    with torch.autocast(logits.device.type, enabled=False):  # as the unpaired loop: the loss outside autocast
        loss = model.loss(logits, targets_BS) / num_microbatches
    seg.close(tape, [loss])
    UnitUse.mark(tape, pins, "head", False)
    tape.add_grad(loss, torch.ones_like(loss))
    if result is not None:
        result["loss"] = loss.detach()
        if with_mtp:  # the LM loss reported, the MTP loss apart
            main, extra = model.last_loss_parts
            result["loss"], result["mtp_loss"] = main / num_microbatches, extra / num_microbatches


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
        return [Exchange(tape, name, self.x_perm, self.d.group, self.d.ledger, splits=(c["out_splits"], c["in_splits"]),
                         wire=self.d.wire)]

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
        return [Exchange(tape, f"{name}.{what}", t, self.d.group, self.d.ledger, kind="gather", size=self.d.size,
                         wire=self.d.wire if what == "x" else None)
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


def _moe_block(tape: Tape, name: str, block, x, cos, sin, counts=None, kept: Optional[dict] = None):
    """The MoE block's sub-steps (module docstring). `counts`: a replay's (model.recompute=full),
    the chunks' counts its forward exchanged (the same routing: no second exchange or host read,
    no router statistics recorded twice); `kept` receives this forward's counts."""
    layer: MoELayer = block.mlp
    d = layer.dispatcher
    chunk_kind = _AllGatherChunk if isinstance(d, AllGatherDispatcher) else _AllToAllChunk
    seg = tape.segment(f"layers.{name}.pre_dispatch", [x])
    x_in, = seg.leaves
    x1 = x_in + block.attn(block.attn_norm(x_in), cos, sin)
    h = block.mlp_norm(x1)
    x_own, parts, r = layer.route(h)
    replay = counts is not None
    if not replay:
        counts = d.exchange_counts([ids for _, ids, _ in parts])  # the layer's one host read
    if kept is not None:
        kept["counts"] = counts
    chunks = [chunk_kind(d, part, c) for part, c in zip(parts, counts)]
    if layer.training and not layer.recomputing and not replay:
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


# ---- model.recompute=full ------------------------------------------------------------------
def _replayed_moe_block(tape: Tape, name: str, block, x, cos, sin):
    """A MoE block under full recomputation: its sub-steps run as in `_moe_block` (the
    exchanges in flight at the same yields, under the other program's compute) but without
    autograd, on a scratch tape that is dropped, so the block keeps only its input x; the tape
    gets one `_Replayed` entry whose backward replays the sub-steps and then runs their
    backward (tape.py)."""
    device = x.device.type
    autocast = (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
    kept: dict = {}
    scratch = Tape(tape.microbatch, tape._log)
    out = yield from stepwise(_moe_block(scratch, name, block, x, cos, sin, kept=kept), torch.no_grad)
    out = out.detach().requires_grad_()
    tape.entries.append(_Replayed(name, block, x, out, cos, sin, kept["counts"], autocast))
    return out


class _Replayed:
    """The backward of a fully recomputed MoE block, a generator (tape.py): the block's forward
    sub-steps again on a fresh tape with autograd (the forward's autocast state, its chunks'
    counts), each exchange issued and waited at the same sub-step boundaries as in the forward
    (yielding between, so the other microbatch's compute runs under them), then that tape's
    backward (the reverse exchanges likewise); the input's gradient goes back to `tape`. The
    ledger counts the replay's exchanges under ep like the forward's."""

    def __init__(self, name, block, x, out, cos, sin, counts, autocast) -> None:
        self.name, self.block, self.x, self.out = name, block, x, out
        self.cos, self.sin, self.counts, self.autocast = cos, sin, counts, autocast

    def backward_steps(self, tape: Tape):
        grad = tape.take_grad(self.out)
        log = tape._log  # the replay's forward sub-steps traced as direction "R"
        replay = Tape(tape.microbatch, (lambda e: log((e[0], "R" if e[1] == "F" else e[1], *e[2:]))) if log else None)
        replay.entries.append(_HandBack(self.x, tape))
        enabled, dtype = self.autocast
        device = self.x.device.type
        out = yield from stepwise(_moe_block(replay, self.name, self.block, self.x, self.cos, self.sin,
                                              counts=self.counts),
                                   lambda: torch.autocast(device, dtype=dtype, enabled=enabled))
        if grad is not None:
            replay.add_grad(out, grad)
        self.block = self.x = self.out = self.cos = self.sin = self.counts = None
        yield from replay.backward_steps()


class _HandBack:
    """The first entry of a replay's tape: hands the block input's gradient to the outer tape."""

    def __init__(self, x: torch.Tensor, outer: Tape) -> None:
        self.x, self.outer = x, outer

    def backward(self, tape: Tape) -> None:
        grad = tape.take_grad(self.x)
        if grad is not None:
            self.outer.add_grad(self.x, grad)
        self.x = self.outer = None
