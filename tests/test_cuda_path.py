"""The CUDA path's host-side behaviour, exercised on CPU: host reads per step,
device choice against the visible GPUs, CUDA_DEVICE_MAX_CONNECTIONS, handles releasing
buffers at wait, parameter gathers waited before first use."""
import os
import sys
import tempfile

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dist_harness import run_distributed  # noqa: E402

from mpoverlap.training.host_sync import count_host_reads  # noqa: E402

SMALL = ["model=gpt_tiny", "model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=4",
         "model.ffn_hidden_size=64", "model.seq_length=16", "train.global_batch_size=8",
         "train.micro_batch_size=2", "data.max_bytes=200000", "train.device=cpu", "train.progress=false"]


def _trainer(overrides, run_dir):
    from mpoverlap.config import compose
    from mpoverlap.training.loop import Trainer
    from mpoverlap.training.setup import init_distributed

    cfg = compose(overrides + [f"run.dir={run_dir}"])
    return Trainer(cfg, init_distributed(cfg), run_dir)


def _step_reads(rank, world, overrides, run_dir):
    from pathlib import Path

    trainer = _trainer(overrides, Path(run_dir))
    trainer.train_step()  # the first step builds lazy state (AdamW moments): not a hot-path step
    out = []
    for _ in range(3):
        with count_host_reads() as reads:
            trainer.train_step()
        out.append(reads.summary())
    return [(s, int(s.split()[0])) for s in out]


# (layout, host reads allowed per step). MoE: one read per MoE layer and microbatch (every
# chunk's split sizes together): moe_tiny at SMALL's 2 layers (both MoE), 2 microbatches at dp2.
HOT_STEP_BUDGETS = {
    "dp2-zero1": (["parallel.dp=2", "train.distributed_optimizer=true", "overlap.dp=true"], 1),
    "dp2-zero2": (["parallel.dp=2", "train.dp_sharding=optim_grads", "overlap.dp=true"], 1),
    "dp2-zero3": (["parallel.dp=2", "train.dp_sharding=optim_grads_params", "overlap.dp=true"], 1),
    "tp2-sp-collective-matmul": (["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.dp=1",
                                  "overlap.tp=true"], 1),
    "cp2-ring": (["parallel.cp=2", "overlap.cp=true"], 1),
    # zero bubble: the W queues and the bubble timing read nothing from the device
    "pp2-zb1p": (["parallel.pp=2", "parallel.pp_schedule=zb1p", "overlap.pp=true"], 1),
    "cp2-a2a": (["parallel.cp=2", "parallel.cp_comm=a2a", "overlap.cp=true"], 1),
    "cp2-ring-gqa": (["model.num_query_groups=2", "parallel.cp=2", "overlap.cp=true"], 1),
    "moe-ep2": (["model=moe_tiny", "model.moe_ffn_hidden_size=64", "parallel.dp=2", "parallel.ep=2",
                 "overlap.ep=true", "overlap.ep_chunks=4"], 1 + 2 * 2),
    # Sigmoid router with the aux-loss-free bias (its update: no host read), and the
    # experts split over tp (etp). moe_fine_tiny at 2 layers has 1 MoE layer (the first is dense).
    "moe-fine-ep2-bias": (["model=moe_fine_tiny", "model.moe_router_score=sigmoid", "model.moe_router_norm_topk=true",
                           "model.moe_router_bias_update_rate=0.01", "parallel.dp=2", "parallel.ep=2",
                           "overlap.ep=true", "overlap.ep_chunks=4"], 1 + 1 * 2),
    # At ep 1 the grouped experts read nothing (rows per expert stay on the device),
    # with a capacity factor too (dropped slots ride as zero rows): the norm's read alone.
    "moe-fine-etp2-sp": (["model=moe_fine_tiny", "model.moe_router_bias_update_rate=0.01", "parallel.tp=2",
                          "parallel.etp=2", "parallel.sequence_parallel=true", "parallel.dp=1"], 1),
    "moe-ep1-capacity": (["model=moe_tiny", "model.moe_ffn_hidden_size=64", "parallel.dp=2",
                          "model.moe_capacity_factor=1.0"], 1),
    # ... and at ep 2: the all-to-all pads every expert's queue to the capacity (fixed sizes)
    "moe-ep2-capacity": (["model=moe_tiny", "model.moe_ffn_hidden_size=64", "parallel.dp=2", "parallel.ep=2",
                          "overlap.ep=true", "overlap.ep_chunks=4", "model.moe_capacity_factor=1.0"], 1),
}


