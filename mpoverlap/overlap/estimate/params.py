"""Exact parameter counts per rank and pipeline stage (pure arithmetic on the config)."""
from __future__ import annotations

from typing import Any

from mpoverlap.models.init import head_dim_of, padded_vocab_size, qkv_rows
from mpoverlap.overlap.layout import Layout


def norm_params(cfg_model: Any) -> int:
    return cfg_model.hidden_size * (2 if cfg_model.norm == "layernorm" else 1)


def chunk_layout_of(cfg: Any, lo: Layout) -> str:
    """How the schedule places model chunks on stages: "loop" (chunk k = v * pp + stage) or
    zbv's "v" (stage s holds chunks s and 2pp-1-s); pipeline/actions.py."""
    from mpoverlap.pipeline import SCHEDULE_CHOICES, chunk_layout, resolve_schedule

    choice = getattr(cfg.parallel, "pp_schedule", "auto")
    if lo.pp is None or lo.pp < 2 or choice not in SCHEDULE_CHOICES:
        return "loop"
    return chunk_layout(resolve_schedule(choice, lo.vpp))


def head_stage(cfg: Any, lo: Layout) -> int:
    """The stage holding the last model chunk (final norm, head, loss): pp-1, or 0 in the V."""
    return 0 if chunk_layout_of(cfg, lo) == "v" else lo.pp - 1


def mtp_stage(cfg: Any, lo: Layout) -> int:
    """The stage of the MTP depths: s where parallel.mtp_stage=s < pp-1 makes them a chunk of
    their own in a loop layout (training/pipeline_glue.py, `mtp_chunk_layout`), else the head's."""
    s = getattr(cfg.parallel, "mtp_stage", -1)
    if lo.pp > 1 and 0 <= s < lo.pp - 1 and chunk_layout_of(cfg, lo) == "loop":
        return s
    return head_stage(cfg, lo)


def mtp_own_chunk(cfg: Any, lo: Layout) -> bool:
    """Whether the estimate and the simulator model the MTP depths as a model chunk of their own,
    chunk pp*vpp on stage 0 (the loop_mtp layout: parallel.mtp_stage=0 in a loop layout at
    pp >= 2). On a middle stage s the depths are estimated on stage s's last chunk instead (their
    activations counted as that chunk's in-flight microbatches: an over-count, not modelled
    apart)."""
    return (lo.pp is not None and lo.pp > 1 and getattr(cfg.model, "mtp_num_layers", 0) > 0
            and getattr(cfg.parallel, "mtp_stage", -1) == 0 and chunk_layout_of(cfg, lo) == "loop")


def num_chunks(cfg: Any, lo: Layout) -> int:
    """Model chunks of the layout: pp*vpp, one more where the MTP depths are a chunk of their own."""
    return lo.pp * lo.vpp + (1 if mtp_own_chunk(cfg, lo) else 0)


def stage_layers(cfg: Any, lo: Layout, stage: int) -> list:
    """Global indices of the layers on pipeline stage `stage` (model chunk k holds layers
    [k L / (pp vpp), (k+1) L / (pp vpp)); `chunk_layout_of` places the chunks)."""
    from mpoverlap.pipeline.actions import chunk_index

    layout = chunk_layout_of(cfg, lo)
    return [i for v in range(lo.vpp) for i in chunk_layers(cfg, lo, chunk_index(stage, v, lo.pp, layout))]


def chunk_layers(cfg: Any, lo: Layout, chunk: int) -> list:
    """Global indices of the layers of model chunk `chunk` (0 .. pp*vpp-1; none of the main
    model's on the MTP chunk pp*vpp)."""
    if chunk >= lo.pp * lo.vpp:
        return []
    per = cfg.model.num_layers // (lo.pp * lo.vpp)
    return list(range(chunk * per, (chunk + 1) * per))


def is_moe_layer(m: Any, i: int) -> bool:
    return (m.num_experts > 0 and i >= getattr(m, "moe_first_dense_layers", 0)
            and i % m.moe_layer_freq == 0)


def mlp_mult(m: Any) -> int:
    """Weight matrices of one MLP: 3 for SwiGLU (gate, up, down), 2 for GeLU (up, down)."""
    return 3 if m.activation == "swiglu" else 2


def expert_ffn(m: Any) -> int:
    return m.moe_ffn_hidden_size or m.ffn_hidden_size


