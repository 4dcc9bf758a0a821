"""Multi-head latent attention under tensor parallelism, against the same layer on one process.

One spawn of 2 ranks (tp 2): the layer with and without the query latent, sequence parallelism
and overlap.tp (collective matmul on the column-parallel up-projections) on and off. Checked per
rank: the output, the input gradient, every weight gradient (column/row shards against the slice
of the single-process gradient; the replicated down-projections and norms whole, after the
gradient sum over tp that GPT.sequence_parallel_params asks for under SP), within 1e-5.
"""
import itertools
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dist_harness import run_distributed  # noqa: E402

from mpoverlap.config import ModelConfig  # noqa: E402

B, S, H, N = 2, 16, 32, 4
SEED = 5


def cfg_of(q_lora_rank):
    return ModelConfig(num_layers=2, hidden_size=H, num_attention_heads=N, ffn_hidden_size=64, seq_length=S,
                       attention="mla", q_lora_rank=q_lora_rank, kv_lora_rank=12, qk_nope_head_dim=8,
                       qk_rope_head_dim=4, v_head_dim=6)


def rel(a, b):
    a, b = a.detach(), b.detach()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def build(cfg, tp=None):
    from mpoverlap.models.gpt import causal_sdpa
    from mpoverlap.models.init import init_tensor
    from mpoverlap.models.mla import LatentAttention

    layer = LatentAttention(cfg, "layers.0.attn", SEED, causal_sdpa, tp)
    with torch.no_grad():  # as GPT.init_weights: the replicated parameters from their names
        for name, p in layer.named_parameters():
            if not hasattr(p, "tensor_model_parallel"):
                p.copy_(init_tensor(f"layers.0.attn.{name}", p.shape, cfg, SEED))
            if name.endswith("layernorm.weight"):  # away from ones, so a lost norm gradient shows
                p.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(len(name)))
    return layer


