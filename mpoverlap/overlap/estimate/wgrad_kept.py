"""What a zero-bubble schedule (`parallel.pp_schedule=zb1p|zbv`) keeps alive between a chunk's
B and its W, and the stage peak that follows (stage_activation_peak in activations.py uses it).

In B the autograd graph frees a microbatch's saved activations as usual, but each deferred
linear (mpoverlap/wgrad) queues a closure over its (input, output gradient) for the W action,
so those stay until W. Per linear and token, in the compute dtype c (tp = TP size, s = the
TP-region positions S/cp, every one of them also under SP, where the column-parallel input is
kept gathered: W runs no communication):

    attention qkv   input H,            output gradient (q + 2g)/tp
    attention proj  input q/tp,         output gradient H
    latent attention (model.attention=mla): estimate/latent.py, wgrad_kept_per_token
    MLP up/gate_up  input H,            output gradient F/tp (2F/tp for SwiGLU's gate|up)
    MLP down        input F/tp,         output gradient H
  MoE layer instead of the MLP: per routed copy (k per token; all s positions with etp > 1,
  the residual region's otherwise) the expert's up/gate_up and down as above with the expert
  width F_e/etp; the shared expert like a dense MLP of its width (split over TP). The router's
  weight gradient stays in B.
  first chunk: the embedding's output gradient (H in the residual dtype f) and its ids (8)
  last chunk: the output head, input H and output gradient V/tp (the logits' gradient)
  MTP depths (on the head's chunk): estimate/mtp.py

Against the activations (`layer_activation_bytes`) this is the linears' inputs, which the
activations count too, plus the output gradients, which 1F1B frees inside the backward. With
full recomputation the recomputed block's linear inputs are what the closures keep, so a
pending W costs about as much as an unrecomputed one. tests/test_estimate.py measures these
bytes on the closures of one block and holds the stage peak against a real pp 2 run.
"""
from __future__ import annotations

from typing import Any, List, Sequence, Tuple

from mpoverlap.models.init import padded_vocab_size, qkv_rows
from mpoverlap.overlap.estimate import latent
from mpoverlap.overlap.estimate.params import chunk_layers, etp_size, expert_ffn, is_moe_layer, shared_expert_ffn


def _mlp_kept(H: int, width: int, swiglu: bool) -> Tuple[int, int]:
    """Per token, in compute bytes: the up (gate_up) and down linears' (inputs, output grads)."""
    return H + width, (2 if swiglu else 1) * width + H


