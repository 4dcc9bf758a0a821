"""Activation memory: the bytes autograd keeps for backward, layer by layer, as this code saves
them, and how many microbatches' worth the pipeline schedule keeps alive on each stage.

What one block keeps per token (measured with `saved_tensors_hooks`, tests/test_estimate.py;
f = residual-stream bytes, 4: the residual stays fp32 under autocast; c = compute bytes):

  residual region (S/tp positions with SP, all S without):
    the two block inputs x, x + attn (the norms' inputs)        2H f
    RMSNorm keeps x * rsqrt(mean x^2) too (the weight's grad)    2H f   (LayerNorm: mean, rstd only)
    the two norm outputs (the next GEMM's input)                 2H c
  TP region (each rank holds 1/tp of the heads and of F, all S/cp positions; with grouped-query
  attention k and v are g = G D wide instead of H: each "k or v" H below becomes g):
    qkv output (v is a view of it, so SDPA keeps it all)         3H c   (H + 2g)
    q, k after RoPE, attention output (flash: log-sum-exp only)  3H c + N f   (2H + g)
      ring CP: + a copy of the output for the projection (BNSD)  +1H c
      a2a CP: stacked head-sharded q, k, v + output + copy, the
              qkv output is not kept                             5H c in all
      no flash (math SDPA): the probabilities                    N S c (per token)
    MLP: GeLU up output and GeLU output                          2F c
         SwiGLU gate|up output, silu(gate), the product          4F c
  MoE MLP instead (not split over TP; S/tp tokens with SP): router logits and probabilities,
    top-k, log-sum-exp (fp32) 2E*4 + 12k + 40 bytes; the permuted tokens, the experts' outputs and
    their unpermuted copy 3kH c; each routed copy runs an expert MLP that keeps its up projection's
    output (2 or 1 x expert width, c; the per-expert loop, model.moe_grouped_gemm=false, 4 or 2);
    the shared expert a dense MLP of the expert width.
  The last chunk adds the final norm and what the loss keeps: at tp 1 the logits in c and a
  log-sum-exp per token, vocab-parallel the fp32 softmax over V/tp per token; the first chunk
  the token ids.

Recomputation (model.recompute, mpoverlap/recompute): `full` keeps only a recomputed block's
input x (H f per residual-region token; 2sbh in the paper's 16-bit terms), and while backward
replays one block its whole activations exist again once: the stage peak adds the largest
recomputed block's bytes. `selective` drops what the attention core alone keeps: with flash
kernels only its log-sum-exp (N f per token: the core's output is still kept, by the
projection that reads it), without flash also the s^2 softmax (and dropout) terms, which is
Korthikanti's selective recomputation (34 sbh/t at TP + SP).

`Conventions.korthikanti()` applies Korthikanti et al. 2022's conventions instead (everything
16-bit, no flash attention: softmax output + dropout mask + dropout output, and a 1-byte dropout
mask after the attention projection and after the MLP), to compare with their Table 2.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

from mpoverlap.models.init import padded_vocab_size, qkv_rows
from mpoverlap.overlap.estimate import latent
from mpoverlap.overlap.estimate.latent import is_latent
from mpoverlap.overlap.estimate.mtp import mtp_activation_bytes, mtp_chunk_input_bytes, mtp_wgrad_items
from mpoverlap.overlap.estimate.params import (chunk_layers, etp_size, expert_ffn, is_moe_layer, mtp_own_chunk,
                                               num_chunks, shared_expert_ffn)
from mpoverlap.overlap.layout import Layout


@dataclass(frozen=True)
class Conventions:
    """How activations are counted. The default is what this code does."""
    compute_bytes: int = 4  # bytes of the compute dtype (2 for train.precision=bf16)
    residual_bytes: int = 4  # the residual stream and norm statistics (fp32 under autocast)
    flash: bool = True  # SDPA picks a flash kernel on CPU and CUDA; ring/a2a CP are flash-style
    dropout: bool = False  # this model has no dropout
    rope: bool = True  # RoPE makes rotated copies of q and k beside the qkv output (2H c per token)

    @classmethod
    def for_dtype(cls, compute_bytes: int = 4) -> "Conventions":
        return cls(compute_bytes=compute_bytes)

    @classmethod
    def korthikanti(cls) -> "Conventions":
        """Korthikanti et al. 2022, Table 2: 16-bit activations, dropout, no flash attention, and
        GPT-3's learned positions (no RoPE copies of q and k)."""
        return cls(compute_bytes=2, residual_bytes=2, flash=False, dropout=True, rope=False)


