"""The memory estimate under train.precision=fp8 held against what the code keeps: the step's
weight casts (estimate/transients.py `weight_casts`: the bf16 copies step_cast_cache holds; the
FP8 grouped experts quantize their fp32 stacks at each call and hold none) and the bytes one
block saves for backward (the FP8 GEMMs save their bf16 inputs, as the bf16 run's)."""
import importlib
import os
import sys

import pytest
import torch

pytest.importorskip("torchao")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from saved_bytes import saved_activation_bytes  # noqa: E402

from mpoverlap.config import compose  # noqa: E402
from mpoverlap.overlap.estimate import Conventions, estimate, layer_activation_bytes  # noqa: E402
from mpoverlap.overlap.layout import build_layout  # noqa: E402

_step_cast = importlib.import_module("mpoverlap.precision.step_cast")

TINY = ["model.num_layers=2", "model.seq_length=32", "train.micro_batch_size=2", "train.global_batch_size=2"]
MODELS = {
    "moe_tiny": ["model=moe_tiny", "model.hidden_size=64", "model.num_attention_heads=4", "model.ffn_hidden_size=64",
                 "model.moe_ffn_hidden_size=32"],  # tied; multiples of 16 for the FP8 grouped GEMMs
    "deepseek_v3_tiny": ["model=deepseek_v3_tiny"],  # MLA, a dense first layer, a shared expert, untied
    "llama_tiny": ["model=llama_tiny", "model.hidden_size=64", "model.num_attention_heads=4"],  # dense, untied
}


def _held_casts(overrides):
    """Bytes of the weight casts step_cast_cache holds at the end of one microbatch's forward
    and backward (distinct storages), and the estimate's `weight_casts`."""
    from mpoverlap.models.gpt import GPT
    from mpoverlap.precision import autocast_context, step_cast_cache
    from mpoverlap.precision.fp8_select import mark_fp8_gemms

    cfg = compose([*overrides, *TINY])
    model = GPT(cfg.model, seed=1)
    if cfg.train.precision == "fp8":
        mark_fp8_gemms(model, "tensorwise")
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    cpu = torch.device("cpu")
    with step_cast_cache(str(cfg.train.precision), cpu, False):
        with autocast_context(str(cfg.train.precision), cpu):
            logits = model(tokens)
        model.loss(logits, tokens).backward()
        held = {c.untyped_storage().data_ptr(): c.untyped_storage().nbytes()
                for _, c in _step_cast._STEP_CASTS.values()}
    return sum(held.values()), estimate(cfg, 1).memory_bytes["weight_casts"]


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("precision", ["fp8", "bf16"])
def test_weight_casts_estimate_equals_the_casts_a_step_holds(model, precision):
    """Exact: the estimate counts the same weights the step casts (2 bytes each). Under fp8 the
    MoE models' grouped experts hold no bf16 copy (the bf16 run holds one: the difference)."""
    measured, est = _held_casts([*MODELS[model], f"train.precision={precision}"])
    assert measured == est > 0, (model, precision, measured, est)


def test_fp8_experts_hold_no_cast_the_bf16_run_does():
    fp8, _ = _held_casts([*MODELS["moe_tiny"], "train.precision=fp8"])
    bf16, _ = _held_casts([*MODELS["moe_tiny"], "train.precision=bf16"])
    experts = 2 * 8 * (2 * 64 * 32 + 64 * 32)  # 2 layers x 8 experts: w_in [2F, H], w_out [H, F]
    assert bf16 - fp8 == 2 * experts, (bf16, fp8)


def _saved(overrides, fp8, layer=0):
    from mpoverlap.models.gpt import Block, rope_cos_sin
    from mpoverlap.precision.fp8_select import mark_fp8_gemms

    cfg = compose([*overrides, "model.seq_length=64", "train.micro_batch_size=2", "train.precision=fp8"])
    m = cfg.model
    torch.manual_seed(0)
    block = Block(m, f"layers.{layer}", 1234, tp=None, layer_index=layer)
    if fp8:
        assert mark_fp8_gemms(block, "tensorwise")
    x = torch.randn(2, m.seq_length, m.hidden_size, requires_grad=True)
    cos, sin = rope_cos_sin(torch.arange(m.seq_length), m.hidden_size // m.num_attention_heads, m.rope_base)

    def forward():
        with torch.autocast("cpu", torch.bfloat16):
            return block(x, cos, sin)

    measured = saved_activation_bytes(forward, block.parameters(), [cos, sin])
    return measured, layer_activation_bytes(cfg, build_layout(cfg, 1), layer, Conventions.for_dtype(2), 2)


@pytest.mark.parametrize("model", ["moe_tiny", "llama_tiny"])
def test_fp8_block_saves_what_the_bf16_block_saves_and_the_estimate_counts(model):
    """The FP8 GEMMs (dense and grouped) save their bf16 inputs and outputs, no e4m3 copy: the
    same bytes as the bf16 block, within test_estimate's one-block bound (10%) of the estimate."""
    fp8, est = _saved(MODELS[model], True)
    bf16, _ = _saved(MODELS[model], False)
    assert fp8 == bf16, (fp8, bf16)
    assert abs(fp8 - est) <= 0.10 * fp8, (fp8, est)
