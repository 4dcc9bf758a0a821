"""This machine's rates for `hardware=measured` (hardware.measured puts them together).

Every rate is timed in the calling thread's CPU time (`time.thread_time`) with torch on one
thread, as each benchmark worker runs, and the per-rank work in as many processes at once as
the layout has ranks on this machine (`concurrently`): the ranks share the cores' caches and
memory bandwidth, and small, memory-bound work runs measurably slower beside a second copy.
Thread time keeps out the time a process waits for a core, not the slowdown other processes'
load causes on the core it has: measure on a quiet machine.

- `matmul_rate`: one (rows x hidden) @ (hidden x ffn) matmul, best of the repeats: the peak.
- `model_rate`: forward + backward of the whole model on one microbatch, the MEDIAN of the
  repeats: the benchmarks report median steps, and on a shared machine the median of a
  repeated piece of work sits well above its best. Under pipeline parallelism the model runs
  as its chunks, one pipeline action at a time.
- `update_seconds_per_param`: what a training step costs beyond forward and backward, per
  parameter of the rank: zeroing the gradient buffer, the foreach gradient norm and clip
  scale, and foreach AdamW (memory-bound: a few passes over parameters, gradients and two
  moments), the work DataParallelAdamW does after the last backward.
- `ring_attention_rate`: ring attention's blockwise math (context_parallel.attention_math,
  the code the cp ranks run: block by block in Python with log-sum-exp merges, fp32) on one
  rank's blocks for the model's shapes, no communication; as FLOP/s of the attention core as
  costs.py counts it (4 t s H / tp forward, twice that backward).
- `loopback_rate`: what gloo ranks move over this machine's loopback together, timed in
  wall-clock seconds by `world` spawned ranks (`python -m mpoverlap.simulate.measure`).
"""
from __future__ import annotations

import statistics
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, List, Tuple


@contextmanager
def one_thread() -> Iterator[None]:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def thread_times(work: Callable[[], Any], repeats: int, warmup: int = 1) -> List[float]:
    """Thread-CPU seconds of `repeats` calls of `work` after `warmup` untimed ones."""
    for _ in range(warmup):
        work()
    out = []
    for _ in range(repeats):
        t0 = time.thread_time()
        work()
        out.append(time.thread_time() - t0)
    return out


def concurrently(measure: Callable[[], float], copies: int) -> float:
    """The median of `measure()` run by `copies` processes at once (this one and copies - 1
    forked children, started together at a barrier): a rank's rate while the layout's other
    ranks on this machine compute too, as they do in a step (they share caches and memory
    bandwidth). copies <= 1: this process alone."""
    import multiprocessing as mp
    import os

    if copies <= 1:
        return measure()
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(copies)
    pipes, children = [], []
    for _ in range(copies - 1):
        recv, send = ctx.Pipe(duplex=False)
        pid = os.fork()
        if pid == 0:  # the child: measure, report, leave without running the parent's cleanup
            code = 1
            try:
                barrier.wait(60)
                send.send(measure())
                code = 0
            finally:
                os._exit(code)
        children.append(pid)
        pipes.append(recv)
    barrier.wait(60)
    values = [measure()]
    for recv in pipes:
        values.append(recv.recv())
    for pid in children:
        os.waitpid(pid, 0)
    return statistics.median(values)


def matmul_rate(rows: int, hidden: int, ffn: int, bf16: bool = False, repeats: int = 10) -> float:
    """FLOP/s of one thread on an (rows x hidden) @ (hidden x ffn) matmul, best of `repeats`."""
    import torch

    with one_thread():
        dtype = torch.bfloat16 if bf16 else torch.float32
        a, b = torch.randn(rows, hidden, dtype=dtype), torch.randn(hidden, ffn, dtype=dtype)
        best = min(thread_times(lambda: a @ b, repeats))
    return 2.0 * rows * hidden * ffn / best


def _model_and_tokens(cfg: Any):
    import torch

    from mpoverlap.models.gpt import GPT

    m, t = cfg.model, cfg.train
    model = GPT(m, seed=0)
    tokens = torch.randint(0, m.vocab_size, (t.micro_batch_size, m.seq_length + 1))
    return model, tokens


