"""Overlap wiring, end to end: the Trainer (what `mpoverlap-train` builds) hands every mode's
switch to the layers it builds, and the handles it runs are then waited later than they are
issued; ZeRO-2/3 prefetch depth, reduce-scatters in flight and gradient bucket memory, probed
on the running Trainer.

Two kinds of checks per mode, for overlap on and off:

- structural: the switch sits on the objects the Trainer built (DataParallel, the TP layers'
  TPComm, the pipeline executor, the context-parallel attention, the MoE layers and their
  dispatchers);
- behavioural, without a clock threshold (timings on 2 shared cores flake): a handle is
  *deferred* when another handle was issued between its post and its wait, i.e. it stayed in
  flight while the rank went on. With overlap off every handle is waited where it is issued
  (none deferred); with overlap on the mode's handles are deferred.

A Trainer that passed `overlap=False` to a mode's layers (training/loop.py) fails both.
"""
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dist_harness import run_distributed  # noqa: E402

pytestmark = pytest.mark.slow

SMALL = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.ffn_hidden_size=128",
         "model.seq_length=32", "train.global_batch_size=8", "train.micro_batch_size=2", "data.max_bytes=100000",
         "overlap.dp_bucket_mb=0.02", "train.progress=false", "train.eval_iters=1", "train.device=cpu"]
MOE = ["model=moe_tiny", "model.moe_ffn_hidden_size=64"]

# mode -> (layout overrides, the override that switches the mode's overlap): world 2 each.
MODES = {
    "dp": (["parallel.dp=2"], "overlap.dp"),
    "tp": (["parallel.tp=2", "parallel.sequence_parallel=true"], "overlap.tp"),
    "pp": (["parallel.pp=2"], "overlap.pp"),
    "cp": (["parallel.cp=2"], "overlap.cp"),
    "ep": ([*MOE, "parallel.dp=2", "parallel.ep=2", "overlap.ep_chunks=4"], "overlap.ep"),
}
# The shares measured (issue, compute and wait order, not time): dp 6/7, tp 72/72, pp 3/6 (the
# pipeline's computes counted: by other handles' issues alone it would read 2/6 and, on a loaded
# machine, 1/6, a completed send freed before the next issue), cp 8/32, ep 56/68
# handles deferred with overlap on, 0 with it off.
MIN_DEFERRED = {"dp": 0.5, "tp": 0.9, "pp": 0.3, "cp": 0.2, "ep": 0.5}
ZERO3 = ["parallel.dp=2", "train.dp_sharding=optim_grads_params", "model.num_layers=4", "overlap.dp=true"]
ZERO = {
    "zero3_prefetch1": [*ZERO3, "overlap.dp_prefetch=1"],
    "zero3_prefetch2": [*ZERO3, "overlap.dp_prefetch=2"],
    "zero3_off": [*ZERO3[:-1], "overlap.dp=false", "overlap.dp_prefetch=2"],
    "zero2": ["parallel.dp=2", "train.dp_sharding=optim_grads", "model.num_layers=4", "overlap.dp=true"],
}
# MoE under SP with parallel.etp=1 at tp 2 and dp 1: the expert
# gradients are partial over tp and their buckets reduce over tp x edp (2 ranks) although there is
# a single data-parallel replica.
MOE_TP_EDP = [*MOE, "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.etp=1", "overlap.dp=auto"]


def _switches(trainer) -> dict:
    """mode -> the overlap switches found on the objects the Trainer built (empty: none built)."""
    from mpoverlap.tensor_parallel.comm_spec import TPComm

    model = trainer.model
    found = {m: [] for m in ("dp", "tp", "pp", "cp", "ep")}
    found["dp"].append(trainer.ddp.overlap)
    found["tp"] += [m.comm.overlap for m in model.modules() if isinstance(getattr(m, "comm", None), TPComm)
                    and m.comm.size > 1]
    if trainer.pipeline is not None:
        found["pp"].append(trainer.pipeline.executor.overlap)
    for m in model.modules():
        core = getattr(m, "core_attention", None)
        if core is not None and hasattr(core, "kwargs"):
            found["cp"].append(core.kwargs["overlap"])
    for layer in trainer.moe_layers:
        if layer.dispatcher.group is not None:
            found["ep"] += [layer.overlap, layer.dispatcher.overlap]
    return found


def _deferred(handles, computes=()) -> dict:
    """mode -> (handles, deferred ones): deferred = another handle was issued, or a pipeline
    action began computing (`computes`, the executor's trace), after this one's post and before
    its wait began (ordering only: no time threshold). The computes count because the executor
    frees a send that has already completed at its next step (`_reap_sends`): whether another
    handle was issued first depends on when the transfer finished, not on the wiring."""
    issues = sorted([h[1] for h in handles] + list(computes))
    out = {}
    for mode, _issued, posted, wait_began in handles:
        n, d = out.get(mode, (0, 0))
        later = any(posted <= t < wait_began for t in issues)
        out[mode] = (n + 1, d + int(later))
    return out


