"""The three invariants of the sharded and recompute paths, checked for many layouts per spawn.

1. Every parameter read happens after its gather was waited: a TorchDispatchMode sees every
   aten op of the forward AND the backward (recomputed forwards included) with its tensors;
   an op that touches the memory of a parameter bucket whose all-gather is still in flight
   (the distributed optimizer's post-step gather under ZeRO-1/2, a unit's gather under ZeRO-3)
   is a read before the wait (on NCCL: a race with the collective writing the buffer).
2. Every handle issued in a step is waited (or carried over on purpose) before the step ends:
   the strict ledger (tests/conftest.py turns it on for the whole suite) raises otherwise, in
   every Trainer.train_step below.
3. Nothing stays gathered past its use: after each backward ZeRO-3 holds no gathered unit
   (train.reshard_after_forward=true), with and without recompute, and full recompute adds no
   parameter gather to the step (its replay uses the gather of the unit's backward); under
   zb1p and zbv after the step's last W, with the bound of docs/invariants.md between B and W.

Plus the unit tests that need no process group (the norm's fp64 copies, the
CUDA timing events of the ledger).
"""
import os
import sys
import tempfile
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dist_harness import run_distributed  # noqa: E402
from zero_bubble_gathers import gathered, held_beyond_pending_w  # noqa: E402

BASE = ["model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=4", "model.ffn_hidden_size=64",
        "model.seq_length=16", "train.micro_batch_size=2", "train.global_batch_size=8", "train.log_interval=1",
        "data.max_bytes=200000", "overlap.dp_bucket_mb=0.005", "train.progress=false", "train.device=cpu",
        "overlap.dp=true"]
MOE = ["model=moe_tiny", "model.num_experts=4", "model.moe_ffn_hidden_size=32", "model.shared_expert=true"]
FINE = ["model=moe_fine_tiny", "model.num_layers=2", "model.num_experts=8", "model.moe_top_k=2"]
ZERO = {"z1": ["train.dp_sharding=optim", "overlap.dp_param_gather=true"],
        "z2": ["train.dp_sharding=optim_grads", "overlap.dp_param_gather=true"],
        "z3": ["train.dp_sharding=optim_grads_params", "overlap.dp_prefetch=1"]}


