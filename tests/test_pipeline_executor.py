"""PipelineExecutor on 4 gloo ranks (one spawn) against a single-process reference.

Toy model: 8 x (Linear(H, H) + tanh), split into pp * vpp model chunks (chunk c = vchunk *
pp + stage holds layers [c * 8 / (pp vpp), (c + 1) * 8 / (pp vpp))), loss = mean over
microbatches of the squared error. Layouts: pp=4 (grid pp=4) and pp=2 (grid dp=2 x pp=2, two
pipelines side by side with different data), vpp 1 and 2, overlap on and off.
"""
import contextlib
import io
import os
import sys
import time

import pytest
import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dist_harness import run_distributed  # noqa: E402
from weight_grad_landings import assert_weight_grads_land_in_their_w, watch_landings  # noqa: E402

from mpoverlap.comm.ledger import CommLedger  # noqa: E402
from mpoverlap.parallel import ParallelState, RankGrid  # noqa: E402
from mpoverlap.pipeline import (PipelineExecutor, build_schedule, chunk_index, chunk_layout,  # noqa: E402
                                schedule_kind)
from mpoverlap.pipeline.actions import is_local  # noqa: E402

H, B, NUM_LAYERS = 16, 4, 8
# (pp, vpp, microbatches): m is not a multiple of pp in every layout but one.
LAYOUTS = [(4, 1, 6), (4, 2, 6), (4, 2, 4), (2, 1, 5), (2, 2, 5)]
# Receives posted before the compute preceding their consumer, per rank, with overlap on (of
# 6/11/11/5, 18/23/23/17, 12/15/15/11, 5/5/4/4 and 15/15/14/14 receives after the first compute).
RECEIVES_AHEAD = {(4, 1, 6): [3, 5, 5, 5], (4, 2, 6): [12, 11, 11, 16], (4, 2, 4): [7, 7, 7, 9],
                  (2, 1, 5): [1, 1, 4, 4], (2, 2, 5): [9, 9, 12, 12]}
CONFIGS = [(pp, vpp, m, overlap) for pp, vpp, m in LAYOUTS for overlap in (False, True)]
# zero bubble (zb1p): the layers defer their weight gradients to the W actions
ZB_CONFIGS = [(4, 1, 6, True), (2, 2, 5, False)]
# zbv: two chunks per stage in a V (stage s: chunks s and 2pp-1-s; the loss on stage 0, the
# turn chunk pp-1 -> pp handed over in memory on stage pp-1)
ZBV_CONFIGS = [(4, 2, 6, True), (2, 2, 4, False)]
ZBV_TIED = (2, 2, 4, True)  # layer 7 is layer 0: a weight both chunks of stage 0 use


def make_layers(linear=nn.Linear):
    torch.manual_seed(0)
    return [linear(H, H) for _ in range(NUM_LAYERS)]


def make_data(dp_rank, m):
    g = torch.Generator().manual_seed(100 + dp_rank)
    return torch.randn(m, B, H, generator=g), torch.randn(m, B, H, generator=g)


def layers_of_chunk(chunk, num_chunks):
    per = NUM_LAYERS // num_chunks
    return range(chunk * per, (chunk + 1) * per)


def tie_ends(layers):
    """The last layer is the first one (one module at both ends of the model, as a tied
    embedding and head are): in zbv's V both sit on stage 0."""
    layers[-1] = layers[0]
    return layers


def reference(dp_rank, m, tied=False):
    """Single process: per-microbatch backward in microbatch order (the pipeline's order)."""
    layers = tie_ends(make_layers()) if tied else make_layers()
    xs, ys = make_data(dp_rank, m)
    losses, xgrads = [], []
    for mb in range(m):
        x = xs[mb].clone().requires_grad_()
        h = x
        for layer in layers:
            h = torch.tanh(layer(h))
        loss = ((h - ys[mb]) ** 2).mean() / m
        loss.backward()
        losses.append(loss.detach())
        xgrads.append(x.grad)
    grads = {i: (layer.weight.grad, layer.bias.grad) for i, layer in enumerate(layers)}
    return losses, grads, xgrads


