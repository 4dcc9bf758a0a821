"""Checkpointer: atomic saves, newest-complete discovery, pruning to checkpoint.keep."""
import os
import socket

import pytest
import torch
import torch.distributed as dist

from mpoverlap.training.checkpoint import COMPLETE, Checkpointer


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
    ck = Checkpointer(tmp_path, keep=3)
    ck.save(1, _state(1))
    import torch.distributed.checkpoint as dcp

    real_save = dcp.save

    def dies_half_way(state, checkpoint_id, planner=None):
        real_save(state, checkpoint_id=checkpoint_id, planner=planner)  # shards written ...
        os.remove(os.path.join(checkpoint_id, ".metadata"))  # ... but the run died before the end
        raise KeyboardInterrupt("killed during save")

    monkeypatch.setattr(dcp, "save", dies_half_way)
    with pytest.raises(KeyboardInterrupt):
        ck.save(2, _state(2))
    assert (tmp_path / "step_00000002.partial").is_dir()
    assert ck.latest().name == "step_00000001"
    assert ck.load(ck.latest(), _state(0))["meta"]["step"] == 1
    # A directory that looks complete but lacks the COMPLETE marker is never picked either.
    fake = tmp_path / "step_00000009"
    fake.mkdir()
    (fake / ".metadata").write_text("junk")
    assert ck.latest().name == "step_00000001"
    (fake / COMPLETE).write_text("{}")
    assert ck.latest().name == "step_00000009"