def _trace_tp_layers(trainer) -> list:
    """Every TP layer of the Trainer appends its (label, step, event, time) marks to one list
    (TPComm.trace, the layers' debug trace)."""
    from mpoverlap.tensor_parallel.comm_spec import TPComm

    trace = []
    for m in trainer.model.modules():
        if isinstance(getattr(m, "comm", None), TPComm):
            m.comm.trace = trace
    return trace


def _tp_deferred(trace) -> tuple:
    """(TP transfers, those with a GEMM between their issue and their wait): a TP handle hides
    under a GEMM chunk (collective matmul) or the wgrad GEMM, not under another handle."""
    total = deferred = 0
    for i, (label, step, event, _) in enumerate(trace):
        if event != "issue":
            continue
        j = next(j for j in range(i + 1, len(trace)) if trace[j][:3] == (label, step, "wait"))
        total += 1
        deferred += any(e[2] == "gemm_start" for e in trace[i + 1:j])
    return total, deferred


def _zero_probes(trainer) -> dict:
    """Wrap the running Trainer's ZeRO machinery: at every unit's forward pre-hook, the buckets
    whose gathers are still in flight once the unit is ready; after every reduce-scatter issue,
    how many are in flight."""
    ddp = trainer.ddp
    probes = {"forward_pending": [], "rs_in_flight": [], "units": 0}
    gatherer = ddp.gatherer
    if gatherer is not None:
        probes["units"] = len(gatherer.units)
        ensure = gatherer.ensure

        def probed_ensure(i, step=1):
            ensure(i, step)
            if step == 1:
                probes["forward_pending"].append((i, sorted(gatherer._pending)))
        gatherer.ensure = probed_ensure
    issue = ddp._issue_sharded

    def probed_issue(b):
        issue(b)
        probes["rs_in_flight"].append(len(ddp._handles))
    ddp._issue_sharded = probed_issue
    return probes


def _probe(rank, world, specs, root):
    from mpoverlap.config import compose
    from mpoverlap.training.loop import Trainer
    from mpoverlap.training.setup import init_distributed

    out = {}
    for name, overrides in specs.items():
        cfg = compose([*overrides, "train.steps=2", f"run.dir={Path(root) / name}"])
        trainer = Trainer(cfg, init_distributed(cfg), Path(root) / name)
        handles = []
        trainer.ledger.recorder = lambda h: handles.append((h.mode, h.issued_at, h.posted_at, h.wait_began_at))
        tp_trace = _trace_tp_layers(trainer)
        zero = _zero_probes(trainer) if trainer.ddp.shard_grads else None
        executor = getattr(getattr(trainer, "pipeline", None), "executor", None)
        trainer.train_step()
        trainer.ddp.peak_grad_bucket_bytes = 0
        handles.clear()
        tp_trace.clear()
        if executor is not None:
            executor.trace.clear()
        trainer.train_step()  # the second step: ZeRO-2's after-step gathers are in it too
        computes = [t for kind, _, t in executor.trace if kind == "compute"] if executor is not None else []
        deferred = _deferred(handles, computes)
        if "tp" in deferred:
            deferred["tp"] = _tp_deferred(tp_trace)
        row = {"switches": _switches(trainer), "deferred": deferred}
        if zero is not None:
            buckets = trainer.ddp.buffer.buckets
            row.update(zero, peak_grad_bucket_bytes=trainer.ddp.peak_grad_bucket_bytes,
                       grad_bucket_bytes=sorted(b.numel * b.grad_data.element_size() for b in buckets),
                       buckets_of=trainer.ddp.gatherer.buckets_of if trainer.ddp.gatherer else [],
                       prefetch=int(cfg.overlap.dp_prefetch), overlap=bool(trainer.ddp.overlap),
                       chunk_of=[u.chunk for u in trainer.ddp.gatherer.units] if trainer.ddp.gatherer else [])
        out[name] = row
    return out


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    """One spawn of two ranks: every mode with overlap on and off, and the ZeRO layouts."""
    specs = {}
    for mode, (layout, switch) in MODES.items():
        for on in (True, False):
            specs[f"{mode}_{'on' if on else 'off'}"] = [*SMALL, *layout, f"{switch}={str(on).lower()}"]
    specs.update({name: [*SMALL, *ov] for name, ov in ZERO.items()})
    specs["moe_tp2_sp_dp1"] = [*SMALL, *MOE_TP_EDP]
    return run_distributed(_probe, 2, specs, str(tmp_path_factory.mktemp("wiring")), timeout_s=600)[0]


# TP without sequence parallelism: overlap.tp=auto (on at tp 2) against false.
TP_NOSP = {"tp_nosp_auto": [*SMALL, "parallel.tp=2"], "tp_nosp_off": [*SMALL, "parallel.tp=2", "overlap.tp=false"]}


