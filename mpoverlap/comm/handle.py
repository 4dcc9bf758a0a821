"""CommHandle: one in-flight communication, with the clocks that tell whether it was hidden.

A handle knows its mode (dp/tp/pp/cp/ep), its op, its bytes, when it was issued, when the
backend finished it and how long compute sat blocked on it (in `wait()`; on CPU also in the
post). Waiting is idempotent; every handle reports once to the ledger it was issued under.

Clocks. On CPU (gloo) host clocks: completion from the work's future callback, blocked time
around `work.wait()` plus the post itself (`post_span`: gloo writes what the socket takes
inside the post, and the caller computes nothing meanwhile). On CUDA (NCCL) `work.wait()`
does not block the host: it makes the compute stream wait for the communication stream.
There the handle records CUDA events on the compute stream at issue and around the wait; the
GPU-side stall (exposed time) is the elapsed time between the events around the wait, and the
in-flight time runs from issue to the end of the wait (an upper bound when the transfer
finished earlier). Events are read only when the ledger summarises (at log steps), never with
a device-wide synchronize.

`wait_began_at` / `wait_ended_at` bound the blocked span of the wait (host clock on CPU; on
CUDA mapped onto the host clock from the issue time once resolved). Both blocked spans lie
inside the in-flight interval [issued_at, completed_at] (a handle still in flight at its wait
completes, for the ledger, when the wait returns; one done inside its post, when the post
returned; one already complete blocked nothing in its wait), so per mode the exposed time
never exceeds the in-flight time. Profiling: issue and wait show as
named ranges `comm/<mode>/<op>` and `wait/<mode>/<op>` in a torch profiler trace (only while
one records) and, for CUDA tensors, as NVTX ranges for Nsight; see `named_range`.
"""
from __future__ import annotations

import threading
import time
from contextlib import nullcontext
from typing import Any, Callable, List, Optional

import torch
import torch.autograd.profiler as _autograd_profiler

# The five overlap modes, and `stop`: the ranks' agreement on the step to stop after a SIGTERM
# (training/stop_agreement.py: store requests, recorded at the step it decided).
MODES = ("dp", "tp", "pp", "cp", "ep", "stop")
# (backend, op) pairs whose works gave no completion future (gloo's p2p and reduce-scatter):
# asking again costs a C++ exception (~50 us of host time, as much as the transfer) on every
# handle, so the first refusal sends that backend's later handles of the op straight to the
# background wait, the path such works always take (exact for any work: it waits the work
# itself). Keyed by backend too: in a process with gloo and NCCL groups, a gloo refusal says
# nothing of an NCCL work of the same op.
_NO_FUTURE_OPS: set = set()


def now() -> float:
    return time.perf_counter()


# Shared no-op context: the common case (no profiler, CPU) allocates nothing.
_NO_RANGE = nullcontext()


class _NamedRange:
    """A torch profiler range (only while a profiler records) plus an NVTX range (CUDA)."""

    __slots__ = ("name", "cuda", "_record")

    def __init__(self, name: str, cuda: bool) -> None:
        self.name, self.cuda, self._record = name, cuda, None

    def __enter__(self) -> "_NamedRange":
        if _autograd_profiler._is_profiler_enabled:
            self._record = torch.profiler.record_function(self.name)
            self._record.__enter__()
        if self.cuda:
            torch.cuda.nvtx.range_push(self.name)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.cuda:
            torch.cuda.nvtx.range_pop()
        if self._record is not None:
            self._record.__exit__(None, None, None)
            self._record = None


def named_range(*parts: Any, cuda: bool = False):
    """Context manager naming a span `parts[0]/parts[1]/...` (e.g. `comm/dp/all_reduce`).

    Off (a shared no-op, the name never built) unless a torch profiler is recording or
    `cuda` is True; NVTX ranges are pushed for CUDA work always, since an outside profiler
    (nsys) cannot be detected from here and a push costs about a microsecond.
    """
    if not (cuda or _autograd_profiler._is_profiler_enabled):
        return _NO_RANGE
    return _NamedRange("/".join(map(str, parts)), cuda)


