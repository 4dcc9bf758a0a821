"""Rules for the attention keys that starting points like Llama 3.1/3.2 and Qwen need:
model.rope_scaling (Llama 3's frequency scaling), model.head_dim (a head width other than
hidden_size / heads) and model.attention (multi-head or DeepSeek's latent attention)."""
from __future__ import annotations

from mpoverlap.models.rope import ROPE_TYPES, rope_scaling_of
from mpoverlap.overlap.layout import Layout
from mpoverlap.overlap.rules import Problem, rule

# Why each other transformers rope type is refused: the model would silently compute other
# angles than the checkpoint was trained with, or depend on the sequence length at run time.
_REFUSED = {
    "default": "it means no scaling: set model.rope_scaling.rope_type=null",
    "linear": "position interpolation divides every frequency alike (not implemented)",
    "dynamic": "dynamic NTK changes the frequencies with the length of each batch at run time, so one "
               "step's angles depend on its data",
    "yarn": "YaRN also scales the attention logits (attention_factor) (not implemented)",
    "longrope": "LongRoPE keeps per-channel factor lists for short and long contexts (not implemented)",
}
# Llama 3.1's published values (Llama 3.2 1B/3B: factor 32).
LLAMA3_31 = ["model.rope_scaling.rope_type=llama3", "model.rope_scaling.factor=8.0",
             "model.rope_scaling.low_freq_factor=1.0", "model.rope_scaling.high_freq_factor=4.0",
             "model.rope_scaling.original_max_position_embeddings=8192"]


@rule("model.rope_scaling", "general", ("model.rope_scaling",),
      "model.rope_scaling.rope_type is null or Llama 3's scaling (rope_type llama3, factor > 0, "
      "high_freq_factor > low_freq_factor > 0, original_max_position_embeddings >= 1)")
def _rope_scaling(lo: Layout):
    rs = rope_scaling_of(lo.cfg.model)
    if rs is None:
        return
    if rs.rope_type not in ROPE_TYPES:
        why = _REFUSED.get(rs.rope_type, "not a rope type this model computes")
        yield Problem("model.rope_scaling", {"model.rope_scaling.rope_type": rs.rope_type},
                      f"only {', '.join(ROPE_TYPES)} scaling is computed exactly as transformers does; "
                      f"{rs.rope_type!r}: {why}. For Llama 3.1/3.2 checkpoints: {' '.join(LLAMA3_31)}",
                      ["model.rope_scaling.rope_type=null"])
        return
    bad = {}
    if not rs.factor > 0:
        bad["model.rope_scaling.factor"] = rs.factor
    if not (rs.high_freq_factor > rs.low_freq_factor > 0):
        bad.update({"model.rope_scaling.low_freq_factor": rs.low_freq_factor,
                    "model.rope_scaling.high_freq_factor": rs.high_freq_factor})
    if rs.original_max_position_embeddings < 1:
        bad["model.rope_scaling.original_max_position_embeddings"] = rs.original_max_position_embeddings
    if bad:
        yield Problem("model.rope_scaling", bad,
                      "llama3 scaling divides low frequencies by factor (> 0) and interpolates between "
                      "the wavelengths original_max_position_embeddings / low_freq_factor and / "
                      "high_freq_factor (so high_freq_factor > low_freq_factor > 0)", LLAMA3_31)


@rule("model.head_dim", "general", ("model.head_dim",),
      "model.head_dim is null (= hidden_size / heads) or a positive even width")
def _head_dim(lo: Layout):
    d = lo.cfg.model.head_dim
    if d is not None and (d < 2 or d % 2):
        yield Problem("model.head_dim", {"model.head_dim": d},
                      "rotary embeddings rotate pairs of channels (x[i], x[i + D/2]): the head width must "
                      "be positive and even", ["model.head_dim=null"])


ATTENTION_KINDS = ("mha", "mla")
# Keys of multi-head attention that latent attention has no place for: set, they would be ignored.
_MHA_ONLY = {"num_query_groups": None, "head_dim": None, "qk_norm": False, "qkv_bias": False}


@rule("model.attention", "general", ("model.attention", "model.q_lora_rank", "model.kv_lora_rank",
                                     "model.qk_nope_head_dim", "model.qk_rope_head_dim", "model.v_head_dim"),
      "model.attention is mha or mla; mla's latent and head widths are positive (qk_rope_head_dim even, "
      "q_lora_rank 0 = no query latent) and the multi-head-only keys are left unset")
def _attention(lo: Layout):
    m = lo.cfg.model
    if m.attention not in ATTENTION_KINDS:
        yield Problem("model.attention", {"model.attention": m.attention},
                      f"must be one of {'|'.join(ATTENTION_KINDS)}", ["model.attention=mha"])
        return
    if m.attention != "mla":
        return
    widths = {"model.kv_lora_rank": m.kv_lora_rank, "model.qk_nope_head_dim": m.qk_nope_head_dim,
              "model.v_head_dim": m.v_head_dim}
    for key, value in widths.items():
        if value < 1:
            yield Problem("model.attention", {"model.attention": "mla", key: value},
                          "latent attention needs a positive width here", [f"{key}={128 if 'dim' in key else 512}"])
    if m.q_lora_rank < 0:
        yield Problem("model.attention", {"model.attention": "mla", "model.q_lora_rank": m.q_lora_rank},
                      "the query latent's width is 0 (no query compression) or positive", ["model.q_lora_rank=0"])
    if m.qk_rope_head_dim < 2 or m.qk_rope_head_dim % 2:
        yield Problem("model.attention", {"model.attention": "mla", "model.qk_rope_head_dim": m.qk_rope_head_dim},
                      "rotary embeddings rotate pairs of channels: the RoPE part of each query/key head "
                      "must be positive and even", ["model.qk_rope_head_dim=64"])
    for key, unset in _MHA_ONLY.items():
        if getattr(m, key) != unset:
            yield Problem("model.attention", {"model.attention": "mla", f"model.{key}": getattr(m, key)},
                          f"model.{key} shapes multi-head attention's fused qkv; latent attention's heads are "
                          "set by model.qk_nope_head_dim, model.qk_rope_head_dim and model.v_head_dim, so it "
                          "would be ignored", [f"model.{key}={'null' if unset is None else 'false'}"])
