"""The loopback's achieved rate for `hardware=measured` (hardware.measured_rates): what gloo
ranks move over this machine's loopback together, per collective, timed in wall-clock seconds by
`world` spawned ranks (`python -m mpoverlap.simulate.loopback`, one JSON line). The compute
rates beside it are in simulate/measure.py.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Dict

from mpoverlap.simulate.hardware import COLLECTIVES


def _loopback_worker(rank: int, world: int, port: int, nbytes: int, repeats: int, out) -> None:
    import torch
    import torch.distributed as dist

    from mpoverlap.overlap.estimate.comm import link_factor
    from mpoverlap.simulate.collectives import steps

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        n = nbytes // 4 // world * world
        # gloo over the loopback: host buffers by design
        full, part, spare = (torch.ones(n, device="cpu"), torch.ones(n // world, device="cpu"),
                             torch.ones(n, device="cpu"))
        right, left = (rank + 1) % world, (rank - 1) % world

        def ring_exchange() -> None:  # each rank sends its buffer to the next and receives one
            for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, full, right),
                                                dist.P2POp(dist.irecv, spare, left)]):
                work.wait()

        calls = {"all_reduce": lambda: dist.all_reduce(full),
                 "all_gather": lambda: dist.all_gather_into_tensor(full, part),
                 "reduce_scatter": lambda: dist.reduce_scatter_tensor(part, full),
                 "all_to_all": lambda: dist.all_to_all_single(spare, full),
                 "send_recv": ring_exchange}
        # bytes each rank sends per call (send_recv: link_factor counts the send and the receive)
        sent = {op: link_factor(op, world) * n * 4 * (2 if op == "send_recv" else 1) for op in COLLECTIVES}
        # latency: a one-element all-reduce (2(n-1) steps of the ring), median of 30
        one = torch.ones(1, device="cpu")
        tiny = []
        for i in range(31):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(one)
            if i:
                tiny.append(time.perf_counter() - t0)
        barrier = statistics.median(tiny)
        latency = barrier / steps("all_reduce", world)
        rates: dict = {op: [] for op in COLLECTIVES}
        cpu = []
        for i in range(repeats + 1):
            used = 0.0
            for op in COLLECTIVES:
                dist.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                calls[op]()
                # until every rank is done: a rank can return as soon as its own receives landed
                # while its sends still queue in its socket buffer (a 2-rank all-to-all shows half
                # its time on one of them)
                dist.all_reduce(one)
                took = time.perf_counter() - t0 - barrier
                used += time.process_time() - c0
                if i:  # the alpha-beta split: the bytes' time is what the latency steps leave
                    rates[op].append(world * sent[op] / max(took - steps(op, world) * latency, 1e-9))
            if i:
                cpu.append(used / sum(sent.values()))
        if rank == 0:
            out.put(({op: statistics.median(r) for op, r in rates.items()}, statistics.median(cpu), latency))
    finally:
        dist.destroy_process_group()


def loopback_rate(world: int = 2, nbytes: int = 2 << 20, repeats: int = 9, spawns: int = 2) -> Dict[str, Any]:
    """What `world` gloo ranks achieve on this machine's loopback:
    - bytes_s: what the ranks move together in an all-reduce (the sum over ranks of what each
      sends on the wire, `link_factor` bytes, over the call's time less its latency steps);
    - efficiency: {op: its rate over the all-reduce's} for the all-reduce, all-gather,
      reduce-scatter, all-to-all and a ring of point-to-point exchanges (gloo runs a
      reduce-scatter at about half the all-reduce's rate);
    - cpu_s_per_byte: CPU seconds (process time) per byte sent over all of them;
    - latency: per collective step, from a one-element all-reduce over its 2(n-1) ring steps.
    Each op moves `nbytes` per call, the median of `repeats` rounds, while the ranks do nothing
    else; the best of `spawns` sets of ranks (a set now and then runs one op at a fraction of its
    rate through all its rounds). Inside a namespace whose loopback carries a tbf rate
    (bench/netns.sh) this is what the rate delivers to gloo, which is below the rate: TCP over a
    shaped queue does not fill it."""
    import socket

    import torch.multiprocessing as mp

    runs = []
    for _ in range(max(1, spawns)):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")
        out = ctx.SimpleQueue()
        procs = [ctx.Process(target=_loopback_worker, args=(r, world, port, nbytes, repeats, out))
                 for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        bad = [p.exitcode for p in procs if p.exitcode != 0]
        if bad or out.empty():
            raise RuntimeError(f"loopback probe failed (worker exit codes {[p.exitcode for p in procs]})")
        runs.append(out.get())
    rates = {op: max(r[0][op] for r in runs) for op in COLLECTIVES}
    base = rates["all_reduce"]
    return {"bytes_s": float(base), "efficiency": {op: float(r / base) for op, r in rates.items()},
            "cpu_s_per_byte": float(statistics.median(r[1] for r in runs)),
            "latency": float(min(r[2] for r in runs))}


if __name__ == "__main__":
    import argparse
    import json

    parser = argparse.ArgumentParser(description="print this machine's loopback for gloo ranks as one JSON line: "
                                                 "bytes/s the ranks move together in an all-reduce, each "
                                                 "collective's rate over it, CPU s per byte sent, latency s per "
                                                 "collective step")
    parser.add_argument("--world", type=int, default=2)
    print(json.dumps(loopback_rate(parser.parse_args().world)))
