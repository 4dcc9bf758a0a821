"""overlap.comm_priority: the groups given NCCL's high-priority streams (from the config), the
options ParallelState.create passes to new_group on nccl and never on gloo, the plan's line,
the value's validation and the GPU report's record. The CUDA path itself (NCCL honouring the
option) needs a GPU and runs only under `make gpu-check`."""
from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mpoverlap.config import compose
from mpoverlap.overlap import validate
from mpoverlap.overlap.plan import render_plan
from mpoverlap.overlap.priority import high_priority_kinds
from mpoverlap.parallel import ParallelState, RankGrid
from mpoverlap.parallel.grid import GROUP_KINDS
from mpoverlap.parallel.state import nccl_group_options

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/ is not an installed package

GPT = ["model=gpt_tiny"]


@pytest.mark.parametrize("overrides, world, kinds", [
    (["parallel.dp=2"], 2, ("dp_cp",)),
    (["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.dp=2"], 4, ("tp", "dp_cp")),
    # without SP the column backward's input-gradient all-reduce is waited under its wgrad GEMM
    (["parallel.tp=2", "parallel.sequence_parallel=false", "parallel.dp=2"], 4, ("tp", "dp_cp")),
    (["parallel.tp=2", "overlap.tp=false", "parallel.dp=2"], 4, ("dp_cp",)),  # TP waited at once
    (["parallel.pp=2", "parallel.dp=2"], 4, ("dp_cp", "pp")),
    (["parallel.cp=2"], 2, ("cp", "dp_cp")),  # cp ranks reduce gradients over dp x cp too
    (["parallel.dp=2", "overlap.comm_priority=high"], 2, ("dp_cp",)),
    (["parallel.dp=2", "overlap.comm_priority=normal"], 2, ()),
    (["parallel.dp=2", "overlap=none"], 2, ()),  # nothing waited under compute
    (["parallel.dp=2", "overlap.dp=false"], 2, ()),
    ([], 1, ()),  # a single rank: no group at all
])
def test_the_groups_of_the_modes_that_are_on(overrides, world, kinds):
    assert high_priority_kinds(compose(GPT + overrides), world) == kinds


def test_moe_groups():
    # overlap.ep=true: the ep group's priority follows EP overlap (auto may resolve it off)
    cfg = compose(["model=moe_tiny", "parallel.dp=4", "parallel.ep=2", "overlap.ep=true"])
    assert high_priority_kinds(cfg, 4) == ("dp_cp", "ep", "edp")
    cfg = compose(["model=moe_tiny", "parallel.dp=2", "parallel.ep=2", "parallel.tp=2",
                   "parallel.sequence_parallel=true", "overlap.ep=true"])
    assert set(high_priority_kinds(cfg, 4)) >= {"tp", "ep", "dp_cp", "tp_edp"}


def test_value_is_validated_with_key_reason_and_fix():
    problems = validate(compose(GPT + ["overlap.comm_priority=highest"]), 1)
    assert [p.rule for p in problems] == ["value.choice"]
    text = problems[0].render()
    assert "overlap.comm_priority=highest" in text and "auto|high|normal" in text
    assert "fix: overlap.comm_priority=auto" in text
    for value in ("auto", "high", "normal"):
        assert not validate(compose(GPT + ["parallel.dp=2", f"overlap.comm_priority={value}"]), 2)


def test_plan_line_on_gloo_and_on_nccl():
    cfg = compose(GPT + ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.dp=2"])
    gloo = [l for l in render_plan(cfg, 4, device="cpu/gloo").splitlines() if "comm_priority" in l]
    assert len(gloo) == 1 and "no effect on gloo" in gloo[0] and "tp, dp_cp" in gloo[0]
    nccl = [l for l in render_plan(cfg, 4, device="cuda/nccl").splitlines() if "comm_priority" in l]
    assert len(nccl) == 1 and "NCCL high-priority streams" in nccl[0] and "tp, dp_cp" in nccl[0]
    cfg = compose(GPT + ["parallel.dp=2", "overlap.comm_priority=normal"])
    line, = [l for l in render_plan(cfg, 2, device="cuda/nccl").splitlines() if "comm_priority" in l]
    assert "default-priority" in line


def _fake_world(monkeypatch, backend: str, world: int, rank: int):
    """torch.distributed as ParallelState.create sees it, recording each new_group call."""
    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: world)
    monkeypatch.setattr(dist, "get_rank", lambda: rank)
    monkeypatch.setattr(dist, "get_backend", lambda: backend)
    monkeypatch.setattr(dist, "all_gather_object", lambda out, obj: out.__setitem__(slice(None), [obj] * len(out)))

    def new_group(ranks, backend, timeout, pg_options=None):
        calls.append((tuple(ranks), pg_options))
        return object()

    monkeypatch.setattr(dist, "new_group", new_group)
    return calls


class _Options:
    def __init__(self, is_high_priority_stream=False):
        self.is_high_priority_stream = is_high_priority_stream


def test_create_passes_the_high_priority_option_on_nccl_only(monkeypatch):
    grid = RankGrid(tp=2, dp=2)
    monkeypatch.setattr(dist, "ProcessGroupNCCL", types.SimpleNamespace(Options=_Options), raising=False)
    calls = _fake_world(monkeypatch, "nccl", 4, 0)
    state = ParallelState.create(grid, torch.device("cpu"), skip=("dp", "mp"), high_priority=("tp", "dp_cp"))
    assert state.high_priority == ("tp", "dp_cp")
    # new_group is called kind by kind in GROUP_KINDS' order: the calls line up with the kinds
    expected = [(tuple(ranks), kind in ("tp", "dp_cp")) for kind in GROUP_KINDS if kind not in ("dp", "mp")
                for ranks in grid.groups(kind) if len(ranks) > 1]
    assert [r for r, _ in calls] == [r for r, _ in expected]
    for (ranks, options), (_, high) in zip(calls, expected):
        assert (options is not None and options.is_high_priority_stream) == high, ranks
    assert any(not high for _, high in expected)  # the other kinds (tp_cp, edp, ...) keep the defaults

    gloo_calls = _fake_world(monkeypatch, "gloo", 4, 0)
    state = ParallelState.create(grid, torch.device("cpu"), skip=("dp", "mp"), high_priority=("tp", "dp_cp"))
    assert state.high_priority == ()
    assert gloo_calls and all(o is None for _, o in gloo_calls)


def test_nccl_group_options_is_none_on_gloo_and_for_other_kinds():
    assert nccl_group_options("tp", ("tp",), "gloo") is None
    assert nccl_group_options("pp", ("tp",), "nccl") is None


def test_gpu_report_records_the_high_priority_groups():
    from bench.gpu_report import priority_lines

    shapes = {"gpt_125m": {"sides": {"mpoverlap": {"high_priority_groups": []}, "plain": {}}},
              "llama3_1b": {"sides": {"mpoverlap": {"high_priority_groups": ["tp", "dp_cp"]}}}}
    text = "\n".join(priority_lines(shapes))
    assert "gpt_125m mpoverlap: none (no process group at world 1)" in text
    assert "llama3_1b mpoverlap: tp, dp_cp" in text
    assert priority_lines({"x": {"status": "skipped"}}) == []
