"""Context parallelism: split helpers, block math, ring and all-to-all attention vs full SDPA.

One spawn of 4 gloo ranks (module fixture) runs every distributed check for cp=4 (grid cp=4)
and cp=2 (grid cp=2 x dp=2: two rings side by side), ring and a2a, overlap on and off.
"""
import functools
import os
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dist_harness import run_distributed  # noqa: E402

from mpoverlap.context_parallel import (CPStats, a2a_attention, cp_chunk_order,  # noqa: E402
                                        gather_from_cp, positions_for_cp, ring_attention,
                                        split_for_cp, unsplit_from_cp)
from mpoverlap.context_parallel.a2a_layout import (pack_head_to_seq, pack_seq_to_head,  # noqa: E402
                                                   unpack_head_to_seq, unpack_seq_to_head)
from mpoverlap.context_parallel.attention_math import (block_backward, block_forward,  # noqa: E402
                                                       merge_partial, softmax_delta)

B, N, S, D = 2, 4, 32, 8
# ring and a2a run the default block kernel (parallel.cp_attention_backend=auto: the CPU flash
# kernel); ring_explicit the fp32 fallback math.
VARIANTS = {"ring": ring_attention, "a2a": a2a_attention,
            "ring_explicit": functools.partial(ring_attention, backend="explicit")}


def rel_err(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def full_inputs(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, N, S, D, generator=g, dtype=dtype) for _ in range(4)]  # q, k, v, w


