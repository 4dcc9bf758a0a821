"""Attention block kernels of context parallelism (mpoverlap/context_parallel/block_kernels.py),
in one process: each block kind against SDPA on the same rows, the ring's block decomposition
(every rank, every source, merged, backward with the final lse) against unsplit causal SDPA,
and no c x c tensor per head on the fused path.
"""
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from mpoverlap.context_parallel import a2a_attention, ring_attention, split_for_cp, unsplit_from_cp
from mpoverlap.context_parallel.attention_math import merge_into
from mpoverlap.context_parallel.block_kernels import (EXPLICIT, FLASH_CPU, KERNELS, NoFusedKernelError,
                                                       describe_block_backend, select_block_kernel)
from mpoverlap.context_parallel.ring_attention import RingAttentionFunction, _blocks
from mpoverlap.context_parallel.stats import NullStats

B, N, c, D = 2, 4, 16, 8


def rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def _mask(Q, K, kind):
    """Boolean keep-mask of a block kind: causal (top-left), or full."""
    return torch.ones(Q, K, dtype=torch.bool).tril() if kind == "causal" else torch.ones(Q, K, dtype=torch.bool)


# (kind, Q, K): a diagonal block; a full block; the load-balanced halves (all local queries x
# the first key chunk; the second query chunk x both key chunks); a rank's own two chunks.
BLOCKS = [("causal", c, c), ("full", c, c), ("full", 2 * c, c), ("full", c, 2 * c), ("causal", 2 * c, 2 * c)]
# (kernel, dtype, tolerance of out / grads against fp64 SDPA)
KERNEL_CASES = [(FLASH_CPU, torch.float32, 1e-5), (EXPLICIT, torch.float64, 1e-12),
                (EXPLICIT, torch.float32, 1e-5), (FLASH_CPU, torch.bfloat16, 2e-2)]


@pytest.mark.parametrize("kind,Q,K", BLOCKS)
@pytest.mark.parametrize("kernel,dtype,tol", KERNEL_CASES, ids=lambda x: getattr(x, "name", str(x)))
@pytest.mark.parametrize("groups", [N, 2])
def test_block_kind_matches_sdpa(kind, Q, K, kernel, dtype, tol, groups):
    """Output, log-sum-exp and dq, dk, dv (the K/V groups') of one block equal SDPA with the
    block's mask on the same rows (fp64 reference), also with grouped-query K/V."""
    _check_block(kind, Q, K, kernel, dtype, tol, groups, "cpu", D)


# Every CUDA backend in every dtype it takes (efficient_cuda in bf16 / fp16: the issue-44 fix,
# first passed on an H200 at c3a3560, docs/gpu-reports/).
CUDA_CASES = [("flash_cuda", torch.bfloat16, 2e-2), ("flash_cuda", torch.float16, 1e-2),
              ("efficient_cuda", torch.float32, 1e-4), ("efficient_cuda", torch.bfloat16, 2e-2),
              ("efficient_cuda", torch.float16, 1e-2), ("cudnn_cuda", torch.bfloat16, 2e-2),
              ("cudnn_cuda", torch.float16, 1e-2)]


@pytest.mark.cuda
@pytest.mark.parametrize("kind,Q,K", BLOCKS)
@pytest.mark.parametrize("name,dtype,tol", CUDA_CASES)
def test_cuda_block_kind_matches_sdpa(kind, Q, K, name, dtype, tol):
    """Each CUDA kernel's out, lse and dq, dk, dv against fp64 SDPA (grouped-query K/V, head dim
    64); the backward gets out as the ring hands it: [B, N, Q, D]-contiguous, not the layout the
    kernel's forward returned (the issue-44 case)."""
    _check_block(kind, Q, K, KERNELS[name], dtype, tol, 2, "cuda", 64)