def _layouts():
    """name -> (world, overrides): every sharding level x recompute none/full x model family at
    dp 2, and the pipelined ones (tied embedding on both stages) at pp 2 x dp 2."""
    out = {}
    for family, model in (("gpt", ["model=gpt_tiny"]), ("llama_gqa", ["model=llama_tiny"]), ("moe", MOE)):
        for level, zero in ZERO.items():
            for rc in ("none", "full"):
                if family != "gpt" and rc == "none" and level != "z3":
                    continue  # the families' first-read paths are the same with and without recompute
                out[f"{family}_{level}_{rc}"] = (2, [*model, *zero, "parallel.dp=2", f"model.recompute={rc}"])
    for level in ("z2", "z3"):
        out[f"gpt_pp2_tied_{level}"] = (4, ["model=gpt_tiny", *ZERO[level], "parallel.dp=2", "parallel.pp=2",
                                            "overlap.pp=true", "model.num_layers=4", "model.recompute=full"])
        out[f"gpt_pp2_vpp2_{level}"] = (4, ["model=gpt_tiny", *ZERO[level], "parallel.dp=2", "parallel.pp=2",
                                            "parallel.vpp=2", "overlap.pp=true", "model.num_layers=4"])
        out[f"fine_moe_etp2_{level}"] = (4, [*FINE, *ZERO[level], "parallel.dp=2", "parallel.tp=2", "parallel.etp=2",
                                             "parallel.sequence_parallel=true", "model.recompute=full"])
    # zbv: the V holds the tied embedding and the head on stage 0 (one parameter, read by two
    # chunks); ZeRO-1's post-step gather and ZeRO-3's unit gathers around both chunks
    for level in ("z1", "z3"):
        out[f"gpt_pp2_zbv_tied_{level}"] = (4, ["model=gpt_tiny", *ZERO[level], "parallel.dp=2", "parallel.pp=2",
                                                "parallel.vpp=2", "parallel.pp_schedule=zbv", "overlap.pp=true",
                                                "model.num_layers=4", "model.tie_embeddings=true"])
    # zb1p (ZB-H1): W deferred on 1F1B (tied embedding across the two stages) and on
    # interleaved chunks; ZeRO-1's post-step gather and ZeRO-3's unit gathers around B and W
    for level in ("z1", "z3"):
        out[f"gpt_pp2_zb1p_tied_{level}"] = (4, ["model=gpt_tiny", *ZERO[level], "parallel.dp=2", "parallel.pp=2",
                                                 "parallel.pp_schedule=zb1p", "overlap.pp=true",
                                                 "model.num_layers=4", "model.tie_embeddings=true"])
        out[f"gpt_pp2_vpp2_zb1p_{level}"] = (4, ["model=gpt_tiny", *ZERO[level], "parallel.dp=2", "parallel.pp=2",
                                                 "parallel.vpp=2", "parallel.pp_schedule=zb1p", "overlap.pp=true",
                                                 "model.num_layers=4"])
    # forward/backward pairing (mpoverlap/pairing): two units in use at once under ZeRO-3, the
    # post-step gathers of ZeRO-1 read by the paired sub-steps
    for level in ("z1", "z3"):
        # 3 layers: the middle one is the forward's and the backward's at once
        out[f"moe_pairing_ep2_{level}"] = (2, [*MOE, *ZERO[level], "parallel.dp=2", "parallel.ep=2",
                                               "overlap.ep_pairing=true", "model.num_layers=3"])
    # pairing at pp 2 x vpp 2 (pipeline/paired.py): the pipeline's FB actions, ZeRO-1's post-step
    # gathers read by the chunks' sub-steps, ZeRO-3's units of two chunks in use at once
    for level in ("z1", "z3"):
        out[f"moe_pp2_vpp2_pairing_{level}"] = (4, [*MOE, *ZERO[level], "parallel.dp=2", "parallel.ep=2",
                                                    "parallel.pp=2", "parallel.vpp=2", "overlap.pp=true",
                                                    "overlap.ep_pairing=true", "model.num_layers=4",
                                                    "train.global_batch_size=16"])
    # The all-gather dispatcher's replay under overlap.ep (plain dp: the ep bytes
    # are compared with mpoverlap-check's estimate, with and without the replay).
    for rc in ("none", "full"):
        out[f"moe_allgather_ep2_{rc}"] = (2, [*MOE, "parallel.dp=2", "parallel.ep=2", "model.moe_dispatcher=allgather",
                                              "overlap.ep=true", "overlap.ep_chunks=4", f"model.recompute={rc}"])
        # A capacity pads the all-to-all's queues (fixed sizes): the estimate is exact
        out[f"moe_capacity_ep2_{rc}"] = (2, [*MOE, "parallel.dp=2", "parallel.ep=2", "model.moe_capacity_factor=1.0",
                                             "overlap.ep=true", "overlap.ep_chunks=4", f"model.recompute={rc}"])
    # fp8 dispatch (train.ep_dispatch_dtype) at ep 2 with tp 2 and SP, replayed under full
    # recomputation: its packed rows waited like the others, its ep bytes the estimate's
    out["moe_fp8_tp2_sp_ep2_full"] = (4, [*MOE, "model.hidden_size=128", "parallel.dp=2", "parallel.tp=2",
                                          "parallel.sequence_parallel=true", "parallel.ep=2", "overlap.ep=true", "overlap.ep_chunks=4",
                                          "train.precision=bf16", "train.ep_dispatch_dtype=fp8",
                                          "model.recompute=full"])
    return out


LAYOUTS = _layouts()


def _bucket_ranges(trainer):
    """storage id -> [(bucket, first byte, end byte)] of every parameter bucket."""
    ranges = {}
    for bucket in trainer.ddp.buffer.buckets:
        t = bucket.param_data
        lo = t.storage_offset() * t.element_size()
        ranges.setdefault(t.untyped_storage()._cdata, []).append((bucket.index, lo, lo + t.numel() * t.element_size()))
    return ranges


def _in_flight(trainer):
    """Buckets whose parameter all-gather is issued and not yet waited."""
    pending = set(trainer.optimizer._pending)
    if trainer.ddp.gatherer is not None:
        pending |= set(trainer.ddp.gatherer._pending)
    return pending