def reference(q, k, v, w):
    """Full causal SDPA on one process: out and dq, dk, dv of loss = sum(out * w) (k, v may
    hold fewer heads: grouped-query attention)."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    return [out.detach(), *grads]


# ---------------------------------------------------------------- single process

@pytest.mark.parametrize("cp", [1, 2, 4])
def test_split_positions_round_trip(cp):
    x = torch.randn(B, N, S, D)
    shards = [split_for_cp(x, r, cp, seq_dim=2) for r in range(cp)]
    assert all(s.shape == (B, N, S // cp, D) for s in shards)
    assert torch.equal(unsplit_from_cp(shards, seq_dim=2), x)
    assert torch.equal(unsplit_from_cp([split_for_cp(x, r, cp, -2) for r in range(cp)], -2), x)
    c = S // (2 * cp)
    for r in range(cp):
        pos = positions_for_cp(S, r, cp)
        assert pos.dtype == torch.long and pos.shape == (S // cp,)
        assert torch.equal(pos, split_for_cp(torch.arange(S), r, cp, 0))
        assert pos[0] == r * c and pos[-1] == (2 * cp - r) * c - 1
    assert torch.equal(torch.cat([positions_for_cp(S, r, cp) for r in range(cp)]).sort().values,
                       torch.arange(S))
    assert cp_chunk_order(cp) == [ch for r in range(cp) for ch in (r, 2 * cp - 1 - r)]


def test_split_rejects_indivisible():
    with pytest.raises(ValueError, match="divisible by 2 \\* cp = 8"):
        split_for_cp(torch.zeros(1, 36), 0, 4, seq_dim=1)
    with pytest.raises(ValueError):
        positions_for_cp(32, 4, 4)


def test_lse_merge_of_two_halves_equals_softmax_over_all():
    q, k, v, _ = full_inputs(1)
    scale = D ** -0.5
    o1, l1 = block_forward(q, k[:, :, :10], v[:, :, :10], scale=scale, causal=False)
    o2, l2 = block_forward(q, k[:, :, 10:], v[:, :, 10:], scale=scale, causal=False)
    out, lse = merge_partial(*merge_partial(None, None, o1, l1), o2, l2)
    ref = F.scaled_dot_product_attention(q, k, v)
    assert rel_err(out, ref) < 1e-6
    assert rel_err(lse, torch.logsumexp((q @ k.transpose(-1, -2)) * scale, -1)) < 1e-6
    # diagonal block (causal mask) equals causal SDPA
    o, _ = block_forward(q, k, v, scale=scale, causal=True)
    assert rel_err(o, F.scaled_dot_product_attention(q, k, v, is_causal=True)) < 1e-6


def test_block_backward_pieces_sum_to_full_gradient():
    q, k, v, w = full_inputs(2)
    scale = D ** -0.5
    out, dq_ref, dk_ref, dv_ref = reference(q, k, v, w)
    h = S // 2  # keys [0, h) are fully visible to queries [h, S); keys [h, S) diagonal
    q2, o2, w2 = q[:, :, h:], out[:, :, h:], w[:, :, h:]
    _, lse_a = block_forward(q2, k[:, :, :h], v[:, :, :h], scale=scale, causal=False)
    _, lse_b = block_forward(q2, k[:, :, h:], v[:, :, h:], scale=scale, causal=True)
    lse = torch.logaddexp(lse_a, lse_b)
    delta = softmax_delta(o2, w2)
    dq_a, dk_a, dv_a = block_backward(q2, k[:, :, :h], v[:, :, :h], w2, lse, delta,
                                      scale=scale, causal=False)
    dq_b, dk_b, dv_b = block_backward(q2, k[:, :, h:], v[:, :, h:], w2, lse, delta,
                                      scale=scale, causal=True)
    assert rel_err(dq_a + dq_b, dq_ref[:, :, h:]) < 1e-5
    assert rel_err(dk_b, dk_ref[:, :, h:]) < 1e-5 and rel_err(dv_b, dv_ref[:, :, h:]) < 1e-5


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_cp1_equals_sdpa(variant):
    q, k, v, w = full_inputs(3)
    ref = reference(q, k, v, w)
    qkv = [t.clone().requires_grad_() for t in (q, k, v)]
    out = VARIANTS[variant](*qkv, cp_group=None, cp_ranks=[0], cp_rank=0, cp_size=1,
                            overlap=True, ledger=None)
    grads = torch.autograd.grad((out * w).sum(), qkv)
    for got, want in zip([out, *grads], ref):
        assert rel_err(got, want) < 1e-5


@pytest.mark.parametrize("cp,groups", [(2, 1), (2, 2), (4, 1)])
def test_a2a_layout_simulated_exchange(cp, groups):
    """pack -> (simulated all_to_all: recv[j][i] = send[i][j]) -> unpack gives each rank its
    heads over the natural-order sequence, and the way back restores the split layout."""
    x = torch.randn(3, B, N, S, D)
    shards = [split_for_cp(x, r, cp, seq_dim=3) for r in range(cp)]
    Ng = N // cp // groups
    for g in range(groups):
        sends = [pack_seq_to_head(s, cp, groups, g) for s in shards]
        for j in range(cp):
            y = unpack_seq_to_head(torch.stack([sends[i][j] for i in range(cp)]), cp)
            heads = [j * (N // cp) + g * Ng + n for n in range(Ng)]
            assert torch.equal(y, x[:, :, heads])
        backs = [pack_head_to_seq(x[:, :, [j * (N // cp) + g * Ng + n for n in range(Ng)]], cp)
                 for j in range(cp)]
        for r in range(cp):
            out = torch.zeros_like(shards[r])
            unpack_head_to_seq(torch.stack([backs[j][r] for j in range(cp)]), out, groups, g)
            sel = out.view(3, B, cp, groups, Ng, S // cp, D)[:, :, :, g]
            ref = shards[r].view(3, B, cp, groups, Ng, S // cp, D)[:, :, :, g]
            assert torch.equal(sel, ref)


def test_argument_errors():
    q = torch.zeros(B, N, S, D)
    with pytest.raises(ValueError, match="cp_ranks"):
        ring_attention(q, q, q, cp_group=None, cp_ranks=[0, 1], cp_rank=0, cp_size=1,
                       overlap=False, ledger=None)
    with pytest.raises(ValueError, match="divisible by cp=1 x head_chunks=3"):
        a2a_attention(q, q, q, cp_group=None, cp_ranks=[0], cp_rank=0, cp_size=1,
                      overlap=False, ledger=None, head_chunks=3)


# ---------------------------------------------------------------- distributed (one spawn)

def _event_index(events, phase, what, step):
    return [i for i, e in enumerate(events) if e[:3] == (phase, what, step)]


def _cp_worker(rank, world):
    from mpoverlap.comm import CommLedger
    from mpoverlap.parallel import ParallelState, RankGrid

    cpu = torch.device("cpu")
    states = {4: ParallelState.create(RankGrid(cp=4), cpu),
              2: ParallelState.create(RankGrid(cp=2, dp=2), cpu)}
    q, k, v, w = full_inputs(0)
    ref = reference(q, k, v, w)
    report = {}
    for cp, st in states.items():
        group, ranks, r = st.group("cp"), st.ranks("cp"), st.coords.cp
        assert ranks[r] == rank
        pos = gather_from_cp(positions_for_cp(S, r, cp), cp_group=group, cp_size=cp, seq_dim=0)
        report[(cp, "positions_ok")] = torch.equal(pos, torch.arange(S))
        for name, fn in VARIANTS.items():
            runs = {}
            for overlap in (False, True):
                ledger, stats = CommLedger(), CPStats()
                local = [split_for_cp(t, r, cp, seq_dim=2).requires_grad_() for t in (q, k, v)]
                out = fn(*local, cp_group=group, cp_ranks=ranks, cp_rank=r, cp_size=cp,
                         overlap=overlap, ledger=ledger, stats=stats)
                grads = torch.autograd.grad((out * split_for_cp(w, r, cp, 2)).sum(), local)
                tensors = [out.detach(), *grads]
                full = [gather_from_cp(t, cp_group=group, cp_size=cp, seq_dim=2) for t in tensors]
                runs[overlap] = tensors
                report[(cp, name, overlap)] = {
                    "errors": [rel_err(got, want) for got, want in zip(full, ref)],
                    "work": stats.work(), "transfers": {k_: v_ for k_, v_ in stats.counts.items()
                                                       if k_.endswith("transfers")},
                    "events": stats.events, "ledger": ledger.summary()}
            report[(cp, name, "bitwise")] = all(torch.equal(a, b)
                                                for a, b in zip(runs[False], runs[True]))
        report.update(_gqa_checks(cp, group, ranks, r))
    return report


GQA_N = 8  # query heads of the grouped-query cases; K/V groups 1, 2, 4 and 8 (= MHA)


def gqa_inputs(groups, seed=5):
    g = torch.Generator().manual_seed(seed)
    q, w = (torch.randn(B, GQA_N, S, D, generator=g) for _ in range(2))
    k, v = (torch.randn(B, groups, S, D, generator=g) for _ in range(2))
    return q, k, v, w


def _gqa_checks(cp, group, ranks, r):
    """Ring (any groups) and a2a (groups divisible by cp) with G < N K/V groups against full
    SDPA with enable_gqa: out, dq and the groups' dk, dv; overlap on/off bitwise; bytes moved."""
    from mpoverlap.comm import CommLedger

    report = {}
    for groups in (1, 2, 4, GQA_N):
        q, k, v, w = gqa_inputs(groups)
        ref = reference(q, k, v, w)
        for name, fn in VARIANTS.items():
            if name == "a2a" and groups % cp:
                continue
            runs = {}
            for overlap in (False, True):
                ledger = CommLedger()
                local = [split_for_cp(t, r, cp, seq_dim=2).requires_grad_() for t in (q, k, v)]
                out = fn(*local, cp_group=group, cp_ranks=ranks, cp_rank=r, cp_size=cp,
                         overlap=overlap, ledger=ledger)
                grads = torch.autograd.grad((out * split_for_cp(w, r, cp, 2)).sum(), local)
                runs[overlap] = [out.detach(), *grads]
                full = [gather_from_cp(t, cp_group=group, cp_size=cp, seq_dim=2) for t in runs[overlap]]
                report[("gqa", cp, name, groups, overlap)] = {
                    "errors": [rel_err(got, want) for got, want in zip(full, ref)],
                    "shapes": [tuple(t.shape) for t in full], "ledger": ledger.summary()}
            report[("gqa", cp, name, groups, "bitwise")] = all(
                torch.equal(a, b) for a, b in zip(runs[False], runs[True]))
    return report


