"""A DataParallel bucket reduced in int8/fp8 (train.grad_reduce_dtype) equals the single-process
emulation of the same quantization path, bit for bit, over three steps with error feedback on
and off: plain data parallelism (a quantized reduce-scatter, then a quantized all-gather of the
reduced shard, both carrying residuals), ZeRO-1 (the reduce-scatter) and ZeRO-2 with two
microbatches (a reduce-scatter each, the residual carried from one to the next); two cases
again with overlap.dp=false (each collective waited at its issue: the same numbers). Every rank's
sent buffers are recorded at the issue; the emulation (comm/quantized.py emulate_*) gets them
all, keeps every rank's residuals itself and must give each rank's reduced gradient.

The buckets (a 3-layer MLP, widths 24 and 40, bucket 0.003 MiB) hold parameters of uneven
sizes, so shards end in partial blocks of the 512-element grid, and buckets are padded to the
group size. dp 2 in one spawn.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dist_harness import run_distributed  # noqa: E402

from mpoverlap.comm.quantized import emulate_all_gather, emulate_reduce_scatter  # noqa: E402
from mpoverlap.comm.wire import wire_format  # noqa: E402
from mpoverlap.data_parallel.grad_wire import GRAD_BLOCK  # noqa: E402

STEPS = 3
CASES = [(level, fmt, ef, True) for level in ("none", "optim", "optim_grads") for fmt in ("int8", "fp8")
         for ef in (True, False)]
CASES += [("none", "int8", True, False), ("optim_grads", "fp8", True, False)]  # overlap.dp=false: the same


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 40), nn.GELU(), nn.Linear(40, 40), nn.GELU(), nn.Linear(40, 7))


def _worker(rank, world):
    from mpoverlap.data_parallel import DataParallel
    from mpoverlap.parallel import ParallelState, RankGrid

    state = ParallelState.create(RankGrid(dp=world), torch.device("cpu"))
    out = {}
    for level, fmt, ef, overlap in CASES:
        model = make_model()
        ddp = DataParallel(model, state, group_kind="dp", overlap=overlap, bucket_mb=0.003, sharding=level,
                           ledger=None, grad_wire=fmt, error_feedback=ef,
                           units=None)
        sent = []  # per step: [(bucket, the fp32 buffer handed to the reduce-scatter)]
        original = ddp.wire.reduce_scatter

        def record(b, out_, send, group, *, ledger, _orig=original):
            sent[-1].append((b, send.detach().clone().numpy()))
            return _orig(b, out_, send, group, ledger=ledger)
        ddp.wire.reduce_scatter = record
        micro = 2 if level == "optim_grads" else 1
        reduced = []
        for step in range(STEPS):
            sent.append([])
            ddp.start_step()
            for i in range(micro):
                g = torch.Generator().manual_seed(100 * step + 10 * rank + i)
                x = torch.randn(5, 24, generator=g) * (1 + rank)
                ddp.set_last_microbatch(i == micro - 1)
                ddp(x).pow(2).mean().backward()
            ddp.finish_grad_sync()
            reduced.append({b.index: ddp.grad_shard(b.index).clone().numpy() for b in ddp.buffer.buckets})
            with torch.no_grad():
                for p in model.parameters():  # a fixed update, the same on every rank
                    p.mul_(0.9)
        # numpy: the results travel back pickled (a tensor would travel as a shared fd of a
        # process that has exited)
        out[(level, fmt, ef, overlap)] = {"sent": sent, "reduced": reduced,
                                 "numel": {b.index: b.numel for b in ddp.buffer.buckets}}
        ddp.close()
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(_worker, 2, timeout_s=120)


def emulate(case_runs, level: str, fmt_name: str, ef: bool):
    """Each rank's reduced bucket shards per step, from every rank's sent buffers."""
    fmt, g = wire_format(fmt_name), len(case_runs)
    numel = case_runs[0]["numel"]
    sent_res = [{b: torch.zeros(n) for b, n in numel.items()} for _ in range(g)] if ef else None
    owned_res = [{b: torch.zeros(n // g) for b, n in numel.items()} for _ in range(g)] if ef else None
    out = []
    for step in range(STEPS):
        shards = [{b: torch.zeros(n // g) for b, n in numel.items()} for _ in range(g)]
        sends = [run["sent"][step] for run in case_runs]
        for j in range(len(sends[0])):  # the sends in issue order (the same on every rank)
            b = sends[0][j][0]
            assert all(s[j][0] == b for s in sends)
            res = [r[b] for r in sent_res] if ef else None
            got = emulate_reduce_scatter([torch.from_numpy(s[j][1]) for s in sends], fmt, GRAD_BLOCK, res)
            for r in range(g):
                shards[r][b].add_(got[r])
        if level == "none":  # the second hop: every rank gathers the owners' shards
            full = {}
            for b in numel:
                res = [r[b] for r in owned_res] if ef else None
                full[b] = emulate_all_gather([shards[r][b] for r in range(g)], fmt, GRAD_BLOCK, res)
            shards = [dict(full) for _ in range(g)]
        out.append(shards)
    return out


@pytest.mark.parametrize("level,fmt,ef,overlap", CASES)
def test_bucket_equals_its_emulation(ranks, level, fmt, ef, overlap):
    runs = [r[(level, fmt, ef, overlap)] for r in ranks]
    assert len(runs[0]["numel"]) >= 2 and any(n % GRAD_BLOCK for n in runs[0]["numel"].values())
    want = emulate(runs, level, fmt, ef)
    for step in range(STEPS):
        for r, run in enumerate(runs):
            for b, got in run["reduced"][step].items():
                assert torch.equal(torch.from_numpy(got), want[step][r][b]), (step, r, b)
    # plain DP: both replicas hold the same reduced gradient
    if level == "none":
        for b in runs[0]["numel"]:
            assert (runs[0]["reduced"][-1][b] == runs[1]["reduced"][-1][b]).all()


def test_error_feedback_keeps_the_accumulated_error_at_one_step():
    """The property error feedback is for, on the emulation the bucket test holds DataParallel
    to: sending the same gradient K times, the sum of what arrives differs from K times the
    gradient by one send's residual with feedback (bounded), and by K times the same rounding
    without it (growing)."""
    torch.manual_seed(0)
    fmt = wire_format("int8")
    grads = [torch.randn(2 * 700) * (1 + r) for r in range(2)]
    for ef in (True, False):
        residuals = [torch.zeros(2 * 700) for _ in range(2)] if ef else None
        total = [torch.zeros(700) for _ in range(2)]
        K = 50
        for _ in range(K):
            for r, got in enumerate(emulate_reduce_scatter(grads, fmt, GRAD_BLOCK, residuals)):
                total[r].add_(got)
        want = sum(grads).view(2, 700)
        err = max(float((total[r] - K * want[r]).abs().max()) for r in range(2))
        one_send = max(float(g.abs().max()) for g in grads) / 254 * 2  # two ranks' rounding
        if ef:
            assert err <= 1.01 * one_send, (err, one_send)
        else:
            assert err > 5 * one_send, (err, one_send)


def test_simulate_says_what_each_gradient_format_saves():
    """`mpoverlap-check --simulate` prints the step under each train.grad_reduce_dtype; on a
    layout whose dp reduction is exposed, fewer bytes a gradient give a shorter step."""
    import re

    from mpoverlap.config import compose
    from mpoverlap.simulate.core import simulate
    from mpoverlap.simulate.hardware import from_config
    from mpoverlap.simulate.report import render

    cfg = compose(["parallel.dp=4", "model.num_layers=8", "model.hidden_size=256", "model.num_attention_heads=8",
                   "model.ffn_hidden_size=1024"])
    hw = from_config(cfg)
    line = next(x for x in render(cfg, hw, simulate(cfg, hw), 4).splitlines() if "per format" in x)
    steps = {f: float(ms) for f, ms in re.findall(r"(fp32|bf16|int8|fp8)(?: \(this run\))? ([\d.]+) ms", line)}
    assert set(steps) == {"fp32", "bf16", "int8", "fp8"} and "fp32 (this run)" in line
    assert steps["int8"] < steps["fp32"] and steps["fp8"] < steps["fp32"], line