def layer_activation_bytes(cfg: Any, lo: Layout, i: int, conv: Conventions, micro_batch: int,
                           recompute: Optional[str] = None) -> int:
    """Bytes layer i keeps for backward, per rank and microbatch (see the module doc), when it
    is not a fully recomputed block. `recompute` None reads model.recompute (selective applies
    to every layer; "full" is handled by `chunk_activation_bytes`)."""
    m, p = cfg.model, cfg.parallel
    selective = (getattr(m, "recompute", "none") if recompute is None else recompute) == "selective"
    H, N, c, f = m.hidden_size, m.num_attention_heads, conv.compute_bytes, conv.residual_bytes
    s_local = m.seq_length // lo.cp
    sp = bool(p.sequence_parallel) and lo.tp > 1
    tokens_tp = micro_batch * s_local  # TP region: every position, 1/tp of heads and F
    tokens_res = tokens_tp // lo.tp if sp else tokens_tp  # residual region: S/tp with SP
    norm_extra = 2 * H * f if m.norm == "rmsnorm" else 2 * 2 * f
    # A norm's output is kept by the GEMM it feeds, as autocast's compute-dtype copy: nn.Linear
    # and the tensor-parallel functions (which cast their input themselves) alike.
    norm_out = c
    residual = (2 * H * f + norm_extra + H * norm_out + H * (c if is_moe_layer(m, i) else norm_out)
                + (2 * H if conv.dropout else 0))
    # q = N D: the query width (H unless model.head_dim says otherwise; the H terms of the doc);
    # g = G D: the K/V width (g = q without grouped-query attention).
    q, g, _ = qkv_rows(m)
    if lo.cp > 1:
        core = (3 * q + 2 * g if p.cp_comm == "a2a" else 4 * q + 3 * g) * c
    else:
        core = (3 * q + 3 * g) * c
    if not conv.rope and p.cp_comm != "a2a":
        core -= (q + g) * c
    attn_tp = core + (0 if selective else N * f)  # the log-sum-exp per head (recomputed: none)
    if is_latent(m):  # multi-head latent attention: its latents and core widths (latent.py)
        latent_res, attn_tp = latent.activation_bytes_per_token(m, 1, c, f, selective, p.cp_comm, lo.cp)
        residual += latent_res
    if not conv.flash and lo.cp == 1 and not selective:
        # Math SDPA keeps the causal softmax over all S keys; with dropout also its mask
        # (1 byte) and the dropped-out probabilities.
        attn_tp += N * s_local * (c + (1 + c if conv.dropout else 0))
    total = tokens_res * residual + tokens_tp * attn_tp // lo.tp
    mult = 4 if m.activation == "swiglu" else 2
    if is_moe_layer(m, i):
        tokens = tokens_res  # each TP rank routes its S/tp (SP) or all S
        k, E, fe, etp = m.moe_top_k, m.num_experts, expert_ffn(m), etp_size(cfg)
        # With etp the experts run on the tp group's tokens (every position), F/etp wide.
        expert_tokens = tokens_tp if etp > 1 else tokens
        total += tokens * (2 * E * 4 + 12 * k + 40)
        # the shared expert is split over TP like a dense MLP
        total += tokens_tp * mult * shared_expert_ffn(m) * c // lo.tp
        # The grouped experts (model.moe_grouped_gemm, mpoverlap/moe/grouped.py) keep only the
        # up projection's output (2F swiglu, F gelu) and recompute the activation in backward;
        # the per-expert loop keeps autograd's (4F / 2F, as a dense MLP).
        per_copy = mult // 2 if getattr(m, "moe_grouped_gemm", True) else mult
        total += expert_tokens * (3 * k * H * c + k * per_copy * (fe // etp) * c)
    else:
        total += tokens_tp * mult * m.ffn_hidden_size * c // lo.tp
    return total + fp8_gathered_input_bytes(cfg, lo, i, c, tokens_res, tokens_tp)


def fp8_gathered_input_bytes(cfg: Any, lo: Layout, i: int, c: int, tokens_res: int, tokens_tp: int) -> int:
    """What layer i's column-parallel FP8 GEMMs change under SP with FP8 gathers
    (comm.fp8_sp_gathers; tensor_parallel/linear_functions.py): each keeps its local e4m3 chunk
    for its weight gradient (1 byte an element, S/tp positions; backward re-gathers it) instead
    of its local chunk in c (a shared expert's chunk is its own copy, not the router's); a chunk
    another GEMM also keeps (MLA's q_proj input, the down-projections') stays. 0 in every other
    layout; below 0 in this one wherever c > 1."""
    from mpoverlap.overlap.estimate.comm import fp8_sp_gathers

    if not fp8_sp_gathers(cfg, lo):
        return 0
    m = cfg.model
    H = m.hidden_size
    moe = is_moe_layer(m, i)
    mlp = 0 if moe and not m.shared_expert else H  # the dense MLP's or the shared expert's input
    if is_latent(m):  # q_b_proj's and kv_b_proj's latents (q_proj: the block's norm output, kept)
        r = m.q_lora_rank
        attn, attn_local = (r if r else H) + m.kv_lora_rank, (r if r else 0) + m.kv_lora_rank
    else:
        attn, attn_local = H, H
    return tokens_res * ((attn + mlp) - (attn_local + mlp) * c)


def head_activation_bytes(cfg: Any, lo: Layout, conv: Conventions, micro_batch: int) -> int:
    """The last chunk's final norm and loss, per microbatch: the norm's input (and RMSNorm's
    normalised copy), its output in c, and what the loss keeps: at tp 1 the logits as the head
    made them (c) and each row's log-sum-exp (models/loss.py; the compiled region keeps the same),
    under TP the vocabulary-parallel loss's fp32 softmax over the local V/tp."""
    m = cfg.model
    H, c, f = m.hidden_size, conv.compute_bytes, conv.residual_bytes
    tokens = micro_batch * (m.seq_length // lo.cp)
    sp = bool(cfg.parallel.sequence_parallel) and lo.tp > 1
    norm = (tokens // lo.tp if sp else tokens) * (H * f + (H * f if m.norm == "rmsnorm" else 2 * f) + H * c)
    V = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by)
    if lo.tp == 1:
        return norm + tokens * (V * c + 4)
    return norm + tokens * (V // lo.tp) * 4


def block_input_bytes(cfg: Any, lo: Layout, conv: Conventions, micro_batch: int) -> int:
    """What a fully recomputed block keeps: its input x, residual-region tokens x H."""
    m = cfg.model
    tokens = micro_batch * (m.seq_length // lo.cp)
    if bool(cfg.parallel.sequence_parallel) and lo.tp > 1:
        tokens //= lo.tp
    return tokens * m.hidden_size * conv.residual_bytes


def recompute_mode(cfg: Any, recompute: Optional[str] = None) -> str:
    return getattr(cfg.model, "recompute", "none") if recompute is None else recompute


def recomputed_in_chunk(cfg: Any, lo: Layout, chunk: int, recompute: Optional[str] = None) -> List[int]:
    """The layers of `chunk` that full recomputation replays (its first recompute_num_layers)."""
    from mpoverlap.recompute import recomputed_layers

    m, ids = cfg.model, chunk_layers(cfg, lo, chunk)
    return ids[:recomputed_layers(recompute_mode(cfg, recompute), len(ids), getattr(m, "recompute_num_layers", None))]


def chunk_activation_bytes(cfg: Any, lo: Layout, chunk: int, conv: Conventions, micro_batch: int,
                           recompute: Optional[str] = None, layer_bytes: Optional[Callable[[int], int]] = None) -> int:
    """One microbatch's saved bytes on model chunk `chunk` (layers, plus loss or token ids);
    `recompute` None reads model.recompute. `layer_bytes(i)`: `layer_activation_bytes` of
    layer i under that mode, when the caller already holds it."""
    mode = recompute_mode(cfg, recompute)
    layer_bytes = layer_bytes or (lambda i: layer_activation_bytes(cfg, lo, i, conv, micro_batch, mode))
    replayed = set(recomputed_in_chunk(cfg, lo, chunk, mode))
    total = sum(block_input_bytes(cfg, lo, conv, micro_batch) if i in replayed
                else layer_bytes(i) for i in chunk_layers(cfg, lo, chunk))
    if chunk == lo.pp * lo.vpp - 1:
        total += head_activation_bytes(cfg, lo, conv, micro_batch)
    total += mtp_activation_bytes(cfg, lo, chunk, conv, micro_batch, mode)
    if chunk == lo.pp * lo.vpp:  # the MTP chunk of its own (loop_mtp)
        total += mtp_chunk_input_bytes(cfg, lo, conv, micro_batch)
    if chunk == 0:
        total += micro_batch * (cfg.model.seq_length // lo.cp) * 8  # int64 token ids
    return total


def stage_activation_peak(cfg: Any, lo: Layout, conv: Conventions, micro_batch: int,
                          recompute: Optional[str] = None) -> List[Dict[str, int]]:
    """Per stage, the peak of saved bytes over the step and how many chunk-microbatches are
    alive then, replaying the schedule's own compute order (a forward keeps its chunk's
    activations until the matching backward). Interleaving keeps more alive on early stages:
    stage 0 of a 96-layer pp 8, vpp 2 run (m >= 8) peaks at 23 chunks of 6 layers, 138
    layers, where 1F1B peaks at 8 microbatches of its 12 layers, 96 (Korthikanti's
    1 + (p-1)/(p v) factor). The MTP chunk of its own (loop_mtp) runs its F and B adjacent
    in stage 0's order (schedules.insert_mtp_chunk) and has no W: one microbatch's depths on
    top of what stage 0 holds where it runs."""
    from mpoverlap.pipeline import chunk_layout, compute_orders, resolve_schedule
    from mpoverlap.pipeline.actions import BACKWARD, FORWARD, LOOP_MTP, WEIGHT, chunk_index
    from mpoverlap.pipeline.schedules import insert_mtp_chunk

    mode = recompute_mode(cfg, recompute)
    kind = resolve_schedule(getattr(cfg.parallel, "pp_schedule", "auto"), lo.vpp)
    own_mtp = mtp_own_chunk(cfg, lo)
    layout = LOOP_MTP if own_mtp else chunk_layout(kind)  # zbv: stage s holds chunks s and 2pp-1-s
    n_chunks = num_chunks(cfg, lo)
    sizes: Dict[int, int] = {}  # layer -> its bytes under `mode`, computed once per layer

    def layer_bytes(i: int) -> int:
        if i not in sizes:
            sizes[i] = layer_activation_bytes(cfg, lo, i, conv, micro_batch, mode)
        return sizes[i]
    per_chunk = [chunk_activation_bytes(cfg, lo, k, conv, micro_batch, mode, layer_bytes)
                 for k in range(n_chunks)]
    micro = lo.num_microbatches or 1

    def replay(stage: int) -> int:
        """Full recomputation: the largest block this stage replays, alive once in backward."""
        return max([layer_bytes(i)
                    for v in range(lo.vpp)
                    for i in recomputed_in_chunk(cfg, lo, chunk_index(stage, v, lo.pp, layout), mode)], default=0)
    if lo.pp == 1:
        if pairing_on(cfg, lo):
            extra = pairing_extra_bytes(cfg, lo, conv, micro_batch, mode)
            return [{"bytes": sum(per_chunk) + extra + replay(0), "chunks_in_flight": 2 * lo.vpp,
                     "layers_in_flight": cfg.model.num_layers + 1, "pairing_extra": extra}]
        # One forward and its backward at a time (no pipeline): one microbatch alive.
        return [{"bytes": sum(per_chunk) + replay(0), "chunks_in_flight": lo.vpp,
                 "layers_in_flight": cfg.model.num_layers}]
    orders = compute_orders(kind, lo.pp, lo.vpp, micro)
    if own_mtp:
        orders = insert_mtp_chunk(orders, lo.pp, lo.vpp)
    per = cfg.model.num_layers // (lo.pp * lo.vpp)
    zero_bubble = any(kind == WEIGHT for order in orders for kind, _, _ in order)
    kept, b_peak = per_chunk, per_chunk  # 1F1B: a microbatch's activations live until its B
    if zero_bubble:
        kept, b_peak = map(list, zip(*(zero_bubble_profile(cfg, lo, k, conv, micro_batch, mode, layer_bytes)
                                       for k in range(lo.pp * lo.vpp))))
        if own_mtp:  # the MTP chunk's B is a full backward: it frees all at once, keeps nothing
            kept.append(0)
            b_peak.append(per_chunk[-1])

    def peak_of(stage: int, order, sizes) -> tuple:
        # Zero bubble: a chunk-microbatch's activations live until its B, what its queued
        # weight-gradient closures keep (wgrad_kept.py) from its B until its W.
        live = alive = peak = peak_alive = 0
        chunks = [chunk_index(stage, v, lo.pp, layout) for v in range(lo.vpp + (1 if own_mtp else 0))]
        for kind, _mb, v in order:
            k = chunks[v]
            with_w = zero_bubble and k < lo.pp * lo.vpp  # the MTP chunk has no W
            now = live
            if kind == FORWARD:
                live += sizes[k]
                alive += 1
                now = live
            elif kind == BACKWARD:
                now = live - sizes[k] + b_peak[k]
                live += (kept[k] if with_w else 0) - sizes[k]
                alive -= 0 if with_w else 1
            elif kind == WEIGHT:
                live -= kept[k]
                alive -= 1
                now = live
            if now > peak:
                peak, peak_alive = now, alive
        return peak, peak_alive

    # overlap.ep_pairing at pp > 1 (pipeline/paired.py, zbv_paired.py): the paired table (the
    # interleaved and zb1p orders with one more warm-up forward per stage, the paired V; a
    # pair's F grows while its B frees, counted as the F's chunk complete before the B frees
    # anything; with W actions a B keeps what its W needs, as unpaired), each chunk-microbatch
    # holding its MoE layers' sub-step boundary buffers too until its B.
    paired_orders = None
    if pairing_on(cfg, lo):
        paired_orders = compute_orders(kind, lo.pp, lo.vpp, micro, pairing=True)
        with_boundaries = [per_chunk[k] + sum(pairing_boundary_bytes(cfg, lo, i, conv, micro_batch)
                                              for i in chunk_layers(cfg, lo, k)
                                              if i not in recomputed_in_chunk(cfg, lo, k, mode))
                           for k in range(lo.pp * lo.vpp)]
    out = []
    for stage, order in enumerate(orders):
        peak, peak_alive = peak_of(stage, order, per_chunk)
        row = {"bytes": peak + replay(stage), "chunks_in_flight": peak_alive, "layers_in_flight": peak_alive * per}
        if paired_orders is not None:
            paired_peak, paired_alive = peak_of(stage, paired_orders[stage], with_boundaries)
            row = {"bytes": paired_peak + replay(stage), "chunks_in_flight": paired_alive,
                   "layers_in_flight": paired_alive * per, "pairing_extra": paired_peak - peak}
        out.append(row)
    return out


def zero_bubble_profile(cfg: Any, lo: Layout, chunk: int, conv: Conventions, micro_batch: int,
                        mode: str, layer_bytes: Optional[Callable[[int], int]] = None) -> tuple:
    """(kept from B to W, peak during B) of one microbatch on `chunk` (wgrad_kept.py);
    `layer_bytes` as for `chunk_activation_bytes`."""
    from mpoverlap.overlap.estimate.wgrad_kept import chunk_wgrad_profile

    layer_bytes = layer_bytes or (lambda i: layer_activation_bytes(cfg, lo, i, conv, micro_batch, mode))
    replayed = set(recomputed_in_chunk(cfg, lo, chunk, mode))
    saved = [block_input_bytes(cfg, lo, conv, micro_batch) if i in replayed
             else layer_bytes(i) for i in chunk_layers(cfg, lo, chunk)]
    ids = micro_batch * (cfg.model.seq_length // lo.cp) * 8
    rec = [i in replayed for i in chunk_layers(cfg, lo, chunk)]
    return chunk_wgrad_profile(cfg, lo, chunk, conv, micro_batch, saved, rec, ids,
                               head_activation_bytes(cfg, lo, conv, micro_batch),
                               mtp_wgrad_items(cfg, lo, chunk, conv, micro_batch, mode))


def pairing_on(cfg: Any, lo: Layout) -> bool:
    """overlap.ep_pairing resolves on (true, or auto where it applies)."""
    from mpoverlap.overlap.ep_rules import pairing_obstacles

    return getattr(cfg.overlap, "ep_pairing", "false") not in (False, "false") and not pairing_obstacles(lo)


def pairing_extra_bytes(cfg: Any, lo: Layout, conv: Conventions, micro_batch: int, mode: str = "none") -> int:
    """Forward/backward pairing at pp 1 (mpoverlap/pairing): while the forward of microbatch i
    runs layer t, the backward of microbatch i-1 still holds its layers 0..L-1-t (it frees each
    layer's saved tensors as its sub-steps finish): max over t of layers[0..t] + layers[0..L-1-t],
    about one layer more than one microbatch, plus a second microbatch's head and token ids, and
    on every MoE layer the buffers its sub-step boundaries hold (`pairing_boundary_bytes`).
    Returns the bytes above one microbatch's. (If the two programs drifted apart the bound would
    be one whole microbatch more; the round-robin keeps forward layer t beside backward L-1-t.)"""
    layers = [layer_activation_bytes(cfg, lo, i, conv, micro_batch, mode) for i in range(cfg.model.num_layers)]
    total = chunk_activation_bytes(cfg, lo, 0, conv, micro_batch, mode)
    rest = total - sum(layers)  # head (final norm, loss) and token ids
    replayed = set(recomputed_in_chunk(cfg, lo, 0, mode))  # full: the block input only, no boundary
    paired = [b + (0 if i in replayed else pairing_boundary_bytes(cfg, lo, i, conv, micro_batch))
              for i, b in enumerate(layers)]
    L = len(paired)
    both = max(sum(paired[:t + 1]) + sum(paired[:L - t]) for t in range(L)) if L else 0
    return both + 2 * rest - total


def pairing_boundary_bytes(cfg: Any, lo: Layout, i: int, conv: Conventions, micro_batch: int) -> int:
    """What the paired sub-steps of MoE layer i hold beyond the unpaired layer, per microbatch:
    the buffers at the exchange boundaries (sorted slots sent, slots received, expert outputs
    sent back, combined slots received: 4 k H per routed token in the compute dtype, dropless),
    which the unpaired layer frees after each exchange and a sub-step boundary keeps until its
    backward."""
    m = cfg.model
    if not is_moe_layer(m, i):
        return 0
    tokens_tp = micro_batch * (m.seq_length // lo.cp)
    sp = bool(cfg.parallel.sequence_parallel) and lo.tp > 1
    expert_tokens = tokens_tp if etp_size(cfg) > 1 or not sp else tokens_tp // lo.tp
    return expert_tokens * 4 * m.moe_top_k * m.hidden_size * conv.compute_bytes