@pytest.mark.parametrize("name", list(HOT_STEP_BUDGETS))
def test_hot_step_reads_the_host_within_budget(name):
    """Outside log steps, with clipping: one host read per step (the non-finite decision on
    the gradient norm), none in the forward, backward (collective matmul, ring and all-to-all
    attention included), gradient reduction or optimizer; MoE at ep > 1 adds one per layer and
    microbatch (every chunk's split sizes together), at ep 1 none."""
    layout, budget = HOT_STEP_BUDGETS[name]
    overrides = SMALL + layout + ["train.grad_clip=1.0", "train.log_interval=100"]
    with tempfile.TemporaryDirectory() as run_dir:
        results = run_distributed(_step_reads, 2, overrides, run_dir)
    for rank_steps in results:
        for summary, count in rank_steps:
            assert count <= budget, summary


# ---- a CUDA handle releases its buffers at wait, keeps only its events ---------------------
class _FakeEvent:
    clock = [0.0]

    def __init__(self, enable_timing=False):
        self.t = None

    def record(self, stream=None):
        _FakeEvent.clock[0] += 1.0
        self.t = _FakeEvent.clock[0]

    def synchronize(self):
        pass

    def elapsed_time(self, other):  # milliseconds, like torch.cuda.Event
        return (other.t - self.t) * 1e3


class _FakeWork:
    def __init__(self, log):
        self.log = log

    def wait(self):
        self.log.append("waited")
        return True


def test_cuda_handle_releases_buffers_at_wait(monkeypatch):
    import gc
    import weakref

    from mpoverlap.comm.handle import CommHandle

    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda name: None)
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: None)
    from mpoverlap.comm.ledger import CommLedger

    recorded = []
    ledger = CommLedger(strict=False, event_factory=_FakeEvent)
    ledger.recorder = recorded.append

    buf = torch.ones(1024)
    alive = weakref.ref(buf)
    log = []
    work = _FakeWork(log)
    work_alive = weakref.ref(work)
    start = _FakeEvent()
    start.record()
    h = CommHandle("tp", "all_gather", buf.numel() * 4, [work], ledger, keepalive=[buf], cuda_start=start)
    del buf, work
    gc.collect()
    assert alive() is not None, "the buffer must live while the collective is in flight"
    h.wait()
    gc.collect()
    assert log == ["waited"]
    # Waited: the compute stream is ordered after the collective, the buffers can go...
    assert alive() is None, "the handle still holds its buffers after wait()"
    assert work_alive() is None, "the handle still holds its works after wait()"
    # ...and the timing still resolves from the events, at the ledger's next summary.
    assert recorded == [h] and h.uses_cuda_events
    h.resolve_timing()
    assert h.blocked_s == pytest.approx(1.0) and h.in_flight_s == pytest.approx(2.0)
    assert not h.uses_cuda_events


