"""What each overlap mode hides under what: the exposed time of a mode's communication given
the compute it runs under. Pure functions of durations (seconds), one per overlap rule as the
code implements it (docs/check-simulate.md, "How the simulator works"); overlap off exposes
every second of communication.

- DP: gradient buckets become ready in order while the last microbatch's backward runs and go
  out one after another on the DP stream (`bucket_finish`); what ends after the backward is
  exposed. ZeRO-1's parameter gather runs bucket by bucket under the next forward
  (`gather_exposed`): a bucket exposes what it is late for the first layer that needs it.
- TP: collective matmul splits each SP all-gather / reduce-scatter into tp-1 ring steps under
  tp GEMM chunks (`ring_exposed`).
- CP: the ring passes K/V blocks (backward: K/V and dK/dV) while attention runs on the block
  already here (`cp_ring_exposed`).
- EP: each microbatch's tokens go in chunks; the next chunk's dispatch and the previous
  chunk's combine are in flight while a chunk's experts compute, the shared expert runs under
  the first dispatch; backward mirrors it (`ep_chunks_exposed`: the layer's programs run on
  one serial link).
- EP pairing (`overlap.ep_pairing`): one microbatch's exchanges under another's compute
  sub-steps, forward beside backward (pairing.py, on `serial_link_waits`).
- PP: sends and receives are posted ahead and run while the stage computes another
  microbatch: the discrete-event engine (engine.py) gives their cost.
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Sequence, Tuple


def ring_exposed(comm: float, compute: float, steps: int, chunks: int) -> float:
    """A ring-decomposed collective of `steps` equal hops, each in flight under one of `chunks`
    equal compute pieces (collective matmul: tp-1 hops, tp GEMM chunks): every hop longer than
    its compute piece exposes the difference."""
    if steps <= 0 or comm <= 0:
        return 0.0
    return steps * max(0.0, comm / steps - compute / chunks)


def cp_ring_exposed(comm_fwd: float, comm_bwd: float, attn_fwd: float, attn_bwd: float, cp: int) -> Tuple[float, float]:
    """(forward, backward) exposed seconds of one layer's ring attention. Forward: cp-1 K/V hops
    under cp-1 of the cp blocks. Backward: 2cp-1 hops (cp-1 K/V, cp dK/dV); each of the cp-1
    blocks with a successor hides its K/V and dK/dV hops, the last dK/dV hop has nothing under it."""
    if cp <= 1:
        return 0.0, 0.0
    fwd = ring_exposed(comm_fwd, attn_fwd * (cp - 1) / cp, cp - 1, cp - 1)
    hop = comm_bwd / (2 * cp - 1)
    bwd = (cp - 1) * max(0.0, 2 * hop - attn_bwd / cp) + hop
    return fwd, bwd


def serial_link_exposed(program: Sequence[Tuple]) -> float:
    """Seconds a program waits on one serial link: `program` runs in order ("compute", seconds),
    ("issue", name, seconds) (the transfer starts when the link is free, first come first
    served) and ("wait", name) (blocks until it is done); returns the summed waits."""
    return sum(serial_link_waits(program).values())


def serial_link_waits(program: Sequence[Tuple]) -> Dict[str, float]:
    """`serial_link_exposed` per transfer: {name: seconds its wait blocked}."""
    now = link_free = 0.0
    done, waits = {}, {}
    for step in program:
        if step[0] == "compute":
            now += step[1]
        elif step[0] == "issue":
            link_free = max(link_free, now) + step[2]
            done[step[1]] = link_free
        else:
            end = done.pop(step[1])
            waits[step[1]] = waits.get(step[1], 0.0) + max(0.0, end - now)
            now = max(now, end)
    return waits


def ep_forward_program(dispatch: float, combine: float, experts: float, chunks: int, shared: float = 0.0) -> List:
    """moe/layer.py's forward with EP overlap, per layer pass: `chunks` chunks each a dispatch,
    its experts and a combine (the totals split evenly). Issue D0; the shared expert; then per
    chunk i: issue D(i+1), wait D(i), experts(i), issue C(i); wait every combine."""
    k = max(1, chunks)
    d, c, e = dispatch / k, combine / k, experts / k
    prog: List = [("issue", "D0", d)]
    if shared > 0:
        prog.append(("compute", shared))
    for i in range(k):
        if i + 1 < k:
            prog.append(("issue", f"D{i + 1}", d))
        prog += [("wait", f"D{i}"), ("compute", e), ("issue", f"C{i}", c)]
    return prog + [("wait", f"C{i}") for i in range(k)]


def ep_backward_program(dispatch: float, combine: float, experts: float, chunks: int, shared: float = 0.0) -> List:
    """The backward of `ep_forward_program` as the autograd engine orders it (moe/dispatcher.py,
    traced in tests/test_moe.py): every combine's reverse exchange first; then from the last chunk
    down: wait its reverse combine, its experts' backward (`experts` / chunks), issue its
    reverse dispatch, wait the later chunk's; the shared expert's backward runs under the
    first chunk's reverse dispatch."""
    k = max(1, chunks)
    d, c, e = dispatch / k, combine / k, experts / k
    prog: List = [("issue", f"C{i}", c) for i in reversed(range(k))]
    for i in reversed(range(k)):
        prog += [("wait", f"C{i}"), ("compute", e), ("issue", f"D{i}", d)]
        if i + 1 < k:
            prog.append(("wait", f"D{i + 1}"))
    if shared > 0:
        prog.append(("compute", shared))
    return prog + [("wait", "D0")]


def ep_chunks_exposed(dispatch: float, combine: float, experts: float, chunks: int, shared: float = 0.0,
                      backward: bool = False) -> float:
    """Exposed seconds of one layer pass of chunked expert dispatch with EP overlap (forward,
    or with `backward` its backward), the exchanges on one serial link (`serial_link_exposed`)."""
    build = ep_backward_program if backward else ep_forward_program
    return serial_link_exposed(build(dispatch, combine, experts, chunks, shared))


def bucket_finish(pieces: Iterable[Tuple[float, float]]) -> float:
    """When a serial communication stream finishes `pieces` of (ready time, duration), each sent
    as soon as it is ready and the stream is free (DP gradient buckets)."""
    end = 0.0
    for ready, duration in sorted(pieces):
        end = max(end, ready) + duration
    return end


def buckets_over(start: float, end: float, total: float, count: int) -> list:
    """`count` buckets of `total` seconds whose gradients become ready evenly over [start, end]
    (the last at `end`)."""
    count = max(1, count)
    span = end - start
    return [(start + span * (i + 1) / count, total / count) for i in range(count)]


def gather_exposed(gather: float, forward: float, buckets: int) -> float:
    """ZeRO-1 parameter all-gather per bucket, issued in order at the start of the forward it
    feeds: bucket i (0-based) is needed when the forward is i/K done, arrives (i+1)/K of the way
    through the gather; the forward waits for the latest of them."""
    k = max(1, buckets)
    return max((i + 1) * gather / k - i * forward / k for i in range(k)) if gather > 0 else 0.0
