"""Checkpointer: atomic saves, newest-complete discovery, pruning to checkpoint.keep, and the
asynchronous saves of checkpoint.async_save=true (staged copy, background write, at most one in
flight, failures leave the previous checkpoint newest)."""
import os
import socket
import sys
import threading

import pytest
import torch
import torch.distributed as dist

from mpoverlap.training.checkpoint import COMPLETE, Checkpointer, CheckpointError, checkpoint_io_group, stage_state

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def one_rank_group():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _state(value: float):
    return {"model": {"w": torch.full((4,), value)}, "meta": {"step": int(value)}}


def test_keep_prunes_to_newest(tmp_path, one_rank_group):
    ck = Checkpointer(tmp_path, keep=2)
    for step in (1, 2, 3):
        ck.save(step, _state(step))
    assert [p.name for p in ck.complete_checkpoints()] == ["step_00000002", "step_00000003"]
    loaded = ck.load(ck.latest(), _state(0))
    assert loaded["meta"]["step"] == 3 and torch.equal(loaded["model"]["w"], torch.full((4,), 3.0))


def test_save_killed_half_way_leaves_previous_loadable(tmp_path, one_rank_group, monkeypatch):
    """Also with the config every checkpoint carries (config.yaml, written into the .partial
    directory first): a killed save's directory holds it, and is still never picked."""
    ck = Checkpointer(tmp_path, keep=3, config_yaml="model:\n  num_layers: 2\n")
    ck.save(1, _state(1))
    assert (tmp_path / "step_00000001" / "config.yaml").read_text() == "model:\n  num_layers: 2\n"
    import torch.distributed.checkpoint as dcp

    real_save = dcp.save

    def dies_half_way(state, checkpoint_id, planner=None):
        real_save(state, checkpoint_id=checkpoint_id, planner=planner)  # shards written ...
        os.remove(os.path.join(checkpoint_id, ".metadata"))  # ... but the run died before the end
        raise KeyboardInterrupt("killed during save")

    monkeypatch.setattr(dcp, "save", dies_half_way)
    with pytest.raises(KeyboardInterrupt):
        ck.save(2, _state(2))
    assert (tmp_path / "step_00000002.partial" / "config.yaml").is_file()
    assert ck.latest().name == "step_00000001"
    assert ck.load(ck.latest(), _state(0))["meta"]["step"] == 1
    # A directory that looks complete but lacks the COMPLETE marker is never picked either.
    fake = tmp_path / "step_00000009"
    fake.mkdir()
    (fake / ".metadata").write_text("junk")
    assert ck.latest().name == "step_00000001"
    (fake / COMPLETE).write_text("{}")
    assert ck.latest().name == "step_00000009"


# ---- checkpoint.async_save ------------------------------------------------------------------
@pytest.fixture(scope="module")
def io_group(one_rank_group):
    return checkpoint_io_group(60)


def _rich_state(value: float):
    return {"model": {"w": torch.full((4, 3), value), "b": torch.arange(5.0) + value},
            "optimizer": {"exp_avg": {"w": torch.full((4, 3), -value)}, "lr": [0.1, value]},
            "meta": {"step": int(value), "name": "run"}}


def _loaded(ck, path, template_value=0.0):
    return ck.load(path, _rich_state(template_value))


def _assert_same(a, b):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    else:
        assert a == b


class _Held:
    """An object of the kind the sharded-checkpoint code puts in app_state: it stages itself."""

    def __init__(self, t):
        self.t, self.staged_calls = t, 0

    def staged(self, copy_tensor):
        self.staged_calls += 1
        return _Held(copy_tensor(self.t))


def test_stage_state_copies_every_tensor_and_asks_objects_for_their_copy():
    held = _Held(torch.ones(3))
    state = {"a": {"t": torch.zeros(2, 2), "list": [torch.ones(2), 3]}, "h": held, "meta": {"k": [1, 2]}}
    staged = stage_state(state)
    assert held.staged_calls == 1 and staged["h"] is not held and torch.equal(staged["h"].t, held.t)
    held.t.add_(1)  # the stager's copy function made a real copy for the object too
    assert torch.equal(staged["h"].t, torch.ones(3))
    state["a"]["t"].add_(5)
    state["a"]["list"][0].add_(5)
    state["meta"]["k"].append(3)
    assert torch.equal(staged["a"]["t"], torch.zeros(2, 2)) and torch.equal(staged["a"]["list"][0], torch.ones(2))
    assert staged["a"]["list"][1] == 3 and staged["meta"] == {"k": [1, 2]}


