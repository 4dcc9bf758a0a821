"""mpoverlap-check's estimates held against the code: the bytes autograd saves for one block
(tp 1 and tp 2, with and without SP, fp32 and bf16), Korthikanti et al. 2022 Table 2, the
schedule's in-flight microbatches, the two communication views, and FLOPs."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dist_harness import run_distributed  # noqa: E402
from saved_bytes import queued_bytes, saved_activation_bytes  # noqa: E402

from mpoverlap.config import compose  # noqa: E402
from mpoverlap.overlap.estimate import Conventions, estimate, layer_activation_bytes  # noqa: E402
from mpoverlap.overlap.layout import build_layout  # noqa: E402

SHAPE = ["model.hidden_size=64", "model.num_attention_heads=4", "model.ffn_hidden_size=176", "model.seq_length=64"]
FAMILIES = {
    "gpt_gelu": ["model.activation=gelu", "model.norm=layernorm"],
    "llama_swiglu": ["model.activation=swiglu", "model.norm=rmsnorm"],
    "moe_top2": ["model=moe_tiny", "model.moe_ffn_hidden_size=88", "model.moe_top_k=2"],
    "moe_top4": ["model=moe_tiny", "model.moe_ffn_hidden_size=88", "model.moe_top_k=4"],
    "llama_gqa": ["model=llama_tiny", "model.num_query_groups=2"],  # 4 heads over 2 K/V groups
}
B = 2


def _overrides(family, tp=1, sp=False):
    return FAMILIES[family][:1] + SHAPE + FAMILIES[family][1:] + [
        f"train.micro_batch_size={B}", f"parallel.tp={tp}", f"parallel.sequence_parallel={str(sp).lower()}"]


def _estimate(family, tp, sp, bf16):
    cfg = compose(_overrides(family, tp, sp))
    return layer_activation_bytes(cfg, build_layout(cfg, tp), 0, Conventions.for_dtype(2 if bf16 else 4), B)


def _measure(family, bf16, tp=None, sp=False, rank=0):
    """Saved bytes of layer 0's block on this rank (tp: the TP context, None on one process)."""
    from mpoverlap.models.gpt import Block, rope_cos_sin

    m = compose(_overrides(family)).model
    torch.manual_seed(0)
    block = Block(m, "layers.0", 1234, tp=tp, layer_index=0)
    S, H = m.seq_length, m.hidden_size
    x = torch.randn(B, S, H)
    if sp:  # the residual stream holds this rank's S/tp positions
        s = S // tp["tp_size"]
        x = x[:, rank * s:(rank + 1) * s].clone()
    x.requires_grad_()
    cos, sin = rope_cos_sin(torch.arange(S), H // m.num_attention_heads, m.rope_base)

    def forward():
        with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            return block(x, cos, sin)

    return saved_activation_bytes(forward, block.parameters(), [cos, sin])


def _measure_kept(family, bf16, tp=None, sp=False, rank=0):
    """Zero bubble: the bytes layer 0's queued weight-gradient closures keep after its B (the
    distinct storages they reach, parameters left out), with a deferral attached."""
    from mpoverlap.models.gpt import Block, rope_cos_sin
    from mpoverlap.wgrad import WeightGradDeferral, WeightGradQueue, attach_deferral

    m = compose(_overrides(family)).model
    torch.manual_seed(0)
    block = Block(m, "layers.0", 1234, tp=tp, layer_index=0)
    deferral = WeightGradDeferral()
    attach_deferral(block, deferral)
    S, H = m.seq_length, m.hidden_size
    x = torch.randn(B, S // (tp["tp_size"] if sp else 1), H, requires_grad=True)
    cos, sin = rope_cos_sin(torch.arange(S), H // m.num_attention_heads, m.rope_base)
    with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
        y = block(x, cos, sin)
    with deferral.deferring(WeightGradQueue()) as queue:
        y.backward(torch.randn_like(y))  # the received gradient (a storage of its own)
    return queued_bytes(queue, block.parameters())


def _estimate_kept(family, tp, sp, bf16):
    from mpoverlap.overlap.estimate.wgrad_kept import layer_wgrad_kept_bytes

    cfg = compose(_overrides(family, tp, sp))
    return layer_wgrad_kept_bytes(cfg, build_layout(cfg, tp), 0, Conventions.for_dtype(2 if bf16 else 4), B)


CASES = [(f, bf) for f in FAMILIES for bf in (False, True)]


@pytest.mark.parametrize("family,bf16", CASES, ids=[f"{f}-{'bf16' if b else 'fp32'}" for f, b in CASES])
def test_saved_bytes_one_block_tp1(family, bf16):
    measured, est = _measure(family, bf16), _estimate(family, 1, False, bf16)
    assert abs(measured - est) <= 0.10 * measured, (family, bf16, measured, est)


@pytest.mark.parametrize("family,bf16", CASES, ids=[f"{f}-{'bf16' if b else 'fp32'}" for f, b in CASES])
def test_wgrad_kept_bytes_one_block_tp1(family, bf16):
    """What a zero-bubble W keeps alive (linear inputs, output gradients) equals the estimate."""
    measured, est = _measure_kept(family, bf16), _estimate_kept(family, 1, False, bf16)
    assert abs(measured - est) <= 0.05 * measured, (family, bf16, measured, est)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("bf16", [False, True])
def test_wgrad_kept_bytes_whole_model_with_embedding_and_head(tied, bf16):
    """The same for a whole 2-layer model: its layers, the embedding's output gradient and ids,
    the head's input and the logits' gradient."""
    from mpoverlap.models.gpt import GPT
    from mpoverlap.overlap.estimate.wgrad_kept import (embedding_wgrad_kept_bytes, head_wgrad_kept_bytes,
                                                        layer_wgrad_kept_bytes)
    from mpoverlap.wgrad import WeightGradDeferral, WeightGradQueue, attach_deferral

    cfg = compose(["model.num_layers=2", "model.vocab_size=300", f"model.tie_embeddings={str(tied).lower()}",
                   *SHAPE[:3], "model.seq_length=32", f"train.micro_batch_size={B}"])
    model, deferral = GPT(cfg.model, seed=1), WeightGradDeferral()
    attach_deferral(model, deferral)
    tokens = torch.randint(0, 300, (B, 32), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
        loss = model.loss(model(tokens), tokens)
    with deferral.deferring(WeightGradQueue()) as queue:
        loss.backward()
    measured = queued_bytes(queue, model.parameters())
    lo, conv = build_layout(cfg, 1), Conventions.for_dtype(2 if bf16 else 4)
    est = (sum(layer_wgrad_kept_bytes(cfg, lo, i, conv, B) for i in range(2))
           + embedding_wgrad_kept_bytes(cfg, lo, conv, B) + head_wgrad_kept_bytes(cfg, lo, conv, B))
    assert abs(measured - est) <= 0.05 * measured, (measured, est)


def _tp_worker(rank, world):
    from mpoverlap.parallel import ParallelState, RankGrid
    from mpoverlap.tensor_parallel import tp_kwargs

    torch.manual_seed(0)
    state = ParallelState.create(RankGrid(tp=world), torch.device("cpu"))
    out = {}
    for sp in (False, True):
        kw = tp_kwargs(state, sequence_parallel=sp, overlap=False)
        for family, bf16 in CASES:
            out[(family, bf16, sp)] = _measure(family, bf16, kw, sp, rank)
            out[("kept", family, bf16, sp)] = _measure_kept(family, bf16, kw, sp, rank)
    return out


def test_saved_bytes_one_block_tp2_with_and_without_sp():
    """One 2-rank spawn measures every family, dtype and SP setting; each rank against the estimate."""
    per_rank = run_distributed(_tp_worker, 2, timeout_s=300)
    bad = []
    for key in per_rank[0]:
        kept = key[0] == "kept"  # zero bubble: what the queued W closures keep (5%)
        family, bf16, sp = key[1:] if kept else key
        est = (_estimate_kept if kept else _estimate)(family, 2, sp, bf16)
        for r in per_rank:
            if abs(r[key] - est) > (0.05 if kept else 0.10) * r[key]:
                bad.append((key, r[key], est))
    assert not bad, bad


def _cp_worker(rank, world):
    """Saved bytes of one dense block under ring (p2p) and all-to-all context parallelism."""
    from mpoverlap.context_parallel import ContextParallelAttention, positions_for_cp
    from mpoverlap.models.gpt import Block, rope_cos_sin
    from mpoverlap.parallel import ParallelState, RankGrid

    state = ParallelState.create(RankGrid(cp=world), torch.device("cpu"))
    out = {}
    for variant in ("p2p", "a2a"):
        for family in ("gpt_gelu", "llama_swiglu", "llama_gqa"):
            for bf16 in (False, True):
                m = compose(_overrides(family)).model
                torch.manual_seed(0)
                block = Block(m, "layers.0", 1234, ContextParallelAttention(state, variant, False, None))
                S, H = m.seq_length, m.hidden_size
                x = torch.randn(B, S // world, H, requires_grad=True)
                cos, sin = rope_cos_sin(positions_for_cp(S, rank, world), H // m.num_attention_heads, m.rope_base)

                def forward():
                    with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
                        return block(x, cos, sin)

                out[(variant, family, bf16)] = saved_activation_bytes(forward, block.parameters(), [cos, sin])
    return out


def test_saved_bytes_one_block_cp2_ring_and_a2a():
    per_rank = run_distributed(_cp_worker, 2, timeout_s=300)
    bad = []
    for (variant, family, bf16), measured in per_rank[0].items():
        cfg = compose(_overrides(family) + ["parallel.cp=2", f"parallel.cp_comm={variant}"])
        est = layer_activation_bytes(cfg, build_layout(cfg, 2), 0, Conventions.for_dtype(2 if bf16 else 4), B)
        for r in per_rank:
            got = r[(variant, family, bf16)]
            if abs(got - est) > 0.10 * got:
                bad.append((variant, family, bf16, got, est))
    assert not bad, bad


PUBLISHED = {  # preset: (exact count, published figure, published active figure)
    "llama3_8b": (8_030_261_248, 8.03e9, None),
    "llama3_1b": (1_235_814_400, 1.24e9, None),
    "mixtral_8x7b": (46_702_792_704, 46.7e9, 12.9e9),
}


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_presets_count_their_published_parameters(preset, capsys):
    """mpoverlap-check prints the exact count of Meta's / Mistral's checkpoints (8,030,261,248
    for Llama 3 8B, 46,702,792,704 for Mixtral 8x7B), within 0.5% of the published figures,
    and Mixtral's active parameters per token (2 of 8 experts) within 0.5% of 12.9B."""
    from mpoverlap.check import main

    exact, published, active = PUBLISHED[preset]
    est = estimate(compose([f"model={preset}"]), 1)
    assert est.total_params == exact and abs(exact - published) <= 0.005 * published
    if active is None:
        assert est.active_params == est.total_params
    else:
        assert abs(est.active_params - active) <= 0.005 * active
    assert main([f"model={preset}"]) == 0
    assert f"parameters: {exact:,} " in capsys.readouterr().out


# preset: (exact count, exact active, {what: (published figure, our matching count)})
QWEN = {
    "qwen3_0_6b": (596_049_920, 596_049_920, {"non-embedding 0.44B": (0.44e9, 596_049_920 - 151_936 * 1024)}),
    "qwen3_moe_30b_a3b": (30_532_122_624, 3_353_032_704,
                          {"total 30.5B": (30.5e9, 30_532_122_624),
                           "non-embedding 29.9B": (29.9e9, 30_532_122_624 - 2 * 151_936 * 2048)}),
}


@pytest.mark.parametrize("preset", sorted(QWEN))
def test_qwen_presets_count_their_published_parameters(preset, capsys):
    """The Qwen3 presets (head width 128 over narrower hidden sizes, q/k norms): mpoverlap-check
    prints the exact count, and the published figures they are quoted with (Qwen's model
    cards) are within 0.5%."""
    from mpoverlap.check import main

    exact, active, published = QWEN[preset]
    est = estimate(compose([f"model={preset}"]), 1)
    assert (est.total_params, est.active_params) == (exact, active)
    for what, (figure, ours) in published.items():
        assert abs(ours - figure) <= 0.005 * figure, what
    assert main([f"model={preset}"]) == 0
    assert f"parameters: {exact:,} " in capsys.readouterr().out


@pytest.mark.parametrize("overrides", [["model=llama_tiny"], ["model=llama_tiny", "model.num_query_groups=1"],
                                       ["model=llama_tiny", "model.num_experts=4", "model.moe_top_k=2"],
                                       ["model=moe_tiny", "model.num_query_groups=2"], ["model=qwen3_tiny"],
                                       ["model=qwen3_tiny", "model.qk_norm=false", "model.qkv_bias=true"],
                                       ["model=qwen3_moe_tiny"], ["model=moe_fine_tiny"]])
def test_total_parameters_equal_the_model(overrides):
    from mpoverlap.models.gpt import GPT, num_parameters

    cfg = compose(overrides)
    assert estimate(cfg, 1).total_params == num_parameters(GPT(cfg.model))


def test_cp_ring_bytes_scale_with_the_kv_groups():
    """Llama 3 8B at cp 2: the ring moves a quarter of the MHA bytes with 8 of 32 groups; the
    all-to-all (4N + 4G) / 8N of them; the other modes do not move."""
    def comm(variant, groups):
        cfg = compose(["model=llama3_8b", "model.num_layers=2", "model.seq_length=1024", "parallel.cp=2",
                       f"parallel.cp_comm={variant}", f"model.num_query_groups={groups}"])
        return estimate(cfg, 2)

    for variant, ratio in (("p2p", 1 / 4), ("a2a", (4 * 32 + 4 * 8) / (8 * 32))):
        gqa, mha = comm(variant, 8), comm(variant, "null")
        assert gqa.comm_bytes_per_step["cp"] == ratio * mha.comm_bytes_per_step["cp"]
        assert gqa.comm_link_bytes_per_step["cp"] == ratio * mha.comm_link_bytes_per_step["cp"]
        assert gqa.layer_activation_bytes < mha.layer_activation_bytes


GPT3_175B = ["model.num_layers=96", "model.hidden_size=12288", "model.num_attention_heads=96",
             "model.ffn_hidden_size=49152", "model.seq_length=2048", "model.norm=layernorm",
             "model.activation=gelu", "train.micro_batch_size=1"]


@pytest.mark.parametrize("layout,paper", [
    ([], lambda s, b, h, a, t: s * b * h * (34 + 5 * a * s / h)),
    (["parallel.tp=8"], lambda s, b, h, a, t: s * b * h * (10 + 24 / t + 5 * a * s / (h * t))),
    (["parallel.tp=8", "parallel.sequence_parallel=true"], lambda s, b, h, a, t: s * b * h / t * (34 + 5 * a * s / h)),
    # Selective recomputation (Table 2's last rows): the s^2 attention terms are gone.
    (["model.recompute=selective"], lambda s, b, h, a, t: s * b * h * 34),
    (["parallel.tp=8", "parallel.sequence_parallel=true", "model.recompute=selective"],
     lambda s, b, h, a, t: s * b * h / t * 34),
], ids=["tp1", "tp8", "tp8_sp", "tp1_selective", "tp8_sp_selective"])
def test_korthikanti_table2_175b_layer(layout, paper):
    """Per-layer activations of the 175B shape under the paper's conventions (16-bit, dropout
    masks, no flash, learned positions: no RoPE copies) within 1% of Table 2 (LayerNorm's
    statistics are the difference)."""
    cfg = compose(GPT3_175B + layout)
    lo = build_layout(cfg, cfg.parallel.tp)
    ours = layer_activation_bytes(cfg, lo, 0, Conventions.korthikanti(), 1)
    theirs = paper(2048, 1, 12288, 96, lo.tp)
    assert abs(ours - theirs) <= 0.01 * theirs, (ours / 2**20, theirs / 2**20)


def test_recompute_estimates():
    """Full recomputation keeps each replayed block's input (plus one block while it is
    replayed); at 8 layers that is well under half of none. Selective with flash kernels
    drops only the log-sum-exp."""
    base = ["model.num_layers=8", "model.seq_length=512", "train.micro_batch_size=4", "train.global_batch_size=8"]
    act = {rc: estimate(compose(base + [f"model.recompute={rc}"]), 1).memory_bytes["activations"]
           for rc in ("none", "selective", "full")}
    assert act["full"] * 2 <= act["none"] and act["selective"] < act["none"]
    cfg = compose(base + ["model.recompute=full", "model.recompute_num_layers=4"])
    assert act["full"] < estimate(cfg, 1).memory_bytes["activations"] < act["none"]


def test_interleaving_keeps_more_in_flight():
    """pp 8 x vpp 2, 96 layers: stage 0 peaks at 138 layers' worth (Korthikanti's
    1 + (p-1)/(p v) factor times L), where 1F1B keeps pp microbatches of 12 layers = 96."""
    base = GPT3_175B + ["parallel.tp=8", "parallel.sequence_parallel=true", "parallel.pp=8",
                        "train.global_batch_size=64"]
    inter = estimate(compose(base + ["parallel.vpp=2"]), 64)
    plain = estimate(compose(base), 64)
    assert inter.stages[0].layers_in_flight == 138 and plain.stages[0].layers_in_flight == 96
    assert inter.stages[0].memory_bytes["activations"] > 1.4 * plain.stages[0].memory_bytes["activations"]
    # Later stages keep fewer; the printed total is each stage's own (no mixing of stages).
    assert inter.stages[-1].layers_in_flight < inter.stages[0].layers_in_flight
    assert inter.memory_bytes == max((st.memory_bytes for st in inter.stages), key=lambda d: sum(d.values()))


def test_moe_top_k_and_width_count():
    small = estimate(compose(["model=moe_350m", "model.moe_top_k=2"]))
    large = estimate(compose(["model=moe_350m", "model.moe_top_k=8"]))
    assert large.memory_bytes["activations"] > 1.5 * small.memory_bytes["activations"]


def test_link_view_zero_equals_allreduce_and_sp_is_1_25x():
    ar = estimate(compose(["parallel.dp=4"]), 4)
    zero = estimate(compose(["parallel.dp=4", "train.distributed_optimizer=true"]), 4)
    assert zero.comm_bytes_per_step["dp"] == 2 * ar.comm_bytes_per_step["dp"]  # buffers: RS + AG
    assert zero.comm_link_bytes_per_step["dp"] == ar.comm_link_bytes_per_step["dp"]  # the same traffic
    assert ar.comm_link_bytes_per_step["dp"] == ar.comm_bytes_per_step["dp"] * 2 * 3 // 4
    no_sp = estimate(compose(["parallel.tp=2"]), 2)
    sp = estimate(compose(["parallel.tp=2", "parallel.sequence_parallel=true"]), 2)
    assert sp.comm_bytes_per_step["tp"] / no_sp.comm_bytes_per_step["tp"] == pytest.approx(2.5, rel=0.02)
    assert sp.comm_link_bytes_per_step["tp"] / no_sp.comm_link_bytes_per_step["tp"] == pytest.approx(1.25, rel=0.02)


def test_cp_a2a_moves_a_fifth_of_the_ring_at_cp4():
    ring = estimate(compose(["model=gpt_125m", "parallel.cp=4"]), 4).comm_bytes_per_step["cp"]
    a2a = estimate(compose(["model=gpt_125m", "parallel.cp=4", "parallel.cp_comm=a2a"]), 4).comm_bytes_per_step["cp"]
    assert a2a * 5 == ring  # 8 local q-sized buffers against 4 (3 cp - 2)


def test_flops_and_bubble():
    from mpoverlap.models.flops import flops_per_token

    cfg = compose(["parallel.pp=2", "parallel.vpp=2", "train.global_batch_size=16", "train.micro_batch_size=2"])
    est = estimate(cfg, 2)
    assert est.model_flops_per_step == flops_per_token(cfg.model) * 16 * cfg.model.seq_length
    assert est.bubble == pytest.approx(1 / (2 * 8))


@pytest.mark.slow
@pytest.mark.parametrize("cp", [4])
def test_cp_a2a_estimate_equals_ledger_and_metrics_report_flops(tmp_path, cp):
    """A real a2a run: the ledger's cp bytes per step equal the estimate's buffer bytes exactly;
    metrics.jsonl has model_tflops_per_s and, on CPU, no mfu. (cp 2: test_train_cli's
    cp2_a2a_on run, in test_check_estimates_match_measured_comm.)"""
    from inproc_train import run_chains
    from test_train_cli import SMALL, rows

    layout = [f"parallel.cp={cp}", "parallel.cp_comm=a2a"]
    # Trainer.run() in a spawned world: the launched run's metrics.jsonl without the launch
    run_chains({"a2a": [(cp, [*SMALL, *layout], 2)]}, tmp_path)
    row = rows(tmp_path / "a2a")[-1]
    cfg = compose([*SMALL, *layout])
    assert row["comm"]["cp"]["bytes"] == estimate(cfg, cp).comm_bytes_per_step["cp"]
    assert row["model_tflops_per_s"] > 0 and "mfu" not in row


def test_throughput_fields_and_peak_table(monkeypatch):
    from mpoverlap.training.metrics import bf16_peak_tflops, throughput

    assert bf16_peak_tflops(torch.device("cpu")) is None
    row = throughput(6e9, 1000, 2.0, 4, None)
    assert row == {"model_tflops_per_s": pytest.approx(6e9 * 1000 / 2.0 / 4 / 1e12)}  # no mfu, not 0
    assert throughput(6e9, 1000, 2.0, 4, 312.0)["mfu"] == pytest.approx(row["model_tflops_per_s"] / 312.0)
    for name, peak in (("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA A100-SXM4-80GB", 312.0),
                       ("NVIDIA A10", 125.0), ("NVIDIA L40S", 362.0), ("NVIDIA H200", 989.0), ("Tesla V100", None)):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, n=name: n)
        assert bf16_peak_tflops(torch.device("cuda", 0)) == peak, name


@pytest.mark.slow
def test_pp2_vpp2_peak_activations_within_25pct(tmp_path):
    """Peak activation memory of stage 0 of a real pp 2 x vpp 2 run, measured as bench/memory.py
    measures it (peak RSS over a near-empty baseline, the estimate's weights and optimizer
    state taken out), against the estimate for stage 0 (5 chunk-microbatches in flight)."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/ is not installed
    from bench import memory

    res = memory.run(["pp2_vpp2"], 2, tmp_path)
    stage0 = memory.activation_rows(res["layouts"]["pp2_vpp2"])[0]
    print(f"\n  pp2_vpp2 stage 0 activations: measured {stage0['measured'] / 2**20:.1f} MiB, "
          f"estimate {stage0['estimate'] / 2**20:.1f} MiB ({stage0['ratio']:.2f}x)")
    assert stage0["stage"] == 0 and 0.75 <= stage0["ratio"] <= 1.25, stage0


@pytest.mark.slow
def test_pp2_zero_bubble_peak_activations_within_25pct(tmp_path, monkeypatch):
    """zb1p and zbv at pp 2 on the pp2_vpp2 layout's activation-heavy model (m = 4): each rank's
    peak activations measured as bench/memory.py measures them, against the estimate for its
    stage, which counts what the queued weight-gradient closures keep from B to W (the later
    stage holds p microbatches' W closures, 1F1B's only one microbatch)."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/ is not installed
    from bench import memory

    base = [o for o in memory.LAYOUTS["pp2_vpp2"] if not o.startswith("parallel.vpp")]
    layouts = {"pp2_zb1p": base + ["parallel.pp_schedule=zb1p"],
               "pp2_zbv": base + ["parallel.vpp=2", "parallel.pp_schedule=zbv"]}
    for name, overrides in layouts.items():
        monkeypatch.setitem(memory.LAYOUTS, name, overrides)
    res = memory.run(list(layouts), 2, tmp_path)
    bad = []
    for name in layouts:
        for row in memory.activation_rows(res["layouts"][name]):
            print(f"\n  {name} rank {row['rank']} activations: measured {row['measured'] / 2**20:.1f} MiB, "
                  f"estimate {row['estimate'] / 2**20:.1f} MiB ({row['ratio']:.2f}x)")
            if not 0.75 <= row["ratio"] <= 1.25:
                bad.append((name, row))
    assert not bad, bad


def test_cp_attention_working_set_grows_with_the_sequence_not_its_square():
    """mpoverlap-check counts the ring's transient buffers (K/V double buffer, out/lse and dQ/dKV
    accumulators, kernel workspace) per rank: linear in the sequence on the fused kernels,
    quadratic with the explicit math; in the total; absent without cp."""
    from mpoverlap.overlap.estimate.attention_work import cp_attention_work_bytes

    def work(seq, *extra):
        cfg = compose(["parallel.cp=2", "model.num_layers=2", "train.micro_batch_size=1",
                       "train.global_batch_size=1", f"model.seq_length={seq}", *extra])
        est = estimate(cfg, 2)
        assert est.memory_bytes["cp_attention_work"] == cp_attention_work_bytes(cfg, build_layout(cfg, 2), 4, 1)
        return est.memory_bytes["cp_attention_work"]

    for comm in ("p2p", "a2a"):
        assert work(8192, f"parallel.cp_comm={comm}") == 2 * work(4096, f"parallel.cp_comm={comm}")
        explicit = [work(s, f"parallel.cp_comm={comm}", "parallel.cp_attention_backend=explicit") for s in (4096, 8192)]
        assert explicit[1] > 3.5 * explicit[0]
    # ring, fp32 (c = a = 4), hidden 128 / 4 heads (D 32, G = N), 4,096 tokens per rank; the
    # backward is the larger half: K/V double buffer, dQ + dK/dV accumulators, dK/dV in flight,
    # the kernel's dq, dk, dv, its workspace.
    T, N, G, D, c, a = 4096, 4, 4, 32, 4, 4
    assert work(8192) == (2 * 2 * G * T * D * c + (N + 2 * G) * T * D * a + 2 * 2 * G * T * D * c
                          + (N + 2 * G) * T * D * c + N * T * (D + 1) * a)
    assert "cp_attention_work" not in estimate(compose(["model.seq_length=8192"]), 1).memory_bytes


def test_weight_casts_and_loss_backward_in_the_estimate():
    """The two terms beside the saved activations (estimate/transients.py), by layout: bf16 keeps a
    2-byte cast of every weight a GEMM reads (a tied model: all of them; untied: not the input
    embedding; never the norms), none in fp32 or under ZeRO-3 (tests/test_fp8_memory.py holds the
    casts against the ones a step makes); the loss's backward writes the logits' gradient in
    the compute dtype, plus one fp32 row block (at most 1 GiB) eager at tp 1, on the stage
    holding the head (the last; stage 0 in zbv's V)."""
    from mpoverlap.models.init import padded_vocab_size
    from mpoverlap.models.loss import CHUNK_BYTES
    from mpoverlap.overlap.estimate.params import model_params

    base = ["model=llama_tiny", "model.seq_length=64", "train.micro_batch_size=2", "train.global_batch_size=8"]

    def mem(*extra, world=1):
        cfg = compose([*base, *extra])
        return cfg, estimate(cfg, world)

    cfg, est = mem("train.precision=bf16")
    m = cfg.model
    V = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by)
    logits = 2 * 64 * V
    total, _ = model_params(cfg)
    norms = (2 * m.num_layers + 1) * m.hidden_size
    assert est.memory_bytes["weight_casts"] == 2 * (total - norms - (0 if m.tie_embeddings else V * m.hidden_size))
    assert est.memory_bytes["loss_backward"] == 2 * logits + min(CHUNK_BYTES, 4 * logits)
    _, fp32 = mem("train.precision=fp32")
    assert fp32.memory_bytes["weight_casts"] == 0 and fp32.memory_bytes["loss_backward"] == 4 * logits + 4 * logits
    _, zero3 = mem("train.precision=bf16", "parallel.dp=2", "train.dp_sharding=optim_grads_params", world=2)
    assert zero3.memory_bytes["weight_casts"] == 0
    _, compiled = mem("train.precision=bf16", "train.compile=true")
    assert compiled.memory_bytes["loss_backward"] == 2 * logits
    _, tp2 = mem("train.precision=bf16", "parallel.tp=2", world=2)
    assert tp2.memory_bytes["loss_backward"] == 2 * logits // 2
    _, pp2 = mem("train.precision=bf16", "parallel.pp=2", world=2)
    assert "loss_backward" not in pp2.stages[0].memory_bytes and pp2.stages[1].memory_bytes["loss_backward"] > 0
    _, zbv = mem("train.precision=bf16", "parallel.pp=2", "parallel.vpp=2", "parallel.pp_schedule=zbv", world=2)
    assert "loss_backward" in zbv.stages[0].memory_bytes and "loss_backward" not in zbv.stages[1].memory_bytes


@pytest.mark.parametrize("model", ["llama_tiny", "gpt_tiny"])
@pytest.mark.parametrize("bf16", [False, True])
def test_head_and_loss_saved_bytes(model, bf16):
    """What the last chunk's final norm, head and one-rank loss keep for backward, measured
    (saved_tensors_hooks, parameters and the targets left out) against `head_activation_bytes`:
    the norm's input and output and the logits as the head made them (bf16 under bf16 autocast,
    models/loss.py keeps them instead of an fp32 log-softmax) plus one fp32 log-sum-exp a token.
    RMSNorm (llama_tiny) and LayerNorm (gpt_tiny, tied head)."""
    from mpoverlap.models.gpt import GPT
    from mpoverlap.overlap.estimate.activations import head_activation_bytes

    cfg = compose([f"model={model}", "model.num_layers=1", "model.vocab_size=1000", "model.seq_length=32",
                   "train.micro_batch_size=2"])
    gpt = GPT(cfg.model, seed=1)
    x = torch.randn(2, 32, cfg.model.hidden_size, requires_grad=True)
    targets = torch.randint(0, 1000, (2, 32), generator=torch.Generator().manual_seed(0))

    def forward():
        with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            logits = gpt.head(x, fp32_logits=False)
        return gpt.loss(logits, targets)

    measured = saved_activation_bytes(forward, gpt.parameters(), [targets])
    est = head_activation_bytes(cfg, build_layout(cfg, 1), Conventions.for_dtype(2 if bf16 else 4), 2)
    assert abs(measured - est) <= 0.01 * measured, (measured, est)