class CommHandle:
    __slots__ = (
        "mode", "op", "nbytes", "issued_at", "completed_at", "blocked_s", "_works", "_ledger",
        "_waited", "_on_done", "_lock", "_keepalive", "_cuda_events", "wait_began_at", "wait_ended_at",
        "_background", "posted_at", "post_span", "site", "carried", "crossed_boundary", "backend", "link_bytes",
    )

    def __init__(self, mode: str, op: str, nbytes: int, works: List[Any], ledger: Optional["Any"],
                 on_done: Optional[Callable[[], None]] = None, keepalive: Any = None,
                 issued_at: Optional[float] = None, cuda_start: Any = None, backend: str = "",
                 link_bytes: Optional[int] = None) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown comm mode {mode!r}; one of {MODES}")
        self.mode = mode
        self.op = op
        self.backend = backend  # the process group's backend ("gloo", "nccl", ...); "" when nothing was sent
        self.nbytes = int(nbytes)
        # What this rank's algorithm puts on the link for the buffers (collectives.link_bytes): the
        # buffer itself when the caller does not say, nothing for a collective of one rank.
        self.link_bytes = int(nbytes) if link_bytes is None else int(link_bytes)
        self.issued_at = issued_at if issued_at is not None else now()
        # The handle is made right after its collective was posted. On CPU the caller sits in
        # the post while gloo writes what the socket takes at once (a profiled pipeline run
        # without overlap spent 76 of its 104 ms in flight but not in a wait inside posts), so
        # that span is time compute sat blocked on the communication, exposed as a wait is.
        # On CUDA the post only enqueues: the stall is read from events around the wait.
        self.posted_at = now()
        self.post_span = ((self.issued_at, self.posted_at)
                          if cuda_start is None and any(w is not None for w in works) else None)
        self.completed_at: Optional[float] = None
        self.blocked_s = 0.0
        self.wait_began_at: Optional[float] = None
        self.wait_ended_at: Optional[float] = None
        self._works = [w for w in works if w is not None]
        self._ledger = ledger
        self._waited = False
        self._on_done = on_done
        self._lock = threading.Lock()
        # Tensors an in-flight collective reads or writes: kept alive until wait() returns.
        self._keepalive = keepalive
        # (start, before_wait, after_wait) CUDA events, or None on CPU.
        self._cuda_events = [cuda_start, None, None] if cuda_start is not None else None
        self._background = None  # a future waiting the works on the ledger's pool
        # Strict ledger: where it was issued; carried: allowed to be waited after the step ends.
        self.site, self.carried, self.crossed_boundary = "", False, False
        if ledger is not None:
            ledger.issued(self)
        if self._cuda_events is None:
            self._watch_completion()

    def _watch_completion(self) -> None:
        if not self._works:
            self.completed_at = self.issued_at
            return
        if (self.backend, self.op) in _NO_FUTURE_OPS:
            if self._ledger is not None:
                self._background = self._ledger.wait_in_background(self._works, self._stamp_completed)
            return
        remaining = [len(self._works)]

        def done(_fut: Any) -> None:
            with self._lock:
                remaining[0] -= 1
                if remaining[0] == 0 and self.completed_at is None:
                    self.completed_at = now()

        for work in self._works:
            try:
                work.get_future().add_done_callback(done)
            except (RuntimeError, AttributeError):
                remaining[0] = -1  # no future (gloo p2p, reduce-scatter): see below
                _NO_FUTURE_OPS.add((self.backend, self.op))
        if remaining[0] < 0 and self._ledger is not None:
            # Such works report completion only once waited: wait them on the ledger's pool,
            # so the completion time is the transfer's end, not this handle's wait().
            self._background = self._ledger.wait_in_background(self._works, self._stamp_completed)

    def _stamp_completed(self) -> None:
        with self._lock:
            if self.completed_at is None:
                self.completed_at = now()

    def is_completed(self) -> bool:
        if self._waited:
            return True
        if self._background is not None:
            return self._background.done()
        return all(w.is_completed() for w in self._works)

    def wait(self) -> "CommHandle":
        if self._waited:
            return self
        if self._cuda_events is not None:
            self._wait_cuda()
            return self
        with named_range("wait", self.mode, self.op):
            t0 = now()
            if self._background is not None:
                self._background.result()  # re-raises the backend's error, as work.wait() would
            else:
                for work in self._works:
                    work.wait()
            t1 = now()
        self._background = None
        self._waited = True
        with self._lock:
            if self.completed_at is not None and self.completed_at < self.posted_at:
                # Done inside its own post (a small send written at once, its callback run
                # before the post returned): it reached the caller when the post returned.
                self.completed_at = self.posted_at
            if self.completed_at is None or self.completed_at > t0:
                # In flight when compute began to wait: it reaches compute when the wait
                # returns (the backend's completion callback can fire a little before the
                # waiter wakes), so the in-flight interval ends no earlier than t1 and the
                # blocked span [t0, t1] lies inside it: exposed <= in flight, always.
                self.completed_at = t1 if self.completed_at is None else max(self.completed_at, t1)
                self.wait_began_at, self.wait_ended_at = t0, t1
            else:
                # Done before the wait began: the wait blocked nothing (the call's own
                # microseconds are not communication).
                self.wait_began_at = self.wait_ended_at = t0
        self.blocked_s = self.wait_ended_at - self.wait_began_at
        if self.post_span is not None:
            self.blocked_s += self.post_span[1] - self.post_span[0]
        self._keepalive = None
        self._works = []
        self._finish()
        return self

    def carry_over(self) -> "CommHandle":
        """Declare that this handle is waited after the current step ends (before the next
        one does): a strict ledger lets it cross one step boundary."""
        self.carried = True
        return self

    def _wait_cuda(self) -> None:
        if self._ledger is not None:
            before, after = self._ledger.events.take(), self._ledger.events.take()
        else:  # nobody reads the timing: order the streams, record nothing
            before = after = None
        with named_range("wait", self.mode, self.op, cuda=True):
            if before is not None:
                before.record()
            for work in self._works:
                work.wait()  # enqueues a stream wait; the host moves on
            if after is not None:
                after.record()
        self._cuda_events[1:] = [before, after]
        self._waited = True
        # The buffers are released now, not when the ledger resolves the timing (up to
        # log_interval steps later, holding every TP/PP/CP/EP buffer of those steps): after
        # `work.wait()` the compute stream is ordered after the collective, so the caching
        # allocator cannot hand the memory to later work before the transfer ends, and the
        # NCCL process group keeps its own references to the tensors until the work is done.
        # Only the events are kept, for resolve_timing().
        self._keepalive = None
        self._works = []
        self._finish()

    def _finish(self) -> None:
        if self._on_done is not None:
            self._on_done()
            self._on_done = None
        if self._ledger is not None:
            self._ledger.record(self)

    def resolve_timing(self, block: bool = True) -> bool:
        """CUDA only: turn the recorded events into seconds and give them back to the ledger's
        pool. `block=False`: only if the `after` event already completed (a query, no sync);
        returns whether the timing is resolved."""
        if self._cuda_events is None or self._cuda_events[2] is None:
            return self._cuda_events is None
        start, before, after = self._cuda_events
        if block:
            after.synchronize()
        elif not after.query():
            return False
        self.blocked_s = before.elapsed_time(after) / 1e3
        in_flight = start.elapsed_time(after) / 1e3
        self.completed_at = self.issued_at + in_flight
        self.wait_ended_at = self.completed_at
        self.wait_began_at = self.completed_at - self.blocked_s
        self._cuda_events = None
        if self._ledger is not None:
            self._ledger.events.give((start, before, after))
        return True

    @property
    def uses_cuda_events(self) -> bool:
        return self._cuda_events is not None

    @property
    def waited(self) -> bool:
        return self._waited

    @property
    def in_flight_s(self) -> float:
        end = self.completed_at if self.completed_at is not None else now()
        return max(0.0, end - self.issued_at)

    def __repr__(self) -> str:
        state = "done" if self._waited else "in flight"
        return f"CommHandle({self.mode}:{self.op}, {self.nbytes} B, {state})"


def wait_all(handles: List[CommHandle]) -> None:
    for h in handles:
        h.wait()