def _check_block(kind, Q, K, kernel, dtype, tol, groups, device, head_dim):
    g = torch.Generator().manual_seed(Q * 7 + K + groups)
    q, dout = (torch.randn(B, N, Q, head_dim, generator=g) for _ in range(2))
    k, v = (torch.randn(B, groups, K, head_dim, generator=g) for _ in range(2))
    scale = head_dim ** -0.5
    ref_in = [t.double().requires_grad_() for t in (q, k, v)]
    keep = _mask(Q, K, kind)
    ref = F.scaled_dot_product_attention(*ref_in, attn_mask=keep, scale=scale, enable_gqa=groups != N)
    ref_grads = torch.autograd.grad((ref * dout.double()).sum(), ref_in)
    k_full = ref_in[1].detach().repeat_interleave(N // groups, dim=1)
    scores = (ref_in[0].detach() @ k_full.transpose(-1, -2) * scale).masked_fill(~keep, float("-inf"))
    ref_lse = torch.logsumexp(scores, dim=-1)

    args = [t.to(device, dtype) for t in (q, k, v)]
    out, lse = kernel.forward(*args, scale, kind == "causal")
    assert lse.dtype == torch.promote_types(dtype, torch.float32)
    assert rel(out.cpu(), ref) < tol and rel(lse.cpu(), ref_lse) < tol
    grads = kernel.backward(dout.to(device, dtype), *args, out.to(dtype).contiguous(), lse, scale, kind == "causal")
    assert [tuple(t.shape) for t in grads] == [tuple(t.shape) for t in ref_in]
    for got, want in zip(grads, ref_grads):
        assert rel(got.cpu(), want) < (tol * 4 if dtype in (torch.bfloat16, torch.float16) else tol)


def _simulated_ring(q, k, v, dout, cp, kernel):
    """Every rank of a cp ring in one process: each rank's blocks (ring_attention._blocks, the
    kernel's decomposition) against every source's K/V, merged in fp32; then each block's
    kernel backward with the FINAL out and lse; dK/dV summed per owner. Returns the unsplit
    (out, dq, dk, dv)."""
    S = q.shape[2]
    ch = S // (2 * cp)
    split = [[split_for_cp(t, r, cp, 2) for r in range(cp)] for t in (q, k, v, dout)]
    qs, ks, vs, douts = split
    dks = [torch.zeros(t.shape, dtype=torch.float32) for t in ks]
    dvs = [torch.zeros(t.shape, dtype=torch.float32) for t in vs]
    outs, dqs = [], []
    scale = D ** -0.5
    for r in range(cp):
        ring = SimpleNamespace(cp_rank=r, cp_size=cp)
        out_acc = torch.zeros(qs[r].shape)
        lse_acc = torch.full(qs[r].shape[:3], float("-inf"))
        for src in range(cp):
            for rows, keys, causal in _blocks(ring, src, ch, kernel.fused):
                o, l = kernel.forward(qs[r][:, :, rows], ks[src][:, :, keys], vs[src][:, :, keys], scale, causal)
                merge_into(out_acc[:, :, rows], lse_acc[:, :, rows], o, l)
        out = out_acc.to(q.dtype)
        dq = torch.zeros(qs[r].shape)
        for src in range(cp):
            for rows, keys, causal in _blocks(ring, src, ch, kernel.fused):
                gq, gk, gv = kernel.backward(douts[r][:, :, rows], qs[r][:, :, rows], ks[src][:, :, keys],
                                             vs[src][:, :, keys], out[:, :, rows], lse_acc[:, :, rows], scale, causal)
                dq[:, :, rows] += gq
                dks[src][:, :, keys] += gk
                dvs[src][:, :, keys] += gv
        outs.append(out)
        dqs.append(dq)
    return [unsplit_from_cp(x, 2) for x in (outs, dqs, dks, dvs)]


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("kernel", [FLASH_CPU, EXPLICIT], ids=lambda k: k.name)
@pytest.mark.parametrize("groups", [N, 1])
def test_ring_blocks_merged_equal_unsplit_sdpa(cp, kernel, groups):
    """The load-balanced halves (fused) and the chunk pairs (explicit), merged with their lse,
    and their backward with the final lse, equal causal SDPA on the whole sequence: out, dq,
    dk, dv (fp32, within 1e-5)."""
    S = 2 * cp * c
    g = torch.Generator().manual_seed(cp + groups)
    q, dout = (torch.randn(B, N, S, D, generator=g) for _ in range(2))
    k, v = (torch.randn(B, groups, S, D, generator=g) for _ in range(2))
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*ref_in, is_causal=True, enable_gqa=groups != N)
    want = [ref.detach(), *torch.autograd.grad((ref * dout).sum(), ref_in)]
    got = _simulated_ring(q, k, v, dout, cp, kernel)
    for a, b in zip(got, want):
        assert rel(a, b) < 1e-5