def run_layout(state, pp, vpp, m, overlap, verbose=False, steps=1, schedule=None, tied=False):
    stage, dp_rank, num_chunks = state.coords.pp, state.coords.dp, pp * vpp
    layout = chunk_layout(schedule or schedule_kind(vpp))
    weight_grads, shared, accumulations = None, [], []
    landings = []  # (layer, action index) of every weight-gradient accumulation (zb1p / zbv)
    if schedule in ("zb1p", "zbv"):
        from mpoverlap.wgrad import Linear, WeightGradDeferral, attach_deferral

        layers, weight_grads = make_layers(Linear), WeightGradDeferral()
        # which action is computing when each layer weight's gradient accumulates (`executor`: below)
        landings, _ = watch_landings(lambda: executor.trace, weight_grads,
                                     [(i, layer.weight) for i, layer in enumerate(layers)])
        if tied:
            layers = tie_ends(layers)
            if stage == 0:  # the V's stage 0 runs both ends: one weight, two chunks' W's
                shared = [layers[0].weight, layers[0].bias]
                # counted as the data-parallel hooks count: B's empty calls for a deferred weight skipped
                layers[0].weight.register_post_accumulate_grad_hook(
                    lambda p: None if weight_grads.withheld(p) else accumulations.append(1))
        attach_deferral(nn.ModuleList(layers), weight_grads)
    else:
        layers = make_layers()
    xs, ys = make_data(dp_rank, m)
    x_leaves, hook_calls = {}, []

    def forward_step(vchunk, mb, input_tensor):
        chunk = chunk_index(stage, vchunk, pp, layout)
        if input_tensor is None:
            input_tensor = x_leaves[mb] = xs[mb].clone().requires_grad_()
        h = input_tensor
        for i in layers_of_chunk(chunk, num_chunks):
            h = torch.tanh(layers[i](h))
        return ((h - ys[mb]) ** 2).mean() / m if chunk == num_chunks - 1 else h

    ledger = CommLedger()
    tables = build_schedule(schedule or schedule_kind(vpp), pp, vpp, m)
    executor = PipelineExecutor(
        tables[stage], stage=stage, pp_ranks=state.ranks("pp"), group=state.group("pp"),
        overlap=overlap, ledger=ledger, tensor_shape=(B, H), dtype=torch.float32, device="cpu",
        forward_step=forward_step, backward_hook=lambda *call: hook_calls.append(call),
        verbose=verbose, weight_grads=weight_grads, shared_params=shared)
    # An independent count of what reaches torch: batch_isend_irecv calls and their ops.
    torch_calls = []
    batch_isend_irecv = torch.distributed.batch_isend_irecv

    def counted(ops):
        torch_calls.append(len(ops))
        return batch_isend_irecv(ops)
    torch.distributed.batch_isend_irecv = counted
    try:
        for _ in range(steps):  # the same executor runs every step; report the last one
            for layer in layers:
                layer.zero_grad(set_to_none=True)
            x_leaves.clear(), hook_calls.clear(), torch_calls.clear(), accumulations.clear(), landings.clear()
            stderr = io.StringIO()
            with contextlib.redirect_stderr(stderr):
                started = time.perf_counter()
                losses = executor.run(m)
                run_s = time.perf_counter() - started
    finally:
        torch.distributed.batch_isend_irecv = batch_isend_irecv
    trace = executor.trace
    compute_at = {i: k for k, (event, i, _) in enumerate(trace) if event == "compute"}
    posted_ahead = sum(1 for k, (event, i, _) in enumerate(trace)
                       if event == "post_recv" and i > 0 and k < compute_at[i - 1])
    own = [i for v in range(vpp) for i in layers_of_chunk(chunk_index(stage, v, pp, layout), num_chunks)]
    summary = ledger.summary()
    return {
        # Plain lists: tensors would travel through shared memory that dies with the worker.
        "stage": stage, "dp": dp_rank, "losses": [loss.tolist() for loss in losses],
        "grads": {i: (layers[i].weight.grad.tolist(), layers[i].bias.grad.tolist()) for i in own},
        "xgrads": {mb: x.grad.tolist() for mb, x in x_leaves.items()},
        "pp_ops": summary.get("pp", {}).get("ops", 0), "expected_ops": executor.p2p_calls_per_run,
        "pp_bytes": summary.get("pp", {}).get("bytes", 0), "torch_calls": len(torch_calls),
        "torch_ops": sum(torch_calls),
        "receives": sum(1 for k, (event, i, _) in enumerate(trace) if event == "post_recv" and i > 0),
        "messages": sum(msg is not None and not is_local(msg, pp, layout)
                        for a in tables[stage] for msg in (a.recv, a.send)),
        "loss_stage": 0 if layout == "v" else pp - 1,
        "posted_ahead": posted_ahead, "hooks": hook_calls, "bubble_s": executor.bubble_s, "run_s": run_s,
        "times_ordered": all(t0 <= t1 for (_, _, t0), (_, _, t1) in zip(trace, trace[1:])),
        "verbose_lines": stderr.getvalue().splitlines(), "shared_accumulations": len(accumulations),
        "landings": landings, "table": [(a.kind, a.microbatch, a.vchunk, a.chunk) for a in tables[stage]],
    }


