"""train.profile=true: a torch profiler trace and a communication timeline per rank.

Steps are numbered as in metrics.jsonl: step s is the s-th optimizer step (1-based), so the
window `[train.profile_start_step, train.profile_start_step + train.profile_steps)` names the
same steps as the metrics rows. For those steps every rank writes

- `<run.dir>/profile/rank<R>.json`: the torch profiler's Chrome trace (open it in
  https://ui.perfetto.dev or chrome://tracing). Communication shows as `comm/<mode>/<op>`
  (issue) and `wait/<mode>/<op>` (blocked in wait) ranges, pipeline actions as `pp/<action>`,
  each step as `step/<s>`.
- `<run.dir>/timeline/rank<R>.jsonl`: one JSON object a line, times in seconds on this
  process's `time.perf_counter()` clock (add `unix_offset_s` of the meta line for Unix time,
  which is how ranks on different hosts are lined up):
    {"kind": "meta", "rank", "world", "coords", "device", "start_step", "steps", "unix_offset_s"}
    {"kind": "step", "step", "begin", "end"}
    {"kind": "comm", "step", "mode", "op", "bytes", "issued_at", "completed_at", "post_end",
     "wait_begin", "wait_end", "exposed_s"}
    {"kind": "action", "step", "action", "microbatch", "vchunk", "begin", "end"}
  A comm line is one CommHandle, attributed to the step during which it was waited (as the
  ledger attributes it to metrics rows); on CPU `exposed_s = (post_end - issued_at) +
  (wait_end - wait_begin)`: the caller is blocked inside the post too (`post_end` is null
  where nothing was sent, and on CUDA). Handles
  of backends without a completion callback (gloo p2p, reduce-scatter) are stamped complete
  at the next issue or wait, so their in-flight span can run long.
  An action line is one pipeline action of this stage (pipelined runs): "F" forward, "B"
  backward, "W" the weight gradients a zero-bubble schedule deferred from the B of the same
  (microbatch, vchunk) (that B then computed the input gradient only). Its span is the
  executor's `pp/<action>` profiler range (its receive wait, compute and posts), moved onto the
  perf_counter clock through the step ranges both clocks hold.

`mpoverlap-timeline <run.dir>` draws the timeline files as a PNG.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, List, Optional, Tuple

import torch
import torch.distributed as dist

from mpoverlap.comm.ledger import CommLedger
from mpoverlap.config import ConfigError


def profile_window(cfg: Any) -> Optional[Tuple[int, int]]:
    """(first, last) step profiled, both inclusive, or None when train.profile is off.

    Raises ConfigError (the launcher prints it as one paragraph, no traceback) naming the key,
    its value and a fix when the window is empty or runs past train.steps: the run would end
    without ever writing its trace. Workers raise it at start-up; a validation rule would
    catch it before any worker starts."""
    t = cfg.train
    if not t.profile:
        return None
    start, count, total = int(t.profile_start_step), int(t.profile_steps), int(t.steps)
    if start < 1:
        raise ConfigError(f"train.profile_start_step={start}: steps are numbered from 1 as in "
                          "metrics.jsonl; set train.profile_start_step=1 or later")
    if count < 1:
        raise ConfigError(f"train.profile_steps={count}: the window needs at least one step; set "
                          "train.profile_steps=1 or more (or train.profile=false)")
    last = start + count - 1
    if last > total:
        fixes = [f"train.profile_steps={total - start + 1}"] if start <= total else []
        fixes += [f"train.profile_start_step={total - count + 1}"] if count <= total else []
        fixes += [f"train.steps={last}"]
        raise ConfigError(
            f"train.profile_steps={count} with train.profile_start_step={start} profiles steps "
            f"{start}..{last}, past the last step train.steps={total}: the trace would never be "
            f"written; set {', '.join(fixes[:-1])}{' or ' if len(fixes) > 1 else ''}{fixes[-1]}")
    return start, last


class RunProfiler:
    """Profiles steps [first, last] of this rank; inert (every call returns at once) when off.

    Call `step_begin(s)` before and `step_end(s)` after optimizer step s, and `close()` once
    at the end (also after an error or a preemption: it writes what the window recorded).
    """

    def __init__(self, run_dir: str | Path, rank: int, ledger: CommLedger,
                 window: Optional[Tuple[int, int]], device: Any = "cpu", coords: Any = None) -> None:
        self.run_dir = Path(run_dir)
        self.rank = int(rank)
        self.ledger = ledger
        self.window = window
        self.device_type = torch.device(device).type
        # This rank's place in the grid (RankCoords or None), for the timeline's labels.
        self.coords = {k: int(getattr(coords, k)) for k in ("tp", "cp", "dp", "pp", "ep")} \
            if coords is not None else {}
        self._prof = None  # torch.profiler.profile while the window is open
        self._done = False
        self._step: Optional[int] = None  # the step running now, for handle attribution
        self._step_range = None
        self._steps: List[dict] = []
        self._handles: List[Tuple[Optional[int], Any]] = []
        self._unix_offset_s = 0.0

    @classmethod
    def from_config(cls, cfg: Any, run_dir: str | Path, rank: int, ledger: CommLedger,
                    device: Any = "cpu", coords: Any = None) -> "RunProfiler":
        return cls(run_dir, rank, ledger, profile_window(cfg), device, coords)

    @property
    def trace_path(self) -> Path:
        return self.run_dir / "profile" / f"rank{self.rank}.json"

    @property
    def timeline_path(self) -> Path:
        return self.run_dir / "timeline" / f"rank{self.rank}.jsonl"

    def _in_window(self, step: int) -> bool:
        return self.window is not None and not self._done and self.window[0] <= step <= self.window[1]

    # ---- the loop's calls -----------------------------------------------------------------
    def step_begin(self, step: int) -> None:
        if not self._in_window(step):
            return
        if self._prof is None:  # a resumed run may enter the window part-way: start there
            self._open()
        self._step = step
        self._step_range = torch.profiler.record_function(f"step/{step}")
        self._step_range.__enter__()
        self._steps.append({"kind": "step", "step": step, "begin": time.perf_counter(), "end": None})

    def step_end(self, step: int) -> None:
        if self._prof is None or self._step != step:
            return
        self._steps[-1]["end"] = time.perf_counter()
        self._step_range.__exit__(None, None, None)
        self._step_range, self._step = None, None
        if step >= self.window[1]:
            self._finish()

    def close(self) -> None:
        """Write whatever the window recorded; say so when the window never ran (a resume
        past it, or a run that stopped before it)."""
        if self._prof is None and self.window is not None and not self._done and self.rank == 0:
            print(f"profile: steps {self.window[0]}..{self.window[1]} did not run in this run; nothing "
                  "profiled (a resumed run starts after its checkpoint's step)", flush=True)
        if self._prof is not None:
            if self._step_range is not None:  # interrupted inside a step
                self._step_range.__exit__(None, None, None)
                self._step_range = None
            self._finish()

    # ---- internals ------------------------------------------------------------------------
    def _open(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device_type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._unix_offset_s = time.time() - time.perf_counter()
        self._prof = torch.profiler.profile(activities=activities, record_shapes=False)
        self._prof.start()
        self.ledger.recorder = self._record

    def _record(self, handle: Any) -> None:
        # Called from CommHandle.wait() via the ledger: keep it to an append.
        self._handles.append((self._step, handle))

    def _finish(self) -> None:
        self.ledger.recorder = None
        prof, self._prof, self._done = self._prof, None, True
        prof.stop()
        self.trace_path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.trace_path))
        self._write_timeline(pipeline_actions(prof.events(), self._steps))
        if self.rank == 0:
            first = self._steps[0]["step"] if self._steps else self.window[0]
            last = self._steps[-1]["step"] if self._steps else self.window[1]
            print(f"profile: steps {first}..{last} -> {self.trace_path.parent}/rank*.json, "
                  f"{self.timeline_path.parent}/rank*.jsonl; draw with: mpoverlap-timeline "
                  f"{self.run_dir}", flush=True)

    def _write_timeline(self, actions: List[dict]) -> None:
        world = dist.get_world_size() if dist.is_initialized() else 1
        lines = [{"kind": "meta", "rank": self.rank, "world": world, "coords": self.coords,
                  "device": self.device_type,
                  "start_step": self.window[0], "steps": self.window[1] - self.window[0] + 1,
                  "unix_offset_s": self._unix_offset_s}]
        lines += [s for s in self._steps if s["end"] is not None]
        for step, h in self._handles:
            if h.uses_cuda_events:
                h.resolve_timing()  # waits for this handle's own events only
            completed = h.completed_at if h.completed_at is not None else h.issued_at
            lines.append({"kind": "comm", "step": step, "mode": h.mode, "op": h.op, "bytes": h.nbytes,
                          "issued_at": h.issued_at, "completed_at": completed,
                          "post_end": h.post_span[1] if h.post_span is not None else None,
                          "wait_begin": h.wait_began_at, "wait_end": h.wait_ended_at,
                          "exposed_s": h.blocked_s})
        self._handles = []
        lines += actions
        self.timeline_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.timeline_path, "w", encoding="utf-8") as f:
            for line in lines:
                f.write(json.dumps(line) + "\n")


def pipeline_actions(events: Any, steps: List[dict]) -> List[dict]:
    """The `pp/<kind>(mb<i>,v<j>)` ranges among the profiler's `events` as action lines, on the
    perf_counter clock of `steps` (the timeline's step lines): the profiler stamps microseconds
    from its own start, and each `step/<s>` range starts when its step line does, so their
    difference moves that step's actions from one clock onto the other."""
    ranges = [(e.name, e.time_range.start / 1e6, e.time_range.end / 1e6) for e in events
              if e.name.startswith(("pp/", "step/"))]
    spans = {int(n[5:]): (a, b) for n, a, b in ranges if n.startswith("step/") and n[5:].isdigit()}
    # Each step's own offset between the clocks (its range opens just before its line's stamp),
    # and an action belongs to the step whose range holds its start on the profiler's clock: with
    # one offset for all steps (their median), an action just before its step's end could fall
    # past it by the offsets' spread (milliseconds on a loaded machine).
    offsets = {s["step"]: s["begin"] - spans[s["step"]][0] for s in steps if s["step"] in spans and s["end"] is not None}
    out = []
    for name, a, b in sorted(ranges, key=lambda r: r[1]):
        parsed = _parse_action(name)
        if parsed is None:
            continue
        step = next((n for n, off in offsets.items() if spans[n][0] <= a <= spans[n][1]), None)
        if step is not None:
            out.append({"kind": "action", "step": step, "action": parsed[0], "microbatch": parsed[1],
                        "vchunk": parsed[2], "begin": a + offsets[step], "end": b + offsets[step]})
    return out


def _parse_action(name: str) -> Optional[Tuple[str, int, int]]:
    """("F", 0, 1) from "pp/F(mb0,v1)" (pipeline.actions.Action's str); None otherwise."""
    if not name.startswith("pp/") or "(mb" not in name or not name.endswith(")"):
        return None
    kind, _, rest = name[3:].partition("(mb")
    mb, _, v = rest[:-1].partition(",v")
    if not (mb.isdigit() and v.isdigit()):
        return None
    return kind, int(mb), int(v)