def layer_wgrad_kept(cfg: Any, lo: Any, i: int, conv: Any, micro_batch: int) -> Tuple[int, int]:
    """(kept, shared): the bytes layer i's queued W closures keep from its B to its W, per rank
    and microbatch, and the part of them its saved activations hold too (the linears' inputs
    as the forward saved them: not the SP-gathered ones, which B makes)."""
    m, p = cfg.model, cfg.parallel
    H, c, tp = m.hidden_size, conv.compute_bytes, lo.tp
    tokens_tp = micro_batch * (m.seq_length // lo.cp)
    sp = bool(p.sequence_parallel) and tp > 1
    q, g, _ = qkv_rows(m)
    swiglu = m.activation == "swiglu"
    # attention: qkv (input H, grad (q+2g)/tp), proj (input q/tp, grad H)
    inputs, grads = H + q // tp, (q + 2 * g) // tp + H
    shared = q // tp + (0 if sp else H)
    res_kept = res_shared = 0
    if latent.is_latent(m):  # its own projections (latent.py); the residual-region ones on S/tp with SP
        tp_kept, shared, res_kept, res_shared = latent.wgrad_kept_per_token(m, tp, sp)
        inputs, grads = tp_kept, 0
        tokens_res = tokens_tp // tp if sp else tokens_tp
        res_kept, res_shared = tokens_res * res_kept * c, tokens_res * res_shared * c
    if not is_moe_layer(m, i):
        mi, mg = _mlp_kept(H, m.ffn_hidden_size // tp, swiglu)
        inputs, grads = inputs + mi, grads + mg
        shared += m.ffn_hidden_size // tp + (0 if sp else H)
        return _fp8_gathered(cfg, lo, i, c, tokens_tp, tokens_tp * (inputs + grads) * c + res_kept,
                             tokens_tp * shared * c + res_shared)
    total, shared_bytes = tokens_tp * (inputs + grads) * c + res_kept, tokens_tp * shared * c + res_shared
    etp = etp_size(cfg)
    expert_tokens = tokens_tp if etp > 1 or not sp else tokens_tp // tp
    ei, eg = _mlp_kept(H, expert_ffn(m) // etp, swiglu)
    total += expert_tokens * m.moe_top_k * (ei + eg) * c
    shared_bytes += expert_tokens * m.moe_top_k * ei * c  # the permuted tokens, the experts' activations
    width = shared_expert_ffn(m)
    if width:
        si, sg = _mlp_kept(H, width // tp, swiglu)
        total += tokens_tp * (si + sg) * c
        shared_bytes += tokens_tp * (width // tp) * c
    return _fp8_gathered(cfg, lo, i, c, tokens_tp, total, shared_bytes)


def _fp8_gathered(cfg: Any, lo: Any, i: int, c: int, tokens_tp: int, kept: int, shared: int) -> Tuple[int, int]:
    """(kept, shared) with SP's FP8 gathers (comm.fp8_sp_gathers): a column GEMM's closure keeps
    B's e4m3 re-gather of its input (1 byte an element, B's own as the compute-dtype re-gather
    was: not a saved activation) where it kept the compute-dtype re-gather (c)."""
    from mpoverlap.overlap.estimate.comm import fp8_sp_gathers

    if not fp8_sp_gathers(cfg, lo):
        return kept, shared
    m = cfg.model
    H = m.hidden_size
    attn = ((m.q_lora_rank or H) + m.kv_lora_rank) if latent.is_latent(m) else H
    mlp = H if not is_moe_layer(m, i) or m.shared_expert else 0
    width = tokens_tp * (attn + mlp)
    return kept - width * (c - 1), shared


def layer_wgrad_kept_bytes(cfg: Any, lo: Any, i: int, conv: Any, micro_batch: int) -> int:
    """Bytes layer i's queued W closures keep from its B to its W, per rank and microbatch."""
    return layer_wgrad_kept(cfg, lo, i, conv, micro_batch)[0]


def embedding_wgrad_kept_bytes(cfg: Any, lo: Any, conv: Any, micro_batch: int) -> int:
    """The first chunk's embedding: its output gradient (fp32 residual) and ids, per microbatch."""
    tokens_tp = micro_batch * (cfg.model.seq_length // lo.cp)
    return tokens_tp * (cfg.model.hidden_size * conv.residual_bytes + 8)


def head_wgrad_kept_bytes(cfg: Any, lo: Any, conv: Any, micro_batch: int) -> int:
    """The last chunk's output head: its input (the final norm's output) and the logits'
    gradient over the local V/tp, per microbatch."""
    m = cfg.model
    tokens_tp = micro_batch * (m.seq_length // lo.cp)
    V = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by)
    return tokens_tp * (m.hidden_size + V // lo.tp) * conv.compute_bytes


def chunk_wgrad_profile(cfg: Any, lo: Any, chunk: int, conv: Any, micro_batch: int,
                        saved: List[int], replayed: List[bool], extra_first: int, extra_last: int,
                        mtp: Sequence[Tuple[int, int, int]] = ()) -> Tuple[int, int]:
    """(kept, B's peak) of one microbatch on model chunk `chunk`: what its closures keep from
    B to W, and the most bytes of this microbatch alive during B. `saved` = the chunk's
    layers' activation bytes (as the activations count them), `replayed` which of them full
    recomputation replays (their closures keep the recomputed inputs: nothing shared),
    `extra_first` / `extra_last` the token ids / head activations of the first / last chunk,
    `mtp` the MTP depths' items on this chunk (estimate/mtp.py, `mtp_wgrad_items`; their
    backward runs before the head's, which their first depth's input gradient reaches).
    B walks the chunk backwards: at item j, the activations of items 0..j are still saved,
    item j's new closure tensors (output gradients) and the closures of items after j are
    queued."""
    m = cfg.model
    ids = chunk_layers(cfg, lo, chunk)
    items = []  # (saved, kept, kept and not saved)
    for a, i, rec in zip(saved, ids, replayed):
        k, shared = layer_wgrad_kept(cfg, lo, i, conv, micro_batch)
        items.append((a, k, k if rec else k - shared))
    tokens_tp = micro_batch * (m.seq_length // lo.cp)
    sp = bool(cfg.parallel.sequence_parallel) and lo.tp > 1
    if chunk == 0:
        k = embedding_wgrad_kept_bytes(cfg, lo, conv, micro_batch)
        items.insert(0, (extra_first, k, k - tokens_tp * 8))
    if chunk == lo.pp * lo.vpp - 1:
        k = head_wgrad_kept_bytes(cfg, lo, conv, micro_batch)
        items.append((extra_last, k, k - (0 if sp else tokens_tp * m.hidden_size * conv.compute_bytes)))
    items += list(mtp)
    kept = sum(k for _, k, _ in items)
    peak = max((sum(a for a, _, _ in items[:j + 1]) + items[j][2] + sum(k for _, k, _ in items[j + 1:])
                for j in range(len(items))), default=0)
    return kept, peak
