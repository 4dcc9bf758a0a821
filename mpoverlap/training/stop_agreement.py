"""StopAgreement: a SIGTERM on any rank stops every rank after the same step, with nothing
exchanged in a step that no signal reached.

The ranks agree through the rendezvous store (the TCPStore the process group was built from,
reachable from every rank) and only once a signal came. Keys live under
`mpoverlap/stop/<elastic restart>/<instance>/<run>/`:

1. SIGTERM on a rank: its handler (on the main thread, the main connection) sets the rank's
   flag and counts the rank in `signalled`; the first to count sets every rank's `wake/<r>`
   (one request), so a signal on every rank at once (SLURM) costs one wake-up each.
2. Each rank's watcher thread sits in a store wait on its own `wake/<rank>`: a blocked socket
   read, no CPU and no traffic while nothing happens. (It has a connection of its own,
   `Store.clone()`: a store object is not for concurrent use from several threads.) Woken, it
   proposes the step this rank is in (steps completed + 1, read under the lock the loop's
   boundary takes), raises `max` to it (compare-and-set), and counts itself in `proposed`; the
   rank that completes the count publishes `done` = `max`.
3. At each step boundary the loop asks `at_boundary(step)`: a lock and two comparisons, until
   this rank has proposed. At the boundary it proposed, it waits for `done`, then stops there
   if `done` is that step, else after step `done`.

Why every rank stops after the same step: no rank passes the boundary it proposed before `done`
is known, and each proposed a step it had not finished, so `done` (the largest proposal) is a
boundary every rank still reaches. Why it cannot deadlock: the proposals are written by the
watcher threads on their own connections, so a rank whose main thread is blocked (in a
collective of the next step, waiting on a rank that waits for `done`) still proposes.
When: a signal during step k reaches every watcher within a few store round trips
(milliseconds), so every rank proposes k, or k + 1 where it had finished k by then: every rank
stops after step k or k + 1, whatever `train.log_interval`.

The ledger counts the agreement under the mode `stop` at the step it decided: its store bytes,
the time from the wake-up to `done`, and what the boundary waited for `done` as exposed. At
world 1 no store is used: the rank's own flag decides at the next boundary.
"""
from __future__ import annotations

import itertools
import os
import signal
import sys
import threading
from datetime import timedelta
from typing import Any, List, Optional

from mpoverlap.comm.handle import now

MODE = "stop"
# The watcher's store wait: long, re-armed when it expires (each expiry prints a c10d warning).
_WATCH_S = 7 * 24 * 3600.0
_instances = itertools.count()  # per process: every rank builds its Trainers in the same order


class StopAgreementError(RuntimeError):
    """The agreement could not complete (a rank's watcher never proposed, the store failed)."""


