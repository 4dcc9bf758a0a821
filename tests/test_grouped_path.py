"""The grouped experts' GEMM paths (moe/grouped_path.py, moe/grouped.py) on CPU: each fallback,
forced where torch's kernel would run, against the kernel and the fp64 per-expert reference,
forward and backward, with the host reads its path declares; and the plan (mpoverlap-check)
naming the path for the device and dtype."""
from __future__ import annotations

import pytest
import torch

from mpoverlap.moe import grouped_path
from mpoverlap.moe.grouped import grouped_mlp
from mpoverlap.moe.grouped_path import DENSE, KERNEL, LOOPED, GroupedPath
from mpoverlap.training.host_sync import count_host_reads
from mpoverlap.wgrad import WeightGradDeferral, WeightGradQueue

L, HID, FFN, COUNTS, ROWS = 3, 16, 8, [4, 0, 5], 11  # an empty expert; rows 9, 10 past the last: dropped slots


def _inputs(dtype, activation):
    g = torch.Generator().manual_seed(7)
    width = 2 * FFN if activation == "swiglu" else FFN
    x = torch.randn(ROWS, HID, generator=g, dtype=torch.float64)
    w_in = torch.randn(L, width, HID, generator=g, dtype=torch.float64) / HID ** 0.5
    w_out = torch.randn(L, HID, FFN, generator=g, dtype=torch.float64) / FFN ** 0.5
    dy = torch.randn(ROWS, HID, generator=g, dtype=torch.float64)
    return [t.to(dtype) for t in (x, w_in, w_out, dy)]


def _reference(x, w_in, w_out, dy, activation):
    """fp64 autograd through a loop over the experts: y and the x, w_in, w_out gradients."""
    x, w_in, w_out = (t.detach().double().requires_grad_() for t in (x, w_in, w_out))
    parts, start = [], 0
    for l, c in enumerate(COUNTS):
        h = x[start:start + c] @ w_in[l].t()
        if activation == "swiglu":
            gate, up = h.chunk(2, dim=-1)
            h = torch.nn.functional.silu(gate) * up
        else:
            h = torch.nn.functional.gelu(h)
        parts.append(h @ w_out[l].t())
        start += c
    y = torch.cat(parts + [x.new_zeros(ROWS - start, HID)])
    return [y.detach(), *torch.autograd.grad((y * dy.double()).sum(), (x, w_in, w_out))]


def _run(x, w_in, w_out, dy, activation, deferred):
    """grouped_mlp forward and backward (W deferred to a queue and run, when `deferred`):
    (y, x grad, w_in grad, w_out grad), the host reads of it all, the torch._grouped_mm calls."""
    x, w_in, w_out = (t.detach().clone().requires_grad_() for t in (x, w_in, w_out))
    calls = []
    library = torch._grouped_mm

    def counted(*args, **kwargs):
        calls.append(1)
        return library(*args, **kwargs)

    torch._grouped_mm = counted
    try:
        with count_host_reads() as reads:
            deferral = WeightGradDeferral() if deferred else None
            y = grouped_mlp(x, w_in, w_out, torch.tensor(COUNTS), activation=activation, padded=True,
                            deferral=deferral)
            if deferred:
                queue = WeightGradQueue()
                with deferral.deferring(queue):
                    y.backward(dy)
                assert w_in.grad is None and len(queue) == 2
                queue.run()
            else:
                y.backward(dy)
    finally:
        torch._grouped_mm = library
    return [y.detach(), x.grad, w_in.grad, w_out.grad], reads, len(calls)