@pytest.fixture(scope="module")
def probed_tp_nosp(tmp_path_factory):
    return run_distributed(_probe, 2, TP_NOSP, str(tmp_path_factory.mktemp("wiring_tp_nosp")), timeout_s=600)[0]


def test_tp_without_sp_waits_the_input_gradient_all_reduce_after_the_wgrad_gemm(probed_tp_nosp):
    """tp 2 without SP, overlap.tp=auto: the Trainer's TP layers get overlap on, and every
    column-parallel backward's input-gradient all-reduce has its wgrad GEMM between its issue
    and its wait; with overlap.tp=false each is waited right after its issue (nothing between)."""
    auto, off = probed_tp_nosp["tp_nosp_auto"], probed_tp_nosp["tp_nosp_off"]
    assert auto["switches"]["tp"] and all(auto["switches"]["tp"]), auto["switches"]
    assert off["switches"]["tp"] and not any(off["switches"]["tp"]), off["switches"]
    total, deferred = auto["deferred"]["tp"]
    print(f"\ntp without SP: auto {auto['deferred']['tp']}  off {off['deferred']['tp']}")
    assert total > 0 and deferred == total, auto["deferred"]
    total_off, deferred_off = off["deferred"]["tp"]
    assert total_off == total and deferred_off == 0, off["deferred"]


@pytest.mark.parametrize("mode", list(MODES))
def test_trainer_wires_each_mode_switch_into_its_layers(probed, mode):
    on, off = probed[f"{mode}_on"]["switches"][mode], probed[f"{mode}_off"]["switches"][mode]
    assert on and off, f"the Trainer built no {mode} object carrying an overlap switch"
    assert all(on), (mode, on)
    assert not any(off), (mode, off)


@pytest.mark.parametrize("mode", list(MODES))
def test_trainer_defers_each_modes_waits_only_with_overlap_on(probed, mode):
    """overlap on: the mode's handles (some, for pp and cp whose handles mostly hide under
    compute alone) stay in flight while the rank goes on issuing; off: none does."""
    on, off = probed[f"{mode}_on"]["deferred"], probed[f"{mode}_off"]["deferred"]
    print(f"\n{mode}: on {on}  off {off}")
    total, deferred = on[mode]
    assert deferred >= MIN_DEFERRED[mode] * total > 0, (mode, on)
    assert off[mode][1] == 0, (mode, off)


def test_zero3_prefetch_depth_when_each_unit_starts(probed):
    """When unit i's forward may start, the gathers in flight are exactly the buckets of the next
    `overlap.dp_prefetch` units of its chunk (fewer at the chunk's end; a tied head shares the
    embedding's bucket); overlap.dp=false prefetches nothing."""
    for name in ("zero3_prefetch1", "zero3_prefetch2", "zero3_off"):
        got = probed[name]
        depth = got["prefetch"] if got["overlap"] else 0
        chunk_of, buckets_of = got["chunk_of"], got["buckets_of"]
        assert len(got["forward_pending"]) == 2 * 2 * len(chunk_of), name  # 2 steps x 2 microbatches
        for i, pending in got["forward_pending"]:
            ahead = [j for j in range(i + 1, min(i + 1 + depth, len(chunk_of))) if chunk_of[j] == chunk_of[i]]
            assert len(ahead) == min(depth, len(chunk_of) - 1 - i)
            want = sorted({b for j in ahead for b in buckets_of[j]} - set(buckets_of[i]))
            assert pending == want, (name, i, pending, want)


def test_zero_reduce_scatters_in_flight_and_bucket_memory(probed):
    """ZeRO-2/3: never more than two reduce-scatters in flight (two reached with overlap on,
    none left in flight with it off), and the full gradient buckets alive at once are at most
    those two plus the one backward is filling (with overlap off: the one filling)."""
    for name in ("zero3_prefetch1", "zero3_prefetch2", "zero2", "zero3_off"):
        got = probed[name]
        in_flight = 2 if got["overlap"] else 0
        assert got["rs_in_flight"], name
        assert max(got["rs_in_flight"]) == in_flight, (name, got["rs_in_flight"])
        sizes = got["grad_bucket_bytes"]
        print(f"\n{name}: peak {got['peak_grad_bucket_bytes']} bucket bytes {sizes}")
        assert 0 < got["peak_grad_bucket_bytes"] <= sum(sizes[-(in_flight + 1):]), name


def test_expert_buckets_over_tp_overlap_at_dp1(probed):
    """dp 1, MoE + SP + etp 1 at tp 2: overlap.dp=auto is on (the tp x edp expert buckets are
    a reduction) and those buckets' all-reduces stay in flight under the rest of backward."""
    row = probed["moe_tp2_sp_dp1"]
    assert row["switches"]["dp"] == [True], row["switches"]
    total, deferred = row["deferred"]["dp"]
    print(f"\nmoe tp2 sp dp1: dp handles {total}, deferred {deferred}")
    assert deferred >= MIN_DEFERRED["dp"] * total > 0, row["deferred"]
