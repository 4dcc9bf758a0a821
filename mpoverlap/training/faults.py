"""Fault injection for reliability tests: make one rank fail the way real ranks fail.

MPOVERLAP_FAULT="<rank>:<step>:<kind>" makes global rank <rank> fail at the start of step
<step> (numbered from 1, as in metrics.jsonl):
    raise  an exception (a bug, a failed kernel): the launcher reports the rank and the cause
    hang   sleep forever (a stuck GPU, a deadlocked host): the other ranks' collectives time
           out after train.comm_timeout_s and the launcher takes everything down
Unset (the normal case), `FaultInjector.at_step` is a comparison against None.
"""
from __future__ import annotations

import os
import time
from typing import Optional, Tuple

ENV = "MPOVERLAP_FAULT"
KINDS = ("raise", "hang")


class InjectedFault(RuntimeError):
    """The exception a `raise` fault throws."""


def parse_fault(value: Optional[str]) -> Optional[Tuple[int, int, str]]:
    if not value:
        return None
    try:
        rank, step, kind = value.split(":")
        parsed = (int(rank), int(step), kind)
    except ValueError:
        parsed = None
    if parsed is None or parsed[2] not in KINDS:
        raise ValueError(f"{ENV}={value!r}: expected <rank>:<step>:<kind> with kind one of {'|'.join(KINDS)}, "
                         f"e.g. {ENV}=1:3:raise; unset it to run without a fault")
    return parsed


class FaultInjector:
    def __init__(self, rank: int) -> None:
        fault = parse_fault(os.environ.get(ENV))
        self.fault = fault if fault is not None and fault[0] == rank else None

    def at_step(self, step: int) -> None:
        if self.fault is None or step != self.fault[1]:
            return
        if self.fault[2] == "raise":
            raise InjectedFault(f"injected fault ({ENV}) at step {step}")
        while True:  # hang: only the collective timeout or the launcher ends this process
            time.sleep(3600)
