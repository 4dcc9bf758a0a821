"""Data parallelism against a single-process reference.

One spawn of 4 gloo ranks hosts two layouts: dp=4 (grid dp=4) and dp=2 (grid tp=2 x dp=2:
each tp rank runs its own dp=2 replica). Each rank trains every configuration (distributed
optimizer on/off, overlap on/off, param-gather overlap on/off) for 3 AdamW steps of 2
microbatches and compares against the same model trained on the full batch in one process.
The comparisons run in the workers; the tests below assert on what they report.
"""
from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dist_harness import run_distributed  # noqa: E402

from mpoverlap.comm.ledger import CommLedger  # noqa: E402
from mpoverlap.data_parallel import DataParallel, DataParallelAdamW, build_buffer  # noqa: E402
from mpoverlap.parallel import ParallelState, RankGrid  # noqa: E402

V, H, FF, T, B = 512, 128, 512, 16, 8  # vocab, hidden, ffn, tokens per row, global batch rows
BUCKET_MB = 0.25  # 65536 fp32 elements: 6 buckets for this ~1.3 MB model
HP = dict(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
LRS = [1e-3, 2e-3, 3e-3, 2e-3]
MAX_NORM = 1.0
STEPS = 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(H)
        self.fc1 = nn.Linear(H, FF)
        self.fc2 = nn.Linear(FF, H)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(self.ln(x))))


