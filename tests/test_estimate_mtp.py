"""The MTP depths (model.mtp_num_layers) in mpoverlap-check's activation estimate: what the chunk
holding them saves for backward, measured with `saved_tensors_hooks` (tests/saved_bytes.py,
parameters and the targets left out), against `chunk_activation_bytes` of that chunk, at pp 1
(the whole model) and pp 2 (the last stage's chunk, which takes hidden states and holds the
depths beside the head): a tied dense model and deepseek_v3_tiny (latent attention, MoE, untied
head), one and two depths, fp32 and bf16.

Tolerance 10%, the one-block test's (tests/test_estimate.py, test_saved_bytes_one_block_tp1):
the chunk is its blocks plus the depths, each depth a block plus terms counted exactly in fp32;
under bf16 a depth's block runs on the compute-dtype output of eh_proj and its norms take the
unfused path, which the estimate (counting fp32 residuals as in a main block) leaves within 5%.
And the stage peak the plan prints, against a real pp 2 run's peak RSS (1F1B, zbv).
"""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from saved_bytes import saved_activation_bytes  # noqa: E402

from mpoverlap.config import compose  # noqa: E402
from mpoverlap.overlap.estimate import Conventions  # noqa: E402
from mpoverlap.overlap.estimate.activations import chunk_activation_bytes  # noqa: E402
from mpoverlap.overlap.layout import build_layout  # noqa: E402

MODELS = {
    "gpt_tied_dense": ["model=gpt_tiny", "model.seq_length=64"],
    "deepseek_v3": ["model=deepseek_v3_tiny"],
}
B = 2


def _cfg(model, depths, pp, *extra):
    return compose([*MODELS[model], "model.num_layers=2", f"model.mtp_num_layers={depths}", f"parallel.pp={pp}",
                    f"train.micro_batch_size={B}", f"train.global_batch_size={4 * B}", *extra])


def _measure(cfg, pp, bf16):
    """Saved bytes of the chunk holding the head and the depths: the whole model at pp 1, the
    second layer's chunk (hidden states in, no embedding lookup of its own) at pp 2."""
    from mpoverlap.models.gpt import GPT
    from mpoverlap.models.mtp import mtp_targets

    m = cfg.model
    first = pp == 1
    torch.manual_seed(0)
    model = GPT(m, seed=1, layer_ids=None if first else [1], pre_process=first)
    S, D = m.seq_length, m.mtp_num_layers
    window = torch.randint(0, m.vocab_size, (B, S + 1), generator=torch.Generator().manual_seed(0))
    targets = mtp_targets(window, D)
    inputs = window[:, :S] if first else torch.randn(B, S, m.hidden_size, requires_grad=True)

    def forward():
        with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            logits = model(inputs, position_ids=None if first else torch.arange(S), fp32_logits=False,
                           mtp_targets=targets)
        return model.loss(logits, targets)

    return saved_activation_bytes(forward, model.parameters(), [targets, window])


# deepseek_v3_tiny in fp32 only: under bf16 its main blocks' estimate is itself 28% low (latent
# attention and the sigmoid-routed MoE keep fp32 copies the per-layer terms leave out), and a
# depth's block is such a block.
CASES = [(model, depths, pp, bf16) for model in MODELS for depths in (1, 2) for pp in (1, 2)
         for bf16 in (False, True) if not (bf16 and (depths == 2 or model == "deepseek_v3"))]


@pytest.mark.parametrize("model,depths,pp,bf16", CASES,
                         ids=[f"{m}-d{d}-pp{p}-{'bf16' if b else 'fp32'}" for m, d, p, b in CASES])
def test_mtp_chunk_saved_bytes(model, depths, pp, bf16):
    cfg = _cfg(model, depths, pp)
    lo = build_layout(cfg, pp)
    measured = _measure(cfg, pp, bf16)
    est = chunk_activation_bytes(cfg, lo, pp - 1, Conventions.for_dtype(2 if bf16 else 4), B)
    assert abs(measured - est) <= 0.10 * measured, (measured, est, est / measured)


OWN_CASES = [(model, depths, bf16) for model in MODELS for depths in (1, 2) for bf16 in (False, True)
             if not (bf16 and (depths == 2 or model == "deepseek_v3"))]


@pytest.mark.parametrize("model,depths,bf16", OWN_CASES,
                         ids=[f"{m}-d{d}-{'bf16' if b else 'fp32'}" for m, d, b in OWN_CASES])
