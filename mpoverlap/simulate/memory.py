"""Memory-bound time: the bytes the step's elementwise work moves through HBM (norms,
activations, RoPE, casts, residual adds, copies, the fp32 loss, the weights' casts and gradient
accumulation, the optimizer), at `hardware.hbm_bw` bytes/s. Each operator reads its inputs and
writes its output once (one kernel per operator, as eager PyTorch runs them; no fusion), so
these are the bytes of the model's own code (models/gpt.py, models/layers.py), counted here
operator by operator; only the backward's factor is an assumption (see BACKWARD).

Per rank, layer and microbatch forward (t tokens = b s / cp, tn = t / tp under sequence
parallelism else t; q and g the local query and K/V rows (N D / tp, G D / tp); F the local MLP
width; r = 4 bytes: the residual stream is fp32, the embedding's dtype, and stays fp32 under
autocast since its adds promote; c the compute dtype's bytes; k = 1 when c < 4, i.e. autocast
casts each GEMM's fp32 input and weight to c, else 0):
  norms (2)          2 tn H (2 r + k (r + c))       one fused norm kernel; autocast's cast of its
                                                    output for the next GEMM
  RoPE (q and k)     t (q + g) (3 c + 8)            per half (models/rope.py's Function): its fp32
                                                    product with cos, one multiply-add with the
                                                    other half's sin written in c; backward the
                                                    same passes (so 1x, not BACKWARD x)
  copies             2 c t (g + q)                  v made contiguous for attention; the output's
                                                    transpose to [B, S, h] before the projection
  residual adds (2)  2 tn H (2 r + c)               fp32 + the projection's c output -> fp32
  MLP activation     t F c (5 swiglu, 2 gelu)       silu and the product; gelu
  MoE                the activation on its t' k rows of width F_e; the permutation and its
                     inverse (a copy each of t' k H c); the shared expert as a dense MLP
  weights            k P (4 + c) / m                the cast of the layer's P fp32 weights, once a
                                                    step (precision.step_cast_cache), a share of it
                                                    on each of the step's m microbatches; under
                                                    ZeRO-3 (weights gathered per use) every
                                                    microbatch's forward casts them again (m = 1)
Backward: BACKWARD x the forward's activation bytes (each operator's backward reads the gradient
of its output and the inputs it saved, writes the gradient of its inputs); weights: the weight
gradient written by its GEMM in c, read and added to the fp32 gradient buffer: P (2 c + 8)
(GEMM output written and read back, fp32 read and written).
Head (last chunk, T = t V / tp logits): the head GEMM's output written in c; the loss's
`.float()` (k T (c + 4)). At tp 1 (models/loss.py, fp32 row blocks): each block's log-sum-exp
reads it (4 T); backward reads the logits and writes exp(logits - lse) in fp32 (T (c + 4)),
exponentiates it in place (8 T) and writes its product with the incoming gradient in c
(T (4 + c)). Under TP the vocabulary-parallel loss: its fp32 softmax written (8 T: read and
written), backward reads it (8 T) and writes the product in c (T (4 + c)).
Per step, after the last backward (`update_bytes`): AdamW reads weight, gradient, m and v and
writes weight, m and v (28 bytes a parameter, fp32), the gradient norm reads the gradient (4),
zeroing the gradient buffer writes it (4): 36 bytes a parameter it updates.

With train.compile=true (models/fused.py) the compiled regions read their inputs and write their
outputs once each (`COMPILED`): the first norm and its cast tn H (r + c); the attention's residual
add with the MLP's norm tn H (2 r + 2 c); RoPE t (q + g) 2 c; SwiGLU 3 t F c (GeLU 2 t F c); the
block's last residual add stays eager (tn H (2 r + c)), as do the copies, casts of weights and
the rest; at tp 1 the loss region reads the head's logits once forward (T c) and once backward,
writing their gradient (2 T c); under TP the vocabulary-parallel loss stays eager (`train.compile`
read here as the memory term only; the GEMM rate is unchanged).

Under train.precision=fp8 (`fp8_cast_bytes`) each covered GEMM (attention qkv and projection,
the MLP's, the experts', the shared expert's) also casts its operands at each use: forward its
input rows and weight; backward the output gradient twice (input gradient, weight gradient),
the input rows again and the weight again. A cast is torchao's operators run eagerly (the GEMMs'
Functions sit outside the compiled regions, so train.compile=true leaves them eager too),
`cast_bytes(src)` an element of `src` bytes: the amax (abs: read and write src, its max: read
src), the fp32 upcast (read src, write 4; none from fp32), the product with the scale and the
saturating clamp (read 4, write 4 each), the fp8 cast (read 4, write 1): 33 bytes from bf16 or
fp32. The dense weights are cast from their bf16 step copies, the grouped experts' from fp32.

Not modelled: flash attention's own traffic (inside the compute term, at the GEMM rate), the
embedding lookup and its gradient (t H per microbatch, small beside the above), host time.
"""
from __future__ import annotations