class _BlockedWrites:
    """FileSystemWriter.write_data patched: each write under `root` records its directory, and
    (while `hold` is clear) waits until the test releases it. Writes elsewhere (a background write
    an earlier, failed test left behind) pass through untouched, so one failure does not cascade."""

    def __init__(self, monkeypatch, root, fail_on=None):
        from torch.distributed.checkpoint import FileSystemWriter

        self.hold = threading.Event()
        self.hold.set()
        self.started, self.nice = [], []
        real = FileSystemWriter.write_data
        blocked = self

        def write_data(writer, plan, planner):
            path = str(writer.path)
            if not path.startswith(str(root)):
                return real(writer, plan, planner)
            blocked.started.append(path)
            blocked.nice.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
            blocked.hold.wait(30)
            fut = real(writer, plan, planner)  # the shards are written ...
            if fail_on and fail_on in path:
                fut.wait()
                raise OSError("No space left on device (injected)")  # ... and the run fails before .metadata
            return fut

        real_prepare = FileSystemWriter.prepare_local_plan

        def prepare_local_plan(writer, plan):
            # Held too: DCP plans (and its writer would create the directory) in the background.
            if str(writer.path).startswith(str(root)):
                blocked.hold.wait(30)
            return real_prepare(writer, plan)

        monkeypatch.setattr(FileSystemWriter, "write_data", write_data)
        monkeypatch.setattr(FileSystemWriter, "prepare_local_plan", prepare_local_plan)


def test_async_save_writes_what_sync_writes_and_keeps_only_complete_ones_visible(tmp_path, io_group, monkeypatch):
    main_nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    sync = Checkpointer(tmp_path / "sync")
    sync.save(1, _rich_state(1.0))
    writes = _BlockedWrites(monkeypatch, tmp_path)
    ck = Checkpointer(tmp_path / "async", keep=5, async_save=True, group=io_group)
    writes.hold.clear()
    state = _rich_state(1.0)
    final = ck.save(1, state)
    assert ck.in_flight and ck.latest() is None and (tmp_path / "async" / "step_00000001.partial").is_dir()
    # The staged copy is real: changing the live tensors now does not change what is written.
    for t in (state["model"]["w"], state["model"]["b"], state["optimizer"]["exp_avg"]["w"]):
        t.fill_(99.0)
    state["optimizer"]["lr"].append(7)
    writes.hold.set()
    ck.wait()
    assert not ck.in_flight and ck.latest() == final and (final / COMPLETE).is_file()
    assert not (tmp_path / "async" / "step_00000001.partial").exists()
    _assert_same(_loaded(ck, final), _loaded(sync, sync.latest()))
    _assert_same(_loaded(ck, final), _rich_state(1.0))
    assert ck.last_async["step"] == 1 and ck.last_async["write_s"] > 0
    # The background write yields the CPU to training (nice 19 for its thread only, on Linux).
    if sys.platform.startswith("linux"):
        assert writes.nice == [19] and os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == main_nice


def test_async_saves_are_one_at_a_time(tmp_path, io_group, monkeypatch):
    writes = _BlockedWrites(monkeypatch, tmp_path)
    ck = Checkpointer(tmp_path, keep=5, async_save=True, group=io_group)
    writes.hold.clear()
    ck.save(1, _rich_state(1.0))
    assert ck.in_flight
    release = threading.Timer(0.3, writes.hold.set)
    release.start()
    ck.save(2, _rich_state(2.0))  # waits for step 1 to be written and renamed before staging step 2
    assert (tmp_path / "step_00000001" / COMPLETE).is_file()
    ck.wait()
    assert [p.name for p in ck.complete_checkpoints()] == ["step_00000001", "step_00000002"]
    assert [os.path.basename(p.rstrip("/")) for p in writes.started] == ["step_00000001.partial",
                                                                          "step_00000002.partial"]
    _assert_same(_loaded(ck, ck.latest()), _rich_state(2.0))


