"""MoE: router, permutation, experts, dispatchers and the overlapped layer.

Single-process checks against direct computations, then one spawn of 4 gloo ranks that runs
every distributed check (grids dp=4 with ep=2 and ep=4) against the ep=1 reference."""
from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from mpoverlap.models.init import init_tensor
from mpoverlap.moe import build_moe_layer, permute, unpermute
from mpoverlap.moe.router import TopKRouter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dist_harness import run_distributed  # noqa: E402

CFG = SimpleNamespace(init_std=0.5, num_layers=2)
H, F, E, K, SEED = 8, 12, 8, 2, 3


def rel_err(got, want):
    got, want = got.detach(), want.detach()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-12)) if want.numel() else 0.0


def tokens(seed, shape=(2, 6, H)):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


class Shared(nn.Module):
    """A dense MLP used as the shared expert; layout-independent init."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(init_tensor("l0.moe.shared.weight", (H, H), CFG, SEED))

    def forward(self, x):
        return torch.tanh(x @ self.w.t())


def layer(ep_group=None, ep_size=1, ep_rank=0, overlap=False, shared=False, **kw):
    kw.setdefault("aux_loss_coeff", 0.01)
    kw.setdefault("z_loss_coeff", 0.001)
    return build_moe_layer(H, F, E, K, name="l0.moe", cfg=CFG, seed=SEED, ep_group=ep_group,
                           ep_size=ep_size, ep_rank=ep_rank, overlap=overlap,
                           shared_expert=Shared() if shared else None, **kw)


# ---------------------------------------------------------------- single process

def test_router_matches_direct_computation():
    router = TopKRouter(H, E, K, name="r", cfg=CFG, seed=1, aux_loss_coeff=0.1, z_loss_coeff=0.01)
    x = tokens(0, (10, H))
    out = router(x)
    logits = x @ router.weight.detach().t()
    probs = torch.softmax(logits, -1)
    counts = torch.zeros(E)
    for t in range(10):
        order = sorted(range(E), key=lambda e: -float(probs[t, e]))[:K]
        assert out.expert_ids[t].tolist() == order
        want = probs[t, order] / probs[t, order].sum()
        assert torch.allclose(out.weights[t], want, atol=1e-6)
        for e in order:
            counts[e] += 1
    aux = E * sum(counts[e] / (10 * K) * probs[:, e].mean() for e in range(E))
    z = (torch.logsumexp(logits, -1) ** 2).mean()
    assert torch.allclose(out.aux_loss, 0.1 * aux, rtol=1e-5)
    assert torch.allclose(out.z_loss, 0.01 * z, rtol=1e-5)
    assert out.stats["tokens_per_expert"].tolist() == counts.long().tolist()
    assert int(out.stats["dropped"]) == 0
    (out.aux_loss + out.z_loss + out.weights.sum()).backward()
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_capacity_drops_are_counted():
    router = TopKRouter(H, 4, 1, name="r", cfg=CFG, seed=1, capacity_factor=1.0)
    with torch.no_grad():
        router.weight.zero_()
        router.weight[0, 0] = 10.0  # every token with x[:, 0] > 0 prefers expert 0
    x = torch.ones(8, H)
    out = router(x)  # capacity = ceil(1.0 * 8 * 1 / 4) = 2
    assert out.expert_ids[:, 0].tolist() == [0, 0] + [-1] * 6
    assert out.weights[:, 0].tolist() == [1.0, 1.0] + [0.0] * 6
    assert int(out.stats["dropped"]) == 6
    assert out.stats["tokens_per_expert"].tolist() == [2, 0, 0, 0]


def test_permute_unpermute_exact_round_trip():
    x = tokens(1, (9, H))
    ids = torch.randint(0, E, (9, K), generator=torch.Generator().manual_seed(2))
    ids[3, 1] = -1  # a dropped slot
    xp, order, counts = permute(x, ids, E)
    assert counts.sum() == 9 * K - 1 and counts.tolist() == torch.bincount(ids[ids >= 0], minlength=E).tolist()
    flat = ids.reshape(-1)[order]
    assert torch.all(flat[1:] >= flat[:-1])  # grouped by expert
    for e in range(E):  # stable: token order within an expert
        assert torch.all(order[flat == e].diff() > 0)
    slots = unpermute(xp, order, 9, K)
    want = x.unsqueeze(1).expand(9, K, H).clone()
    want[3, 1] = 0
    assert torch.equal(slots, want)
    assert torch.equal(unpermute(xp, order, 9, K, torch.ones(9, K)), want.sum(1))


def expert_reference(moe):
    """{global expert: its MLP as plain math on the weights under its per-expert names}."""
    w = moe.experts.global_names()
    gelu = any(n.endswith(".up.weight") for n in w)

    def mlp(g):
        base = f"l0.moe.experts.{g}"
        w_in, w_out = w[f"{base}.{'up' if gelu else 'gate_up'}.weight"], w[f"{base}.down.weight"]

        def run(x):
            h = x @ w_in.t()
            if gelu:
                return torch.nn.functional.gelu(h) @ w_out.t()
            gate, up = h.chunk(2, dim=-1)
            return (torch.nn.functional.silu(gate) * up) @ w_out.t()
        return run
    return {g: mlp(g) for g in range(moe.experts.first_expert_index,
                                     moe.experts.first_expert_index + moe.experts.num_local_experts)}


def dense_reference(moe, x):
    """Loop over tokens and their experts: y_t = sum_j w_tj * expert_{e_tj}(x_t) (+ shared)."""
    xf = x.reshape(-1, H)
    r = moe.router(xf)
    experts = expert_reference(moe)
    rows = []
    for t in range(xf.shape[0]):
        y = xf.new_zeros(H)
        for j in range(r.expert_ids.shape[1]):
            e = int(r.expert_ids[t, j])
            if e >= 0:
                y = y + r.weights[t, j] * experts[e](xf[t:t + 1])[0]
        rows.append(y)
    y = torch.stack(rows)
    if moe.shared_expert is not None:
        y = y + moe.shared_expert(xf)
    return y.view(x.shape)


@pytest.mark.parametrize("kw", [dict(), dict(overlap=True, num_chunks=3, shared=True),
                                dict(activation="gelu", capacity_factor=0.75),
                                dict(dispatcher="allgather", overlap=True, shared=True),
                                # the per-expert loop (model.moe_grouped_gemm=false)
                                dict(grouped_gemm=False, overlap=True, shared=True),
                                dict(grouped_gemm=False, activation="gelu", capacity_factor=0.75)])
def test_layer_ep1_matches_dense_reference(kw):
    moe = layer(**kw)
    x = tokens(5).requires_grad_()
    y, r = moe(x)
    x_ref = x.detach().clone().requires_grad_()
    y_ref = dense_reference(moe, x_ref)
    assert rel_err(y, y_ref) < 1e-5
    w = tokens(6)
    g, = torch.autograd.grad((y * w).sum(), x)
    g_ref, = torch.autograd.grad((y_ref * w).sum(), x_ref)
    assert rel_err(g, g_ref) < 1e-5
    if "capacity_factor" in kw:
        assert int(r.stats["dropped"]) > 0


MOE_CONFIGS = [dict(), dict(overlap=True, num_chunks=4, shared=True), dict(capacity_factor=0.75, num_chunks=4),
               dict(dispatcher="allgather", overlap=True, num_chunks=4, shared=True),
               # the fine-grained router options: sigmoid scores with the aux-loss-free bias, top-k-then-softmax
               dict(capacity_factor=0.75, num_chunks=4, router_options=dict(score="sigmoid", bias_update_rate=0.01)),
               dict(overlap=True, num_chunks=4, shared=True, router_options=dict(order="topk_score", norm_topk=False))]


@pytest.mark.parametrize("kw", MOE_CONFIGS + [dict(grouped_gemm=False, **c) for c in MOE_CONFIGS[:3]])
def test_no_host_read_at_ep1(kw):
    """At ep 1 the grouped experts take the rows per expert as a device tensor, so
    forward and backward of an MoE layer read nothing on the host, whatever the chunking,
    capacity or dispatcher. The per-expert loop (grouped_gemm=False) splits by host ints:
    one read (every chunk's counts together)."""
    from mpoverlap.training.host_sync import count_host_reads

    moe = layer(**kw)
    x = tokens(5).requires_grad_()
    with count_host_reads() as reads:
        y, r = moe(x)
        ((y * y).sum() + r.aux_loss + r.z_loss).backward()
    if kw.get("grouped_gemm", True):
        assert reads.count == 0, reads.summary()
    else:
        assert reads.count == 1 and reads.by_kind() == {"tolist": 1}, reads.summary()


@pytest.mark.parametrize("kw", MOE_CONFIGS)
def test_no_tensor_is_made_off_its_inputs_device(kw):
    """Every index and count tensor is created on the tokens' device (the
    default device is meta during the pass, so a device-less tensor would show)."""
    from mpoverlap.training.device_check import stray_device_tensors

    moe = layer(**kw)
    x = tokens(5).requires_grad_()
    with stray_device_tensors() as strays:
        y, r = moe(x)
        ((y * y).sum() + r.aux_loss + r.z_loss).backward()
    assert not strays.events, strays.summary()


def test_router_computes_in_fp32_under_autocast():
    """Routing decisions and losses do not change under bf16 autocast."""
    router = TopKRouter(H, E, K, name="r", cfg=CFG, seed=1, aux_loss_coeff=0.1, z_loss_coeff=0.01)
    x = tokens(0, (32, H))
    ref = router(x)
    with torch.autocast("cpu", torch.bfloat16):
        got = router(x)
    assert torch.equal(got.expert_ids, ref.expert_ids) and torch.equal(got.weights, ref.weights)
    assert got.weights.dtype == torch.float32
    assert torch.equal(got.aux_loss, ref.aux_loss) and torch.equal(got.z_loss, ref.z_loss)


def test_placement_does_not_change_expert_weights():
    full = layer().experts.global_names()
    half = layer(ep_group=object(), ep_size=2, ep_rank=1).experts.global_names()
    assert set(half) < set(full) and all(torch.equal(full[n], p) for n, p in half.items())


# ---------------------------------------------------------------- distributed (world 4)

def _grads(moe, x, w):
    x = x.clone().requires_grad_()
    moe.zero_grad()
    ledger_trace = []
    y, r = moe(x, trace=ledger_trace)
    ((y * w).sum() + r.aux_loss + r.z_loss).backward()
    weights = moe.experts.global_names()
    experts = {n: (g.clone() if g is not None else torch.zeros_like(weights[n]))
               for n, g in moe.experts.global_grads().items()}
    return dict(y=y.detach(), dx=x.grad, router=moe.router.weight.grad.clone(), experts=experts,
                trace=ledger_trace)


def _router_losses(router, x):
    """(loss value, the reported stats, dW, dx) of the router's aux + z losses."""
    x = x.clone().requires_grad_()
    router.zero_grad()
    r = router(x)
    (r.aux_loss + r.z_loss).backward()
    return (r.aux_loss + r.z_loss).detach(), r.stats, router.weight.grad.clone(), x.grad


def _router_split_checks(rank):
    """The router over a sequence split n ways (2 and 4) against the unsplit router: the stats
    are the whole sequence's, the tp-style summed weight gradient and the cp-style averaged one
    (grad_mean_size = n) are the unsplit gradient, and so is each slice's input gradient."""
    import torch.distributed as dist
    from mpoverlap.moe.sequence_shards import SequenceShards
    from mpoverlap.parallel import ParallelState, RankGrid

    T = 24
    x_full = tokens(400, (T, H))
    make = dict(name="r", cfg=CFG, seed=4, aux_loss_coeff=0.1, z_loss_coeff=0.01)
    _, ref_stats, ref_dw, ref_dx = _router_losses(TopKRouter(H, E, K, **make), x_full)
    out = {}
    for n in (2, 4):
        st = ParallelState.create(RankGrid(tp=n, dp=4 // n), torch.device("cpu"))
        group, me = st.group("tp"), st.coords.tp
        # A strided share, as context parallelism's load-balanced chunks are not contiguous.
        rows = torch.arange(me, T, n)
        for mean in (1, n):
            shards = SequenceShards(group=group, size=n, grad_mean_size=mean)
            _, stats, dw, dx = _router_losses(TopKRouter(H, E, K, shards=shards, **make), x_full[rows])
            dw_total = dw.clone()
            dist.all_reduce(dw_total, group=group)
            if mean > 1:
                dw_total /= mean  # the dp x cp gradient average
            out[(n, mean)] = dict(
                aux=rel_err(stats["aux_loss"], ref_stats["aux_loss"]),
                z=rel_err(stats["z_loss"], ref_stats["z_loss"]),
                dw=rel_err(dw_total, ref_dw), dx=rel_err(dx / mean, ref_dx[rows]))
    return out


def _ep_bytes_fp32_bf16(group, ep, me, x, w):
    """ep ledger bytes of one forward + backward in fp32 and under bf16 autocast, the host
    reads of the bf16 one, and the bytes of the counts exchange (int64, not halved)."""
    from mpoverlap.comm import CommLedger
    from mpoverlap.training.host_sync import count_host_reads

    out = {}
    for name, ctx in (("fp32", None), ("bf16", torch.autocast("cpu", torch.bfloat16))):
        ledger = CommLedger()
        moe = layer(group, ep, me, overlap=True, ledger=ledger, num_chunks=3)
        xr = x.clone().requires_grad_()
        with count_host_reads() as reads:
            with (ctx if ctx is not None else torch.autocast("cpu", enabled=False)):
                y, r = moe(xr)
            ((y.float() * w).sum() + r.aux_loss + r.z_loss).backward()
        out[name] = ledger.summary()["ep"]["bytes"]
        out[name + "_reads"] = reads.count
    out["counts"] = 3 * E * 8  # one all_to_all of [chunks, E] int64 counts
    return out


def _moe_worker(rank, world):
    from mpoverlap.comm import CommLedger
    from mpoverlap.moe import AllToAllDispatcher
    from mpoverlap.parallel import ParallelState, RankGrid

    report = {"router_split": _router_split_checks(rank)}
    for ep in (2, 4):
        st = ParallelState.create(RankGrid(dp=4, ep=ep), torch.device("cpu"))
        group, ranks, me = st.group("ep"), st.ranks("ep"), st.coords.ep
        assert ranks[me] == rank
        # Dispatcher round trip: integer-valued tokens, identity experts, unit weights.
        ids_of = {q: torch.randint(0, E, (10, K), generator=torch.Generator().manual_seed(50 + q))
                  for q in ranks}
        x = (rank * 100 + torch.arange(10.0)).unsqueeze(1).expand(10, H).contiguous()
        disp = AllToAllDispatcher(group, ep, me, E, False, None)
        got, counts, ctx = disp.dispatch(x, ids_of[rank], torch.ones(10, K))
        lo, L = me * (E // ep), E // ep
        want = [sum(int((ids_of[q] == lo + l).sum()) for q in ranks) for l in range(L)]
        back = disp.combine(got, ctx)
        report[(ep, "round_trip")] = (counts.tolist() == want and torch.equal(back, K * x))  # device counts
        # Layer parity against the ep=1 reference over the ep group's tokens.
        x_of = {q: tokens(100 + q) for q in ranks}
        w_of = {q: tokens(200 + q) for q in ranks}
        refs = {q: _grads(layer(), x_of[q], w_of[q]) for q in ranks}
        ref_experts = {}
        for q in ranks:
            for n, g in refs[q]["experts"].items():
                ref_experts[n] = ref_experts.get(n, 0) + g
        for dispatcher in ("alltoall", "allgather"):
            runs = {}
            for overlap in (False, True):
                ledger = CommLedger()
                moe = layer(group, ep, me, overlap=overlap, dispatcher=dispatcher, ledger=ledger,
                            num_chunks=3, shared=(dispatcher == "alltoall"))
                out = _grads(moe, x_of[rank], w_of[rank])
                ref = refs[rank]
                if dispatcher == "alltoall":
                    ref = _grads(layer(shared=True, num_chunks=3), x_of[rank], w_of[rank])
                    shared_ref = {q: _grads(layer(shared=True), x_of[q], w_of[q]) for q in ranks}
                    exp_ref = {n: sum(shared_ref[q]["experts"][n] for q in ranks) for n in out["experts"]}
                else:
                    exp_ref = ref_experts
                runs[overlap] = out
                report[(ep, dispatcher, overlap)] = dict(
                    y=rel_err(out["y"], ref["y"]), dx=rel_err(out["dx"], ref["dx"]),
                    router=rel_err(out["router"], ref["router"]),
                    experts=max(rel_err(g, exp_ref[n]) for n, g in out["experts"].items()),
                    ledger=ledger.summary(), trace=out["trace"])
            if dispatcher == "alltoall":
                report[(ep, "bf16_bytes")] = _ep_bytes_fp32_bf16(group, ep, me, x_of[rank], w_of[rank])
            a, b = runs[False], runs[True]
            report[(ep, dispatcher, "bitwise")] = all(
                torch.equal(a[k_], b[k_]) for k_ in ("y", "dx", "router")) and all(
                torch.equal(a["experts"][n], b["experts"][n]) for n in a["experts"])
        report[(ep, "capacity")] = _capacity_checks(group, ep, me, ranks, x_of, w_of, rank)
    return report


def _capacity_checks(group, ep, me, ranks, x_of, w_of, rank):
    """A capacity at ep > 1 (all-to-all) pads every expert's queue to it, so the
    layer reads nothing on the host; against the ep 1 reference with the same capacity (drops
    are decided per rank over its own tokens, so the same slots drop), overlap on and off."""
    from mpoverlap.comm import CommLedger
    from mpoverlap.training.host_sync import count_host_reads

    cap = dict(capacity_factor=0.75, num_chunks=3)
    refs = {q: _grads(layer(**cap), x_of[q], w_of[q]) for q in ranks}
    out = {}
    for overlap in (False, True):
        ledger = CommLedger()
        moe = layer(group, ep, me, overlap=overlap, ledger=ledger, **cap)
        with count_host_reads() as reads:
            got = _grads(moe, x_of[rank], w_of[rank])
        exp_ref = {n: sum(refs[q]["experts"][n] for q in ranks) for n in got["experts"]}
        x = x_of[rank].reshape(-1, H)
        r = moe.router(x)
        out[overlap] = dict(
            got=got, reads=reads.count, pads=moe.dispatcher.pads_capacity, dropped=int(r.stats["dropped"]),
            y=rel_err(got["y"], refs[rank]["y"]), dx=rel_err(got["dx"], refs[rank]["dx"]),
            router=rel_err(got["router"], refs[rank]["router"]),
            experts=max(rel_err(g, exp_ref[n]) for n, g in got["experts"].items()),
            ops=ledger.summary()["ep"]["ops"], bytes=ledger.summary()["ep"]["bytes"], capacity=r.capacity)
    a, b = out[False]["got"], out[True]["got"]
    bitwise = all(torch.equal(a[k_], b[k_]) for k_ in ("y", "dx", "router")) and all(
        torch.equal(a["experts"][n], b["experts"][n]) for n in a["experts"])
    return {o: {k_: v for k_, v in d.items() if k_ != "got"} for o, d in out.items()} | {"bitwise": bitwise}


@pytest.mark.parametrize("ep", [2, 4])
def test_capacity_at_ep_pads_to_it_and_reads_nothing(moe_reports, ep):
    """Capacity 0.75 (12 tokens x top-2 over 8 experts: C = 3, some slots dropped), 3 chunks of
    one queue position each: no host read in forward or backward, the ep 1 reference's outputs
    and gradients (1e-5), overlap on and off bitwise equal, and the exchanges' bytes those of
    the padded queues: 3 chunks x (dispatch + combine) x (forward + backward) of E x 1 rows."""
    for rank, rep in enumerate(moe_reports):
        c = rep[(ep, "capacity")]
        assert c["bitwise"], rank
        for overlap in (False, True):
            r = c[overlap]
            assert r["pads"] and r["capacity"] == 3 and r["dropped"] > 0, r
            assert r["reads"] == 0, r
            for what in ("y", "dx", "router", "experts"):
                assert r[what] < 1e-5, (rank, overlap, what, r[what])
            assert r["ops"] == 3 * 2 * 2 and r["bytes"] == 3 * 2 * 2 * E * 1 * H * 4, r


@pytest.fixture(scope="module")
def moe_reports():
    return run_distributed(_moe_worker, 4, timeout_s=100)


@pytest.mark.parametrize("split", [2, 4])
def test_router_losses_over_a_split_sequence_match_the_unsplit_ones(moe_reports, split):
    """The load-balancing and z losses of a sequence split across ranks (SP, CP) are
    those of the whole sequence, in value and in gradient (weights and inputs)."""
    for rank, rep in enumerate(moe_reports):
        for mean in (1, split):
            errs = rep["router_split"][(split, mean)]
            assert max(errs.values()) < 1e-5, (rank, split, mean, errs)


@pytest.mark.parametrize("ep", [2, 4])
def test_ep_tokens_travel_in_the_compute_dtype(moe_reports, ep):
    """EP under bf16 autocast: the dispatch and combine exchanges (and their
    backward) move half the bytes; and the layer reads the host once with ep > 1 too."""
    for rep in moe_reports:
        b = rep[(ep, "bf16_bytes")]
        assert b["bf16"] - b["counts"] == (b["fp32"] - b["counts"]) // 2, b
        assert b["fp32_reads"] == 1 and b["bf16_reads"] == 1, b


@pytest.mark.parametrize("ep", [2, 4])
def test_dispatcher_round_trip(moe_reports, ep):
    assert all(rep[(ep, "round_trip")] for rep in moe_reports)


CASES = [(ep, d, o) for ep in (2, 4) for d in ("alltoall", "allgather") for o in (False, True)]


@pytest.mark.parametrize("ep,dispatcher,overlap", CASES)
def test_layer_matches_ep1_reference(moe_reports, ep, dispatcher, overlap):
    for rank, rep in enumerate(moe_reports):
        r = rep[(ep, dispatcher, overlap)]
        for what in ("y", "dx", "router", "experts"):
            assert r[what] < 1e-5, (rank, what, r[what])
        assert r["ledger"]["ep"]["ops"] > 0 and set(r["ledger"]) == {"ep"}


@pytest.mark.parametrize("ep", [2, 4])
@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_overlap_on_off_bitwise_identical(moe_reports, ep, dispatcher):
    assert all(rep[(ep, dispatcher, "bitwise")] for rep in moe_reports)


@pytest.mark.parametrize("ep", [2, 4])
def test_next_dispatch_issued_before_expert_compute(moe_reports, ep):
    for rep in moe_reports:
        for overlap in (False, True):
            trace = rep[(ep, "alltoall", overlap)]["trace"]
            for i in range(2):  # 3 chunks
                issued, computed = trace.index(("dispatch_issued", i + 1)), trace.index(("compute", i))
                assert (issued < computed) == overlap, (overlap, trace)
            shared, first_wait = trace.index(("shared", -1)), trace.index(("dispatch_waited", 0))
            if overlap:
                assert trace.index(("dispatch_issued", 0)) < shared < first_wait


def _open_exchanges_during_expert_backward(trace):
    """For each ("bwd_compute", i) in the backward part of the trace: how many reverse
    exchanges were issued and not yet waited when it ran."""
    open_ids, counts = set(), []
    for event in trace:
        if event[0] == "bwd_exchange_issued":
            open_ids.add(event[1])
        elif event[0] == "bwd_exchange_waited":
            open_ids.discard(event[1])
        elif event[0] == "bwd_compute":
            counts.append(len(open_ids))
    return counts


@pytest.mark.parametrize("ep", [2, 4])
@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_backward_mirrors_forward_overlap(moe_reports, ep, dispatcher):
    """overlap=True: expert backward of a chunk runs while another chunk's reverse exchange is
    in flight; overlap=False: every reverse exchange is waited before anything else runs."""
    for rep in moe_reports:
        for overlap in (False, True):
            trace = rep[(ep, dispatcher, overlap)]["trace"]
            issued = [e for e in trace if e[0] == "bwd_exchange_issued"]
            waited = [e for e in trace if e[0] == "bwd_exchange_waited"]
            assert issued and sorted(issued, key=lambda e: e[1]) == sorted(
                [("bwd_exchange_issued", e[1]) for e in waited], key=lambda e: e[1])
            open_counts = _open_exchanges_during_expert_backward(trace)
            assert len(open_counts) == 3  # every chunk's experts ran backward
            if overlap:
                assert sum(c > 0 for c in open_counts) >= 2, trace
            else:
                assert not any(open_counts), trace


# ---------------------------------------------------------------- grouped GEMMs

@pytest.mark.parametrize("dtype,activation,hidden", [(torch.float32, "swiglu", 16), (torch.float64, "gelu", 16),
                                                     (torch.float32, "gelu", 6), (torch.bfloat16, "swiglu", 16)])
def test_grouped_mlp_matches_per_expert_autograd(dtype, activation, hidden):
    """moe/grouped.py's Function (torch._grouped_mm, or its fallback for fp64 and unaligned
    widths) against autograd through a per-expert loop: output, input and weight gradients,
    an empty expert and padded rows (dropped slots) included; bounds: fp32/fp64 sum-order
    rounding (1e-5), bf16 one rounding of a GEMM output (2^-7 relative, 3e-2 with margin)."""
    from mpoverlap.moe.grouped import grouped_mlp
    from mpoverlap.wgrad import WeightGradDeferral, WeightGradQueue

    g = torch.Generator().manual_seed(3)
    L, Fw, counts = 3, 8, [4, 0, 5]
    width = 2 * Fw if activation == "swiglu" else Fw
    x = torch.randn(11, hidden, generator=g).to(dtype).requires_grad_()  # 2 padded rows at the end
    w_in = torch.randn(L, width, hidden, generator=g).to(dtype).requires_grad_()
    w_out = torch.randn(L, hidden, Fw, generator=g).to(dtype).requires_grad_()
    dy = torch.randn(11, hidden, generator=g).to(dtype)

    def act(h):
        if activation == "gelu":
            return torch.nn.functional.gelu(h)
        gate, up = h.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    parts, start = [], 0
    for l, c in enumerate(counts):
        parts.append(act(x[start:start + c] @ w_in[l].t()) @ w_out[l].t())
        start += c
    ref = torch.cat(parts + [x.new_zeros(11 - start, hidden)])
    ref_grads = torch.autograd.grad((ref * dy).sum(), (x, w_in, w_out))
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-5
    for deferred in (False, True):
        deferral = WeightGradDeferral() if deferred else None
        y = grouped_mlp(x, w_in, w_out, torch.tensor(counts), activation=activation, padded=True, deferral=deferral)
        assert rel_err(y.float(), ref.float()) < tol
        queue = WeightGradQueue()
        if deferred:
            with deferral.deferring(queue):
                y.backward(dy)
            assert x.grad is not None and w_in.grad is None and len(queue) == 2  # W waits for the queue
            queue.run()
        else:
            y.backward(dy)
        for got, want in zip((x.grad, w_in.grad, w_out.grad), ref_grads):
            assert rel_err(got.float(), want.float()) < tol
        assert torch.all(x.grad[start:] == 0) and torch.all(w_in.grad[1] == 0)
        x.grad = w_in.grad = w_out.grad = None