def model_rate(cfg: Any, repeats: int = 7, copies: int = 1, pp: int = 1, vpp: int = 1) -> float:
    """FLOP/s (`flops_per_token`'s count) of one thread running forward + backward of the whole
    model on one microbatch of random tokens, the median of `repeats` after a warm-up, in each
    of `copies` processes at once (`concurrently`). With pp x vpp > 1 the model runs as the
    pipeline's chunks (`build_chunks` of every stage), each chunk's forward and backward on its
    own as a pipeline action runs it (a received activation in, its gradient back): what a stage
    pays per action on top of its layers' FLOPs."""
    import torch

    from mpoverlap.models.gpt import flops_per_token
    from mpoverlap.training.pipeline_glue import build_chunks

    m, t = cfg.model, cfg.train
    with one_thread():
        model, tokens = _model_and_tokens(cfg)
        autocast = torch.autocast("cpu", torch.bfloat16, enabled=str(t.precision) == "bf16")
        chunks = [c for s in range(pp) for c in build_chunks(m, pp, vpp, s, 0)] if pp * vpp > 1 else [model]
        positions = torch.arange(m.seq_length)
        shape = (t.micro_batch_size, m.seq_length, m.hidden_size)

        def work() -> None:
            for chunk in chunks:
                x = tokens[:, :-1] if chunk.pre_process else torch.randn(shape, requires_grad=True)
                with autocast:
                    out = chunk(x, position_ids=positions)
                if chunk.post_process:
                    chunk.loss(out.float(), tokens[:, 1:]).backward()
                else:
                    out.backward(torch.randn_like(out))

        took = concurrently(lambda: statistics.median(thread_times(work, repeats)), copies)
    return flops_per_token(m) * t.micro_batch_size * m.seq_length / took


def update_seconds_per_param(cfg: Any, repeats: int = 7, copies: int = 1) -> float:
    """Thread-CPU seconds per parameter of the step's work after the last backward (gradient
    buffer zeroed, fp64 foreach norm, foreach clip scale, foreach AdamW with weight decay), on
    the model's own parameters in one flat buffer as the DP wrapper keeps them; the median."""
    import torch

    with one_thread():
        model, _ = _model_and_tokens(cfg)
        params = [p for p in model.parameters()]
        n = sum(p.numel() for p in params)
        flat_grad = torch.randn(n)
        grads, offset = [], 0
        for p in params:
            grads.append(flat_grad[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        for p, g in zip(params, grads):
            p.grad = g
        optimizer = torch.optim.AdamW(params, lr=1e-6, foreach=True)

        def work() -> None:
            torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float64)).pow(2).sum().sqrt()
            torch._foreach_mul_(grads, 0.5)
            optimizer.step()
            flat_grad.zero_()

        took = concurrently(lambda: statistics.median(thread_times(work, repeats)), copies)
    return took / n


