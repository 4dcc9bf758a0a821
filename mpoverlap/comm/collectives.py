"""Async collectives that return a CommHandle instead of blocking.

Every function issues with `async_op=True` and returns at once; the caller decides when to
wait (that decision is the overlap mode). A `group` of None means a one-member group: the
result is computed locally and the handle is already complete, so callers never special-case
size 1.

Each issue runs inside `named_range("comm", mode, op)`: a `comm/<mode>/<op>` range in a torch
profiler trace while one records (free otherwise), and an NVTX range for CUDA tensors.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from mpoverlap.comm.handle import CommHandle, named_range, now
from mpoverlap.comm.ledger import CommLedger


# torch 2.13 renamed the tensor collectives; older releases only have the old names.
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _clock(tensor: torch.Tensor, communicates, ledger: Optional[CommLedger]) -> dict:
    """Issue-time clocks, taken before the collective is enqueued: host time, plus a CUDA
    event (from the ledger's pool) on the compute stream when the tensor lives on a GPU and
    something is sent (without a ledger nobody reads it: a fresh event, never timed)."""
    start = None
    if tensor.is_cuda and communicates:
        start = ledger.events.take() if ledger is not None else torch.cuda.Event(enable_timing=True)
        start.record()
    return {"issued_at": now(), "cuda_start": start}


def _backend(group) -> str:
    """The backend that runs a collective on `group` (None: the world), for the handle (~1 us)."""
    return dist.get_backend(group)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def ring_link_bytes(op: str, nbytes: int, size: int) -> int:
    """Bytes a rank sends for a collective whose buffer (as the ledger counts it) holds `nbytes`,
    over `size` ranks, with the ring algorithms NCCL and gloo use: an all-reduce 2(n-1)/n of the
    buffer, an all-gather (of its output) and a reduce-scatter (of its input) (n-1)/n, an
    all-to-all with even splits (n-1)/n (its own slot stays home). The estimate's `link` view
    (overlap/estimate/comm.py `link_factor`) is the same arithmetic."""
    if size <= 1:
        return 0
    if op == "all_reduce":
        return nbytes * 2 * (size - 1) // size
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return nbytes * (size - 1) // size
    raise ValueError(f"no ring link figure for {op!r}")


def _a2a_link_bytes(input: torch.Tensor, group, input_split_sizes: Optional[List[int]]) -> int:
    """An all-to-all's send buffer less the slot this rank keeps (its own split)."""
    size = dist.get_world_size(group)
    if input_split_sizes is None:
        return ring_link_bytes("all_to_all", _nbytes(input), size)
    row = _nbytes(input) // max(1, input.shape[0])
    return (input.shape[0] - input_split_sizes[dist.get_rank(group)]) * row


def all_reduce(tensor: torch.Tensor, group, *, mode: str, ledger: Optional[CommLedger],
               op=dist.ReduceOp.SUM, on_done=None) -> CommHandle:
    """In-place all-reduce of `tensor` over `group`; `on_done()` runs when the handle is
    waited (e.g. to copy a flat buffer's sums back to the tensors it was packed from)."""
    clock = _clock(tensor, group, ledger)
    work, backend = None, ""
    if group is not None:
        with named_range("comm", mode, "all_reduce", cuda=tensor.is_cuda):
            work = dist.all_reduce(tensor, op=op, group=group, async_op=True)
        backend = _backend(group)
    link = ring_link_bytes("all_reduce", _nbytes(tensor), dist.get_world_size(group)) if work is not None else 0
    return CommHandle(mode, "all_reduce", _nbytes(tensor), [work], ledger, keepalive=tensor, on_done=on_done,
                      backend=backend, link_bytes=link, **clock)


def _out_of_place(op: str, output: torch.Tensor, input: torch.Tensor, group, mode: str,
                  ledger: Optional[CommLedger], launch, nbytes: int, link_bytes, on_done=None) -> CommHandle:
    """The out-of-place collectives' issue: `launch()` (the async torch call) inside the op's
    named range, or with a one-member group (None) `output` a copy of `input` and nothing sent.
    `nbytes`: the buffer the ledger counts; `link_bytes()`: what this rank sends, asked only when
    something is (it reads the group's size)."""
    clock = _clock(input, group, ledger)
    work, backend = None, ""
    if group is None:
        output.copy_(input)
    else:
        backend = _backend(group)
        with named_range("comm", mode, op, cuda=input.is_cuda):
            work = launch()
    link = link_bytes() if work is not None else 0
    return CommHandle(mode, op, nbytes, [work], ledger, keepalive=(output, input), backend=backend, on_done=on_done,
                      link_bytes=link, **clock)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group, *, mode: str,
                   ledger: Optional[CommLedger], op=dist.ReduceOp.SUM) -> CommHandle:
    """output[n/g] = shard `rank` of sum over the group of input[n]."""
    return _out_of_place("reduce_scatter", output, input, group, mode, ledger,
                         lambda: _reduce_scatter_tensor(output, input, op=op, group=group, async_op=True),
                         _nbytes(input),
                         lambda: ring_link_bytes("reduce_scatter", _nbytes(input), dist.get_world_size(group)))


def all_gather(output: torch.Tensor, input: torch.Tensor, group, *, mode: str,
               ledger: Optional[CommLedger], on_done=None) -> CommHandle:
    """output[g*n] = concat over the group of input[n]; `on_done()` runs when the handle is waited."""
    return _out_of_place("all_gather", output, input, group, mode, ledger,
                         lambda: _all_gather_tensor(output, input, group=group, async_op=True), _nbytes(output),
                         lambda: ring_link_bytes("all_gather", _nbytes(output), dist.get_world_size(group)),
                         on_done=on_done)


def all_to_all(output: torch.Tensor, input: torch.Tensor, group, *, mode: str,
               ledger: Optional[CommLedger], output_split_sizes: Optional[List[int]] = None,
               input_split_sizes: Optional[List[int]] = None, on_done=None) -> CommHandle:
    """all_to_all_single along dim 0, uneven splits allowed; `on_done()` runs when the handle is waited."""
    return _out_of_place("all_to_all", output, input, group, mode, ledger,
                         lambda: dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes,
                                                        group=group, async_op=True),
                         _nbytes(input), lambda: _a2a_link_bytes(input, group, input_split_sizes), on_done=on_done)


def send_recv(sends: Sequence[tuple], recvs: Sequence[tuple], group, *, mode: str,
              ledger: Optional[CommLedger]) -> CommHandle:
    """One batched set of point-to-point ops: sends [(tensor, global_peer)], recvs likewise."""
    tensors = [t for t, _ in sends] + [t for t, _ in recvs]
    # p2p peers are global ranks; group None here is the world, so anything listed is sent.
    clock = _clock(tensors[0], True, ledger) if tensors else {}
    ops = [dist.P2POp(dist.isend, t, peer, group=group) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, t, peer, group=group) for t, peer in recvs]
    with named_range("comm", mode, "send_recv", cuda=bool(tensors) and tensors[0].is_cuda):
        works = dist.batch_isend_irecv(ops) if ops else []
    backend = _backend(group) if ops else ""
    nbytes = sum(_nbytes(t) for t, _ in sends) + sum(_nbytes(t) for t, _ in recvs)
    sent = sum(_nbytes(t) for t, _ in sends)  # what leaves this rank; the receives come in
    return CommHandle(mode, "send_recv", nbytes, list(works), ledger, keepalive=tensors, backend=backend,
                      link_bytes=sent, **clock)
