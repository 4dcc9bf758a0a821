"""When a node is lost: a worker dies with its launcher agent, and the survivors say which
host (and which ranks) they lost instead of only a socket error.


torchrun's agent starts the workers as its child processes; when the agent itself is killed
(SIGKILL, the OOM killer, a node that loses its daemon), nothing ends the workers: they keep
their connections to the other hosts open and the rest of the job trains on, or hangs, without
ever learning that a node is gone. With the parent-death signal set, the kernel kills the
worker the moment its agent dies, so the peers' next collective fails at once (a closed
connection) and their agents bring the job down with the lost host named.
"""
from __future__ import annotations

import ctypes
import os
import re
import signal
import socket
import sys
from typing import Optional, Sequence

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> bool:
    """Ask the kernel for SIGKILL when this process's parent exits (Linux; elsewhere a no-op).
    True when set. A parent that is already gone (this process was re-parented before the
    call) ends the process at once, as the signal would have."""
    if not sys.platform.startswith("linux"):
        return False
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent or parent == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return True


# gloo: "Read error [10.0.0.2]:4711: Connection reset by peer", "Connection closed by peer
# [10.0.0.2]:4711"; NCCL: "remote process exited or there was a network error".
_LOST = re.compile(r"(Connection reset by peer|Connection closed by peer|Broken pipe|"
                   r"remote process exited|Socket closed)", re.IGNORECASE)
_ADDR = re.compile(r"\[([0-9a-fA-F:.]+)\]:\d+")


class PeerLostError(RuntimeError):
    """A collective failed because a rank on another host went away."""


def _address_of(host: str) -> Optional[str]:
    try:
        return socket.gethostbyname(host)
    except OSError:
        return None


def lost_peer(err: BaseException, hosts: Sequence[str], rank: int) -> Optional[PeerLostError]:
    """The PeerLostError that explains `err`, or None when `err` is not a lost connection.
    `hosts`: each rank's hostname (ParallelState.hosts)."""
    text = str(err)
    if not _LOST.search(text):
        return None
    me = hosts[rank] if rank < len(hosts) else socket.gethostname()
    found = _ADDR.search(text)
    addr = found.group(1) if found else None
    lost = sorted({h for h in hosts if addr is not None and _address_of(h) == addr})
    if lost == [me]:
        who = f"a rank on this host ({me}, address {addr}) that stopped first"
    elif lost:
        lost = [h for h in lost if h != me]
        ranks = [r for r, h in enumerate(hosts) if h in lost]
        who = f"host {', '.join(lost)} (ranks {', '.join(map(str, ranks))}, address {addr})"
    elif addr is not None:
        who = f"the peer at {addr}"
    else:
        who = "a peer rank"
    first = text.strip().splitlines()[0] if text.strip() else type(err).__name__
    return PeerLostError(
        f"lost {who}: a collective on {me} failed ({first[:200]}). The node died, its agent was killed or "
        "one of its workers exited; its own log says why. Rerun the same command (checkpoint.resume=auto) "
        "to continue from the newest complete checkpoint")