@pytest.fixture(scope="module")
def cp_reports():
    return run_distributed(_cp_worker, 4)


CASES = [(cp, name, overlap) for cp in (2, 4) for name in sorted(VARIANTS) for overlap in (False, True)]


@pytest.mark.parametrize("cp,name,overlap", CASES)
def test_matches_full_sdpa(cp_reports, cp, name, overlap):
    for rank, rep in enumerate(cp_reports):
        errs = rep[(cp, name, overlap)]["errors"]  # out, dq, dk, dv
        assert max(errs) < 1e-5, (rank, errs)


@pytest.mark.parametrize("cp", [2, 4])
def test_overlap_on_off_bitwise_identical(cp_reports, cp):
    for rep in cp_reports:
        assert rep[(cp, "ring", "bitwise")] and rep[(cp, "a2a", "bitwise")]
        assert rep[(cp, "positions_ok")]


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_work_is_equal_on_every_rank(cp_reports, cp):
    works = [rep[(cp, name, ov)]["work"] for rep in cp_reports for ov in (False, True)
             for name in ("ring", "ring_explicit")]
    assert all(wk == works[0] for wk in works)
    wk = works[0]
    for phase in ("fwd", "bwd"):
        # per rank: 2cp+1 unmasked chunk pairs of 4cp, two of them diagonal
        assert wk[f"{phase}.pairs_full"] + wk[f"{phase}.pairs_diag"] == 2 * cp + 1
        assert wk[f"{phase}.pairs_diag"] == 2 and wk[f"{phase}.pairs_skip"] == 2 * cp - 1
        # together the ranks see exactly the causal triangle of B*N*S(S+1)/2 scores
        assert wk[f"{phase}.scores_visible"] * cp == B * N * S * (S + 1) // 2