def test_failed_async_write_leaves_previous_checkpoint_newest_and_raises(tmp_path, io_group, monkeypatch):
    ck = Checkpointer(tmp_path, keep=5, async_save=True, group=io_group)
    ck.save(1, _rich_state(1.0))
    ck.wait()
    _BlockedWrites(monkeypatch, tmp_path, fail_on="step_00000002")
    ck.save(2, _rich_state(2.0))  # returns once staged; the write fails in the background
    with pytest.raises(CheckpointError, match="step 2 failed") as err:
        ck.wait()
    assert "(OSError: No space left on device (injected))" in str(err.value) and err.value.__cause__ is not None
    partial = tmp_path / "step_00000002.partial"
    assert partial.is_dir() and not (partial / COMPLETE).exists()
    assert ck.latest().name == "step_00000001"
    _assert_same(_loaded(ck, ck.latest()), _rich_state(1.0))
    # A failure is also reported by the next save (step 2 fails again here), which then saves normally.
    ck.save(2, _rich_state(2.0))
    with pytest.raises(CheckpointError, match="step 2 failed"):
        ck.save(3, _rich_state(3.0))
    ck.save(3, _rich_state(3.0))
    ck.wait()
    assert ck.latest().name == "step_00000003" and not (tmp_path / "step_00000003.partial").exists()


def test_planners_reach_dcp_in_sync_and_async_saves_and_loads(tmp_path, io_group):
    from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner

    class CountingSave(DefaultSavePlanner):
        calls = 0

        def create_local_plan(self):
            CountingSave.calls += 1
            return super().create_local_plan()

    class CountingLoad(DefaultLoadPlanner):
        calls = 0

        def create_local_plan(self):
            CountingLoad.calls += 1
            return super().create_local_plan()

    for i, async_save in enumerate((False, True)):
        ck = Checkpointer(tmp_path / str(async_save), async_save=async_save, group=io_group if async_save else None)
        ck.save(1, _rich_state(1.0), planner=CountingSave())
        ck.wait()
        assert CountingSave.calls == i + 1
        _assert_same(ck.load(ck.latest(), _rich_state(0.0), planner=CountingLoad()), _rich_state(1.0))
        assert CountingLoad.calls == i + 1


def test_async_saving_run_resumes_on_the_uninterrupted_curve(tmp_path):
    """World 2 through Trainer.run(): a segment saving asynchronously (step 2's write in flight
    under step 3; the final save waits for it; ZeRO-1 moment shards), resumed by a second
    segment (async too, no sharding), against
    the uninterrupted run without async saves: the same losses within 1e-5."""
    from inproc_train import run_chains
    from test_train_cli import SMALL, rows

    base = [*SMALL, "parallel.dp=2", "train.lr_decay_steps=6", "checkpoint.interval=2"]
    on = [*base, "checkpoint.async_save=true"]
    # The first segment shards the AdamW moments over dp (train.dp_sharding=optim): each rank
    # stages and writes only its own chunks.
    run_chains({"ref": [(2, base, 6)], "part": [(2, [*on, "train.dp_sharding=optim"], 3), (2, on, 6)]}, tmp_path)
    part, ref = rows(tmp_path / "part"), rows(tmp_path / "ref")
    assert [r["step"] for r in part] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in part] == pytest.approx([r["loss"] for r in ref], rel=1e-5)
    names = sorted(p.name for p in (tmp_path / "part" / "checkpoints").iterdir())
    assert names == ["step_00000004", "step_00000006"]  # keep=2, no .partial left behind


_KILLED_WRITER = r"""
import os, socket, sys, threading, time
import torch, torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
from mpoverlap.training.checkpoint import Checkpointer, checkpoint_io_group
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
dist.init_process_group("gloo", rank=0, world_size=1)
ck = Checkpointer(sys.argv[1], async_save=True, group=checkpoint_io_group(60))
ck.save(1, {"w": torch.full((64,), 1.0), "meta": {"step": 1}})
ck.wait()
real = FileSystemWriter.write_data
def write_then_hang(writer, plan, planner):
    real(writer, plan, planner).wait()  # this rank's shards are on disk ...
    print("writing", flush=True)
    time.sleep(600)                     # ... and the process is killed before the end
FileSystemWriter.write_data = write_then_hang
ck.save(2, {"w": torch.full((64,), 2.0), "meta": {"step": 2}})
time.sleep(600)
"""


def test_process_killed_during_an_async_write_leaves_the_previous_checkpoint_newest(tmp_path, one_rank_group):
    import signal
    import subprocess

    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(tmp_path)], stdout=subprocess.PIPE,
                            text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        assert proc.stdout.readline().strip() == "writing"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    partial = tmp_path / "step_00000002.partial"
    assert partial.is_dir() and any(partial.iterdir()) and not (partial / COMPLETE).exists()
    ck = Checkpointer(tmp_path)
    assert ck.latest().name == "step_00000001"
    loaded = ck.load(ck.latest(), {"w": torch.zeros(64), "meta": {"step": 0}})
    assert loaded["meta"]["step"] == 1 and torch.equal(loaded["w"], torch.full((64,), 1.0))
