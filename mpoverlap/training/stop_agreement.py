"""StopAgreement: a SIGTERM on any rank stops every rank after the same step, with nothing
exchanged in a step that no signal reached.

The ranks agree through the rendezvous store (the TCPStore the process group was built from,
reachable from every rank) and only once a signal came. Keys live under
`mpoverlap/stop/<elastic restart>/<namespace>/<run>/`, where `<run>` is the number of runs
started before this one, agreed through the store: each rank adds one to `starts` when its run
starts (one request a run), and since a run's steps couple every rank, all of them have counted
run k before any counts run k + 1. So the ranks' k-th runs share their keys whatever else a
rank built (one more Trainer, an agreement it never started).

1. SIGTERM on a rank: its handler (on the main thread) sets the rank's flag and counts the rank
   in `signalled`; the first to count sets every rank's `wake/<r>` (one request), so a signal on
   every rank at once (SLURM) costs one wake-up each. The handler waits for its requests
   `SIGNAL_TIMEOUT_S` at most: they run on an idle thread of the agreement (the signaller, on a
   connection of its own), because a TCPStore request other than a wait has no timeout. So a
   store that does not answer holds the training thread that long, and the rank then raises at
   its next boundary.
2. Each rank's watcher thread sits in a store wait on its own `wake/<rank>`: a blocked socket
   read, no CPU and no traffic while nothing happens. (It has a connection of its own,
   `Store.clone()`: a store object is not for concurrent use from several threads.) Woken, it
   proposes the step this rank is in (steps completed + 1, read under the lock the loop's
   boundary takes), raises `max` to it (compare-and-set), and counts itself in `proposed`; the
   rank that completes the count publishes `done` = `max`.
3. At each step boundary the loop asks `at_boundary(step)`: a lock and two comparisons, until
   this rank has proposed. At the boundary it proposed, it waits for `done`, then stops there
   if `done` is that step, else after step `done`.
4. A watcher whose store request fails (in the run, or while its rank is closing and a peer's
   signal woke it) writes `failed: rank <r>: <error>` to `done` where it still can: the ranks
   waiting for `done` raise at once, naming it, instead of after `train.comm_timeout_s`. Only a
   store that no longer answers while the rank closes (its host exited at the end of the run)
   is not reported: no rank can wait on it.

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

import os
import queue
import signal
import sys
import threading
from datetime import timedelta
from typing import Any, List, Optional

from mpoverlap.comm.handle import now

MODE = "stop"
# The watcher's store wait: long, re-armed when it expires (each expiry prints a c10d warning).
_WATCH_S = 7 * 24 * 3600.0
# How long the signal handler's store requests (and restore's) may hold the training thread: a
# round trip takes milliseconds, and a store silent for this long would not carry the agreement
# either. The rank then raises at its next boundary, well within a scheduler's grace (SLURM's
# KillWait, between its SIGTERM and SIGKILL: 30 s by default).
SIGNAL_TIMEOUT_S = 10.0
_FAILED = "failed: "  # the prefix of a failure written to `done`


class StopAgreementError(RuntimeError):
    """The agreement could not complete (a rank's watcher never proposed, the store failed)."""


class StopAgreement:
    """One rank's side of the protocol above: `install` for a run, `at_boundary` after each
    step, `restore` at its end."""

    def __init__(self, store: Optional[Any], world: int, rank: int, ledger: Any = None,
                 timeout_s: float = 600.0, name: str = "trainer",
                 signal_timeout_s: float = SIGNAL_TIMEOUT_S) -> None:
        """`store`: the rendezvous store (None, or world 1: no agreement, this rank's flag
        decides). `name`: the keys' namespace, the same on every rank of the world (tests give
        each case its own on one store). `timeout_s`: how long a boundary waits for every
        rank's proposal; `signal_timeout_s`: the bound of the signal handler's store requests."""
        self.raised = False
        self._store = store if world > 1 else None
        self.world = world
        self.rank = rank
        self._ledger = ledger
        self._timeout_s = float(timeout_s)
        self._signal_timeout_s = float(signal_timeout_s)
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self._prefix = f"mpoverlap/stop/{restart}/{name}/"
        # The signaller's queues (start): the handler's and restore's requests, and their outcomes.
        # SimpleQueue: its put may be called from a signal handler.
        self._requests: "queue.SimpleQueue" = queue.SimpleQueue()
        self._outcomes: "queue.SimpleQueue" = queue.SimpleQueue()
        self._signal_hung = False  # a request never returned: the signaller is not asked again
        self._lock = threading.RLock()  # RLock: the signal handler may run while this thread holds it
        self._completed = 0
        self._proposed: Optional[int] = None
        self._target: Optional[int] = None
        self._woke_at: Optional[float] = None
        self._nbytes = 0  # what this rank sent the store for the agreement (keys and values, approximate)
        self._error: Optional[BaseException] = None
        self._error_message = ""
        self._closing = False
        self._signalled = False
        self._threads: List[threading.Thread] = []
        self._previous = None
        self._run = 0  # this run's number (start), the same on every rank

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
        # This run's keys: the number of runs the world started before, agreed through the store.
        self._run = (self._store.add(f"{self._prefix}starts", 1) - 1) // self.world
        self._proposed = self._target = self._woke_at = self._error = None
        self._closing = False
        self._signalled = False
        self._nbytes = 0
        self._requests, self._outcomes = queue.SimpleQueue(), queue.SimpleQueue()
        self._signal_hung = False
        signaller = threading.Thread(target=self._signaller, args=(self._store.clone(), self._requests, self._outcomes),
                                     daemon=True, name="mpoverlap-stop-signal")
        signaller.start()  # before the watcher: a signal from here on may ask it
        self._threads = [signaller, threading.Thread(target=self._watch, args=(self._store.clone(),), daemon=True,
                                                     name="mpoverlap-stop-watch")]
        self._threads[1].start()
        if self.raised:  # a signal before the watcher existed
            self._wake_everyone()

    def request(self) -> None:
        """What SIGTERM does: set this rank's flag and, once per run, wake every rank's watcher
        (the first rank signalled does; two store requests, each bounded by
        `signal_timeout_s`)."""
        self.raised = True
        if self._threads and not self._closing:  # closing: this rank's run is over
            self._wake_everyone()

    def _wake_everyone(self) -> None:
        if self._signalled:
            return
        self._signalled = True

        def wake(conn: Any) -> None:
            if conn.add(self._key("signalled"), 1) == 1:
                keys = [self._key(f"wake/{r}") for r in range(self.world)]
                conn.multi_set(keys, ["stop"] * self.world)
                self._nbytes += sum(len(k) + 4 for k in keys)
            self._nbytes += 40
        try:
            self._bounded(wake)
        except Exception as e:  # raised at the next boundary: this rank cannot stop the others
            self._failed(e, f"rank {self.rank} got SIGTERM but could not wake the other ranks through the store "
                            f"within {self._signal_timeout_s:g}s")

    def _handle_signal(self, signum, frame) -> None:
        self.request()

    def _bounded(self, request) -> None:
        """`request(conn)` on the signaller's connection, waited `signal_timeout_s` at most (a
        store request other than a wait has no timeout: a stopped store host holds it forever).
        Not re-entered: the handler asks nothing while restore() does (`_closing`)."""
        if self._signal_hung:
            raise TimeoutError("an earlier request of the stop agreement's signaller never returned")
        self._requests.put(request)
        try:
            outcome = self._outcomes.get(timeout=self._signal_timeout_s)
        except queue.Empty:
            self._signal_hung = True
            raise TimeoutError(f"the store did not answer within {self._signal_timeout_s:g}s") from None
        if outcome is not None:
            raise outcome

    @staticmethod
    def _signaller(conn: Any, requests: "queue.SimpleQueue", outcomes: "queue.SimpleQueue") -> None:
        """The signaller thread: idle in `requests.get()` until a request (None: the end)."""
        while True:
            request = requests.get()
            if request is None:
                return
            try:
                request(conn)
                outcomes.put(None)
            except Exception as e:  # raised on the asking thread (_bounded)
                outcomes.put(e)

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
            self._bounded(lambda conn: conn.compare_set(self._key(f"wake/{self.rank}"), "", "exit"))
        except Exception:  # the store is gone (its host exited) or silent: so is the watcher's wait
            pass
        self._requests.put(None)  # the signaller's end (one stuck in a request is left, a daemon)
        for thread in self._threads:
            thread.join(timeout=0.0 if self._signal_hung and thread.name.endswith("signal") else 5.0)
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
            raise StopAgreementError(f"{self._error_message} ({error!r})") from error
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
            value = self._store.get(key).decode()
        except Exception as e:
            raise StopAgreementError(
                f"rank {self.rank} proposed to stop after step {step} and waited {self._timeout_s:g}s "
                f"(train.comm_timeout_s={self._timeout_s:g}) for every rank's proposal; a rank's watcher never "
                "proposed (it exited, or the store is unreachable). Its checkpoint is not written: resume from "
                "the newest complete one") from e
        if value.startswith(_FAILED):
            raise StopAgreementError(
                f"rank {self.rank} proposed to stop after step {step}, and the agreement failed on another rank: "
                f"{value[len(_FAILED):]}. Its checkpoint is not written: resume from the newest complete one")
        target = int(value)
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
                    if self._closing or not self._expired(conn, key):
                        raise
            if conn.get(key) != b"stop":
                return  # "exit": restore()
            self._propose(conn, key)
        except Exception as e:
            if self._closing and not self._answers(conn, key):
                return  # the store is gone (its host exited at the end of the run): no rank waits on it
            self._failed(e, f"rank {self.rank}'s stop-agreement watcher lost the store: a SIGTERM on another rank "
                            "could no longer stop this one")
            self._tell_peers(conn, e)

    def _propose(self, conn: Any, key: str) -> None:
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

    def _tell_peers(self, conn: Any, error: BaseException) -> None:
        """The ranks waiting for `done` learn this rank's failure now (unless `done` is set)."""
        try:
            conn.compare_set(self._key("done"), "", f"{_FAILED}rank {self.rank}: {error!r}")
        except Exception as e:
            print(f"mpoverlap: rank {self.rank} could not tell the other ranks that its stop agreement failed: {e!r}",
                  file=sys.stderr, flush=True)

    @staticmethod
    def _expired(conn: Any, key: str) -> bool:
        """Whether the wait only timed out (the store still answers)."""
        try:
            return not conn.check([key])
        except Exception:
            return False

    @staticmethod
    def _answers(conn: Any, key: str) -> bool:
        try:
            conn.check([key])
            return True
        except Exception:
            return False

    def _failed(self, error: BaseException, message: str) -> None:
        with self._lock:
            self._error = error
            self._error_message = message
        print(f"mpoverlap: {message} ({error!r})", file=sys.stderr, flush=True)
