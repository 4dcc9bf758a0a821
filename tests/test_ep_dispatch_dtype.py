"""train.ep_dispatch_dtype=fp8: the MoE dispatch's forward exchange carries each token's hidden
vector in blocks of 128 (float8 e4m3, one fp32 scale a block, one uint8 row a token).

Exactness (one spawn of 2 gloo ranks, against single-process emulations): an exchange moves
rows without arithmetic, so every row a rank receives is `round_trip(row)` of the row its source
sent (the same quantization of that token's vector, dequantized into the activation dtype), bit
for bit: the all-to-all with uneven splits (the counted and the padded queues post it), the
all-gather (the all-gather dispatcher) and the pairing's exchange, fp32 and bf16 rows, a hidden
size with an uneven last block (200 = 128 + 72), rows of very different magnitudes (each its own
scales). The gradient of the sent rows is the straight-through one: the received rows' gradient
moved back unchanged (equal to the emulated reverse exchange). The MoE layer at ep 2 with fp8
dispatch (counted, capacity-padded and all-gather dispatchers, overlap on) matches the ep 1
layer whose experts read round-tripped rows (a straight-through node), to 1e-5 as the plain
dispatch matches its ep 1 reference (tests/test_moe.py): the summation order of the expert
gradients differs, nothing else.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dist_harness import run_distributed  # noqa: E402

from mpoverlap.comm.wire import packed_bytes, wire_format  # noqa: E402
from mpoverlap.moe.dispatch_wire import DispatchWire, resolve_dispatch_wire  # noqa: E402

FP8 = DispatchWire("fp8")
WIDE = 200  # two blocks, the last one 72 elements
SPLITS = [[3, 5], [4, 2]]  # SPLITS[src][dst]: rows rank src sends to rank dst


def rows(rank: int, n: int, hidden: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Rank `rank`'s rows: Gaussian, each row scaled by 10^(-3..3) so its blocks get their own scales."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    x = torch.randn(n, hidden, generator=g)
    x = x * torch.logspace(-3, 3, n).unsqueeze(1)
    return x.to(dtype)


def test_round_trip_is_the_blockwise_quantization_of_each_row():
    """A row's round trip is wire.dequantize(wire.quantize(row)) in the row's dtype, one row at a
    time; a zero row (capacity padding) stays zero; a row takes H + 4 per 128 elements bytes."""
    from mpoverlap.comm.wire import dequantize, quantize

    fmt = wire_format("fp8")
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.cat([rows(0, 5, WIDE, dtype), torch.zeros(1, WIDE, dtype=dtype)])
        got = FP8.round_trip(x)
        assert got.dtype == dtype and got.shape == x.shape
        for i in range(x.shape[0]):
            want = dequantize(quantize(x[i:i + 1], fmt, 128), WIDE, fmt, 128).to(dtype)
            assert torch.equal(got[i:i + 1], want), (dtype, i)
        assert torch.equal(got[-1], torch.zeros(WIDE, dtype=dtype))
        err = ((got[:-1].float() - x[:-1].float()).abs() / x[:-1].float().abs().amax(1, keepdim=True)).max()
        assert 0 < err <= 2 ** -4, err  # e4m3: 3 mantissa bits
    assert FP8.row_bytes(128) == 128 + 4 and FP8.row_bytes(WIDE) == 256 + 8 == packed_bytes(WIDE, fmt, 128)
    assert resolve_dispatch_wire("auto", "bf16") is None and resolve_dispatch_wire("bf16", "bf16") is None
    bf16 = resolve_dispatch_wire("bf16", "fp32")
    x = rows(0, 5, WIDE, torch.float32)
    assert bf16.row_bytes(128) == 256 and torch.equal(bf16.round_trip(x), x.bfloat16().float())


def test_round_trip_operators_do_not_grow_with_rows_or_width():
    """All rows of an exchange in one call: the same operators for 8 rows or 512, hidden 128 or
    1024 (no loop over tokens, blocks or experts), and no host read."""
    from mpoverlap.training.host_sync import count_host_reads
    from mpoverlap.training.launch_count import count_launches

    ops = []
    for n, hidden in ((8, 128), (512, 128), (8, 1024)):
        x = rows(0, n, hidden, torch.bfloat16)
        with count_launches() as launches, count_host_reads() as reads:
            FP8.round_trip(x)
        assert reads.count == 0, reads.summary()
        ops.append(launches.ops)
    assert ops[0] == ops[1] == ops[2] > 0, ops


class _StraightThrough(torch.autograd.Function):
    """round_trip(x) forward, identity backward: the emulation of the fp8 dispatch."""

    @staticmethod
    def forward(ctx, x):
        return FP8.round_trip(x)

    @staticmethod
    def backward(ctx, g):
        return g


def _exchange_checks(rank, group, dtype):
    from mpoverlap.comm import CommLedger
    from mpoverlap.moe.exchange import Pending, TokenExchange, issue_all_gather, issue_all_to_all
    from mpoverlap.pairing.tape import Exchange, Tape

    out = {}
    x_of = {q: rows(q, sum(SPLITS[q]), WIDE, dtype) for q in (0, 1)}
    g_of = {q: rows(q, sum(SPLITS[p][q] for p in (0, 1)), WIDE, dtype, seed=1) for q in (0, 1)}
    # all-to-all: rank q's rows [a, b) for rank `rank` where a = sum(SPLITS[q][:rank])
    mine = {q: x_of[q][sum(SPLITS[q][:rank]):sum(SPLITS[q][:rank + 1])] for q in (0, 1)}
    want = torch.cat([FP8.round_trip(mine[q]) for q in (0, 1)])
    for overlap in (False, True):
        ledger = CommLedger()
        x = x_of[rank].clone().requires_grad_()
        out_splits, in_splits = [SPLITS[q][rank] for q in (0, 1)], SPLITS[rank]
        h, link = issue_all_to_all(x, group, out_splits, in_splits, ledger, TokenExchange(group, ledger, overlap, None, 1),
                                   wire=FP8)
        got, = Pending([h], [link], {}).wait()
        got.backward(g_of[rank])
        # straight-through: x's gradient is the received rows' gradients sent back as they are
        grad_want = torch.cat([g_of[q][sum(SPLITS[p][q] for p in range(rank)):][:SPLITS[rank][q]] for q in (0, 1)])
        out[("a2a", overlap)] = dict(rows=torch.equal(got, want), dtype=got.dtype == dtype,
                                     grad=torch.equal(x.grad, grad_want),
                                     bytes=ledger.summary()["ep"]["bytes"],
                                     sent=sum(SPLITS[rank]) * packed_bytes(WIDE, FP8.fmt, 128),
                                     grad_bytes=sum(SPLITS[q][rank] for q in (0, 1)) * WIDE * x.element_size())
    # all-gather: every rank's rows, each round-tripped
    ledger = CommLedger()
    x = x_of[rank][:4].clone().requires_grad_()
    h, link = issue_all_gather(x, group, 2, ledger, TokenExchange(group, ledger, False, None, 1), wire=FP8)
    got, = Pending([h], [link], {}).wait()
    out["gather"] = dict(rows=torch.equal(got, torch.cat([FP8.round_trip(x_of[q][:4]) for q in (0, 1)])),
                         bytes=ledger.summary()["ep"]["bytes"], sent=8 * packed_bytes(WIDE, FP8.fmt, 128))
    # the pairing's exchange between two tape segments
    tape = Tape(0)
    ex = Exchange(tape, "d", x_of[rank].clone().requires_grad_(), group, None,
                  splits=([SPLITS[q][rank] for q in (0, 1)], SPLITS[rank]), wire=FP8)
    out["pairing"] = dict(rows=torch.equal(ex.wait(tape), want))
    return out


def _layer_checks(rank, group):
    """The ep 2 layer with fp8 dispatch against the ep 1 layer whose experts read round-tripped rows."""
    from test_moe import _grads, layer, rel_err, tokens

    x_of, w_of = {q: tokens(100 + q) for q in (0, 1)}, {q: tokens(200 + q) for q in (0, 1)}
    out = {}
    for name, kw in (("counted", {}), ("padded", dict(capacity_factor=0.75)), ("allgather", dict(dispatcher="allgather"))):
        cap = {k: v for k, v in kw.items() if k == "capacity_factor"}
        refs = {}
        for q in (0, 1):
            ref = layer(num_chunks=3, **cap)
            inner = ref.experts.forward
            ref.experts.forward = lambda t, n, inner=inner: inner(_StraightThrough.apply(t), n)
            refs[q] = _grads(ref, x_of[q], w_of[q])
        moe = layer(group, 2, rank, overlap=True, num_chunks=3, dispatch_wire=FP8, **kw)
        got = _grads(moe, x_of[rank], w_of[rank])
        exp_ref = {n: sum(refs[q]["experts"][n] for q in (0, 1)) for n in got["experts"]}
        out[name] = dict(y=rel_err(got["y"], refs[rank]["y"]), dx=rel_err(got["dx"], refs[rank]["dx"]),
                         router=rel_err(got["router"], refs[rank]["router"]),
                         experts=max(rel_err(g, exp_ref[n]) for n, g in got["experts"].items()),
                         pads=moe.dispatcher.pads_capacity)
    return out


def _worker(rank, world):
    from mpoverlap.parallel import ParallelState, RankGrid

    st = ParallelState.create(RankGrid(dp=2, ep=2), torch.device("cpu"))
    group = st.group("ep")
    report = {dtype: _exchange_checks(rank, group, dtype) for dtype in (torch.float32, torch.bfloat16)}
    report["layer"] = _layer_checks(rank, group)
    return report


@pytest.fixture(scope="module")
def reports():
    return run_distributed(_worker, 2, timeout_s=120)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_exchanged_rows_are_the_emulated_round_trip_bit_for_bit(reports, dtype):
    for rank, rep in enumerate(reports):
        r = rep[dtype]
        for overlap in (False, True):
            a = r[("a2a", overlap)]
            assert a["rows"] and a["dtype"], (rank, overlap, a)
            assert a["grad"], (rank, overlap, "the straight-through gradient")
            # the forward carries packed rows, the backward the gradient in the activation dtype
            assert a["bytes"] == a["sent"] + a["grad_bytes"], (rank, a)
        assert r["gather"]["rows"] and r["gather"]["bytes"] == r["gather"]["sent"], (rank, r["gather"])
        assert r["pairing"]["rows"], rank


@pytest.mark.parametrize("name", ["counted", "padded", "allgather"])
def test_fp8_layer_matches_the_emulated_ep1_layer(reports, name):
    for rank, rep in enumerate(reports):
        r = rep["layer"][name]
        assert r["pads"] == (name == "padded"), r
        for what in ("y", "dx", "router", "experts"):
            assert r[what] < 1e-5, (rank, name, what, r[what])


def test_one_rank_refuses_fp8():
    from mpoverlap.moe import AllToAllDispatcher

    with pytest.raises(ValueError, match="ep_size > 1"):
        AllToAllDispatcher(None, 1, 0, 8, dispatch_wire=FP8)


def test_simulate_says_what_fp8_dispatch_saves():
    """`--simulate` simulates the layout again with the other dispatch format: fp8 moves a
    smaller forward (less ep in flight, the backward unchanged), nothing where fp8 cannot run."""
    from mpoverlap.config import compose
    from mpoverlap.simulate.core import simulate
    from mpoverlap.simulate.formats import format_lines
    from mpoverlap.simulate.hardware import from_config

    args = ["model=moe_350m", "parallel.dp=8", "parallel.ep=8", "train.precision=bf16", "train.global_batch_size=64"]
    runs = {}
    for fmt in ("auto", "fp8"):
        cfg = compose([*args, f"train.ep_dispatch_dtype={fmt}"])
        runs[fmt] = simulate(cfg, from_config(cfg))
        line, = format_lines(cfg, from_config(cfg), [*args, f"train.ep_dispatch_dtype={fmt}"], runs[fmt])
        assert "fp8 saves" in line, line
    assert runs["fp8"].in_flight_s["ep"] < runs["auto"].in_flight_s["ep"]
    assert runs["fp8"].step_s <= runs["auto"].step_s
    cfg = compose(["model=moe_350m", "train.precision=bf16"])  # ep 1: nothing to compress
    assert format_lines(cfg, from_config(cfg), ["model=moe_350m"], simulate(cfg, from_config(cfg))) == []