from typing import Any

from mpoverlap.models.init import padded_vocab_size, qkv_rows
from mpoverlap.overlap.estimate.latent import core_widths, is_latent
from mpoverlap.overlap.estimate.params import etp_size, expert_ffn, is_moe_layer, layer_params, shared_expert_ffn
from mpoverlap.overlap.layout import Layout

# The backward of an elementwise operator moves about twice its forward's bytes: it reads the
# gradient of the output and the saved input(s) and writes the input's gradient (an add's
# backward is free, a product's reads both inputs). An assumption, like the FLOPs' 2x.
BACKWARD = 2.0
RESIDUAL = 4  # the residual stream's bytes (fp32)
UPDATE_BYTES_PER_PARAM = 36  # AdamW 28 + gradient norm 4 + zeroing 4 (fp32)


def _casts(c: int) -> int:
    return 1 if c < 4 else 0


def _activation(m: Any, rows: float, width: float, c: int, fused: bool = False) -> float:
    """The MLP's activation on `rows` rows of `width`: silu and the product (swiglu: read 2
    write 1 and read 1 write 1; fused: read 2 write 1) or gelu (read 1 write 1)."""
    if m.activation != "swiglu":
        return rows * width * c * 2
    return rows * width * c * (3 if fused else 5)


def layer_bytes(cfg: Any, lo: Layout, i: int, c: int) -> dict:
    """{"F": forward bytes, "B": backward bytes} of layer i per rank and microbatch."""
    from mpoverlap.simulate.costs import moe_tokens

    m = cfg.model
    H, tp, r, k = m.hidden_size, lo.tp, RESIDUAL, _casts(c)
    t = cfg.train.micro_batch_size * m.seq_length / lo.cp
    sp = bool(cfg.parallel.sequence_parallel) and tp > 1
    tn = t / tp if sp else t
    q_all, kv_all, _ = qkv_rows(m)
    q, g = q_all / tp, kv_all / tp
    roped = copied = q + g  # RoPE rotates q and k; attention's copies are q- and k-sized
    if is_latent(m):  # latent attention: RoPE on the q_rope heads and the one shared key (on every rank);
        # the copies are the concatenated q and k, N (n + p) each
        roped = m.num_attention_heads * m.qk_rope_head_dim / tp + m.qk_rope_head_dim
        copied = 2 * core_widths(m)[0] / tp
    fused = bool(getattr(cfg.train, "compile", False))
    rope = 0.0  # eager RoPE's backward moves what its forward does (not BACKWARD x)
    if fused:  # the compiled regions: norm + cast, add + norm + cast, RoPE; the last add eager
        act = tn * H * (r + c) + tn * H * (2 * r + 2 * c) + t * roped * 2 * c + tn * H * (2 * r + c)
    else:
        act = 2 * tn * H * (2 * r + k * (r + c))  # norms
        rope = t * roped * (3 * c + 8)  # RoPE on q and k
        act += 2 * tn * H * (2 * r + c)  # residual adds
    act += 2 * c * t * copied  # copies around attention
    if is_moe_layer(m, i):
        rows = moe_tokens(cfg, lo) * m.moe_top_k
        act += _activation(m, rows, expert_ffn(m), c) + 2 * 2 * rows * H * c  # experts stay eager
        if m.shared_expert:
            act += _activation(m, t, shared_expert_ffn(m) / tp, c, fused)
    else:
        act += _activation(m, t, m.ffn_hidden_size / tp, c, fused)
    dense, expert = layer_params(cfg, lo, i)
    params = dense + expert
    casts = fp8_cast_bytes(cfg, lo, i, c) if str(cfg.train.precision) == "fp8" else {"F": 0.0, "B": 0.0}
    return {"F": act + rope + k * params * (4 + c) / _casts_shared_by(cfg, lo) + casts["F"],
            "B": BACKWARD * act + rope + params * (2 * c + 8) + casts["B"]}