def _rel(got, want):
    return float((got.double() - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("forced", [DENSE, LOOPED])
@pytest.mark.parametrize("dtype,activation", [(torch.float32, "swiglu"), (torch.float32, "gelu"),
                                              (torch.bfloat16, "swiglu")])
def test_forced_fallback_matches_the_kernel_and_reads_what_it_declares(monkeypatch, forced, dtype, activation):
    """On CPU torch._grouped_mm runs; each fallback, forced by patching the path choice (as it
    runs on a GPU without the kernel), gives the kernel's output and x, w_in, w_out gradients:
    against the fp64 reference, within twice the kernel's own error there (the noise floor of
    this run) plus an eighth of the dtype's epsilon, with padded rows zero, calls torch._grouped_mm never, and reads
    the host exactly as often as its GroupedPath says (dense 0, looped 1 a call: forward,
    backward and the deferred W together)."""
    args = _inputs(dtype, activation)
    ref = _reference(*args, activation)
    kernel, kernel_reads, kernel_calls = _run(*args, activation, deferred=False)
    assert kernel_calls == 6 and kernel_reads.count == 0, kernel_reads.summary()
    declared = {DENSE: GroupedPath(DENSE, 0, "forced"), LOOPED: GroupedPath(LOOPED, 1, "forced")}[forced]
    monkeypatch.setattr(grouped_path, "choose", lambda *a, **k: declared)
    for deferred in (False, True):
        got, reads, calls = _run(*args, activation, deferred)
        assert calls == 0
        assert reads.count == declared.host_reads, reads.summary()
        if forced == LOOPED:
            assert reads.by_kind() == {"tolist": 1}
        for g, k, want in zip(got, kernel, ref):
            floor = 2 * _rel(k, want) + torch.finfo(dtype).eps / 8  # the kernel's own error: this run's floor
            assert _rel(g, want) <= floor, (forced, _rel(g, want), _rel(k, want))
        assert torch.all(got[0][sum(COUNTS):] == 0) and torch.all(got[1][sum(COUNTS):] == 0)
        assert torch.all(got[2][1] == 0) and torch.all(got[3][1] == 0)  # the empty expert


def test_moe_layer_host_reads_follow_the_path(monkeypatch):
    """A MoE layer at ep 1 reads nothing with torch's kernel; with the looped path forced it
    reads once per expert-MLP call, so once per chunk (overlap.ep_chunks), forward and backward
    together: the count the plan multiplies out."""
    from test_moe import layer, tokens

    for chunks, forced, want in ((4, None, 0), (1, LOOPED, 1), (4, LOOPED, 4)):
        if forced is not None:
            monkeypatch.setattr(grouped_path, "choose", lambda *a, **k: GroupedPath(LOOPED, 1, "forced"))
        moe = layer(num_chunks=chunks, capacity_factor=0.75)
        x = tokens(5).requires_grad_()
        with count_host_reads() as reads:
            y, r = moe(x)
            ((y * y).sum() + r.aux_loss + r.z_loss).backward()
        assert reads.count == want, (chunks, forced, reads.summary())


def test_choose_names_each_path_by_device_capability_and_dtype():
    """The rule, one case each: CPU fp32/bf16 and CUDA bf16 on sm90/sm100 run the kernel; fp32
    on a GPU, bf16 on sm80, fp64 and widths off the 16-byte rule take the dense fallback while
    its product is small, the looped one (1 host read a call) past FALLBACK_MAX_BYTES."""
    small, big = 2**20, grouped_path.FALLBACK_MAX_BYTES + 1
    cases = [("cpu", None, torch.float32, True, big, KERNEL), ("cpu", None, torch.bfloat16, True, big, KERNEL),
             ("cuda", (9, 0), torch.bfloat16, True, big, KERNEL), ("cuda", (10, 0), torch.bfloat16, True, big, KERNEL),
             ("cuda", (9, 0), torch.float32, True, small, DENSE), ("cuda", (9, 0), torch.float32, True, big, LOOPED),
             ("cuda", (8, 0), torch.bfloat16, True, small, DENSE), ("cuda", (8, 0), torch.bfloat16, True, big, LOOPED),
             ("cuda", (9, 0), torch.bfloat16, False, small, DENSE), ("cpu", None, torch.float64, True, small, DENSE),
             ("cpu", None, torch.float32, False, big, LOOPED)]
    for device, capability, dtype, aligned, nbytes, want in cases:
        path = grouped_path.choose(device, capability, dtype, aligned=aligned, product_bytes=nbytes)
        assert path.name == want and path.host_reads == (want == LOOPED), (device, capability, dtype, path)
    assert grouped_path.widths_aligned(torch.bfloat16, 128, 352) and not grouped_path.widths_aligned(torch.bfloat16, 6)


def _grouped_line(capsys, overrides):
    from mpoverlap.check import main

    assert main(overrides) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "grouped GEMM" in line]
    assert len(lines) == 1, lines
    return lines[0]


def test_check_prints_the_grouped_gemm_path_for_the_device(capsys, monkeypatch):
    """mpoverlap-check names the grouped path on the device the run would use: torch's kernel on
    CPU; with a GPU visible, its generation and the dtype decide (patched: sm80 in bf16 takes
    the looped fallback for a real model and says its host reads, sm90 the kernel); off with
    model.moe_grouped_gemm=false; no line for a dense model."""
    assert "torch._grouped_mm" in _grouped_line(capsys, ["model=moe_tiny", "train.device=cpu"])
    assert "grouped GEMM: off" in _grouped_line(capsys, ["model=moe_tiny", "train.device=cpu",
                                                         "model.moe_grouped_gemm=false"])
    from mpoverlap.check import main

    assert main(["model=gpt_tiny", "train.device=cpu"]) == 0 and "grouped GEMM" not in capsys.readouterr().out
    real = ["model=qwen3_moe_30b_a3b", "train.precision=bf16", "train.micro_batch_size=1", "train.device=cuda"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(grouped_path, "device_capability", lambda device: (8, 0))
    line = _grouped_line(capsys, real)
    assert "grouped GEMM: looped" in line and "not sm80" in line
    assert "1 host read(s) per MoE layer and microbatch" in line
    assert "dense" in _grouped_line(capsys, ["model=moe_tiny", "train.precision=bf16", "train.device=cuda"])
    monkeypatch.setattr(grouped_path, "device_capability", lambda device: (9, 0))
    assert "grouped GEMM: torch._grouped_mm" in _grouped_line(capsys, real)
    fp32 = _grouped_line(capsys, ["model=moe_tiny", "train.device=cuda"])  # fp32 on any GPU: no kernel
    assert "grouped GEMM: dense" in fp32 and "bf16 only" in fp32 and "no host read" in fp32


def test_plan_without_a_visible_gpu_states_the_rule_per_generation(monkeypatch):
    """The plan of a CUDA run drawn where no GPU is visible (render_plan with the device given)
    states both cases in bf16, one in fp32 (the kernel runs bf16 only)."""
    from mpoverlap.config import compose
    from mpoverlap.overlap.plan import render_plan

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def line(overrides):
        plan = render_plan(compose(["model=qwen3_moe_30b_a3b", "train.micro_batch_size=1", *overrides]),
                           device="cuda/nccl")
        return next(x for x in plan.splitlines() if "grouped GEMM" in x)

    bf16 = line(["train.precision=bf16"])
    assert "on sm90/sm100 torch._grouped_mm" in bf16 and "on other GPUs (e.g. sm80) looped" in bf16, bf16
    assert "grouped GEMM on any GPU: looped" in line([])