def _check_step(trainer):
    """Run one train_step under the checks; -> (late reads, buckets read, gathers, bytes held
    after each backward, (kind, vchunk, microbatch, buckets gathered) after each action)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    ranges = _bucket_ranges(trainer)
    late, read = [], set()

    def touched(t):
        st = t.untyped_storage()
        spans = ranges.get(st._cdata)
        if not spans or t.numel() == 0:
            return []
        es = t.element_size()
        lo = t.storage_offset() * es
        hi = lo + (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * es
        return [b for b, a, z in spans if lo < z and a < hi]

    class Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not str(func).startswith("c10d"):  # the gather itself writes the bucket
                pending = _in_flight(trainer)
                for t in tree_flatten((args, kwargs))[0]:
                    if isinstance(t, torch.Tensor):
                        for b in touched(t):
                            read.add(b)
                            if b in pending:
                                late.append((str(func), b))
            return func(*args, **(kwargs or {}))

    gatherer = trainer.ddp.gatherer
    counts = {"gathers": 0}
    held_after_backward = []
    if gatherer is not None:
        issue = gatherer._gather

        def counted(b):
            before = len(gatherer._pending)
            issue(b)
            counts["gathers"] += len(gatherer._pending) > before
        gatherer._gather = counted
    backward = torch.autograd.backward

    def backward_then_look(*args, **kwargs):
        out = backward(*args, **kwargs)
        if gatherer is not None:
            held_after_backward.append(gatherer.held_bytes)
        return out
    torch.autograd.backward = backward_then_look
    from mpoverlap.pipeline.executor import PipelineExecutor
    compute, after_action = PipelineExecutor._compute, []

    def compute_then_look(executor, index, action, losses):
        compute(executor, index, action, losses)
        if gatherer is not None:
            after_action.append((action.kind, action.vchunk, action.microbatch, gathered(gatherer)))
    PipelineExecutor._compute = compute_then_look
    try:
        with Reads():
            trainer.train_step()
    finally:
        torch.autograd.backward = backward
        PipelineExecutor._compute = compute
        if gatherer is not None:
            gatherer._gather = issue
    return late, read, counts["gathers"], held_after_backward, after_action


def _invariants(rank, world, layouts, root):
    from pathlib import Path

    from mpoverlap.config import compose
    from mpoverlap.training.loop import Trainer
    from mpoverlap.training.setup import init_distributed

    out = {}
    for name, overrides in layouts.items():
        cfg = compose([*BASE, *overrides, f"run.dir={Path(root) / name}"])
        trainer = Trainer(cfg, init_distributed(cfg), Path(root) / name)
        assert trainer.ledger.strict, "the suite runs with the strict ledger (tests/conftest.py)"
        trainer.train_step()  # leaves the post-step parameter gathers in flight (ZeRO-1/2)
        in_flight = sorted(trainer.optimizer._pending)
        if trainer.ddp.gatherer is not None:
            trainer.ddp.gatherer.reset_peak()
        late, read, gathers, held, after_action = _check_step(trainer)
        g = trainer.ddp.gatherer
        excess, most_units = ([], 0) if g is None else held_beyond_pending_w(g, after_action)
        out[name] = {"late": late, "read": sorted(read), "buckets": len(trainer.ddp.buffer.buckets),
                     "in_flight_at_start": in_flight, "gathers": gathers, "held_after_backward": held,
                     "zero3": g is not None, "comm": trainer.ledger.reset(per=2),
                     "paired": trainer.overlap.ep_pairing.enabled,
                     "held_at_end": g.held_bytes if g is not None else 0,
                     "largest_unit": max((sum(trainer.ddp.buffer.buckets[b].param_data.numel() * 4 for b in bs)
                                          for bs in g.buckets_of), default=0) if g is not None else 0,
                     "prefetch": g.prefetch if g is not None else 0,
                     "held_beyond_pending_w": excess, "most_units_held": most_units, "units": 0 if g is None else len(g.units),
                     "actions": len(after_action), "stage": trainer.state.coords.pp,
                     "peak_held": 0 if g is None else g.peak_held_bytes}
    return out


@pytest.mark.parametrize("world", sorted({w for w, _ in LAYOUTS.values()}))
def test_reads_wait_gathers_handles_waited_nothing_held(world):
    from mpoverlap.config import compose
    from mpoverlap.overlap.estimate import estimate

    layouts = {n: o for n, (w, o) in LAYOUTS.items() if w == world}
    with tempfile.TemporaryDirectory() as root:
        results = run_distributed(_invariants, world, layouts, root, timeout_s=600)
    for rank, per in enumerate(results):
        for name, r in per.items():
            where = f"{name} rank {rank}"
            assert not r["late"], f"{where}: read while its bucket's gather was in flight: {r['late'][:5]}"
            assert len(r["read"]) == r["buckets"], f"{where}: the check saw {len(r['read'])} of {r['buckets']} buckets"
            if "overlap.dp_param_gather=true" in LAYOUTS[name][1]:
                assert r["in_flight_at_start"], f"{where}: no parameter gather left in flight: nothing checked"
            if r["zero3"] and r["paired"]:
                # A paired step runs each backward as several autograd calls while the other
                # microbatch's forward holds its unit: at most two units (and their prefetch)
                # are gathered at once, and nothing once the step is done.
                assert r["gathers"] > 0 and r["held_at_end"] == 0, (where, r["held_at_end"])
                bound = 2 * (1 + r["prefetch"]) * r["largest_unit"]
                assert max(r["held_after_backward"]) <= bound, (where, max(r["held_after_backward"]), bound)
            elif r["zero3"]:
                assert r["gathers"] > 0 and r["held_after_backward"], where
                held = r["held_after_backward"]
                if any(f"parallel.pp_schedule={s}" in LAYOUTS[name][1] for s in ("zbv", "zb1p")):
                    # Zero bubble: nothing held once the step's last W ran; in between at most
                    # the embedding until its W (tests/zero_bubble_gathers.py); within an action the
                    # working set mpoverlap-check estimates (sharding.gathered_working_set).
                    held = held[-1:]
                    assert r["actions"] > 0, f"{where}: no pipeline action seen: nothing checked"
                    assert not r["held_beyond_pending_w"], \
                        f"{where}: gathered beyond the embedding awaiting its W: {r['held_beyond_pending_w'][:5]}"
                    assert r["most_units_held"] <= 1, (where, r["most_units_held"], r["units"])
                    est = estimate(compose([*BASE, *LAYOUTS[name][1]]), world).stages[r["stage"]].gathered_bytes
                    assert r["peak_held"] <= 1.02 * est, (where, r["peak_held"], est)
                assert all(h == 0 for h in held), \
                    f"{where}: bytes still gathered after each backward: {r['held_after_backward']}"


    if world == 2:  # what the replay issues is waited (strict ledger) and estimated
        for rc in ("none", "full"):
            name = f"moe_allgather_ep2_{rc}"
            got = sum(r[name]["comm"]["ep"]["bytes"] for r in results) / len(results)
            est = estimate(compose([*BASE, *LAYOUTS[name][1]]), 2).comm_bytes_per_step["ep"]
            assert abs(got - est) <= 0.03 * est, (name, got, est)
            name = f"moe_capacity_ep2_{rc}"
            got = [r[name]["comm"]["ep"]["bytes"] for r in results]
            est = estimate(compose([*BASE, *LAYOUTS[name][1]]), 2).comm_bytes_per_step["ep"]
            assert got == [est] * len(results), (name, got, est)
    if world == 4:  # fp8 dispatch: the ledger counts the packed rows the estimate counts
        name = "moe_fp8_tp2_sp_ep2_full"
        got = sum(r[name]["comm"]["ep"]["bytes"] for r in results) / len(results)
        est = estimate(compose([*BASE, *LAYOUTS[name][1]]), 4).comm_bytes_per_step["ep"]
        assert got == est, (name, got, est)


def _zero3_gathers(rank, world, root):
    """Parameter gathers per step and bytes held after each backward, ZeRO-3 at dp 2, per
    recompute mode and reshard_after_forward."""
    from pathlib import Path

    from mpoverlap.config import compose
    from mpoverlap.training.loop import Trainer
    from mpoverlap.training.setup import init_distributed

    out = {}
    for rc in ("none", "full"):
        for reshard in ("true", "false"):
            name = f"{rc}_{reshard}"
            cfg = compose([*BASE, "model=gpt_tiny", "model.num_layers=4", *ZERO["z3"], "parallel.dp=2",
                           f"model.recompute={rc}", f"train.reshard_after_forward={reshard}",
                           f"run.dir={Path(root) / name}"])
            trainer = Trainer(cfg, init_distributed(cfg), Path(root) / name)
            trainer.train_step()
            _, _, gathers, held, _ = _check_step(trainer)
            out[name] = (gathers, held, trainer.ddp.gatherer.peak_held_bytes)
    return out


def test_zero3_recompute_adds_no_gather_and_frees_every_unit():
    """ZeRO-3 + model.recompute=full at dp 2 issues as many parameter
    gathers per step as recompute=none (the replay runs on the gather of its unit's backward:
    no gather of its own) and holds nothing gathered at the end of each backward; with
    reshard_after_forward=false too (the forward's gather is kept until the unit's backward)."""
    with tempfile.TemporaryDirectory() as root:
        results = run_distributed(_zero3_gathers, 2, root, timeout_s=300)
    for r in results:
        for reshard in ("true", "false"):
            none, full = r[f"none_{reshard}"], r[f"full_{reshard}"]
            assert none[0] > 0 and full[0] == none[0], (reshard, none, full)
            assert len(full[1]) == 2 and all(h == 0 for h in none[1] + full[1]), (reshard, none, full)
            assert full[2] <= none[2], (reshard, none, full)  # the replay gathers nothing more at its peak
        assert r["none_true"][0] > r["none_false"][0]  # resharding after forward gathers again in backward


# ---- the gradient norm makes no fp64 copy of the gradients ----------------------------------
def test_grad_square_sum_copies_nothing_and_matches_fp64():
    """The profiler sees the allocations inside an op (fp64 `_foreach_norm` copies each tensor
    to fp64 below the dispatcher: an 8 MiB `aten::_to_copy` for a 4 MiB gradient)."""
    from torch.profiler import ProfilerActivity, profile

    from mpoverlap.data_parallel.grad_norm import square_sum

    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(1 << 20, generator=g), torch.randn(1000, generator=g) * 1e-3, torch.randn(7, 5, generator=g)]
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        sq = square_sum(grads, torch.device("cpu"))
    allocated = {e.key: e.cpu_memory_usage for e in prof.key_averages() if e.cpu_memory_usage > 0}
    assert max(allocated.values()) <= 64 << 10, f"the norm allocated a gradient's copy: {allocated}"
    ref = sum(float((t.double() ** 2).sum()) for t in grads)
    assert sq.dtype == torch.float64 and abs(float(sq) - ref) <= 1e-6 * ref
    bf16 = square_sum([t.bfloat16() for t in grads], torch.device("cpu"))
    assert abs(float(bf16) - ref) <= 1e-2 * ref


# ---- CUDA timing events are bounded and read without synchronising -----------------------------
class _FakeEvent:
    """A CUDA timing event on a fake clock: completes `lag` records later (query), counts the
    ones alive and every synchronize."""
    clock, alive, syncs = [0], [0], [0]

    def __init__(self, enable_timing=True):
        _FakeEvent.alive[0] += 1
        self.t = None

    def __del__(self):
        _FakeEvent.alive[0] -= 1

    def record(self, stream=None):
        _FakeEvent.clock[0] += 1
        self.t = _FakeEvent.clock[0]

    def query(self):
        return self.t is not None and _FakeEvent.clock[0] - self.t >= 2

    def synchronize(self):
        _FakeEvent.syncs[0] += 1

    def elapsed_time(self, other):
        return float(other.t - self.t)  # ms


class _Work:
    def wait(self):
        return True


def test_cuda_timing_events_are_pooled_and_resolved_at_step_boundaries(monkeypatch):
    from mpoverlap.comm.collectives import _clock
    from mpoverlap.comm.handle import CommHandle
    from mpoverlap.comm.ledger import CommLedger

    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda name: None)
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: None)
    ledger = CommLedger(strict=True, event_factory=_FakeEvent)
    cuda_like = SimpleNamespace(is_cuda=True)  # all `_clock` asks of the tensor
    per_step, steps = 50, 40
    for _ in range(steps):
        for _ in range(per_step):
            CommHandle("tp", "all_reduce", 4, [_Work()], ledger, **_clock(cuda_like, True, ledger)).wait()
        ledger.end_step()
    # Between log steps the events of completed handles went back to the pool: at most the
    # last step's (3 per handle) plus the few not complete at its boundary are alive.
    assert _FakeEvent.alive[0] <= 3 * per_step + 6, _FakeEvent.alive[0]
    assert ledger.events.created <= 3 * per_step + 6
    assert _FakeEvent.syncs[0] == 0  # step boundaries only query
    summary = ledger.summary()
    assert summary["tp"]["ops"] == per_step * steps
    assert _FakeEvent.syncs[0] <= 2  # the log step synchronises only the handles still unresolved


def test_strict_ledger_names_the_unwaited_handle():
    from mpoverlap.comm.collectives import all_reduce
    from mpoverlap.comm.ledger import CommLedger, UnwaitedCommError

    ledger = CommLedger(strict=True)
    all_reduce(torch.ones(3), None, mode="ep", ledger=ledger).wait()
    kept = all_reduce(torch.ones(3), None, mode="dp", ledger=ledger).carry_over()
    ledger.end_step()  # waited, or carried over on purpose: fine
    forgotten = all_reduce(torch.ones(2), None, mode="tp", ledger=ledger)  # noqa: F841
    with pytest.raises(UnwaitedCommError, match=r"tp:all_reduce 8 B issued at test_invariants.py:\d+ "
                                                r"test_strict_ledger_names_the_unwaited_handle") as err:
        ledger.end_step()
    assert "dp:all_reduce" in str(err.value)  # carried over one boundary, not two
    kept.wait()
    assert not CommLedger(strict=False).strict