@pytest.mark.parametrize("cp", [2, 4])
def test_ledger_counts_cp_ops(cp_reports, cp):
    groups = 1 if (N // cp) % 2 else 2
    for rep in cp_reports:
        for ov in (False, True):
            ring, a2a = rep[(cp, "ring", ov)], rep[(cp, "a2a", ov)]
            # ring: fwd cp-1 K/V hops; bwd cp-1 K/V hops + cp dK/dV hops
            assert ring["ledger"]["cp"]["ops"] == 3 * cp - 2 and ring["ledger"]["cp"]["bytes"] > 0
            assert ring["transfers"] == {"fwd.transfers": cp - 1, "bwd.transfers": 2 * cp - 1}
            assert a2a["ledger"]["cp"]["ops"] == 4 * groups  # in + out, fwd + bwd, per group
            assert set(ring["ledger"]) == {"cp"} and set(a2a["ledger"]) == {"cp"}


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_transfer_issued_before_compute(cp_reports, cp):
    for rep in cp_reports:
        for ov in (False, True):
            ev = rep[(cp, "ring", ov)]["events"]
            times = [e[3] for e in ev]
            assert times == sorted(times)
            for s in range(cp - 1):
                for phase in ("fwd", "bwd"):
                    (issue,) = _event_index(ev, phase, "issue", s + 1)
                    (wait,) = _event_index(ev, phase, "wait", s + 1)
                    (begin,) = _event_index(ev, phase, "compute_begin", s)
                    (end,) = _event_index(ev, phase, "compute_end", s)
                    assert issue < begin  # next block's transfer issued before this block's compute
                    assert (end < wait) if ov else (issue < wait < begin)
                # dK/dV of step s leave after its compute; with overlap, waited after step s+1's
                (d_issue,) = _event_index(ev, "bwd", "issue_dkv", s + 1)
                d_wait = _event_index(ev, "bwd", "wait_dkv", s + 1)[0]
                assert _event_index(ev, "bwd", "compute_end", s)[0] < d_issue
                next_end = _event_index(ev, "bwd", "compute_end", s + 1)[0]
                assert (next_end < d_wait) if ov else (d_wait < next_end)


GQA_CASES = [(cp, name, groups) for cp in (2, 4) for name in sorted(VARIANTS) for groups in (1, 2, 4, GQA_N)
             if name != "a2a" or groups % cp == 0]


@pytest.mark.parametrize("cp,name,groups", GQA_CASES)
def test_gqa_matches_full_sdpa(cp_reports, cp, name, groups):
    """Grouped-query attention (8 heads over `groups` K/V groups) through ring and all-to-all
    attention equals full causal SDPA with enable_gqa: out, dq and dk, dv of the groups."""
    for rank, rep in enumerate(cp_reports):
        for overlap in (False, True):
            case = rep[("gqa", cp, name, groups, overlap)]
            assert case["shapes"][2] == (B, groups, S, D) == case["shapes"][3]  # dk, dv: the groups only
            assert max(case["errors"]) < 1e-5, (rank, overlap, case["errors"])
        assert rep[("gqa", cp, name, groups, "bitwise")]


@pytest.mark.parametrize("cp", [2, 4])
def test_gqa_moves_only_the_kv_groups(cp_reports, cp):
    """The ring's bytes are exactly groups / heads of multi-head attention's (only K/V and
    dK/dV travel); the all-to-all's shrink by the K/V share of its q, k, v, out buffers."""
    for rep in cp_reports:
        for ov in (False, True):
            mha = rep[("gqa", cp, "ring", GQA_N, ov)]["ledger"]["cp"]
            for groups in (1, 2, 4):
                ring = rep[("gqa", cp, "ring", groups, ov)]["ledger"]["cp"]
                assert ring["ops"] == mha["ops"] and ring["bytes"] * GQA_N == mha["bytes"] * groups
            a2a_mha = rep[("gqa", cp, "a2a", GQA_N, ov)]["ledger"]["cp"]["bytes"]
            a2a = rep[("gqa", cp, "a2a", 4, ov)]["ledger"]["cp"]["bytes"]
            # fwd: q + 2 kv in, out back; bwd: dout in, dq + 2 dkv back -> (4N + 4G) / 8N
            assert a2a * 8 * GQA_N == a2a_mha * (4 * GQA_N + 4 * 4)


def test_a2a_overlap_issues_all_groups_before_compute(cp_reports):
    for rep in cp_reports:
        for phase in ("fwd", "bwd"):
            ev = rep[(2, "a2a", True)]["events"]  # cp=2, N/cp=2 -> 2 head groups
            first_compute = _event_index(ev, phase, "compute_begin", 0)[0]
            issued = [e for e in ev[:first_compute] if e[:2] == (phase, "issue")]
            assert len(issued) == 2
            # group 0's result leaves before group 1 computes
            out_issue_0 = _event_index(ev, phase, "issue", 0)[1]
            assert out_issue_0 < _event_index(ev, phase, "compute_begin", 1)[0]
            ev_off = rep[(2, "a2a", False)]["events"]
            first_off = _event_index(ev_off, phase, "compute_begin", 0)[0]
            assert len([e for e in ev_off[:first_off] if e[:2] == (phase, "issue")]) == 1
