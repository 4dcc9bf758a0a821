"""Checkpoints with torch.distributed.checkpoint, saved atomically, optionally in the background.

Layout of `checkpoint.dir`:
    step_00000030/          a complete checkpoint (DCP shards + .metadata + config.yaml + COMPLETE)
    step_00000060.partial/  a save in progress or one killed half way: never loaded

A save writes into `<name>.partial`, then rank 0 marks it COMPLETE and renames it; the rename
is atomic, so a crash at any point leaves the previous checkpoint loadable.

checkpoint.async_save=true: `save()` copies the state at the step boundary (`stage_state`: the
only part the training loop waits for) and returns; DCP's async save writes the copy from a
background thread (at the lowest CPU priority) while the next steps run, and a finisher thread waits for every rank's write,
then rank 0 marks COMPLETE and renames. At most one save is in flight (the next `save()` and
`wait()` join it). Every collective of that background work (DCP's plan and write exchanges, the
completion barrier) runs on a dedicated gloo group, never on the group the training loop uses.
"""
from __future__ import annotations

import copy
import json
import os
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, Optional

import torch
import torch.distributed as dist

_STEP_DIR = re.compile(r"^step_(\d{8})$")
COMPLETE = "COMPLETE"
CONFIG = "config.yaml"  # the resolved config the checkpoint was written with


class CheckpointError(Exception):
    """A checkpoint that cannot be used (incompatible model, unreadable files), or a background
    save that failed."""


def first_failure(err: BaseException) -> str:
    """'Type: message' of the error behind a DCP CheckpointException (the first failing
    rank's), or of `err` itself."""
    failures = getattr(err, "failures", None)
    if failures:
        err = next(iter(failures.values()))[0]
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"