def test_fused_halves_cover_exactly_the_unmasked_pairs():
    """Per rank and source, the fused blocks cover the same (query, key) pairs as the explicit
    chunk pairs (minus what a causal block masks): no pair twice, none missing."""
    for cp in (2, 3, 4):
        for r in range(cp):
            ring = SimpleNamespace(cp_rank=r, cp_size=cp)
            for src in range(cp):
                def covered(fused):
                    cells = torch.zeros(2 * c, 2 * c, dtype=torch.int32)
                    for rows, keys, causal in _blocks(ring, src, c, fused):
                        blk = torch.ones(rows.stop - rows.start, keys.stop - keys.start, dtype=torch.int32)
                        cells[rows, keys] += blk.tril() if causal else blk
                    return cells
                assert torch.equal(covered(True), covered(False))
                assert covered(True).max() <= 1
                assert len(_blocks(ring, src, c, True)) == 1  # one kernel call per ring step


class _RecordSizes(TorchDispatchMode):
    """Records the element count of every tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(t, torch.Tensor):
                self.sizes.append((str(func), t.numel()))
        return out


class _LocalRing:
    """A cp ring simulated in one process for allocation watching: `exchange` fills the
    receive buffer with source data at once (values need not be right, sizes are)."""

    def __init__(self, cp_rank, cp_size):
        self.cp_rank, self.cp_size, self.overlap = cp_rank, cp_size, False

    def source_of_step(self, step):
        return (self.cp_rank - step) % self.cp_size

    def exchange(self, send, recv):
        recv.copy_(send)
        return SimpleNamespace(wait=lambda: None, waited=True)


def _largest_per_head(fn, q, k, v):
    with _RecordSizes() as rec:
        out = fn(q, k, v)
        out.backward(torch.ones_like(out))
    return max(n for _, n in rec.sizes) / (q.shape[0] * q.shape[1])


@pytest.mark.parametrize("cp_size,cp_rank", [(2, 0), (4, 2)])
def test_fused_ring_allocates_no_c_by_c_tensor_per_head(cp_size, cp_rank):
    """Every tensor the fused ring's forward and backward create (each op's outputs, seen by
    a dispatch mode) holds fewer than c x c elements per head; the explicit path does
    allocate c x c per head (the check can fail)."""
    cl = 256  # chunk length: c x c = 65,536 per head, beyond any O(c) tensor of these sizes
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 2 * cl, 16, generator=g).requires_grad_()
    k, v = (torch.randn(1, 1, 2 * cl, 16, generator=g).requires_grad_() for _ in range(2))
    ring = _LocalRing(cp_rank, cp_size)

    def run(kernel):
        return lambda q_, k_, v_: RingAttentionFunction.apply(q_, k_, v_, ring, 0.25, NullStats(), kernel)

    assert _largest_per_head(run(FLASH_CPU), q, k, v) < cl * cl / 4
    assert _largest_per_head(run(EXPLICIT), q, k, v) >= cl * cl


def test_fused_a2a_and_cp1_ring_allocate_no_s_by_s_tensor_per_head():
    S = 1024
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, S, 8, generator=g).requires_grad_() for _ in range(3))
    kw = dict(cp_group=None, cp_ranks=[0], cp_rank=0, cp_size=1, overlap=False)
    for fn in (a2a_attention, ring_attention):
        assert _largest_per_head(lambda *t: fn(*t, **kw), q, k, v) < S * S / 16
        assert _largest_per_head(lambda *t: fn(*t, **kw, backend="explicit"), q, k, v) >= S * S / 4


def test_backend_selection():
    x32, x64 = torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8, dtype=torch.float64)
    assert select_block_kernel("auto", x32) is FLASH_CPU
    assert select_block_kernel("fused", x32.bfloat16()) is FLASH_CPU
    assert select_block_kernel("explicit", x32) is EXPLICIT
    assert select_block_kernel("auto", x64) is FLASH_CPU  # the CPU flash kernel takes fp64 too
    with pytest.raises(NoFusedKernelError, match="parallel.cp_attention_backend=cudnn"):
        select_block_kernel("cudnn", x32)
    with pytest.raises(ValueError, match="auto|fused|explicit|cudnn"):
        select_block_kernel("flash", x32)
    assert "flash_cuda" in describe_block_backend("auto", "cuda", torch.bfloat16, 64)
    assert describe_block_backend("auto", "cuda", torch.float32, 64).startswith("efficient_cuda")
    assert describe_block_backend("auto", "cpu", torch.float32, 64).startswith("flash_cpu")
    assert set(KERNELS) == {"explicit", "flash_cpu", "flash_cuda", "efficient_cuda", "cudnn_cuda"}


@pytest.mark.parametrize("name", ["flash_cuda", "efficient_cuda", "cudnn_cuda"])
def test_cuda_kernels_signatures_on_meta(name):
    """The CUDA kernels' calls (argument order, lse shapes and padding, GQA expansion) run on
    the meta device, where torch registers shape functions for these aten ops: shapes of
    out, lse and dq, dk, dv (the K/V groups') are what the ring expects. No numbers: no GPU."""
    kernel = KERNELS[name]
    m = dict(dtype=torch.bfloat16, device="meta")
    q, dout = torch.empty(2, 8, 48, 64, **m), torch.empty(2, 8, 48, 64, **m)
    k, v = torch.empty(2, 2, 80, 64, **m), torch.empty(2, 2, 80, 64, **m)
    for causal in (False, True):
        out, lse = kernel.forward(q, k, v, 0.125, causal)
        assert out.shape == q.shape and lse.shape == (2, 8, 48) and lse.dtype == torch.float32
        dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, 0.125, causal)
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