class TinyLM(nn.Module):
    """Embedding tied to the output head (a shared Parameter), 2 MLP blocks, one unused
    parameter (registered first, so it sits alone in the last bucket and gets no grad)."""

    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.Parameter(torch.zeros(7))
        self.embed = nn.Embedding(V, H)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.blocks = nn.ModuleList([Block() for _ in range(2)])
        self.norm = nn.LayerNorm(H)
        self.head = nn.Linear(H, V, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + block(x)
        return self.head(self.norm(x))


def make_model() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM()


def batch(step: int):
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, V, (B, T + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(model, x, y):
    return F.cross_entropy(model(x).reshape(-1, V), y.reshape(-1))


def make_adamw(model):
    params = [p for p in model.parameters()]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": HP["weight_decay"]},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=LRS[0], betas=HP["betas"], eps=HP["eps"])


def reference(steps: int = STEPS + 1) -> dict:
    """Full batch, one process, plain torch.optim.AdamW. Records step-0 grads, norms, the
    parameters and optimizer state after STEPS steps and the parameters after STEPS + 1."""
    model = make_model()
    opt = make_adamw(model)
    out = {"norms": []}
    for s in range(steps):
        opt.zero_grad()
        x, y = batch(s)
        loss_fn(model, x, y).backward()
        if s == 0:
            out["grads"] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        out["norms"].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        for g in opt.param_groups:
            g["lr"] = LRS[s]
        opt.step()
        if s == STEPS - 1:
            out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
            names = {p: n for n, p in model.named_parameters()}
            out["state"] = {k: {names[p]: st[k].clone() for p, st in opt.state.items()}
                            for k in ("exp_avg", "exp_avg_sq")}
    out["params_final"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def owned_mask(ddp: DataParallel) -> torch.Tensor:
    """Buffer elements whose reduced gradient this rank holds (all of them without ZeRO-1)."""
    mask = torch.zeros(ddp.buffer.grad_data.numel(), dtype=torch.bool)
    for b in range(ddp.num_buckets):
        lo, hi = ddp.shard_range(b)
        mask[lo:hi] = True
    return mask


def flat_like(ddp: DataParallel, tensors: dict) -> torch.Tensor:
    """Per-name tensors laid out like ddp's buffer (zeros where a name is missing/padding)."""
    flat = torch.zeros_like(ddp.buffer.grad_data)
    for p, (start, end, _) in ddp.buffer.index.items():
        t = tensors.get(ddp.buffer.name_of[p])
        if t is not None:
            flat[start:end] = t.reshape(-1)
    return flat


def train(state, dp_rank, dp, ref, *, overlap, dist_opt, pgo, n_micro=2, steps=STEPS,
          sd_in=None, start=0, model=None):
    """Train `steps` steps from step `start`; returns (ddp, opt, metrics)."""
    model = model or make_model()
    probe = {}
    holder = []

    def grad_probe(_p):  # registered before DataParallel's hook on the same (last-grad) param
        if holder:
            probe["inflight"] = len(holder[0].inflight_handles)
            probe["issued"] = holder[0].issued_buckets

    model.embed.weight.register_post_accumulate_grad_hook(grad_probe)
    ledger = CommLedger()
    ddp = DataParallel(model, state, group_kind="dp", overlap=overlap, bucket_mb=BUCKET_MB,
                       distributed_optimizer=dist_opt, ledger=ledger)
    holder.append(ddp)
    opt = DataParallelAdamW(ddp, lr=LRS[0], param_gather_overlap=pgo, **HP)
    if sd_in is not None:
        opt.load_state_dict(sd_in)

    def fwd_probe(_m, _a):  # after the optimizer's pre-hook on blocks.0.fc1, first forward after a step
        if opt.step_count > start:
            probe.setdefault("pending_at_block0", opt.pending_param_gathers)

    model.blocks[0].fc1.register_forward_pre_hook(fwd_probe)
    rows = B // dp
    m = {"norms": [], "warned": False}
    for s in range(start, start + steps):
        x, y = batch(s)
        x, y = x[dp_rank * rows:(dp_rank + 1) * rows], y[dp_rank * rows:(dp_rank + 1) * rows]
        mb = rows // n_micro
        ddp.start_step()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i in range(n_micro):
                ddp.set_last_microbatch(i == n_micro - 1)
                (loss_fn(ddp, x[i * mb:(i + 1) * mb], y[i * mb:(i + 1) * mb]) / n_micro).backward()
            ddp.finish_grad_sync()
        m["warned"] |= any("got no gradient" in str(w.message) for w in caught)
        if s == 0:
            mask = owned_mask(ddp)
            m["grads0"] = ddp.buffer.grad_data.clone()
            m["grad_err"] = rel_err(ddp.buffer.grad_data[mask], flat_like(ddp, ref["grads"])[mask])
        m["norms"].append(opt.clip_grad_norm(MAX_NORM))
        opt.step(LRS[s])
        if s == start:
            m["pending_after_step"] = opt.pending_param_gathers
    opt.finish_param_sync()
    target = ref["params"] if start + steps == STEPS else ref["params_final"]
    m["param_err"] = max(float((p.detach() - target[n]).abs().max()) for n, p in model.named_parameters())
    m["params"] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    m["norm_err"] = max(abs(a - b) / b for a, b in zip(m["norms"], ref["norms"][start:]))
    m["ledger"] = ledger.summary().get("dp", {"ops": 0, "bytes": 0})
    nb, numel = ddp.num_buckets, ddp.buffer.grad_data.numel()
    per_step = (2 * nb, 2 * numel * 4) if dist_opt else (nb, numel * 4)
    m["expected_ledger"] = {"ops": steps * per_step[0], "bytes": steps * per_step[1]}
    m["num_buckets"] = nb
    m["probe"] = probe
    return ddp, opt, m


CONFIGS = {  # name: (overlap, distributed_optimizer, param_gather_overlap)
    "plain": (False, False, False), "plain+ov": (True, False, False),
    "zero1": (False, True, False), "zero1+ov": (True, True, False),
    "zero1+pg": (False, True, True), "zero1+ov+pg": (True, True, True),
}


def _sd_close(sd, ref_state) -> float:
    return max(rel_err(sd[k][n], ref_state[k][n]) for k in ref_state for n in ref_state[k])


def _sd_equal(a, b) -> bool:
    return a["step"] == b["step"] and all(
        torch.equal(a[k][n], b[k][n]) for k in ("exp_avg", "exp_avg_sq") for n in a[k])


def worker(rank, world):
    ref = reference()
    out = {}
    sd_dp2 = None
    for dp, grid in ((2, RankGrid(tp=2, dp=2)), (4, RankGrid(dp=4))):
        state = ParallelState.create(grid, torch.device("cpu"))
        dp_rank = state.coords.dp
        res, runs = {}, {}
        for name, (ov, zo, pg) in CONFIGS.items():
            ddp, opt, m = train(state, dp_rank, dp, ref, overlap=ov, dist_opt=zo, pgo=pg)
            runs[name] = (ddp, opt, m)
            res[name] = {k: v for k, v in m.items() if k not in ("grads0", "params")}
        # Without gradient accumulation too.
        res["plain+ov/1mb"] = {k: v for k, v in train(state, dp_rank, dp, ref, overlap=True, dist_opt=False,
                                                      pgo=False, n_micro=1)[2].items()
                               if k not in ("grads0", "params")}
        bitwise = {}
        for a, b in (("plain", "plain+ov"), ("zero1", "zero1+ov"), ("zero1+pg", "zero1+ov+pg")):
            ma, mb = runs[a][2], runs[b][2]
            bitwise[f"{a}|{b}"] = (torch.equal(ma["grads0"], mb["grads0"]),
                                   torch.equal(ma["params"], mb["params"]))
        # Checkpoint: full optimizer state, sharded <-> unsharded <-> other dp size.
        sd_zero, sd_plain = runs["zero1+ov+pg"][1].state_dict(), runs["plain"][1].state_dict()
        sd = {"zero_vs_ref": _sd_close(sd_zero, ref["state"]), "plain_vs_ref": _sd_close(sd_plain, ref["state"]),
              "step": sd_zero["step"]}
        loads = [("zero->plain", sd_zero, False), ("plain->zero", sd_plain, True)]
        if sd_dp2 is not None:
            loads.append(("dp2zero->dp4zero", sd_dp2, True))
        for label, sd_in, zo in loads:
            model = make_model()
            model.load_state_dict(runs["zero1+ov+pg"][0].module.state_dict())
            ddp, opt, m = train(state, dp_rank, dp, ref, overlap=True, dist_opt=zo, pgo=zo, steps=1,
                                start=STEPS, model=model, sd_in=sd_in)
            sd[label] = {"param_err": m["param_err"]}
        opt = DataParallelAdamW(DataParallel(make_model(), state, group_kind="dp", overlap=True,
                                             bucket_mb=BUCKET_MB, distributed_optimizer=True, ledger=None), **HP)
        opt.load_state_dict(sd_plain)
        sd["roundtrip_equal"] = _sd_equal(opt.state_dict(), sd_plain)
        sd_dp2 = sd_zero if dp == 2 else sd_dp2
        out[f"dp{dp}"] = {"configs": res, "bitwise": bitwise, "sd": sd}
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(worker, 4, timeout_s=150)


def _each(results):
    for rank, out in enumerate(results):
        for dp_key, r in out.items():
            yield f"rank{rank}/{dp_key}", r


def test_grads_match_reference(results):
    for where, r in _each(results):
        for name, m in r["configs"].items():
            assert m["grad_err"] < 1e-6, (where, name, m["grad_err"])
            assert m["num_buckets"] >= 3


def test_overlap_on_off_bitwise(results):
    for where, r in _each(results):
        for pair, (grads_eq, params_eq) in r["bitwise"].items():
            assert grads_eq and params_eq, (where, pair)


def test_adamw_matches_reference(results):
    for where, r in _each(results):
        for name, m in r["configs"].items():
            assert m["param_err"] < 1e-5, (where, name, m["param_err"])
            assert m["norm_err"] < 1e-5, (where, name, m["norm_err"])


def test_ledger_counts_dp_traffic(results):
    for where, r in _each(results):
        for name, m in r["configs"].items():
            assert m["ledger"]["ops"] == m["expected_ledger"]["ops"], (where, name, m["ledger"])
            assert m["ledger"]["bytes"] == m["expected_ledger"]["bytes"], (where, name, m["ledger"])


def test_reductions_issued_during_backward(results):
    for where, r in _each(results):
        for name, m in r["configs"].items():
            probe, nb = m["probe"], m["num_buckets"]
            # When the tied embedding (last gradient) is accumulated, every bucket before its
            # own (and the unused parameter's) has been issued...
            assert probe["issued"] == list(range(nb - 2)), (where, name, probe)
            # ...and, with overlap, is still in flight rather than waited.
            if name.startswith(("plain+ov", "zero1+ov")):
                assert probe["inflight"] == nb - 2, (where, name, probe)
                assert m["warned"], "the unused parameter must be reported, not hidden"
            else:
                assert probe["inflight"] == 0, (where, name, probe)


def test_param_gather_waited_lazily(results):
    for where, r in _each(results):
        for name, m in r["configs"].items():
            nb = m["num_buckets"]
            if name.endswith("+pg"):
                assert m["pending_after_step"] == list(range(nb)), (where, name)
                # blocks.0.fc1 (bucket 3) waits its own gather; later layers' are still pending.
                assert m["probe"]["pending_at_block0"] == [0, 1, 2], (where, name, m["probe"])
            else:
                assert m["pending_after_step"] == [] and m["probe"]["pending_at_block0"] == []


def test_state_dict_roundtrip(results):
    for where, r in _each(results):
        sd = r["sd"]
        assert sd["step"] == STEPS
        assert sd["zero_vs_ref"] < 1e-5 and sd["plain_vs_ref"] < 1e-5, (where, sd)
        assert sd["roundtrip_equal"], where
        for label in ("zero->plain", "plain->zero", "dp2zero->dp4zero"):
            if label in sd:
                assert sd[label]["param_err"] < 1e-5, (where, label, sd[label])
    assert "dp2zero->dp4zero" in results[0]["dp4"]["sd"]


# ---- single process -------------------------------------------------------------------------

def test_buffer_layout():
    model = make_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    buf = build_buffer(model.named_parameters(), bucket_mb=BUCKET_MB, pad_to=4)
    names = [n for b in buf.buckets for n in b.names]
    assert names == [n for n, _ in model.named_parameters()][::-1]  # reverse order, tied once
    assert "head.weight" not in names and len(buf.buckets) == 6
    limit = int(BUCKET_MB * 2 ** 20 / 4)
    for i, b in enumerate(buf.buckets):
        assert b.numel % 4 == 0 and b.numel - b.data_numel < 4
        assert b.data_numel == sum(p.numel() for p in b.params)
        if i < len(buf.buckets) - 1:  # closes once full, and not a parameter later
            assert b.data_numel >= limit and b.data_numel - b.params[-1].numel() < limit
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), before[n])
        start, _, _ = buf.index[p]
        assert p.data_ptr() == buf.param_data[start:].data_ptr()
        assert p.grad.data_ptr() == buf.grad_data[start:].data_ptr()
    assert model.head.weight is model.embed.weight


def test_expert_weights_get_buckets_of_their_own():
    """Expert parameters never share a bucket with dense ones (they reduce over another
    group), each kind is padded to its own group size, and buckets still follow reverse order."""
    from mpoverlap.data_parallel.reduce_groups import expert_key

    model = make_model()
    experts = [p for n, p in model.named_parameters() if ".1." in n or n.startswith("blocks.1")]
    assert experts
    for p in experts:
        p.expert_parallel = True
    buf = build_buffer(model.named_parameters(), bucket_mb=BUCKET_MB, pad_to={"dense": 4, "expert": 3},
                       key_of=expert_key)
    names = [n for b in buf.buckets for n in b.names]
    assert names == [n for n, _ in model.named_parameters() if n != "head.weight"][::-1]
    kinds = set()
    for b in buf.buckets:
        keys = {expert_key(p) for p in b.params}
        assert keys == {b.key}, (b.names, keys)
        assert b.numel % {"dense": 4, "expert": 3}[b.key] == 0
        kinds.add(b.key)
    assert kinds == {"dense", "expert"}


def test_single_rank_matches_reference_bitwise():
    ref = reference()
    model = make_model()
    ddp = DataParallel(model, ParallelState.single(), overlap=True, bucket_mb=BUCKET_MB,
                       distributed_optimizer=True, ledger=CommLedger())
    x, y = batch(0)
    ddp.start_step()
    loss_fn(ddp, x, y).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ddp.finish_grad_sync()
    assert ddp.inflight_handles == [] and ddp.ledger.summary() == {}
    for n, p in model.named_parameters():
        if n in ref["grads"]:
            assert torch.equal(p.grad, ref["grads"][n]), n


def test_replaced_grad_is_copied_back_and_misuse_raises():
    model = make_model()
    ddp = DataParallel(model, ParallelState.single(), overlap=False, bucket_mb=BUCKET_MB,
                       distributed_optimizer=False, ledger=None)
    x, y = batch(0)
    ddp.start_step()
    model.blocks[0].fc1.weight.grad = None  # autograd will allocate a fresh tensor
    loss_fn(ddp, x, y).backward()
    w = model.blocks[0].fc1.weight
    assert w.grad.data_ptr() == ddp.buffer.grad_view(w).data_ptr() and w.grad.abs().sum() > 0
    with pytest.raises(RuntimeError, match="start_step"):
        loss_fn(ddp, x, y).backward()  # no start_step(): buckets were already reduced
    with pytest.raises(ValueError, match="distributed_optimizer"):
        DataParallelAdamW(ddp, param_gather_overlap=True)
    with pytest.raises(ValueError, match="bucket_mb"):
        build_buffer(make_model().named_parameters(), bucket_mb=0)
