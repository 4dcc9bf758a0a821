"""What the multi-token prediction depths (model.mtp_num_layers, models/mtp.py) keep for backward
and, under a zero-bubble schedule, from their B to their W, on the chunk that holds them (the
head's chunk, on the stage `sharding.mtp_depths_on` names).

One depth per token (f = residual bytes, c = compute bytes; residual region: S/tp positions with
SP; measured with `saved_tensors_hooks`, tests/test_estimate_mtp.py):
    its input ids (the shifted tokens, a new int64 tensor)                  8
    the embedding's output, the embedding norm's input                      H f
    the two norms' statistics (RMSNorm's normalised copy; LayerNorm: mean, rstd)  2H f (2 x 2 f)
    the concatenation [hidden ; embedding], eh_proj's input                  2H c
    the block: a main layer's (`layer_activation_bytes` of layer L + d)
    its final norm, head and loss: the last chunk's (`head_activation_bytes`), except that the
    depth's loss at tp 1 upcasts the logits and keeps the fp32 log-softmax (V x 4, not V c), and
    keeps its per-token losses and valid mask (4 + 4); vocab-parallel the same fp32 softmax
    over V/tp as the LM loss, plus the losses and the mask.
The depth's hidden input is the previous output (the main model's last block output for the
first depth), which the final norm before it keeps already: nothing more.

Zero bubble: each depth's closures keep its block's (`layer_wgrad_kept`), eh_proj's (input 2H,
output gradient H) and its head GEMM's (input H, logits' gradient V/tp), in c.
"""
from __future__ import annotations

from typing import Any, List, Tuple

from mpoverlap.models.init import padded_vocab_size
from mpoverlap.overlap.layout import Layout


def mtp_depths_in_chunk(cfg: Any, lo: Layout, chunk: int) -> int:
    """The MTP depths model chunk `chunk` holds: all of them on the MTP chunk pp*vpp where they
    are a chunk of their own (`mtp_own_chunk`), else those of its stage (`mtp_depths_on`) on
    the stage's head chunk (the model builds them beside the head), else on its last chunk."""
    from mpoverlap.overlap.estimate.params import chunk_layout_of
    from mpoverlap.overlap.estimate.sharding import mtp_depths_on
    from mpoverlap.pipeline.actions import stage_of

    if not getattr(cfg.model, "mtp_num_layers", 0):  # the planner estimates thousands of layouts
        return 0
    stage = stage_of(chunk, lo.pp, chunk_layout_of(cfg, lo))
    return mtp_depths_on(cfg, lo, stage) if chunk == mtp_chunk_of(cfg, lo, stage) else 0


def mtp_chunk_of(cfg: Any, lo: Layout, stage: int) -> int:
    """The model chunk of `stage` that holds its MTP depths (see `mtp_depths_in_chunk`)."""
    from mpoverlap.overlap.estimate.params import chunk_layout_of, mtp_own_chunk
    from mpoverlap.pipeline.actions import chunk_index

    last = lo.pp * lo.vpp - 1
    if stage == 0 and mtp_own_chunk(cfg, lo):
        return last + 1
    layout = chunk_layout_of(cfg, lo)
    mine = [chunk_index(stage, v, lo.pp, layout) for v in range(lo.vpp)]
    return last if last in mine else max(mine)


def mtp_chunk_input_bytes(cfg: Any, lo: Layout, conv: Any, micro_batch: int) -> int:
    """The MTP chunk's received h_0 (models/mtp_chunk.py), which the first depth's hidden norm
    keeps; on the head's chunk the final norm keeps that tensor already."""
    return _tokens(cfg, lo, micro_batch)[1] * cfg.model.hidden_size * conv.residual_bytes


def _tokens(cfg: Any, lo: Layout, micro_batch: int) -> Tuple[int, int]:
    """(TP-region tokens, residual-region tokens) per rank and microbatch."""
    tokens = micro_batch * (cfg.model.seq_length // lo.cp)
    sp = bool(cfg.parallel.sequence_parallel) and lo.tp > 1
    return tokens, tokens // lo.tp if sp else tokens


def mtp_depth_activation_bytes(cfg: Any, lo: Layout, d: int, conv: Any, micro_batch: int, mode: str) -> int:
    """Bytes depth d (0-based) keeps for backward, per rank and microbatch (see the module doc);
    `mode` the recompute mode (full recomputation replays none of the depths)."""
    from mpoverlap.overlap.estimate.activations import head_activation_bytes, layer_activation_bytes

    m = cfg.model
    H, c, f = m.hidden_size, conv.compute_bytes, conv.residual_bytes
    tokens_tp, tokens_res = _tokens(cfg, lo, micro_batch)
    norm_stats = H * f if m.norm == "rmsnorm" else 2 * f
    own = tokens_res * (H * f + 2 * norm_stats + 2 * H * c) + tokens_tp * 8
    block = layer_activation_bytes(cfg, lo, m.num_layers + d, conv, micro_batch, "none" if mode == "full" else mode)
    V = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by)
    upcast = tokens_tp * V * (4 - c) if lo.tp == 1 else 0
    return own + block + head_activation_bytes(cfg, lo, conv, micro_batch) + upcast + tokens_tp * 8


def mtp_activation_bytes(cfg: Any, lo: Layout, chunk: int, conv: Any, micro_batch: int, mode: str) -> int:
    """What the depths on `chunk` keep for backward, per rank and microbatch (0 without)."""
    return sum(mtp_depth_activation_bytes(cfg, lo, d, conv, micro_batch, mode)
               for d in range(mtp_depths_in_chunk(cfg, lo, chunk)))


def mtp_wgrad_items(cfg: Any, lo: Layout, chunk: int, conv: Any, micro_batch: int, mode: str) -> List[Tuple[int, int, int]]:
    """Zero bubble: per depth on `chunk`, (saved, kept from B to W, kept and not saved), as
    `chunk_wgrad_profile` walks its items: the linears' inputs are saved activations too, the
    output gradients are not."""
    from mpoverlap.overlap.estimate.wgrad_kept import head_wgrad_kept_bytes, layer_wgrad_kept

    m = cfg.model
    H, c = m.hidden_size, conv.compute_bytes
    tokens_tp, tokens_res = _tokens(cfg, lo, micro_batch)
    items = []
    for d in range(mtp_depths_in_chunk(cfg, lo, chunk)):
        block_kept, block_shared = layer_wgrad_kept(cfg, lo, m.num_layers + d, conv, micro_batch)
        eh_kept = tokens_res * 3 * H * c  # input [hidden ; embedding] 2H, output gradient H
        head_kept = head_wgrad_kept_bytes(cfg, lo, conv, micro_batch)
        kept = block_kept + eh_kept + head_kept
        sp = tokens_res < tokens_tp  # the head's input is gathered over the tp group in B
        shared = block_shared + tokens_res * 2 * H * c + (0 if sp else tokens_tp * H * c)
        items.append((mtp_depth_activation_bytes(cfg, lo, d, conv, micro_batch, mode), kept, kept - shared))
    return items