def cast_bytes(src: int) -> int:
    """HBM bytes of one element's eager FP8 cast from `src` bytes (module docstring): amax 3 src,
    upcast src + 4 (from below fp32), scale 8, clamp 8, fp8 cast 5."""
    return 3 * src + (src + 4 if src < 4 else 0) + 8 + 8 + 5


def fp8_cast_bytes(cfg: Any, lo: Layout, i: int, c: int) -> dict:
    """{"F", "B"} bytes of layer i's FP8 casts per rank and microbatch (module docstring): per
    covered GEMM [rows, K] x [K, N], the rows' casts forward (rows K) and backward (2 rows N +
    rows K), and its weight's, forward and for the input gradient."""
    from mpoverlap.simulate.costs import moe_tokens

    m = cfg.model
    H, tp = m.hidden_size, lo.tp
    t = cfg.train.micro_batch_size * m.seq_length / lo.cp  # the GEMMs' rows (gathered under SP)
    q, kv, _ = qkv_rows(m)
    up = 2 if m.activation == "swiglu" else 1  # gate and up in one GEMM
    gemms = [(t, H, (q + 2 * kv) / tp), (t, q / tp, H)]
    if is_moe_layer(m, i):
        fe = expert_ffn(m) / etp_size(cfg)
        rows = moe_tokens(cfg, lo) * m.moe_top_k
        gemms += [(rows, H, up * fe), (rows, fe, H)]
        if m.shared_expert:
            gemms += [(t, H, up * shared_expert_ffn(m) / tp), (t, shared_expert_ffn(m) / tp, H)]
    else:
        gemms += [(t, H, up * m.ffn_hidden_size / tp), (t, m.ffn_hidden_size / tp, H)]
    per = cast_bytes(c)
    dense, expert = layer_params(cfg, lo, i)
    weights = dense * per + expert * cast_bytes(4)  # the experts cast their fp32 master weights
    return {"F": sum(rows * K for rows, K, _ in gemms) * per + weights,
            "B": sum(rows * (2 * N + K) for rows, K, N in gemms) * per + weights}


def _casts_shared_by(cfg: Any, lo: Layout) -> int:
    """Microbatches one cast of the weights serves: the step's (precision.step_cast_cache), 1
    under ZeRO-3, whose weights are gathered and cast at each use."""
    from mpoverlap.data_parallel.levels import resolve_level

    t = cfg.train
    level = resolve_level(getattr(t, "dp_sharding", "none"), bool(getattr(t, "distributed_optimizer", False)))
    return 1 if level == "optim_grads_params" else max(1, lo.num_microbatches or 1)


def head_bytes(cfg: Any, lo: Layout, c: int) -> dict:
    """{"F", "B"} bytes of the output head's logits and the fp32 loss per rank and microbatch."""
    m = cfg.model
    V = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by)
    T = cfg.train.micro_batch_size * m.seq_length / lo.cp * V / lo.tp
    if bool(getattr(cfg.train, "compile", False)) and lo.tp == 1:  # the compiled loss region
        return {"F": 2 * T * c, "B": 2 * T * c}
    k = _casts(c)
    if lo.tp == 1:
        return {"F": T * (c + k * (c + 4) + 4), "B": T * ((c + 4) + 8 + (4 + c))}
    return {"F": T * (c + k * (c + 4) + 8), "B": T * (8 + 4 + c)}


def update_bytes(params: float) -> float:
    """Bytes of the step's update after the last backward for `params` updated parameters."""
    return params * UPDATE_BYTES_PER_PARAM