def _worker(rank, world):
    states = {4: ParallelState.create(RankGrid(pp=4), torch.device("cpu")),
              2: ParallelState.create(RankGrid(dp=2, pp=2), torch.device("cpu"))}
    out = {}
    for pp, vpp, m, overlap in CONFIGS:
        out[(pp, vpp, m, overlap)] = run_layout(states[pp], pp, vpp, m, overlap)
    out["verbose"] = run_layout(states[2], 2, 2, 5, True, verbose=True, steps=2)
    for pp, vpp, m, overlap in ZB_CONFIGS:
        out[("zb1p", pp, vpp, m, overlap)] = run_layout(states[pp], pp, vpp, m, overlap, schedule="zb1p")
    for pp, vpp, m, overlap in ZBV_CONFIGS:
        out[("zbv", pp, vpp, m, overlap)] = run_layout(states[pp], pp, vpp, m, overlap, schedule="zbv")
    out["zbv_tied"] = run_layout(states[2], *ZBV_TIED, schedule="zbv", tied=True)
    return out


@pytest.fixture(scope="module")
def reports():
    return run_distributed(_worker, 4, timeout_s=170)


def rel_err(a, b):
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("pp,vpp,m,overlap", CONFIGS)
def test_bubble_is_the_receive_wait_inside_the_step(reports, pp, vpp, m, overlap):
    for r in reports:
        got = r[(pp, vpp, m, overlap)]
        assert 0 <= got["bubble_s"] <= got["run_s"]
        if got["stage"] > 0:  # its first forward waits for the activations of every stage before
            assert got["bubble_s"] > 0


@pytest.mark.parametrize("key", CONFIGS + [("zb1p", *c) for c in ZB_CONFIGS] + [("zbv", *c) for c in ZBV_CONFIGS],
                         ids=str)
def test_matches_single_process_reference(reports, key):
    pp, vpp, m, overlap = key[-4:]
    seen_layers = {0: set(), 1: set()}
    for rank_report in reports:
        r = rank_report[key]
        ref_losses, ref_grads, ref_xgrads = reference(r["dp"], m)
        if r["stage"] == r["loss_stage"]:
            assert len(r["losses"]) == m
            for got, want in zip(r["losses"], ref_losses):
                assert rel_err(got, want) < 1e-6
        else:
            assert r["losses"] == []
        for i, (w, b) in r["grads"].items():
            assert rel_err(w, ref_grads[i][0]) < 1e-6 and rel_err(b, ref_grads[i][1]) < 1e-6, i
            seen_layers[r["dp"]].add(i)
        if r["stage"] == 0:  # input gradients of the data, too
            assert sorted(r["xgrads"]) == list(range(m))
            for mb, g in r["xgrads"].items():
                assert rel_err(g, ref_xgrads[mb]) < 1e-6
    assert seen_layers[0] == set(range(NUM_LAYERS))
    if pp == 2:
        assert seen_layers[1] == set(range(NUM_LAYERS))


@pytest.mark.parametrize("pp,vpp,m", LAYOUTS)
def test_overlap_on_off_bitwise_identical(reports, pp, vpp, m):
    for rank_report in reports:
        off, on = rank_report[(pp, vpp, m, False)], rank_report[(pp, vpp, m, True)]
        assert off["losses"] == on["losses"]  # float32 values, compared exactly
        assert off["grads"] == on["grads"] and off["xgrads"] == on["xgrads"]


@pytest.mark.parametrize("key", CONFIGS + [("zbv", *c) for c in ZBV_CONFIGS], ids=str)
def test_ledger_counts_pp_ops(reports, key):
    for rank_report in reports:
        r = rank_report[key]
        # The ledger against what reached torch: one handle per batch_isend_irecv call, one op per
        # message of the action table (zbv's turn: none), each message a [B, H] fp32 tensor.
        assert r["pp_ops"] == r["torch_calls"] == r["expected_ops"] > 0
        assert r["torch_ops"] == r["messages"]
        assert r["pp_bytes"] == r["messages"] * B * H * 4