def test_mtp_own_chunk_saved_bytes(model, depths, bf16):
    """parallel.mtp_stage=0 at pp 2 (1F1B, the loop_mtp layout): the MTP chunk on stage 0
    (models/mtp_chunk.py: h_0 received, the depths with their embedding and head copies)
    against `chunk_activation_bytes` of chunk pp*vpp, and the head's chunk keeps none of it."""
    from mpoverlap.models.mtp import mtp_targets
    from mpoverlap.models.mtp_chunk import MTPChunk

    cfg = _cfg(model, depths, 2, "parallel.mtp_stage=0", "parallel.pp_schedule=1f1b")
    m, lo = cfg.model, build_layout(cfg, 2)
    torch.manual_seed(0)
    chunk = MTPChunk(m, seed=1)
    S = m.seq_length
    window = torch.randint(0, m.vocab_size, (B, S + 1), generator=torch.Generator().manual_seed(0))
    targets = mtp_targets(window, depths)
    h = torch.randn(B, S, m.hidden_size, requires_grad=True)

    def forward():
        with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            return chunk(h, torch.arange(S), targets)

    measured = saved_activation_bytes(forward, chunk.parameters(), [targets, window])
    conv = Conventions.for_dtype(2 if bf16 else 4)
    est = chunk_activation_bytes(cfg, lo, lo.pp * lo.vpp, conv, B)
    assert abs(measured - est) <= 0.10 * measured, (measured, est, est / measured)
    without = _cfg(model, depths, 2, "parallel.pp_schedule=1f1b", "model.mtp_num_layers=0")
    assert chunk_activation_bytes(cfg, lo, 1, conv, B) == chunk_activation_bytes(without, lo, 1, conv, B)


@pytest.mark.parametrize("model", list(MODELS))
def test_mtp_wgrad_kept_bytes(model):
    """Zero bubble: what the queued weight-gradient closures of the whole model with two depths
    keep after B (the distinct storages they reach, parameters left out), against the layers',
    embedding's and head's terms plus `mtp_wgrad_items`, within the 5% the whole-model test
    without depths holds (tests/test_estimate.py)."""
    from saved_bytes import queued_bytes

    from mpoverlap.models.gpt import GPT
    from mpoverlap.models.mtp import mtp_targets
    from mpoverlap.overlap.estimate.mtp import mtp_wgrad_items
    from mpoverlap.overlap.estimate.wgrad_kept import (embedding_wgrad_kept_bytes, head_wgrad_kept_bytes,
                                                        layer_wgrad_kept_bytes)
    from mpoverlap.wgrad import WeightGradDeferral, WeightGradQueue, attach_deferral

    cfg = _cfg(model, 2, 1)
    m = cfg.model
    gpt, deferral = GPT(m, seed=1), WeightGradDeferral()
    attach_deferral(gpt, deferral)
    window = torch.randint(0, m.vocab_size, (B, m.seq_length + 1), generator=torch.Generator().manual_seed(0))
    targets = mtp_targets(window, 2)
    loss = gpt.loss(gpt(window[:, :m.seq_length], fp32_logits=False, mtp_targets=targets), targets)
    with deferral.deferring(WeightGradQueue()) as queue:
        loss.backward()
    measured = queued_bytes(queue, gpt.parameters())
    lo, conv = build_layout(cfg, 1), Conventions.for_dtype(4)
    est = (sum(layer_wgrad_kept_bytes(cfg, lo, i, conv, B) for i in range(m.num_layers))
           + embedding_wgrad_kept_bytes(cfg, lo, conv, B) + head_wgrad_kept_bytes(cfg, lo, conv, B)
           + sum(kept for _, kept, _ in mtp_wgrad_items(cfg, lo, 0, conv, B, "none")))
    assert abs(measured - est) <= 0.05 * measured, (measured, est, est / measured)


@pytest.mark.slow
@pytest.mark.peaks  # about two minutes: make test-peaks (the saved-bytes checks above run in make test)
def test_pp2_peak_activations_with_mtp_within_25pct(tmp_path, monkeypatch):
    """The stage peak mpoverlap-check prints, with two depths, against a real pp 2 run measured
    as bench/memory.py measures it (peak RSS over a near-empty baseline, the estimate's weights
    and optimizer state taken out), within the 25% tests/test_estimate.py holds the pp 2 peaks
    to: 1F1B with the depths on the last stage, 1F1B with them as a chunk of their own on stage
    0 (parallel.mtp_stage=0: one microbatch's depths at a time, F and B adjacent), and zbv's V
    with them on stage 0 (their W closures kept until W). On the pp2_vpp2 layout's
    activation-heavy model."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/ is not installed
    from bench import memory

    base = [o for o in memory.LAYOUTS["pp2_vpp2"] if not o.startswith("parallel.vpp")] + ["model.mtp_num_layers=2"]
    layouts = {"pp2_1f1b_mtp": (base, 1),
               # three depths: counted once per microbatch in flight (two on stage 0) they would
               # be 0.70x, two depths leave that at the edge of the 25%
               "pp2_1f1b_mtp0": (base + ["parallel.pp_schedule=1f1b", "parallel.mtp_stage=0",
                                         "model.mtp_num_layers=3"], 0),
               "pp2_zbv_mtp": (base + ["parallel.vpp=2", "parallel.pp_schedule=zbv", "parallel.mtp_stage=0"], 0)}
    for name, (overrides, _) in layouts.items():
        monkeypatch.setitem(memory.LAYOUTS, name, overrides)
    res = memory.run(list(layouts), 2, tmp_path)
    bad = []
    for name, (_, depths_stage) in layouts.items():
        row = memory.activation_rows(res["layouts"][name])[depths_stage]
        print(f"\n  {name} stage {row['stage']} activations: measured {row['measured'] / 2**20:.1f} MiB, "
              f"estimate {row['estimate'] / 2**20:.1f} MiB ({row['ratio']:.2f}x)")
        if not (row["stage"] == depths_stage and 0.75 <= row["ratio"] <= 1.25):
            bad.append((name, row))
    assert not bad, bad
