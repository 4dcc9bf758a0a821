"""Parameters a microbatch does not use (data_parallel/unused.py) against a single-process
reference: a model whose middle branch is used on some ranks in some microbatches (and on no
rank in one step) trains at dp 2 with `mark_unused(loss)` after each forward. Every bucket's
reduction is issued before that step's backward ends (the ledger's issue times against the
time backward returned), and the weights equal the reference's: the same microbatches, the
same gates, one process. Plain data parallelism, ZeRO-1, ZeRO-2 and a one-step delay."""
from __future__ import annotations

import os
import sys
import time

import pytest
import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dist_harness import run_distributed  # noqa: E402

from mpoverlap.comm.ledger import CommLedger  # noqa: E402
from mpoverlap.data_parallel import DataParallel, DataParallelAdamW  # noqa: E402
from mpoverlap.parallel import ParallelState, RankGrid  # noqa: E402

H, ROWS, DP, N_MICRO, STEPS = 32, 4, 2, 2, 4
BUCKET_MB = 0.002  # ~500 fp32 elements: every weight a bucket of its own
HP = dict(betas=(0.9, 0.95), eps=1e-4, weight_decay=0.0)  # a large eps: no gradient element tiny enough for
# the order of the sums (per rank, then over ranks) to swing its normalized update
LRS = [1e-2, 2e-2, 1e-2, 5e-3]


class Gated(nn.Module):
    """fc_in -> (side branch if used) -> fc_mid -> fc_out. Buckets are in reverse order of
    registration: fc_out, fc_mid, side, fc_in; an unused side holds side's and fc_in's
    buckets unless it is marked."""

    def __init__(self) -> None:
        super().__init__()
        self.fc_in = nn.Linear(H, H)
        self.side = nn.Linear(H, H)
        self.fc_mid = nn.Linear(H, H)
        self.fc_out = nn.Linear(H, 1)

    def forward(self, x, use_side: bool):
        h = torch.tanh(self.fc_in(x))
        if use_side:
            h = h + torch.tanh(self.side(h))
        return self.fc_out(torch.tanh(self.fc_mid(h)))


def make_model() -> Gated:
    torch.manual_seed(0)
    return Gated()


def uses_side(step: int, rank: int, micro: int) -> bool:
    """Used on one rank's microbatch, not the other's; in step 2 on no rank at all."""
    return step != 2 and (step + rank + micro) % 2 == 0


def data(step: int, rank: int, micro: int):
    g = torch.Generator().manual_seed(100 * step + 10 * rank + micro)
    return torch.randn(ROWS, H, generator=g), torch.randn(ROWS, 1, generator=g)


def loss_of(model, step, rank, micro):
    """A rank's microbatch loss; the gradient buffer's average over ranks makes it the mean."""
    x, y = data(step, rank, micro)
    return ((model(x, uses_side(step, rank, micro)) - y) ** 2).mean() / N_MICRO


def reference(delay: int) -> dict:
    """One process runs every rank's microbatches; a parameter with no gradient gets a zero one
    (the data-parallel buffer's). With `delay` step t applies step t-1's gradient."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LRS[0], **HP)
    previous = None
    for s in range(STEPS):
        opt.zero_grad()
        for r in range(DP):
            for i in range(N_MICRO):
                (loss_of(model, s, r, i) / DP).backward()
        grads = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
        if delay:
            grads, previous = previous, grads
            if grads is None:
                continue
        for p, g in zip(model.parameters(), grads):
            p.grad = g
        for group in opt.param_groups:
            group["lr"] = LRS[s]
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def train(state, rank, *, sharding, delay, mark):
    model = make_model()
    ledger = CommLedger()
    handles = []
    ledger.recorder = lambda h: handles.append((h.mode, h.op, h.issued_at))
    ddp = DataParallel(model, state, group_kind="dp", overlap=True, bucket_mb=BUCKET_MB, ledger=ledger,
                       sharding=sharding, delay=delay)
    opt = DataParallelAdamW(ddp, lr=LRS[0], **HP)
    backward_ends, sync_ends, marked = [], [], []
    for s in range(STEPS):
        ddp.start_step()
        for i in range(N_MICRO):
            ddp.set_last_microbatch(i == N_MICRO - 1)
            loss = loss_of(ddp, s, rank, i)
            if mark:
                marked.append(ddp.mark_unused(loss))
            loss.backward()
        backward_ends.append(time.perf_counter())
        ddp.finish_grad_sync()
        sync_ends.append(time.perf_counter())
        if not delay or ddp.applies_delayed_grad:
            opt.step(LRS[s])
    opt.finish_param_sync()
    ddp.close()
    ledger.close()
    dp_issues = sorted(t for mode, op, t in handles if mode == "dp" and "reduce" in op)  # not ZeRO-1 gathers
    ref = reference(delay)
    err = {n: float((p.detach() - ref[n]).abs().max()) for n, p in model.named_parameters()}
    return {"issues": dp_issues, "backward_ends": backward_ends, "sync_ends": sync_ends,
            "num_buckets": ddp.num_buckets,
            "marked": marked, "param_err": err}


CONFIGS = {  # name: (sharding, delay)
    "plain": ("none", 0), "zero1": ("optim", 0), "zero2": ("optim_grads", 0), "delay": ("none", 1),
}


def worker(rank, world, mark):
    state = ParallelState.create(RankGrid(dp=DP), torch.device("cpu"))
    return {name: train(state, rank, sharding=sh, delay=d, mark=mark) for name, (sh, d) in CONFIGS.items()}


@pytest.fixture(scope="module")
def results():
    return run_distributed(worker, DP, True, timeout_s=120)


def issued_after_backward(m) -> list:
    """Per step, the reductions issued between the end of its backward and the end of its
    `finish_grad_sync()` (what was held back by a parameter that got no gradient)."""
    return [sum(1 for t in m["issues"] if end < t <= sync) for end, sync in zip(m["backward_ends"], m["sync_ends"])]


def test_every_bucket_issued_during_backward(results):
    for rank, out in enumerate(results):
        for name, m in out.items():
            per_step = m["num_buckets"] * (N_MICRO if name == "zero2" else 1)
            assert len(m["issues"]) == STEPS * per_step, (rank, name, len(m["issues"]))
            assert issued_after_backward(m) == [0] * STEPS, (rank, name, issued_after_backward(m))


def test_marked_what_the_microbatch_did_not_use(results):
    names = {"side.weight", "side.bias"}
    for rank, out in enumerate(results):
        marked = out["zero2"]["marked"]  # ZeRO-2 marks in every microbatch
        expected = [set() if uses_side(s, rank, i) else names for s in range(STEPS) for i in range(N_MICRO)]
        assert [set(m) for m in marked] == expected, rank


def test_weights_match_reference(results):
    for rank, out in enumerate(results):
        for name, m in out.items():
            assert max(m["param_err"].values()) < 1e-6, (rank, name, m["param_err"])