def shared_expert_ffn(m: Any) -> int:
    """The shared expert's width (0 without one): its own key, default the expert width."""
    if m.num_experts == 0 or not m.shared_expert:
        return 0
    return getattr(m, "moe_shared_expert_ffn_hidden_size", None) or expert_ffn(m)


def etp_size(cfg: Any) -> int:
    """parallel.etp as an int (1 where the key is missing or unusable: the rule reports it)."""
    etp = getattr(cfg.parallel, "etp", 1)
    return etp if isinstance(etp, int) and etp >= 1 else 1


def model_params(cfg: Any) -> tuple:
    """(total, active per token) parameters of the whole model, exactly as built: embedding
    (padded vocab), the head unless tied, norms, attention, dense MLPs; an MoE layer's router,
    all its experts (active: top_k of them) and its shared expert."""
    m = cfg.model
    H = m.hidden_size
    V = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by)
    total = active = V * H * (1 if m.tie_embeddings else 2) + norm_params(m)
    for i in range(m.num_layers):
        layer_total, layer_active = block_params(m, i)
        total, active = total + layer_total, active + layer_active
    mtp_total, mtp_active = mtp_params(m)
    return total + mtp_total, active + mtp_active


def block_params(m: Any, i: int) -> tuple:
    """(total, active per token) parameters of the block at layer index i."""
    H = m.hidden_size
    common = attention_params(m) + 2 * norm_params(m)
    if not is_moe_layer(m, i):
        dense = common + mlp_mult(m) * H * m.ffn_hidden_size
        return dense, dense
    one = mlp_mult(m) * H * expert_ffn(m)
    base = common + moe_dense_unsplit(m) + shared_expert_params(m)
    return base + m.num_experts * one, base + m.moe_top_k * one


def mtp_depth_extra(m: Any) -> int:
    """What one MTP depth (models/mtp.py) holds beside its block: three norms (hidden, embedding,
    final) and eh_proj [H, 2H], replicated over tp; the embedding and head are the model's."""
    return 3 * norm_params(m) + 2 * m.hidden_size * m.hidden_size


def mtp_params(m: Any) -> tuple:
    """(total, active per token) parameters of the model.mtp_num_layers MTP depths: depth d's
    block sits at layer index num_layers + d (dense or MoE as a main layer there)."""
    total = active = 0
    for d in range(getattr(m, "mtp_num_layers", 0)):
        block_total, block_active = block_params(m, m.num_layers + d)
        total += mtp_depth_extra(m) + block_total
        active += mtp_depth_extra(m) + block_active
    return total, active


def mtp_stage_params(cfg: Any, lo: Layout, stage: int, expert_only: bool = False) -> int:
    """Parameters of the MTP depths on one rank of `stage` (they live on `mtp_stage`), and the
    copy of the embedding an untied model keeps there for them on the last stage of the loop
    layouts; as a chunk of their own (on stage 0 or a middle stage) they hold copies of the
    embedding and of an untied output layer (models/mtp_chunk.py)."""
    m = cfg.model
    D = getattr(m, "mtp_num_layers", 0)
    if D <= 0 or stage != mtp_stage(cfg, lo):
        return 0
    parts = [layer_params(cfg, lo, m.num_layers + d) for d in range(D)]
    if expert_only:
        return sum(e for _, e in parts)
    V = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by)
    if stage != head_stage(cfg, lo):  # the MTP chunk: the embedding copy, and the untied head's
        copy = V * m.hidden_size // lo.tp * (1 if m.tie_embeddings else 2)
    else:
        copy = V * m.hidden_size // lo.tp if stage != 0 and not m.tie_embeddings else 0
    return sum(d + e for d, e in parts) + D * mtp_depth_extra(m) + copy


def attention_params(m: Any, tp: int = 1) -> int:
    """Parameters of one attention on one of `tp` ranks: qkv [(N + 2G) D, H] (+ its bias with
    model.qkv_bias) and proj [H, N D] (4 H^2 without GQA), split over tp; the two RMSNorms of
    model.qk_norm (D each), replicated. MLA: `latent_attention_params`."""
    if m.attention == "mla":
        return latent_attention_params(m, tp)
    rows = qkv_rows(m)
    split = sum(rows) * m.hidden_size + rows[0] * m.hidden_size + (sum(rows) if m.qkv_bias else 0)
    return split // tp + (2 * head_dim_of(m) if m.qk_norm else 0)


