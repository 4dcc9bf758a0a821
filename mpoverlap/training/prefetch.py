"""The next step's batch, built while the current step runs.

`BatchPrefetcher.get(step)` hands over the microbatches of `step` and starts building those of
the step after it on a background thread, so that reading and stacking the samples (a Python
loop over this rank's G/dp samples) leaves the step's critical path. The batch of a step is a
pure function of (dataset, seed, step, dp rank): building it ahead changes no sample and no
order; a step that is not the one built ahead (a resumed run, a caller that moved the step)
is built on the spot and the one built ahead is dropped.

On CUDA the thread also puts the batch in pinned memory and copies it to the device on a side
stream; the step's stream waits on an event recorded after that copy, so the step never reads
a microbatch before it arrived and the host never blocks on the copy. On CPU there is no copy:
the thread builds the batch and the step uses it where it lies.

An exception raised while building (a reader error, an index out of range) is raised again,
the same exception with its message, by the `get` of the step that needed the batch, in the
calling thread. `close()` waits for the build in flight (at most one batch) and ends the
thread; the next `get` starts a new one, so a run that closed it can still be stepped.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, List, Optional, Tuple

import torch

Batch = List[torch.Tensor]


class BatchPrefetcher:
    """build(step) -> this rank's microbatches of `step` (host tensors)."""

    def __init__(self, build: Callable[[int], Batch], device: torch.device, ahead: bool = True) -> None:
        self._build = build
        self._device = torch.device(device)
        self._ahead = ahead  # False: every batch built in the caller's thread (a measurement's baseline)
        self._pool: Optional[ThreadPoolExecutor] = None
        self._pending: Optional[Tuple[int, Future]] = None
        self._stream = torch.cuda.Stream(device=self._device) if self._device.type == "cuda" else None

    def get(self, step: int, next_step: Optional[int] = None) -> Batch:
        """The microbatches of `step`, on the device; then the build of `next_step` (None: no
        next step, nothing built ahead) starts in the background."""
        future = self._take(step)
        batch, event = future.result() if future is not None else self._load(step)
        if self._ahead and next_step is not None:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mpoverlap-batch-ahead")
            self._pending = (int(next_step), self._pool.submit(self._load, int(next_step)))
        if event is not None:
            current = torch.cuda.current_stream(self._device)
            current.wait_event(event)
            for mb in batch:  # allocated on the side stream, used on this one
                mb.record_stream(current)
        return batch

    def _take(self, step: int) -> Optional[Future]:
        """The future of `step` if it is the one built ahead; any other is dropped."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        built, future = pending
        if built == int(step):
            return future
        future.cancel()  # a wrong guess: its result (or its error) is never used
        return None

    def _load(self, step: int) -> Tuple[Batch, Optional[torch.cuda.Event]]:
        batch = self._build(step)
        if self._stream is None:
            return batch, None
        with torch.cuda.device(self._device), torch.cuda.stream(self._stream):
            batch = [mb.pin_memory().to(self._device, non_blocking=True) for mb in batch]
            event = torch.cuda.Event()
            event.record(self._stream)
        return batch, event

    def close(self) -> None:
        """Drop the batch built ahead and end the thread, waiting for the build in flight (one
        batch). Idempotent; a later `get` starts a new thread."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending[1].cancel()
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
