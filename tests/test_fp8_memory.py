"""The memory estimate under train.precision=fp8 held against what the code keeps: the step's
weight casts (estimate/transients.py `weight_casts`: the bf16 copies step_cast_cache holds; the
FP8 grouped experts quantize their fp32 stacks at each call and hold none) and the bytes one
block saves for backward (the FP8 GEMMs save their bf16 inputs, as the bf16 run's). Under
sequence parallelism (tp 2 and 4, tensorwise): the column-parallel linear keeps its local e4m3
chunk and re-gathers it in e4m3 under the dgrad GEMM (its weight gradient bit for bit the
layout without SP's, the backward's tp bytes, the order of events), and the saved and
zero-bubble-kept bytes that follow against the estimates."""
import importlib
import os
import sys

import pytest
import torch

pytest.importorskip("torchao")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from saved_bytes import queued_bytes, saved_activation_bytes  # noqa: E402

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


SP_SHAPE = ["model.hidden_size=64", "model.num_attention_heads=4", "model.ffn_hidden_size=128",
            "model.seq_length=64", "train.micro_batch_size=2"]
SP_FAMILIES = {
    "llama_swiglu": ["model=llama_tiny"],
    "gpt_gelu": ["model=gpt_tiny"],
    "moe_shared": ["model=moe_tiny", "model.moe_ffn_hidden_size=32", "model.shared_expert=true"],
    "moe": ["model=moe_tiny", "model.moe_ffn_hidden_size=32"],
}


def _sp_cfg(family, tp=2):
    return compose([*SP_FAMILIES[family][:1], *SP_SHAPE, *SP_FAMILIES[family][1:], "train.precision=fp8",
                    f"parallel.tp={tp}", "parallel.sequence_parallel=true", "overlap.tp=false"])


def _column_grads(rank, state, sp, overlap=False):
    """A column-parallel FP8 linear at tp 2 or 4 through ColumnParallelLinearFn (the plain path:
    collective matmul bypassed, so overlap=True runs its overlapped backward), forward and
    backward: its weight gradient, the backward's tp bytes, the bytes it saved for backward and
    the backward's trace (comm.mark events)."""
    import dataclasses

    from mpoverlap.comm.ledger import CommLedger
    from mpoverlap.config import ModelConfig
    from mpoverlap.precision import autocast_context
    from mpoverlap.precision.fp8_select import fp8_gemms
    from mpoverlap.tensor_parallel import ColumnParallelLinear, tp_kwargs
    from mpoverlap.tensor_parallel.linear_functions import ColumnParallelLinearFn

    cfg = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=2, ffn_hidden_size=64, seq_length=32,
                      vocab_size=64, make_vocab_size_divisible_by=16)
    x = torch.randn(2, 32, 32, generator=torch.Generator().manual_seed(3)) * 3
    ledger, trace = CommLedger(), []
    col = ColumnParallelLinear(32, 64, name="layers.0.mlp.gate_up", cfg=cfg, seed=5,
                               **tp_kwargs(state, sequence_parallel=sp, overlap=False, ledger=ledger))
    col.fp8_recipe = "tensorwise"
    comm = dataclasses.replace(col.comm, overlap=overlap, trace=trace)
    s, o = 32 // comm.size, 64 // comm.size
    g = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(4))[..., rank * o:(rank + 1) * o]
    xi = (x[:, rank * s:(rank + 1) * s] if sp else x).clone().requires_grad_()

    def forward():
        with autocast_context("fp8", torch.device("cpu")):
            return ColumnParallelLinearFn.apply(xi, col.weight, col.bias, comm, fp8_gemms(col))

    saved = saved_activation_bytes(forward, col.parameters())
    y = forward()
    ledger.reset()
    trace.clear()
    y.backward(g.to(y.dtype))
    return col.weight.grad.clone(), ledger.reset().get("tp", {}).get("bytes", 0), saved, list(trace)