# ---- the a2a layout's index tensors are built once per (cp, device) ------------------------
def test_a2a_layout_builds_its_indices_once(monkeypatch):
    from mpoverlap.context_parallel import a2a_layout as lay

    cp, T, B, N, S, D = 2, 3, 2, 4, 8, 4
    y = torch.randn(T, B, N // cp, S, D)
    lay.pack_head_to_seq(y, cp)  # warm-up: may build the indices
    built = []
    real = torch.tensor
    monkeypatch.setattr(torch, "tensor", lambda *a, **k: built.append(a) or real(*a, **k))
    with count_host_reads() as reads:
        for _ in range(3):
            send = lay.pack_head_to_seq(y, cp)
            back = lay.unpack_seq_to_head(send, cp)
    assert torch.equal(back, y)  # the two moves are inverse: the cached indices are the right ones
    assert built == [], f"index tensors rebuilt from Python lists on every call: {len(built)}"
    assert reads.count == 0, reads.summary()


# ---- groups the trainer never uses are not created; eval p2p on the pp group ----------------
def _created_groups(rank, world):
    import torch.distributed as dist

    from mpoverlap.parallel import ParallelState, RankGrid
    from mpoverlap.training.setup import unused_group_kinds

    calls = []
    real = dist.new_group
    dist.new_group = lambda *a, **k: calls.append(k.get("ranks")) or real(*a, **k)
    try:
        state = ParallelState.create(RankGrid(tp=2, dp=2), torch.device("cpu"), skip=unused_group_kinds(False))
    finally:
        dist.new_group = real
    try:
        state.group("mp")
        raised = None
    except KeyError as err:
        raised = str(err)
    return calls, sorted(state.groups), raised, state.group("dp_cp") is not None


def test_unused_group_kinds_are_not_created():
    results = run_distributed(_created_groups, 4)
    calls = results[0][0]
    assert all(r[0] == calls for r in results)  # the same new_group calls, in the same order
    kinds = results[0][1]
    assert "dp" not in kinds and "mp" not in kinds and {"tp", "dp_cp", "edp", "pp", "ep"} <= set(kinds)
    # tp2 x dp2: tp (2 groups), dp_cp (2), edp (2); the 2 dp and 2 mp groups are not created.
    assert len(calls) == 6, calls
    assert "not created" in results[0][2] and results[0][3]


def test_eval_pipeline_p2p_uses_the_pp_group(monkeypatch):
    import torch.distributed as dist

    from mpoverlap.training.pipeline_glue import forward_only

    seen = []
    monkeypatch.setattr(dist, "send", lambda t, dst, group=None, **k: seen.append(("send", dst, group)))
    monkeypatch.setattr(dist, "recv", lambda t, src, group=None, **k: seen.append(("recv", src, group)))
    pp_group = object()
    # stage 0 of 2 (global ranks 4 and 6), two chunks per stage: send, recv, send.
    forward_only([None, None], 0, [4, 6], 1, lambda v, mb, h: torch.zeros(2), (2,), torch.float32,
                 torch.device("cpu"), pp_group=pp_group)
    assert seen == [("send", 6, pp_group), ("recv", 6, pp_group), ("send", 6, pp_group)]


# ---- ranks per node against the visible GPUs ------------------------------------------------
def _fake_gpus(monkeypatch, count):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_auto_device_needs_a_gpu_per_rank(monkeypatch):
    from mpoverlap.overlap.cuda_env import device_choice
    from mpoverlap.training.setup import resolve_device

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    _fake_gpus(monkeypatch, 4)
    choice, why = device_choice("auto", 8)  # self-launch of 8 ranks on a 4-GPU machine
    assert choice == "cpu" and "8 ranks" in why and "4 visible GPU" in why
    assert device_choice("auto", 4)[0] == "cuda"
    # The worker's own choice agrees (not cuda whenever one GPU exists: ranks past it would ask for an invalid ordinal).
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert resolve_device("auto", 8) == (torch.device("cpu"), "gloo")
    # torchrun over 2 nodes, 4 ranks each: LOCAL_WORLD_SIZE, not the world, is what must fit.
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert device_choice("auto", 8)[0] == "cuda"
    _fake_gpus(monkeypatch, 0)
    assert device_choice("auto", 1)[0] == "cpu"


def test_explicit_cuda_with_too_few_gpus_is_refused(monkeypatch):
    from mpoverlap.config import compose
    from mpoverlap.overlap import validate

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    _fake_gpus(monkeypatch, 4)
    overrides = ["train.device=cuda", "parallel.dp=8"]
    found = [p for p in validate(compose(overrides)) if p.rule == "train.device_available"]
    assert found, "train.device=cuda with 8 ranks and 4 GPUs must be refused"
    text = found[0].render()
    assert "train.device=cuda" in text and "ranks on this machine=8" in text and "visible GPUs=4" in text
    assert not [p for p in validate(compose(overrides + found[0].fix)) if p.rule == "train.device_available"]
    assert not [p for p in validate(compose(["train.device=cuda", "parallel.dp=4"]))
                if p.rule == "train.device_available"]


def test_self_launch_refuses_cuda_with_too_few_gpus_exit_2(monkeypatch, capsys):
    from mpoverlap import train

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    _fake_gpus(monkeypatch, 1)
    assert train.main(["train.device=cuda", "parallel.dp=2"]) == 2
    err = capsys.readouterr().err
    assert "train.device_available" in err and "visible GPUs=1" in err and "fix: train.device=cpu" in err


# ---- CUDA_DEVICE_MAX_CONNECTIONS set only for TP/CP overlap, never over the user's --------------
def test_launcher_sets_max_connections_only_for_tp_cp_overlap(monkeypatch, tmp_path):
    import torch.distributed.launcher.api as launcher_api

    from mpoverlap import train

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    _fake_gpus(monkeypatch, 8)
    seen = {}

    def fake_launch(config, entry):
        return lambda args: seen.update(env=os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")) or {0: None}

    monkeypatch.setattr(launcher_api, "elastic_launch", fake_launch)
    # The CPU case would start the fork server; the launch is faked, so is the server (this
    # process may already run the test harness's own, which start() rightly refuses).
    from mpoverlap.training import fork_server

    monkeypatch.setattr(fork_server, "start", lambda: "forkserver")
    cases = [([], None, None),  # dense dp: nothing to set
             (["parallel.tp=2", "parallel.sequence_parallel=true"], None, "1"),  # TP overlap on
             (["parallel.tp=2", "parallel.sequence_parallel=true", "overlap.tp=false"], None, None),
             (["parallel.tp=2"], None, "1"),  # without SP: the input-gradient all-reduce under wgrad
             (["parallel.tp=2", "overlap.tp=false"], None, None),
             (["parallel.tp=2", "parallel.sequence_parallel=true"], "4", "4"),  # the user's value is kept
             (["parallel.tp=2", "parallel.sequence_parallel=true", "train.device=cpu"], None, None)]
    for extra, user, expected in cases:
        if user is None:
            monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
        else:
            monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", user)
        cfg = __import__("mpoverlap.config", fromlist=["compose"]).compose(
            ["parallel.dp=2"] + extra + [f"run.dir={tmp_path}"])
        try:
            assert train._launch(cfg, ["parallel.dp=2"] + extra) == 0
        finally:
            got = os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
        assert seen["env"] == expected == got, (extra, user, seen)


def test_torchrun_worker_sets_max_connections_itself(monkeypatch):
    from mpoverlap import train
    from mpoverlap.config import compose

    _fake_gpus(monkeypatch, 2)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    for extra, expected in ((["parallel.tp=2", "parallel.sequence_parallel=true"], "1"), (["parallel.dp=2"], None)):
        monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
        try:
            train._worker_max_connections(compose(extra), 2)
        finally:
            got = os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
        assert got == expected, extra


# ---- every parameter's gather is waited before its first read -------------------------------
def _gather_order(rank, world, overrides, run_dir):
    """Record, during the step after a distributed-optimizer step, the first read of every
    parameter and the wait of every pending parameter all-gather, in program order.

    A TorchFunctionMode sees every torch call with its tensor arguments, whatever module or
    function makes it (a forward pre-hook records only module calls: exactly the blind spot
    of the bug, an ExpertMLP that reads its Linear's weight without calling the Linear)."""
    from pathlib import Path

    from torch.overrides import TorchFunctionMode

    trainer = _trainer(overrides, Path(run_dir))
    opt = trainer.optimizer
    buf = trainer.ddp.buffer
    bucket_of = {id(p): buf.index[p][2] for p in buf.params}
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    trainer.train_step()
    pending = set(opt.pending_param_gathers)
    assert pending, "parameter-gather overlap is off: nothing to check"
    log = []

    class Logged:
        def __init__(self, b, handle):
            self.b, self.handle = b, handle

        def wait(self):
            log.append(("wait", self.b))
            return self.handle.wait()

    for b in list(opt._pending):
        opt._pending[b] = Logged(b, opt._pending[b])
    seen = set()

    def visit(obj):
        if isinstance(obj, torch.nn.Parameter) and id(obj) in bucket_of and id(obj) not in seen:
            seen.add(id(obj))
            log.append(("read", names.get(id(obj), "?"), bucket_of[id(obj)]))
        elif isinstance(obj, (list, tuple)):
            for o in obj:
                visit(o)

    class FirstRead(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            visit(args)
            visit(tuple((kwargs or {}).values()))
            return func(*args, **(kwargs or {}))

    with FirstRead():
        trainer.train_step()
    waited, late = set(), []
    for entry in log:
        if entry[0] == "wait":
            waited.add(entry[1])
        elif entry[2] in pending and entry[2] not in waited:
            late.append(entry[1])
    read = {e[1] for e in log if e[0] == "read"}
    return {"late": late, "read": len(read), "params": len(names), "pending": sorted(pending)}


@pytest.mark.parametrize("model", [["model=gpt_tiny"], ["model=moe_tiny", "model.shared_expert=true"],
                                   ["model=moe_tiny", "model.shared_expert=true", "parallel.ep=2"]],
                         ids=["gpt_tiny", "moe_tiny+shared", "moe_tiny+shared+ep2"])
def test_param_gathers_waited_before_first_read(model):
    overrides = SMALL + model + ["parallel.dp=2", "train.distributed_optimizer=true", "overlap.dp=true",
                                 "overlap.dp_param_gather=true", "overlap.dp_bucket_mb=0.01",
                                 "model.num_experts=4", "model.moe_ffn_hidden_size=32"]
    if model[0] == "model=gpt_tiny":
        overrides = [o for o in overrides if not o.startswith(("model.num_experts", "model.moe_ffn"))]
    with tempfile.TemporaryDirectory() as run_dir:
        results = run_distributed(_gather_order, 2, overrides, run_dir)
    for r in results:
        assert len(r["pending"]) > 1  # several buckets in flight: the order matters
        assert r["read"] == r["params"], r  # every parameter was seen (the mode sees them all)
        assert not r["late"], f"read before their bucket's gather was waited: {r['late']}"
