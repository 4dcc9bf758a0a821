"""The batch built ahead (training/prefetch.py): built on another thread while the step runs,
the same samples as the synchronous order, a reader's error raised in the step with its
message, and the thread ended by close() and by a run's end."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from mpoverlap.training.data import TokenWindows, global_batch, rank_batch, rank_microbatches
from mpoverlap.training.prefetch import BatchPrefetcher


def _windows(n=64, seq=7):
    return TokenWindows(np.arange(n * (seq + 1), dtype=np.int64) % 251, seq)


class _Recording:
    """A dataset that records, for each item read, the thread and the time it was read."""

    def __init__(self, inner, fail_at=None, delay_s=0.0):
        self.inner, self.fail_at, self.delay_s = inner, fail_at, delay_s
        self.reads = []

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, i):
        if self.fail_at is not None and int(i) == self.fail_at:
            raise OSError(f"corrupt record {i} in shard-00042.bin")
        time.sleep(self.delay_s)
        self.reads.append((threading.get_ident(), time.perf_counter()))
        return self.inner[i]


def test_rank_batch_is_the_rank_share_of_the_global_batch():
    ds = _windows()
    for dp_rank in range(4):
        mine = rank_batch(ds, 3, 16, 5, dp_rank, 4, 2)
        ref = rank_microbatches(global_batch(ds, 3, 16, 5), dp_rank, 4, 2)
        assert len(mine) == len(ref) == 2
        assert all(torch.equal(a, b) for a, b in zip(mine, ref))
    with pytest.raises(ValueError, match="train.micro_batch_size=3"):
        rank_batch(ds, 0, 16, 5, 0, 4, 3)


def test_next_batch_is_built_on_another_thread_while_the_step_runs():
    ds = _Recording(_windows(), delay_s=0.02)  # a slow reader: step 1's build lasts ~0.16 s
    batches = BatchPrefetcher(lambda s: rank_batch(ds, s, 8, 1, 0, 1, 2), torch.device("cpu"))
    main = threading.get_ident()
    try:
        first = batches.get(0, next_step=1)
        step_begin = time.perf_counter()
        time.sleep(0.5)  # "the step": the main thread is busy elsewhere
        step_end = time.perf_counter()
        second = batches.get(1, next_step=None)
        step0, step1 = ds.reads[:8], ds.reads[8:]
        assert len(step1) == 8
        assert all(tid == main for tid, _ in step0)  # nothing was ahead of the first step
        assert all(tid != main for tid, _ in step1), "step 1's samples were read by the step's thread"
        assert all(when < step_end for _, when in step1), "step 1's samples were read after step 0 ended"
        assert any(when > step_begin for _, when in step1), "step 1's samples were all read before step 0 ran"
        ref = rank_batch(_windows(), 1, 8, 1, 0, 1, 2)
        assert all(torch.equal(a, b) for a, b in zip(second, ref))
        assert all(torch.equal(a, b) for a, b in zip(first, rank_batch(_windows(), 0, 8, 1, 0, 1, 2)))
    finally:
        batches.close()


def test_a_step_other_than_the_one_built_ahead_is_built_on_the_spot():
    """A resume moves the step: the batch built ahead is dropped, never used."""
    ds = _windows()
    batches = BatchPrefetcher(lambda s: rank_batch(ds, s, 8, 1, 1, 2, 2), torch.device("cpu"))
    try:
        batches.get(0, next_step=1)
        got = batches.get(7, next_step=8)
        assert all(torch.equal(a, b) for a, b in zip(got, rank_batch(ds, 7, 8, 1, 1, 2, 2)))
    finally:
        batches.close()


def test_reader_error_in_the_thread_reaches_the_step_with_its_message():
    ds = _Recording(_windows(), fail_at=None)
    batches = BatchPrefetcher(lambda s: [ds[8 * s + j] for j in range(8)], torch.device("cpu"))
    try:
        batches.get(0, next_step=1)
        ds.fail_at = 11  # read by step 1's build, in the thread
        with pytest.raises(OSError, match="corrupt record 11 in shard-00042.bin"):
            batches.get(1, next_step=2)
    finally:
        batches.close()


def test_close_ends_the_thread_and_a_later_get_still_works():
    before = {t.ident for t in threading.enumerate()}
    batches = BatchPrefetcher(lambda s: rank_batch(_windows(), s, 8, 1, 0, 1, 2), torch.device("cpu"))
    batches.get(0, next_step=1)
    started = [t for t in threading.enumerate() if t.ident not in before]
    assert started and all(t.name.startswith("mpoverlap-batch-ahead") for t in started)
    batches.close()
    batches.close()
    assert not any(t.is_alive() for t in started)
    assert len(batches.get(1)) == 4
    batches.close()


def test_the_run_ends_the_thread_on_an_error(tmp_path, monkeypatch):
    """A step that raises: the run's finally ends the batch-ahead thread (no thread left behind)."""
    from mpoverlap.config import compose
    from mpoverlap.parallel import ParallelState
    from mpoverlap.training.loop import Trainer

    cfg = compose(["model=gpt_tiny", "model.num_layers=1", "model.hidden_size=32", "model.num_attention_heads=2",
                   "model.ffn_hidden_size=64", "model.seq_length=16", "train.steps=4", "train.global_batch_size=4",
                   "train.micro_batch_size=2", "data.max_bytes=20000", "train.device=cpu", "train.progress=false",
                   f"run.dir={tmp_path}"])
    trainer = Trainer(cfg, ParallelState.single(), tmp_path)
    calls = {"n": 0}
    step = trainer.train_step

    def failing_step():
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected failure in step 2")
        return step()

    monkeypatch.setattr(trainer, "train_step", failing_step)
    with pytest.raises(RuntimeError, match="injected failure"):
        trainer.run()
    assert not [t for t in threading.enumerate() if t.name.startswith("mpoverlap-batch-ahead")]