class StopAgreement:
    """One rank's side of the protocol above: `install` for a run, `at_boundary` after each
    step, `restore` at its end."""

    def __init__(self, store: Optional[Any], world: int, rank: int, ledger: Any = None,
                 timeout_s: float = 600.0, name: Optional[str] = None) -> None:
        """`store`: the rendezvous store (None, or world 1: no agreement, this rank's flag
        decides). `name`: the keys' instance, by default the count of agreements this process
        built before (every rank builds its Trainers in the same order)."""
        self.raised = False
        self._store = store if world > 1 else None
        self.world, self.rank, self._ledger, self._timeout_s = world, rank, ledger, float(timeout_s)
        self._prefix = ""
        if self._store is not None:
            restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            self._prefix = f"mpoverlap/stop/{restart}/{next(_instances) if name is None else name}/"
        self._lock = threading.RLock()  # RLock: the signal handler may run while this thread holds it
        self._completed = 0
        self._proposed: Optional[int] = None
        self._target: Optional[int] = None
        self._woke_at: Optional[float] = None
        self._nbytes = 0  # what this rank sent the store for the agreement (keys and values, approximate)
        self._error: Optional[BaseException] = None
        self._closing = self._signalled = False
        self._threads: List[threading.Thread] = []
        self._previous = None
        self._run = 0

    @classmethod
    def default(cls, world: int, rank: int, ledger: Any, timeout_s: float) -> "StopAgreement":
        """On the default process group's store (world > 1): the store torch.distributed was
        initialised with (env://: the launcher's rendezvous store), which torch exposes only
        through this private accessor (present since torch 1.x)."""
        store = None
        if world > 1:
            from torch.distributed.distributed_c10d import _get_default_store
            store = _get_default_store()
        return cls(store, world, rank, ledger, timeout_s)

    # -- the run ------------------------------------------------------------------------------
    def install(self, completed: int = 0) -> None:
        """For the run's duration (Trainer.run): SIGTERM requests the stop (`request`), and the
        watcher thread starts (`start`). `completed`: the steps done before (a resumed run's)."""
        self._previous = signal.signal(signal.SIGTERM, self._handle_signal)
        self.start(completed)

    def start(self, completed: int = 0) -> None:
        """The watcher alone (no signal handler: tests, benchmarks, a thread that is not the
        main one). Idempotent."""
        self._completed = completed
        if self._store is None or self._threads:
            return
        # A new run of the same agreement (Trainer.run again): its own keys, a fresh state.
        self._run += 1
        self._proposed = self._target = self._woke_at = self._error = None
        self._closing = self._signalled = False
        self._nbytes = 0
        self._threads = [threading.Thread(target=self._watch, args=(self._store.clone(),), daemon=True,
                                          name="mpoverlap-stop-watch")]
        self._threads[0].start()
        if self.raised:  # a signal before the watcher existed
            self._wake_everyone()

    def request(self) -> None:
        """What SIGTERM does: set this rank's flag and, once per run, wake every rank's watcher
        (the first rank signalled does; two store requests on this thread's connection)."""
        self.raised = True
        if self._threads:
            self._wake_everyone()

    def _wake_everyone(self) -> None:
        if self._signalled:
            return
        self._signalled = True
        try:
            if self._store.add(self._key("signalled"), 1) == 1:
                keys = [self._key(f"wake/{r}") for r in range(self.world)]
                self._store.multi_set(keys, ["stop"] * self.world)
                self._nbytes += sum(len(k) + 4 for k in keys)
            self._nbytes += 40
        except Exception as e:  # raised at the next boundary: this rank cannot stop the others
            self._failed(e)

    def _handle_signal(self, signum, frame) -> None:
        self.request()

    def restore(self) -> None:
        """Back to the previous handler, unless the run stopped for a SIGTERM: then the process
        is on its way out and a second SIGTERM (SLURM signals every process of the step, and
        torchrun's agent forwards its own to the workers) must not kill it with the default
        action, which its agent would report as a failed worker. The threads end."""
        if self._previous is not None and not self.raised:
            signal.signal(signal.SIGTERM, self._previous)
        self._previous = None
        if not self._threads:
            return
        self._closing = True
        try:  # the watcher's own key, unless a stop already set it
            self._store.compare_set(self._key(f"wake/{self.rank}"), "", "exit")
        except Exception:  # the store is gone (its host exited): so is the watcher's wait
            pass
        for thread in self._threads:
            thread.join(timeout=5.0)
        self._threads = []

    # -- the boundary ---------------------------------------------------------------------------
    def at_boundary(self, step: int) -> bool:
        """After step `step`: whether every rank stops here (the loop then saves and returns)."""
        if self._store is None:
            return self.raised
        with self._lock:
            self._completed = step
            proposed, error = self._proposed, self._error
        if error is not None:
            raise StopAgreementError(f"the stop agreement's store connection failed on rank {self.rank} ({error!r}): "
                                     "a SIGTERM on another rank could no longer stop this one") from error
        if proposed is None or step < proposed:
            return False
        if self._target is None:
            self._target = self._wait_done(step)
        return step >= self._target

    def _wait_done(self, step: int) -> int:
        began = now()
        key = self._key("done")
        try:
            self._store.wait([key], timedelta(seconds=self._timeout_s))
            target = int(self._store.get(key))
        except Exception as e:
            raise StopAgreementError(
                f"rank {self.rank} proposed to stop after step {step} and waited {self._timeout_s:g}s "
                f"(train.comm_timeout_s={self._timeout_s:g}) for every rank's proposal; a rank's watcher never "
                "proposed (it exited, or the store is unreachable). Its checkpoint is not written: resume from "
                "the newest complete one") from e
        ended = now()
        if target < step:  # cannot happen: every rank proposed a step it had not finished
            raise StopAgreementError(f"the agreed stop step {target} is behind rank {self.rank}'s step {step}")
        self._nbytes += len(key) + 16
        if self._ledger is not None:
            self._ledger.record_span(MODE, "store", self._nbytes, self._woke_at or began, ended, (began, ended))
        return target

    # -- the watcher ----------------------------------------------------------------------------
    def _key(self, name: str) -> str:
        return f"{self._prefix}{self._run}/{name}"

    def _watch(self, conn: Any) -> None:
        key = self._key(f"wake/{self.rank}")
        try:
            while True:
                try:
                    conn.wait([key], timedelta(seconds=_WATCH_S))
                    break
                except Exception:
                    if self._closing:
                        return
                    if not self._expired(conn, key):
                        raise
            if conn.get(key) != b"stop":
                return  # "exit": restore()
            self._woke_at = now()
            with self._lock:  # from here the boundary of `proposal` waits for `done`
                proposal = self._completed + 1
                self._proposed = proposal
            cur = conn.compare_set(self._key("max"), "", str(proposal))
            while int(cur) < proposal:
                cur = conn.compare_set(self._key("max"), cur, str(proposal))
            if conn.add(self._key("proposed"), 1) == self.world:
                conn.set(self._key("done"), conn.get(self._key("max")))
            self._nbytes += 4 * (len(key) + 16)
        except Exception as e:
            if not self._closing:
                self._failed(e)

    @staticmethod
    def _expired(conn: Any, key: str) -> bool:
        """Whether the wait only timed out (the store still answers)."""
        try:
            return not conn.check([key])
        except Exception:
            return False

    def _failed(self, error: BaseException) -> None:
        with self._lock:
            self._error = error
        print(f"mpoverlap: the stop agreement's store request failed on rank {self.rank}: {error!r}", file=sys.stderr,
              flush=True)