def _on_cuda(dtype, head_dim, index=0):
    """What select_block_kernel reads of q, for a CUDA tensor on a machine without a GPU."""
    return SimpleNamespace(device=torch.device("cuda", index), dtype=dtype, shape=(1, 2, 4, head_dim))


@pytest.fixture
def fresh_selection():
    from mpoverlap.context_parallel import block_kernels

    block_kernels._select.cache_clear()
    yield
    block_kernels._select.cache_clear()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_auto_takes_efficient_in_16_bit_where_flash_cannot_run(dtype, monkeypatch, fresh_selection):
    """Where flash cannot run (head dim over 256 or not a multiple of 8, a GPU before sm80), auto
    and fused take efficient_cuda in bf16 / fp16: its issue-44 fix (the output in the forward's
    layout) passed test_cuda_block_kind_matches_sdpa on an H200 (`make gpu-check` at c3a3560,
    docs/gpu-reports/); flash where it runs, efficient in fp32."""
    from mpoverlap.context_parallel.block_kernels import EFFICIENT_CUDA, FLASH_CUDA

    capability = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[0])
    assert select_block_kernel("auto", _on_cuda(dtype, 64)) is FLASH_CUDA
    assert select_block_kernel("auto", _on_cuda(torch.float32, 64)) is EFFICIENT_CUDA
    assert select_block_kernel("auto", _on_cuda(torch.float32, 320)) is EFFICIENT_CUDA
    for head_dim in (320, 12):  # flash cannot run: efficient is the fused kernel left
        assert select_block_kernel("auto", _on_cuda(dtype, head_dim)) is EFFICIENT_CUDA
        assert select_block_kernel("fused", _on_cuda(dtype, head_dim)) is EFFICIENT_CUDA
    capability[0] = (7, 5)  # a V100 / T4-class GPU: no flash at any head dim
    assert select_block_kernel("auto", _on_cuda(dtype, 64, index=1)) is EFFICIENT_CUDA
    line = describe_block_backend("auto", "cuda", dtype, 64)
    assert line.startswith("flash_cuda") and "else efficient_cuda" in line
    assert describe_block_backend("auto", "cuda", dtype, 320).startswith("efficient_cuda")
    assert describe_block_backend("fused", "cuda", dtype, 320).startswith("efficient_cuda")
    assert describe_block_backend("auto", "cuda", torch.float32, 320).startswith("efficient_cuda")