def worker(rank, world):
    from mpoverlap.comm.ledger import CommLedger
    from mpoverlap.models.rope import rope_cos_sin
    from mpoverlap.parallel import ParallelState, RankGrid
    from mpoverlap.tensor_parallel import allreduce_sequence_parallel_grads, shard_tensor, tp_kwargs

    state = ParallelState.create(RankGrid(tp=2), torch.device("cpu"))
    r, tp = state.coords.tp, state.size("tp")
    g = torch.Generator().manual_seed(3)
    x_full, gy = torch.randn(B, S, H, generator=g), torch.randn(B, S, H, generator=g)
    cos, sin = rope_cos_sin(torch.arange(S), 4, 10000.0)
    out = {}
    for q_lora_rank in (16, 0):
        cfg = cfg_of(q_lora_rank)
        ref = build(cfg)
        xr = x_full.clone().requires_grad_(True)
        y_ref = ref(xr, cos, sin)
        (y_ref * gy).sum().backward()
        ref_grads = {n: p.grad for n, p in ref.named_parameters()}
        for sp, ov in itertools.product((False, True), repeat=2):
            if ov and not sp:
                continue  # overlap.tp needs SP (rule tp.overlap_needs_sp)
            loc = (lambda t: t[:, r * (S // tp):(r + 1) * (S // tp)]) if sp else (lambda t: t)
            ledger = CommLedger()
            layer = build(cfg, tp_kwargs(state, sequence_parallel=sp, overlap=ov, ledger=ledger))
            x = loc(x_full).clone().requires_grad_(True)
            y = layer(x, cos, sin)
            (y * loc(gy)).sum().backward()
            replicated = [p for p in layer.parameters() if not getattr(p, "tensor_model_parallel", False)]
            if sp:
                for h in allreduce_sequence_parallel_grads(replicated, state.group("tp"), ledger):
                    h.wait()
            errs = {"y": rel(y, loc(y_ref)), "x": rel(x.grad, loc(xr.grad))}
            for name, p in layer.named_parameters():
                want = ref_grads[name]
                if getattr(p, "tensor_model_parallel", False):
                    want = shard_tensor(want, p.partition_dim, r, tp)
                errs[name] = rel(p.grad, want)
            out[(q_lora_rank, sp, ov)] = errs
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(worker, 2, timeout_s=150)


def test_latent_attention_under_tp_matches_one_process(results):
    n = 0
    for rank, out in enumerate(results):
        assert set(out) == {(q, sp, ov) for q in (16, 0) for sp, ov in ((False, False), (True, False), (True, True))}
        for key, errs in out.items():
            names = set(errs) - {"y", "x"}
            assert ("q_a_proj.weight" in names) == (key[0] > 0)
            for what, err in errs.items():
                assert err < 1e-5, (rank, key, what, err)
                n += 1
    assert n == 2 * 3 * ((2 + 7) + (2 + 5))


# ---- context parallelism: q/k heads 12 wide, v heads 6 -------------------------------------------

DQK, DV, SC = 12, 6, 32


def cp_inputs():
    g = torch.Generator().manual_seed(11)
    q, k = (torch.randn(B, N, SC, DQK, generator=g) for _ in range(2))
    v, w = (torch.randn(B, N, SC, DV, generator=g) for _ in range(2))
    return q, k, v, w


def cp_worker(rank, world):
    import functools

    from mpoverlap.comm.ledger import CommLedger
    from mpoverlap.context_parallel import a2a_attention, ring_attention, split_for_cp
    from mpoverlap.parallel import ParallelState, RankGrid

    state = ParallelState.create(RankGrid(cp=2), torch.device("cpu"))
    r = state.coords.cp
    q, k, v, w = cp_inputs()
    ref = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out_ref = torch.nn.functional.scaled_dot_product_attention(*ref, is_causal=True)
    grads_ref = torch.autograd.grad((out_ref * w).sum(), ref)
    local = [split_for_cp(t, r, 2, seq_dim=2) for t in (q, k, v, w)]
    out = {}
    for variant, fn in (("p2p", ring_attention), ("a2a", a2a_attention)):
        for backend, overlap in (("auto", False), ("auto", True), ("explicit", False)):
            attn = functools.partial(fn, cp_group=state.group("cp"), cp_ranks=state.ranks("cp"), cp_rank=r,
                                     cp_size=2, overlap=overlap, ledger=CommLedger(), backend=backend)
            xs = [t.clone().requires_grad_(True) for t in local[:3]]
            y = attn(*xs)
            grads = torch.autograd.grad((y * local[3]).sum(), xs)
            out[(variant, backend, overlap)] = [rel(y, split_for_cp(out_ref, r, 2, seq_dim=2))] + [
                rel(gr, split_for_cp(want, r, 2, seq_dim=2)) for gr, want in zip(grads, grads_ref)]
    return out


@pytest.fixture(scope="module")
def cp_results():
    return run_distributed(cp_worker, 2, timeout_s=150)


def test_cp_attention_with_a_narrower_value_head_matches_one_process(cp_results):
    """Ring and all-to-all attention (the fused CPU flash block kernel, padded and trimmed,
    overlap on and off, and the explicit math) with q/k heads 12 wide and v heads 6: output
    and dq, dk, dv equal full-sequence causal SDPA on one process."""
    for rank, out in enumerate(cp_results):
        assert len(out) == 6
        for key, errs in out.items():
            assert max(errs) < 1e-5, (rank, key, errs)


def test_flash_block_kernel_pads_and_trims_differing_head_widths():
    """The CPU flash kernel takes one head width for q, k and v (it raises otherwise): the
    block kernel pads v and trims back, equal to the explicit math, forward and backward."""
    from mpoverlap.context_parallel.block_kernels import EXPLICIT, FLASH_CPU

    q, k, v, w = cp_inputs()
    with pytest.raises(RuntimeError, match="same head size"):
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=DQK ** -0.5)
    scale = DQK ** -0.5
    o, lse = FLASH_CPU.forward(q, k, v, scale, True)
    o_ref, lse_ref = EXPLICIT.forward(q, k, v, scale, True)
    assert o.shape == (B, N, SC, DV)
    assert rel(o, o_ref) < 1e-5 and rel(lse, lse_ref) < 1e-5
    got = FLASH_CPU.backward(w, q, k, v, o, lse, scale, True)
    want = EXPLICIT.backward(w, q, k, v, o_ref, lse_ref, scale, True)
    assert [g.shape[-1] for g in got] == [DQK, DQK, DV]
    assert all(rel(a, b) < 1e-5 for a, b in zip(got, want))
