"""This machine's rates for `hardware=measured` (hardware.measured_rates times them,
with_rates puts them together).

Every rate is timed in the calling thread's CPU time (`time.thread_time`) with torch on one
thread, as each benchmark worker runs, and the per-rank work in as many processes at once as
the layout has ranks on this machine (`concurrently`): the ranks share the cores' caches and
memory bandwidth, and small, memory-bound work runs measurably slower beside a second copy.
Thread time keeps out the time a process waits for a core, not the slowdown other processes'
load causes on the core it has: measure on a quiet machine.

- `matmul_rate`: one (rows x hidden) @ (hidden x ffn) matmul, best of the repeats: the peak.
- `model_rate`: forward + backward of the whole model on one microbatch, the MEDIAN of the
  repeats: the benchmarks report median steps, and on a shared machine the median of a
  repeated piece of work sits well above its best. It runs as a rank runs its share: under
  pipeline parallelism as the pipeline's chunks, one action at a time; under context
  parallelism (the p2p ring) each cp rank's tokens through ring attention, block by block in
  Python with log-sum-exp merges (much slower than the single-process SDPA), over a ring whose
  exchanges are local copies.
- `update_seconds_per_param`: what a training step costs beyond forward and backward, per
  parameter of the rank: zeroing the gradient buffer, the foreach gradient norm and clip
  scale, and foreach AdamW (memory-bound: a few passes over parameters, gradients and two
  moments), the work DataParallelAdamW does after the last backward.
- `expert_rate`: forward + backward of a rank's routed experts on one dispatch chunk's rows,
  spread evenly over them: many small GEMMs, slower per FLOP than the model on average; how
  long the experts hide the token exchanges.
- `loopback_rate` (simulate/loopback.py, re-exported here): what gloo ranks move over this
  machine's loopback together, per collective, timed in wall-clock seconds by spawned ranks.
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


def _local_ring(cp_rank: int, cp_size: int):
    """A CPRing of one process: `exchange` copies the block it sends into the receive buffer at
    once (the arithmetic a cp rank does, without the communication)."""
    from mpoverlap.comm.handle import CommHandle
    from mpoverlap.context_parallel.ring_comm import CPRing

    class LocalRing(CPRing):
        def exchange(self, send_t, recv_t):
            recv_t.copy_(send_t)
            return CommHandle("cp", "send_recv", 0, [], None)

    return LocalRing(None, tuple(range(cp_size)), cp_rank, cp_size, True, None)


def model_rate(cfg: Any, repeats: int = 15, copies: int = 1, pp: int = 1, vpp: int = 1, cp: int = 1) -> float:
    """FLOP/s (`flops_per_token`'s count) of one thread running `model_work` (forward + backward
    of the whole model on one microbatch of random tokens, as a rank of the layout runs its
    share), the median of `repeats` after a warm-up, in each of `copies` processes at once
    (`concurrently`)."""
    with one_thread():
        work, flops = model_work(cfg, pp=pp, vpp=vpp, cp=cp)
        took = concurrently(lambda: statistics.median(thread_times(work, repeats)), copies)
    return flops / took


def model_work(cfg: Any, pp: int = 1, vpp: int = 1, cp: int = 1) -> Tuple[Callable[[], None], float]:
    """(work, its FLOPs as `flops_per_token` counts them): forward + backward of the whole model
    on one microbatch of random tokens, run as a rank of the layout runs its share, one share
    after the other:
    - pp x vpp > 1: as the pipeline's chunks (`build_chunks` of every stage, in the layout the
      schedule runs: loop_mtp's MTP chunk on stage 0 with parallel.mtp_stage=0), each chunk's
      forward and backward on its own as a pipeline action runs it (a received activation in,
      its gradient back): what a stage pays per action on top of its layers' FLOPs;
    - the MTP depths (model.mtp_num_layers) run where the model holds them, on their targets,
      as `flops_per_token` counts them;
    - cp > 1 (the p2p ring): as each cp rank in turn, its S/cp tokens (split_for_cp) through
      the model with ring attention (context_parallel's block math with log-sum-exp merges)
      over a ring whose exchanges are local copies.
    Run it with torch on one thread (`one_thread`), as each benchmark worker runs."""
    import math

    import torch

    from mpoverlap.context_parallel.block_kernels import select_block_kernel
    from mpoverlap.context_parallel.ring_attention import RingAttentionFunction
    from mpoverlap.context_parallel.split import positions_for_cp, split_for_cp
    from mpoverlap.context_parallel.stats import NullStats
    from mpoverlap.models.flops import flops_per_token
    from mpoverlap.models.gpt import GPT
    from mpoverlap.models.mtp import mtp_targets
    from mpoverlap.training.pipeline_glue import build_chunks, schedule_layout

    m, t = cfg.model, cfg.train
    model, tokens = _model_and_tokens(cfg)
    autocast = torch.autocast("cpu", torch.bfloat16, enabled=str(t.precision) == "bf16")
    S, shape = m.seq_length, (t.micro_batch_size, m.seq_length // cp, m.hidden_size)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    depths = getattr(m, "mtp_num_layers", 0)
    if depths:  # [B, S, 1 + D]: the token targets, then each depth's
        targets = mtp_targets(tokens, depths)
    if cp > 1:
        def ring_model(rank: int):
            ring = _local_ring(rank, cp)

            def attention(q, k, v):
                # the block kernel the run's layers use (parallel.cp_attention_backend)
                return RingAttentionFunction.apply(q, k, v, ring, 1.0 / math.sqrt(q.shape[-1]), NullStats(),
                                                   select_block_kernel(cfg.parallel.cp_attention_backend, q))

            return GPT(m, seed=0, core_attention=attention)

        # (model, its input tokens, targets, positions) of each share a rank runs
        shares = [(ring_model(r), split_for_cp(inputs, r, cp, seq_dim=1), split_for_cp(targets, r, cp, seq_dim=1),
                   positions_for_cp(S, r, cp)) for r in range(cp)]
    else:
        layout = schedule_layout(cfg.parallel, vpp, m, pp)
        chunks = ([c for s in range(pp) for c in build_chunks(m, pp, vpp, s, 0, layout)]
                  if pp * vpp > 1 else [model])
        shares = [(c, inputs, targets, torch.arange(S)) for c in chunks]

    def work() -> None:
        for chunk, x, y, positions in shares:
            inp = x if chunk.pre_process else torch.randn(shape, requires_grad=True)
            if getattr(chunk, "is_mtp_chunk", False):  # h_0 in, the MTP loss out
                with autocast:
                    chunk(inp, positions, y).backward()
                continue
            mtp = chunk.post_process and y.dim() == 3 and chunk.mtp is not None
            if y.dim() == 3 and not mtp:  # loop_mtp's head chunk: the token targets alone
                y = y[..., 0]
            with autocast:
                out = chunk(inp, position_ids=positions, fp32_logits=False, **({"mtp_targets": y} if mtp else {}))
            if chunk.post_process:
                chunk.loss(out, y).backward()
            else:
                out.backward(torch.randn_like(out))

    return work, flops_per_token(m) * t.micro_batch_size * m.seq_length


def update_seconds_per_param(cfg: Any, repeats: int = 7, copies: int = 1) -> float:
    """Thread-CPU seconds per parameter of the step's work after the last backward (gradient
    buffer zeroed, the optimizer's norm over [rows, 2^14] views with an fp64 total, the clip
    scale, fused AdamW with weight decay, as DataParallelAdamW runs them), on the model's own
    parameters in one flat buffer as the DP wrapper keeps them; the median."""
    import torch

    from mpoverlap.data_parallel.grad_norm import SquareSum

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
        optimizer = torch.optim.AdamW(params, lr=1e-6, fused=True)
        square_sum = SquareSum([flat_grad], flat_grad.device)

        def work() -> None:
            square_sum().sqrt()
            torch._foreach_mul_([flat_grad], 0.5)
            optimizer.step()
            flat_grad.zero_()

        took = concurrently(lambda: statistics.median(thread_times(work, repeats)), copies)
    return took / n


def expert_rate(cfg: Any, lo: Any, repeats: int = 15, copies: int = 1) -> float:
    """FLOP/s of one thread running `expert_work` (this rank's routed experts forward +
    backward on one dispatch chunk's rows), the median of `repeats`, in `copies` processes at
    once."""
    with one_thread():
        work, flops = expert_work(cfg, lo)
        took = concurrently(lambda: statistics.median(thread_times(work, repeats)), copies)
    return flops / took


def expert_work(cfg: Any, lo: Any) -> Tuple[Callable[[], None], float]:
    """(work, its FLOPs): this rank's routed experts (`GroupedExperts` or `Experts`, E/ep of them, the model's
    activation and expert width) forward + backward on one dispatch chunk's rows (the rank's
    MoE tokens x top_k / overlap.ep_chunks, as a balanced router sends them), split evenly over
    the experts. Run it with torch on one thread (`one_thread`)."""
    import torch

    from mpoverlap.moe.experts import Experts, GroupedExperts
    from mpoverlap.overlap.config import ep_chunks
    from mpoverlap.overlap.estimate.params import expert_ffn, mlp_mult
    from mpoverlap.simulate.costs import moe_tokens

    m = cfg.model
    local = max(1, m.num_experts // max(1, lo.ep))
    chunks = ep_chunks(cfg)
    rows = max(local, int(moe_tokens(cfg, lo) * m.moe_top_k) // chunks)
    # The experts the model runs: grouped GEMMs (model.moe_grouped_gemm, the default) or the loop.
    kind = GroupedExperts if getattr(m, "moe_grouped_gemm", True) else Experts
    experts = kind(local, m.hidden_size, expert_ffn(m), first_expert_index=0, name_prefix="rate", cfg=m,
                   seed=0, activation=m.activation)
    x = torch.randn(rows, m.hidden_size, requires_grad=True)
    counts = [rows // local] * local
    counts[-1] += rows - sum(counts)
    if kind is GroupedExperts:
        counts = torch.tensor(counts)

    def work() -> None:
        y = experts(x, counts)
        y.backward(torch.randn_like(y))

    return work, 3 * 2 * rows * mlp_mult(m) * m.hidden_size * expert_ffn(m)


from mpoverlap.simulate.loopback import loopback_rate  # noqa: E402,F401  (hardware=measured reads it here)