@pytest.mark.parametrize("pp,vpp,m", LAYOUTS)
def test_overlap_posts_receives_before_the_preceding_compute(reports, pp, vpp, m):
    ahead = [rank_report[(pp, vpp, m, True)]["posted_ahead"] for rank_report in reports]
    lazy = [rank_report[(pp, vpp, m, False)]["posted_ahead"] for rank_report in reports]
    receives = [rank_report[(pp, vpp, m, True)]["receives"] for rank_report in reports]
    print(f"\npp {pp} vpp {vpp} m {m}: posted ahead {ahead} of {receives} receives; lazy {lazy}")
    # The posting order is a pure function of the table (no clock): its counts per rank,
    # pinned. Off, a receive goes ahead only where the global message order forces it.
    assert ahead == RECEIVES_AHEAD[(pp, vpp, m)], (ahead, receives)
    assert all(a >= b for a, b in zip(ahead, lazy)) and sum(ahead) - sum(lazy) >= 0.25 * sum(receives)
    assert all(rank_report[(pp, vpp, m, True)]["times_ordered"] for rank_report in reports)


@pytest.mark.parametrize("pp,vpp,m,overlap", CONFIGS)
def test_backward_hook_marks_last_backward_of_each_chunk(reports, pp, vpp, m, overlap):
    for rank_report in reports:
        calls = rank_report[(pp, vpp, m, overlap)]["hooks"]
        assert len(calls) == m * vpp
        for v in range(vpp):
            mine = [c for c in calls if c[0] == v]
            assert [c[2] for c in mine] == [False] * (m - 1) + [True]


@pytest.mark.parametrize("pp,vpp,m,overlap", ZB_CONFIGS)
def test_zb1p_hook_marks_the_last_b_and_the_last_w(reports, pp, vpp, m, overlap):
    """Before each B and each W; True at the last B (norms and biases are final) and at the
    last W (the deferred weights are) of each chunk, so DP issues its buckets from W."""
    for rank_report in reports:
        calls = rank_report[("zb1p", pp, vpp, m, overlap)]["hooks"]
        assert len(calls) == 2 * m * vpp
        for v in range(vpp):
            flags = [c[2] for c in calls if c[0] == v]
            assert flags[-1] and sum(flags) == 2


@pytest.mark.parametrize("key", [("zb1p", *c) for c in ZB_CONFIGS] + [("zbv", *c) for c in ZBV_CONFIGS] +
                         ["zbv_tied"], ids=str)
def test_weight_gradients_land_in_w_actions_after_their_b(reports, key):
    """Every deferring schedule (zb1p, zbv): each layer weight's gradient reaches the parameter
    while a W action computes, after its B, and each W lands exactly the weights of its chunk
    (tests/weight_grad_landings.py). The paired tables (the paired V, paired zb1p) are checked
    the same way on GPT chunks in tests/test_zero_bubble_parity.py."""
    pp, vpp = (ZBV_TIED if key == "zbv_tied" else key[1:])[:2]
    for rank_report in reports:
        r = rank_report[key]
        table = r["table"]
        def expected(i):  # the tied weight lands in the microbatch's last W only (see below)
            return None if key == "zbv_tied" else set(layers_of_chunk(table[i][3], pp * vpp))
        assert_weight_grads_land_in_their_w(table, r["landings"], expected, (key, r["stage"]))


def test_second_step_and_verbose_lines(reports):
    """The verbose run is the executor's second step: same numbers as a fresh executor."""
    for rank, rank_report in enumerate(reports):
        r = rank_report["verbose"]
        assert (r["losses"], r["grads"], r["xgrads"]) == tuple(rank_report[(2, 2, 5, True)][k] for k in
                                                              ("losses", "grads", "xgrads"))
        lines = r["verbose_lines"]
        assert len(lines) == r["messages"]
        assert all(line.startswith("[pp-p2p] step 1 call ") and f" rank {rank} " in line for line in lines)
        assert any(" send to rank " in line for line in lines) and any(" recv from rank " in line for line in lines)
        assert all(" mb " in line and " vchunk " in line for line in lines)


def test_zbv_weight_shared_by_two_chunks_accumulates_once_per_microbatch(reports):
    """A weight both chunks of stage 0 use (zbv's tied embedding and head): the executor folds
    the earlier W's share into the microbatch's last W, so the parameter accumulates once per
    microbatch (what the data-parallel hooks count on), and its gradient is the reference's."""
    pp, vpp, m, _ = ZBV_TIED
    for rank_report in reports:
        r = rank_report["zbv_tied"]
        ref_losses, ref_grads, _ = reference(r["dp"], m, tied=True)
        for i, (w, b) in r["grads"].items():
            assert rel_err(w, ref_grads[i][0]) < 1e-6 and rel_err(b, ref_grads[i][1]) < 1e-6, i
        if r["stage"] == 0:
            assert sorted(r["grads"]) == [0, 1, 6, 7]
            assert r["shared_accumulations"] == m
            for got, want in zip(r["losses"], ref_losses):
                assert rel_err(got, want) < 1e-6