def ring_attention_rate(cfg: Any, cp: int, tp: int = 1, repeats: int = 3, copies: int = 1) -> float:
    """FLOP/s (costs.py's count of the attention core) of one cp rank's ring-attention math for
    `cfg`'s shapes: every block pair the rank attends over the cp ring steps, forward (block
    attention, log-sum-exp merge) and backward (recomputed blocks, dQ/dK/dV accumulation), fp32,
    no communication; the median rank-mean of `repeats`."""
    import torch

    from mpoverlap.context_parallel.attention_math import (SKIP, block_backward, block_forward, chunk_relation,
                                                            merge_partial, repeat_kv, softmax_delta,
                                                            sum_kv_groups)
    from mpoverlap.context_parallel.split import cp_chunks_of_rank

    m, t = cfg.model, cfg.train
    B, S = t.micro_batch_size, m.seq_length
    N = m.num_attention_heads // tp
    G = max(1, (getattr(m, "num_query_groups", None) or m.num_attention_heads) // tp)
    D, c, rep = m.hidden_size // m.num_attention_heads, S // (2 * cp), N // G
    scale = D ** -0.5

    def rank_work(rank: int) -> Callable[[], None]:
        g = torch.Generator().manual_seed(rank)
        q = [torch.randn(B, N, c, D, generator=g) for _ in range(2)]
        k = [torch.randn(B, G, c, D, generator=g) for _ in range(2)]
        v = [torch.randn(B, G, c, D, generator=g) for _ in range(2)]
        dout = [torch.randn(B, N, c, D, generator=g) for _ in range(2)]
        mine = cp_chunks_of_rank(rank, cp)
        pairs = [(i, j, chunk_relation(qc, kc)) for src in range(cp)
                 for i, qc in enumerate(mine) for j, kc in enumerate(cp_chunks_of_rank(src, cp))]
        pairs = [p for p in pairs if p[2] != SKIP]

        def work() -> None:
            out, lse = [None, None], [None, None]
            for i, j, rel in pairs:
                o, l = block_forward(q[i], repeat_kv(k[j], rep), repeat_kv(v[j], rep), scale=scale,
                                     causal=rel != "full")
                out[i], lse[i] = merge_partial(out[i], lse[i], o, l)
            delta = [softmax_delta(out[i], dout[i]) for i in range(2)]
            dq = [torch.zeros(B, N, c, D) for _ in range(2)]
            dkv = [torch.zeros(2, B, G, c, D) for _ in range(2)]
            for i, j, rel in pairs:
                a, b, e = block_backward(q[i], repeat_kv(k[j], rep), repeat_kv(v[j], rep), dout[i], lse[i],
                                         delta[i], scale=scale, causal=rel != "full")
                dq[i].add_(a)
                dkv[j][0].add_(sum_kv_groups(b, rep))
                dkv[j][1].add_(sum_kv_groups(e, rep))

        return work

    with one_thread():
        works = [rank_work(r) for r in range(cp)]
        def rank_mean() -> float:
            rounds = [sum(thread_times(w, 1, warmup=0)[0] for w in works) / cp for _ in range(repeats + 1)]
            return statistics.median(rounds[1:])

        took = concurrently(rank_mean, copies)
    tokens = B * S / cp
    return 3 * 4 * tokens * S * m.hidden_size / tp / took


# ---- the loopback's achieved rate ------------------------------------------------------------
LOOPBACK_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def _loopback_worker(rank: int, world: int, port: int, nbytes: int, repeats: int, out) -> None:
    import torch
    import torch.distributed as dist

    from mpoverlap.overlap.estimate.comm import link_factor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        n = nbytes // 4 // world * world
        full, part = torch.ones(n), torch.ones(n // world)
        calls = {"all_reduce": lambda: dist.all_reduce(full),
                 "all_gather": lambda: dist.all_gather_into_tensor(full, part),
                 "reduce_scatter": lambda: dist.reduce_scatter_tensor(part, full),
                 "all_to_all": lambda: dist.all_to_all_single(full.clone(), full)}
        sent = sum(link_factor(op, world) * n * 4 for op in LOOPBACK_OPS)
        rates, cpu = [], []
        for i in range(repeats + 1):
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            for op in LOOPBACK_OPS:
                calls[op]()
            took, used = time.perf_counter() - t0, time.process_time() - c0
            if i:
                rates.append(world * sent / took)
                cpu.append(used / sent)
        if rank == 0:
            out.put((statistics.median(rates), statistics.median(cpu)))
    finally:
        dist.destroy_process_group()


def loopback_rate(world: int = 2, nbytes: int = 2 << 20, repeats: int = 5) -> Tuple[float, float]:
    """Bytes/s that `world` gloo ranks on this machine's loopback move together (the sum over
    ranks of what each sends on the wire, `link_factor` bytes, per second of a collective), the
    median of `repeats` rounds of an all-reduce, all-gather, reduce-scatter and all-to-all of
    `nbytes` each, while the ranks do nothing else. Inside a namespace whose loopback carries a
    tbf rate (bench/netns.sh) this is what the rate delivers to gloo, which is below the rate:
    TCP over a shaped queue does not fill it."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    procs = [ctx.Process(target=_loopback_worker, args=(r, world, port, nbytes, repeats, out)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    bad = [p.exitcode for p in procs if p.exitcode != 0]
    if bad or out.empty():
        raise RuntimeError(f"loopback probe failed (worker exit codes {[p.exitcode for p in procs]})")
    rate, cpu = out.get()
    return float(rate), float(cpu)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="print this machine's loopback rate for gloo ranks (bytes/s)")
    parser.add_argument("--world", type=int, default=2)
    print("%.6g %.6g" % loopback_rate(parser.parse_args().world))