def _sp_worker(rank, world, families=tuple(SP_FAMILIES), column=True, kept=True):
    from mpoverlap.models.gpt import Block, rope_cos_sin
    from mpoverlap.parallel import ParallelState, RankGrid
    from mpoverlap.precision.fp8_select import mark_fp8_gemms
    from mpoverlap.tensor_parallel import tp_kwargs

    state = ParallelState.create(RankGrid(tp=world), torch.device("cpu"))
    out = {}
    if column:
        w_sp, bytes_sp, saved_sp, trace_off = _column_grads(rank, state, True)
        w_full = _column_grads(rank, state, False)[0]
        w_ov, bytes_ov, _, trace_on = _column_grads(rank, state, True, overlap=True)
        out = {"wgrad_equal": torch.equal(w_sp, w_full), "wgrad_overlap_equal": torch.equal(w_ov, w_full),
               "bwd_tp_bytes": bytes_sp, "bwd_tp_bytes_overlap": bytes_ov, "column_saved": saved_sp,
               "trace": {False: trace_off, True: trace_on}}
    for family in families:
        for fp8 in (True, False):
            m = _sp_cfg(family, tp=world).model
            torch.manual_seed(0)
            block = Block(m, "layers.0", 1234, tp=tp_kwargs(state, sequence_parallel=True, overlap=False),
                          layer_index=0)
            if fp8:
                assert mark_fp8_gemms(block, "tensorwise")
            S, H = m.seq_length, m.hidden_size
            x = torch.randn(2, S // world, H, generator=torch.Generator().manual_seed(rank), requires_grad=True)
            cos, sin = rope_cos_sin(torch.arange(S), H // m.num_attention_heads, m.rope_base)

            def forward():
                with torch.autocast("cpu", torch.bfloat16):
                    return block(x, cos, sin)

            out[(family, fp8)] = saved_activation_bytes(forward, block.parameters(), [cos, sin])
            if fp8 and kept:
                out[("kept", family)] = _kept(block, forward)
    return out


def _kept(block, forward):
    """Zero bubble: the bytes the block's queued W closures keep after its B (saved_bytes'
    queued_bytes: the distinct storages they reach, parameters left out)."""
    from mpoverlap.wgrad import WeightGradDeferral, WeightGradQueue, attach_deferral

    deferral = WeightGradDeferral()
    attach_deferral(block, deferral)
    y = forward()
    with deferral.deferring(WeightGradQueue()) as queue:
        y.backward(torch.randn_like(y))
    return queued_bytes(queue, block.parameters())


@pytest.fixture(scope="module")
def sp_runs():
    from dist_harness import run_distributed

    return run_distributed(_sp_worker, 2, timeout_s=300)


def _check_column(rep, tp):
    """The column-parallel FP8 linear with SP at `tp` (B 2, S 32, H 32): its weight gradient bit
    for bit the layout without SP's (x whole, cast by the GEMM), overlap on and off; what it
    keeps for backward this rank's e4m3 chunk (B S H / tp x 1) and its 4-byte scale; the
    backward's tp bytes the e4m3 re-gather (B S H x 1) and the input gradient's bf16
    reduce-scatter (B S H x 2)."""
    B, S, H = 2, 32, 32
    assert rep["wgrad_equal"] and rep["wgrad_overlap_equal"], rep
    assert rep["column_saved"] == B * S * H // tp + 4, (tp, rep["column_saved"])
    assert rep["bwd_tp_bytes"] == rep["bwd_tp_bytes_overlap"] == B * S * H * (1 + 2), (tp, rep["bwd_tp_bytes"])


def test_sp_fp8_weight_gradient_on_the_e4m3_regather(sp_runs):
    """tp 2, SP, tensorwise: the weight gradient on backward's e4m3 re-gather of the kept chunk
    (the forward's cast of the same x, the same scale): see _check_column."""
    for rep in sp_runs:
        _check_column(rep, 2)


def test_sp_fp8_regather_runs_under_the_dgrad_gemm(sp_runs):
    """The e4m3 re-gather is issued before the dgrad GEMM and waited after it with overlap (the
    input gradient's reduce-scatter under the wgrad GEMM), each waited at once without: the
    bf16 re-gather's order (test_tensor_parallel's test_backward_collectives_hidden_under_gemms)."""
    from test_tensor_parallel import _transfers

    for rep in sp_runs:
        for overlap, trace in rep["trace"].items():
            assert {e[0] for e in trace} == {"column.bwd"}, trace
            steps = [step for _, step, event, _ in trace if event == "issue"]
            assert steps == [0, 1], (overlap, trace)  # the re-gather, then the reduce-scatter
            for between in _transfers(trace, "column.bwd"):
                assert between == (["gemm_start", "gemm_end"] if overlap else []), (overlap, between)


@pytest.mark.parametrize("family", list(SP_FAMILIES))
def test_sp_fp8_block_saved_bytes_against_the_estimate(sp_runs, family):
    """One block at tp 2 with SP: the column GEMMs keep their local e4m3 inputs ((S/2) H bytes,
    where the bf16 chunk took 2 (S/2) H), and a shared expert's beside the router's bf16 chunk.
    The fp8 block against the bf16 block, measured, differs by the estimate's fp8 term
    (fp8_gathered_input_bytes) and each column GEMM's 4-byte scale, exactly; the fp8 block
    against the whole estimate within test_estimate's one-block bound (10%)."""
    from mpoverlap.overlap.estimate.activations import fp8_gathered_input_bytes

    cfg = _sp_cfg(family)
    lo = build_layout(cfg, 2)
    est = layer_activation_bytes(cfg, lo, 0, Conventions.for_dtype(2), 2)
    extra = fp8_gathered_input_bytes(cfg, lo, 0, 2, 2 * 32, 2 * 64)
    columns = 1 if family == "moe" else 2  # qkv, and the dense MLP's or shared expert's gate_up
    for rep in sp_runs:
        fp8, bf16 = rep[(family, True)], rep[(family, False)]
        print(f"{family}: fp8 {fp8}, bf16 {bf16}, estimate {est} (fp8 term {extra})")
        assert fp8 - bf16 == extra + 4 * columns, (family, fp8, bf16, extra)
        assert abs(fp8 - est) <= 0.10 * fp8, (family, fp8, est)


@pytest.mark.parametrize("family", list(SP_FAMILIES))
def test_sp_fp8_deferred_weight_grads_keep_the_gathered_copy(sp_runs, family):
    """Zero bubble, tp 2, SP, fp8: a column GEMM's queued W keeps B's e4m3 re-gather of its
    input (1 byte an element) rather than a bf16 re-gather (2): the closures' bytes against
    the estimate within test_estimate's bound for them (5%)."""
    from mpoverlap.overlap.estimate.wgrad_kept import layer_wgrad_kept_bytes

    cfg = _sp_cfg(family)
    est = layer_wgrad_kept_bytes(cfg, build_layout(cfg, 2), 0, Conventions.for_dtype(2), 2)
    for rep in sp_runs:
        got = rep[("kept", family)]
        print(f"{family}: kept {got}, estimate {est}")
        assert abs(got - est) <= 0.05 * got, (family, got, est)


def test_sp_fp8_block_saved_bytes_at_tp4():
    """tp 4: the kept e4m3 chunk (S H / 4) is half the bf16 chunk it replaces (2 (S/4) H): the
    fp8 block keeps that much less than the bf16 block, measured, exactly the estimate's fp8
    term (plus the 4-byte scales); and the column linear's kept bytes and backward tp bytes
    (_check_column)."""
    from dist_harness import run_distributed

    from mpoverlap.overlap.estimate.activations import fp8_gathered_input_bytes

    families = ("gpt_gelu", "moe_shared")
    per_rank = run_distributed(_sp_worker, 4, families, True, False, timeout_s=300)
    for rep in per_rank:
        _check_column(rep, 4)
    for family in families:
        cfg = _sp_cfg(family, tp=4)
        extra = fp8_gathered_input_bytes(cfg, build_layout(cfg, 4), 0, 2, 2 * 64 // 4, 2 * 64)
        assert extra == -2 * 64 // 4 * 64 * 2 < 0  # (S/4) H (1 - 2) a column GEMM, two of them
        for rep in per_rank:
            fp8, bf16 = rep[(family, True)], rep[(family, False)]
            assert fp8 - bf16 == extra + 4 * 2, (family, fp8, bf16, extra)
