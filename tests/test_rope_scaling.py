"""model.rope_scaling (Llama 3.1/3.2's llama3 type): the frequencies equal transformers' own
`_compute_llama3_parameters` bit for bit; the presets carry the published values and the plan
shows them; other rope types are refused by name with a reason and a fix."""
import pytest
import torch

from mpoverlap.config import compose
from mpoverlap.models.rope import inv_frequencies, rope_scaling_of


@pytest.mark.parametrize("preset,factor", [("llama3_1b", 32.0), ("llama3_8b", 8.0)])
def test_presets_carry_the_published_scaling_and_match_transformers(preset, factor, capsys):
    from mpoverlap.check import main

    m = compose([f"model={preset}"]).model
    rs = rope_scaling_of(m)
    assert (rs.rope_type, rs.factor, rs.low_freq_factor, rs.high_freq_factor, rs.original_max_position_embeddings) \
        == ("llama3", factor, 1.0, 4.0, 8192)
    ours = inv_frequencies(m.hidden_size // m.num_attention_heads, m.rope_base, rs, "cpu")
    plain = inv_frequencies(m.hidden_size // m.num_attention_heads, m.rope_base, None, "cpu")
    assert (ours < plain).any() and (ours == plain).any()  # the low frequencies are scaled, the high kept
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = transformers.LlamaConfig(hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
                                  max_position_embeddings=131072,
                                  rope_parameters={"rope_type": "llama3", "rope_theta": m.rope_base, "factor": factor,
                                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                   "original_max_position_embeddings": 8192})
    theirs, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    assert attention_factor == 1.0 and torch.equal(ours, theirs)
    assert main([f"model={preset}"]) == 0
    assert (f"scaled llama3 (factor {factor:g}, low_freq_factor 1, high_freq_factor 4, "
            "original_max_position_embeddings 8192)") in capsys.readouterr().out


def test_other_rope_types_are_refused_by_name(capsys):
    from mpoverlap.check import main

    assert main(["model.rope_scaling.rope_type=yarn"]) == 2
    out = capsys.readouterr()
    text = out.out + out.err
    assert "[model.rope_scaling] model.rope_scaling.rope_type=yarn" in text and "attention logits" in text
    assert "model.rope_scaling.factor=8.0" in text and "fix: model.rope_scaling.rope_type=null" in text
    assert main(["model.rope_scaling.rope_type=llama3", "model.rope_scaling.high_freq_factor=0.5"]) == 2
    assert "model.rope_scaling.high_freq_factor=0.5" in capsys.readouterr().err
