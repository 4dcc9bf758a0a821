"""Checkpoints with torch.distributed.checkpoint, saved atomically.

Layout of `checkpoint.dir`:
    step_00000030/          a complete checkpoint (DCP shards + .metadata + COMPLETE)
    step_00000060.partial/  a save in progress or one killed half way: never loaded

A save writes into `<name>.partial`, then rank 0 marks it COMPLETE and renames it; the rename
is atomic, so a crash at any point leaves the previous checkpoint loadable.
"""
from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path
from typing import Any, Dict, Optional

import torch.distributed as dist

_STEP_DIR = re.compile(r"^step_(\d{8})$")
COMPLETE = "COMPLETE"


class CheckpointError(Exception):
    """A checkpoint that cannot be used (incompatible model, unreadable files)."""


def first_failure(err: BaseException) -> str:
    """'Type: message' of the error behind a DCP CheckpointException (the first failing
    rank's), or of `err` itself."""
    failures = getattr(err, "failures", None)
    if failures:
        err = next(iter(failures.values()))[0]
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


class Checkpointer:
    def __init__(self, directory: str | Path, keep: int = 2) -> None:
        self.dir = Path(directory)
        self.keep = max(1, int(keep))

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
        by DCP, so each is written once)."""
        import torch.distributed.checkpoint as dcp

        final = self.dir / f"step_{step:08d}"
        partial = self.dir / f"step_{step:08d}.partial"
        if _is_rank0():
            self.dir.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)
        _barrier()
        t0 = time.perf_counter()
        dcp.save(app_state, checkpoint_id=str(partial), planner=planner)
        _barrier()
        if _is_rank0():
            (partial / COMPLETE).write_text(json.dumps({"step": step, "saved_s": time.perf_counter() - t0}))
            if final.exists():  # an older save of the same step (a rerun): replace it whole
                shutil.rmtree(final)
            partial.rename(final)
            self._prune()
        _barrier()
        return final

    def _prune(self) -> None:
        done = self.complete_checkpoints()
        for old in done[: max(0, len(done) - self.keep)]:
            shutil.rmtree(old, ignore_errors=True)

    def load(self, path: Path, app_state: Dict[str, Any], planner=None) -> Dict[str, Any]:
        """Fill `app_state` (a template of the right shapes) in place from `path`."""
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