def _barrier(group=None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def checkpoint_io_group(timeout_s: float):
    """The gloo group that carries the background saves' collectives (None outside a process
    group). Collective: every rank calls it at the same point."""
    if not dist.is_initialized():
        return None
    from datetime import timedelta

    return dist.new_group(backend="gloo", timeout=timedelta(seconds=float(timeout_s)))


def stage_state(app_state: Any) -> Any:
    """A copy of `app_state` that later training steps cannot change: the nested dicts/lists
    walked, tensors cloned to host memory (from CUDA into pinned memory, non-blocking), objects
    with a `staged(copy_tensor)` method asked for their own copy made with the same function,
    other values deep-copied. The CUDA copies are then waited through one event per device on
    the stream they were queued on, not a device-wide synchronize: collectives in flight on other
    streams keep running."""
    on_cuda = set()

    def copy_of(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            value = value.detach()
            if value.device.type == "cpu":
                return value.clone()
            host = torch.empty(value.shape, dtype=value.dtype, device="cpu", pin_memory=value.device.type == "cuda")
            host.copy_(value, non_blocking=True)
            on_cuda.add(value.device)
            return host
        if hasattr(value, "staged") and callable(value.staged):
            return value.staged(copy_of)
        if isinstance(value, dict):
            return type(value)((k, copy_of(v)) for k, v in value.items())
        if isinstance(value, (list, tuple)):
            return type(value)(copy_of(v) for v in value)
        return copy.deepcopy(value)

    staged = copy_of(app_state)
    for device in on_cuda:
        copied = torch.cuda.Event()
        copied.record(torch.cuda.current_stream(device))
        copied.synchronize()
    return staged


class _AlreadyStaged:
    """DCP's AsyncStager protocol for a state that `stage_state` copied already: hand it over
    unchanged, so DCP's own stager never walks (or copies again) the caller's objects."""

    _synchronize_after_execute = False
    should_synchronize_after_execute = False

    def stage(self, state_dict):
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def _background_writer(path: Path):
    """DCP's FileSystemWriter whose writes run at the lowest CPU priority (Linux: nice 19 for the
    writing thread only): where the training ranks keep every core busy (2 ranks on 2 CPU cores)
    the write then takes the cycles training leaves idle instead of half of every step's."""
    import sys

    from torch.distributed.checkpoint import FileSystemWriter

    class BackgroundWriter(FileSystemWriter):
        def write_data(self, plan, planner):
            if sys.platform.startswith("linux"):
                try:
                    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
                except OSError:  # not permitted here: write at the usual priority
                    pass
            return super().write_data(plan, planner)

    return BackgroundWriter(str(path))


class _InFlight:
    """One background save: its thread and, once it ended, its error (None when it completed)."""

    def __init__(self, step: int, final: Path, partial: Path) -> None:
        self.step, self.final, self.partial = step, final, partial
        self.thread: Optional[threading.Thread] = None
        self.error: Optional[BaseException] = None
        self.stage_s = self.write_s = 0.0


class Checkpointer:
    def __init__(self, directory: str | Path, keep: int = 2, async_save: bool = False, group=None,
                 log: Optional[Callable[[str], None]] = None, config_yaml: Optional[str] = None) -> None:
        """async_save=True needs `group` (from `checkpoint_io_group`) when a process group exists;
        `log` prints a line (rank 0 only is the caller's choice); `config_yaml`: the resolved
        config of the run, written into every checkpoint as CONFIG (the checkpoint describes
        itself wherever checkpoint.dir lives)."""
        self.dir = Path(directory)
        self.config_yaml = config_yaml
        self.keep = max(1, int(keep))
        self.async_save = bool(async_save)
        if self.async_save and dist.is_initialized() and group is None:
            raise ValueError("Checkpointer(async_save=True) needs a group of its own: checkpoint_io_group()")
        self.group = group
        self._log = log or (lambda message: None)
        self._in_flight: Optional[_InFlight] = None
        # The last background save that ended: {"step", "stage_s", "write_s"} (benchmarks read it).
        self.last_async: Optional[Dict[str, Any]] = None

    def complete_checkpoints(self) -> list:
        if not self.dir.is_dir():
            return []
        found = []
        for child in self.dir.iterdir():
            match = _STEP_DIR.match(child.name)
            if match and (child / COMPLETE).is_file() and (child / ".metadata").is_file():
                found.append((int(match.group(1)), child))
        return [path for _, path in sorted(found)]

    def latest(self) -> Optional[Path]:
        done = self.complete_checkpoints()
        return done[-1] if done else None

    def save(self, step: int, app_state: Dict[str, Any], planner=None) -> Path:
        """Collective: every rank calls it with its state (replicated entries are deduplicated
        by DCP, so each is written once). `planner`: a DCP SavePlanner, or None for DCP's default.
        Asynchronous saves return once the state is staged; the path is final only after `wait()`."""
        self.wait()  # at most one save in flight; a failed previous one raises here
        if self.async_save:
            return self._save_async(step, app_state, planner)
        import torch.distributed.checkpoint as dcp

        final, partial = self._paths(step)
        self._prepare(partial, group=None)
        t0 = time.perf_counter()
        dcp.save(app_state, checkpoint_id=str(partial), planner=planner)
        _barrier()
        if _is_rank0():
            self._complete(step, final, partial, time.perf_counter() - t0)
        _barrier()
        return final

    def _paths(self, step: int):
        return self.dir / f"step_{step:08d}", self.dir / f"step_{step:08d}.partial"

    def _prepare(self, partial: Path, group) -> None:
        if _is_rank0():
            self.dir.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)
            # Created here, not by DCP's writer (whose planning runs in the background thread of an
            # asynchronous save): a save under way is visible as `.partial` once save() returns.
            partial.mkdir()
            if self.config_yaml is not None:  # inside .partial: COMPLETE covers it too
                (partial / CONFIG).write_text(self.config_yaml)
        _barrier(group)

    def _complete(self, step: int, final: Path, partial: Path, saved_s: float) -> None:
        """Rank 0, once every rank's write finished: mark, rename (atomic), prune."""
        (partial / COMPLETE).write_text(json.dumps({"step": step, "saved_s": saved_s}))
        if final.exists():  # an older save of the same step (a rerun): replace it whole
            shutil.rmtree(final)
        partial.rename(final)
        self._prune()

    def _save_async(self, step: int, app_state: Dict[str, Any], planner) -> Path:
        import torch.distributed.checkpoint as dcp

        final, partial = self._paths(step)
        self._prepare(partial, group=self.group)
        t0 = time.perf_counter()
        staged = stage_state(app_state)
        future = dcp.async_save(staged, storage_writer=_background_writer(partial), planner=planner,
                                process_group=self.group, async_stager=_AlreadyStaged())
        stage_s = time.perf_counter() - t0  # what the training loop pays: the copy and the hand-over
        job = _InFlight(step, final, partial)
        job.stage_s = stage_s
        job.thread = threading.Thread(target=self._finish, args=(job, future, t0 + stage_s),
                                      name=f"checkpoint-step-{step}")
        self._in_flight = job
        job.thread.start()
        self._log(f"staged checkpoint step {step} in {stage_s:.2f}s (the step boundary's cost); "
                  f"writing {partial} in the background")
        return final

    def _finish(self, job: _InFlight, future, t_write0: float) -> None:
        """Background: wait for this rank's write (DCP raises on every rank if any rank failed),
        then barrier on the checkpoint group; rank 0 marks COMPLETE and renames, and tells every
        rank whether that worked."""
        try:
            future.result()
            _barrier(self.group)
            job.write_s = time.perf_counter() - t_write0
            failed = [None]
            if _is_rank0():
                try:
                    self._complete(job.step, job.final, job.partial, job.write_s)
                except Exception as err:  # shared by every rank below, so all of them raise
                    failed = [f"{type(err).__name__}: {err}"]
            if dist.is_initialized():
                dist.broadcast_object_list(failed, src=0, group=self.group)
            if failed[0] is not None:
                raise CheckpointError(f"marking {job.partial} complete failed on rank 0: {failed[0]}")
            self._log(f"saved checkpoint {job.final} in the background ({job.write_s:.2f}s after staging)")
        except BaseException as err:
            job.error = err

    def wait(self, raise_error: bool = True) -> None:
        """Block until the save in flight (if any) is written, marked COMPLETE and renamed.
        A failed save raises CheckpointError here (its directory stays `.partial`, so the
        previous checkpoint is still `latest()`); raise_error=False logs it instead."""
        job, self._in_flight = self._in_flight, None
        if job is None:
            return
        job.thread.join()
        self.last_async = {"step": job.step, "stage_s": job.stage_s, "write_s": job.write_s}
        if job.error is None:
            return
        message = (f"asynchronous save of step {job.step} failed ({first_failure(job.error)}); {job.partial} was "
                   f"left incomplete, the newest complete checkpoint is still {self.latest()}")
        if not raise_error:
            self._log(message)
            return
        raise CheckpointError(message) from job.error

    @property
    def in_flight(self) -> bool:
        return self._in_flight is not None and self._in_flight.thread.is_alive()

    def _prune(self) -> None:
        done = self.complete_checkpoints()
        for old in done[: max(0, len(done) - self.keep)]:
            shutil.rmtree(old, ignore_errors=True)

    def load(self, path: Path, app_state: Dict[str, Any], planner=None) -> Dict[str, Any]:
        """Fill `app_state` (a template of the right shapes) in place from `path`. `planner`: a
        DCP LoadPlanner, or None for DCP's default."""
        import torch.distributed.checkpoint as dcp

        from torch.distributed.checkpoint.api import CheckpointException

        try:
            dcp.load(app_state, checkpoint_id=str(path), planner=planner)
        except (Exception, CheckpointException) as err:  # DCP's is a BaseException wrapping each rank's error
            raise CheckpointError(
                f"checkpoint {path} could not be loaded into this model ({first_failure(err)}). It was "
                "probably saved by a different model shape; point checkpoint.dir elsewhere or set "
                "checkpoint.resume=none") from None
        return app_state
