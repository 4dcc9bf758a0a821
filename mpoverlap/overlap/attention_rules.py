"""Rules for the attention keys that starting points like Llama 3.1/3.2 and Qwen need:
model.rope_scaling (Llama 3's frequency scaling) and model.head_dim (a head width other than
hidden_size / heads)."""
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