def latent_attention_params(m: Any, tp: int = 1) -> int:
    """One MLA layer on one of `tp` ranks (models/mla.py): the down-projections q_a_proj [r, H]
    and kv_a_proj_with_mqa [c + p, H] and their RMSNorms (r, c) replicated; q_b_proj [N (n + p), r]
    (or q_proj [N (n + p), H] when q_lora_rank is 0), kv_b_proj [N (n + v), c] and proj [H, N v]
    split over tp."""
    r, c, p = m.q_lora_rank, m.kv_lora_rank, m.qk_rope_head_dim
    H, N, qk = m.hidden_size, m.num_attention_heads, m.qk_nope_head_dim + p
    replicated = (H * r + r if r else 0) + H * (c + p) + c
    split = (r if r else H) * N * qk + c * N * (m.qk_nope_head_dim + m.v_head_dim) + N * m.v_head_dim * H
    return replicated + split // tp


def latent_norm_params(m: Any) -> int:
    """MLA's two latent RMSNorms (q_lora_rank + kv_lora_rank weights; 0 for multi-head attention)."""
    return m.q_lora_rank + m.kv_lora_rank if m.attention == "mla" else 0


def shared_expert_params(m: Any, tp: int = 1) -> int:
    """The shared expert of one MoE layer (0 without one), split over tp like a dense MLP."""
    return mlp_mult(m) * m.hidden_size * shared_expert_ffn(m) // tp


def layer_params(cfg: Any, lo: Layout, i: int) -> tuple:
    """(dense, expert) parameters of layer i on one rank: attention and dense MLP split over
    tp; an MoE MLP holds the router (not split over tp), the shared expert (split over tp) and num_experts
    / ep experts, split over etp (experts are the `expert` part)."""
    m = cfg.model
    H, tp = m.hidden_size, lo.tp
    dense = attention_params(m, tp) + 2 * norm_params(m)
    if not is_moe_layer(m, i):
        return dense + mlp_mult(m) * H * m.ffn_hidden_size // tp, 0
    return (dense + moe_dense_unsplit(m) + shared_expert_params(m, tp),
            m.num_experts // lo.ep * mlp_mult(m) * H * expert_ffn(m) // etp_size(cfg))


def read_as_is_params(cfg: Any, lo: Layout, stage: int) -> int:
    """Parameters of one rank of `stage` that the forward reads without a cast to the compute
    dtype (precision.compute_cast_weights: all but the GEMM weights): the norms (MLA's latent
    norms too), the qkv bias,
    the routers, the embedding (and the last stage's tied copy) and the final norm."""
    m = cfg.model
    H, tp = m.hidden_size, lo.tp
    V = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by)
    total = 0
    for i in stage_layers(cfg, lo, stage):
        total += 2 * norm_params(m) + (2 * head_dim_of(m) if m.qk_norm else 0) + latent_norm_params(m)
        total += sum(qkv_rows(m)) // tp if m.qkv_bias else 0
        total += moe_dense_unsplit(m) if is_moe_layer(m, i) else 0
    first, last = stage == 0, stage == head_stage(cfg, lo)
    if first or (last and m.tie_embeddings):
        total += V * H // tp
    if last:
        total += norm_params(m)
    return total


def moe_dense_unsplit(m: Any) -> int:
    """The router of one MoE layer (replicated over TP)."""
    return m.hidden_size * m.num_experts


def stage_params(cfg: Any, lo: Layout, stage: int, expert_only: bool = False) -> int:
    """Parameters held by one rank of pipeline stage `stage` (all its vpp chunks); with
    `expert_only`, only its expert weights."""
    m = cfg.model
    H, tp = m.hidden_size, lo.tp
    V = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by)
    parts = [layer_params(cfg, lo, i) for i in stage_layers(cfg, lo, stage)]
    if expert_only:
        return sum(e for _, e in parts) + mtp_stage_params(cfg, lo, stage, expert_only=True)
    total = sum(d + e for d, e in parts)
    first, last = stage == 0, stage == head_stage(cfg, lo)
    if first or (last and m.tie_embeddings):
        total += V * H // tp  # the embedding (and, tied, the last stage's copy for the head; in
        # zbv's V the head is on stage 0 and shares it)
    if last:
        total += norm_params(m) + (0 if m.tie_embeddings else V * H // tp)
    return total + mtp_stage_params(cfg, lo, stage)