def test_efficient_backward_hands_the_kernel_out_laid_out_seq_major():
    """The issue-44 cause, checked on the meta device: the CUTLASS backward reads out's query
    rows N x D apart (o_strideM = head_dim_value * num_heads, kernel_backward.h) and in 16-bit
    computes rowsum(dout * out) from that pointer, so out must reach the op laid out
    [B, Q, N, D] in memory whatever layout the caller holds (the ring's merged output is
    [B, N, Q, D]-contiguous, a slice of its rows is strided)."""
    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._scaled_dot_product_efficient_attention_backward.default:
                seen.append(args[5])
            return func(*args, **(kwargs or {}))

    m = dict(dtype=torch.bfloat16, device="meta")
    q, dout = torch.empty(2, 8, 48, 64, **m), torch.empty(2, 8, 48, 64, **m)
    k, v = torch.empty(2, 2, 80, 64, **m), torch.empty(2, 2, 80, 64, **m)
    full = torch.empty(2, 8, 96, 64, **m)
    kernel = KERNELS["efficient_cuda"]
    with Record():
        for out in (torch.empty(2, 8, 48, 64, **m), full[:, :, 48:], torch.empty(2, 48, 8, 64, **m).transpose(1, 2)):
            kernel.backward(dout, q, k, v, out, torch.empty(2, 8, 48, dtype=torch.float32, device="meta"), 0.125, True)
    assert len(seen) == 3
    for out in seen:
        assert out.shape == (2, 8, 48, 64) and out.transpose(1, 2).is_contiguous(), out.stride()


def test_plan_names_the_attention_backend_and_cudnn_is_validated():
    from mpoverlap.config import compose
    from mpoverlap.overlap.plan import render_plan
    from mpoverlap.overlap.rules import validate

    def line(*ov):
        plan = render_plan(compose(["train.device=cpu", *ov]), None)
        return next(x for x in plan.splitlines() if x.strip().startswith("attention:"))

    assert "p2p blocks on flash_cpu (aten._scaled_dot_product_flash_attention_for_cpu)" in line("parallel.cp=2")
    assert "a2a blocks on explicit" in line("parallel.cp=2", "parallel.cp_comm=a2a",
                                            "parallel.cp_attention_backend=explicit")
    assert line("train.precision=bf16").endswith("F.scaled_dot_product_attention -> flash_attention")
    problems = validate(compose(["parallel.cp=2", "parallel.cp_attention_backend=cudnn", "train.device=cpu"]), 2)
    assert [p.rule for p in problems] == ["cp.attention_backend_kernel"]
    assert "parallel.cp_attention_backend=auto" in problems[0].fix
    assert validate(compose(["parallel.cp=2", "parallel.cp_attention_backend=flash"]), 2)[0].rule == "value.choice"
