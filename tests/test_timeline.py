"""train.profile=true end to end (one tiny 2-rank run) and the mpoverlap-timeline command."""
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from mpoverlap.comm.handle import _NO_RANGE, named_range
from mpoverlap.comm.ledger import union_length
from mpoverlap.config import ConfigError
from mpoverlap.timeline import merge, subtract
from mpoverlap.training.profiling import profile_window

BIN = Path(sys.executable).parent
TINY = ["model=gpt_tiny", "model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4",
        "model.ffn_hidden_size=128", "model.seq_length=64", "train.global_batch_size=8",
        "train.micro_batch_size=2", "train.log_interval=1", "data.max_bytes=300000",
        "overlap.dp_bucket_mb=0.05", "train.progress=false", "train.eval_iters=1"]
PROFILED = (1, 2)  # train.profile_start_step=1 train.profile_steps=2


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("RANK", None)
    return env


def _profiled_run(out, *layout):
    """A 3-step 2-rank run of TINY with `layout`, steps 1 and 2 profiled, into `out`."""
    args = [str(BIN / "mpoverlap-train"), *TINY, "train.steps=3", f"run.dir={out}", *layout,
            "train.profile=true", "train.profile_start_step=1", "train.profile_steps=2"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=240, env=_env())
    assert proc.returncode == 0, f"{args}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    return out


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return _profiled_run(tmp_path_factory.mktemp("profiled"), "parallel.world_size=2", "overlap.dp=true")


def _timeline(run_dir, rank):
    rows = [json.loads(line) for line in (run_dir / "timeline" / f"rank{rank}.jsonl").read_text().splitlines()]
    return ([r for r in rows if r["kind"] == "meta"], [r for r in rows if r["kind"] == "step"],
            [r for r in rows if r["kind"] == "comm"])


@pytest.mark.slow
def test_chrome_traces_have_named_ranges(run_dir):
    for rank in (0, 1):
        events = json.loads((run_dir / "profile" / f"rank{rank}.json").read_text())["traceEvents"]
        names = {e.get("name", "") for e in events}
        assert any(n.startswith("comm/dp/") for n in names), sorted(n for n in names if "/" in n)
        assert any(n.startswith("wait/dp/") for n in names)
        assert {"step/1", "step/2"} <= names and "step/3" not in names


@pytest.mark.slow
def test_timeline_handles_are_consistent(run_dir):
    for rank in (0, 1):
        meta, steps, comms = _timeline(run_dir, rank)
        assert len(meta) == 1 and meta[0]["rank"] == rank and meta[0]["world"] == 2
        assert [s["step"] for s in steps] == list(PROFILED)
        bounds = {s["step"]: (s["begin"], s["end"]) for s in steps}
        # dp's buckets only (the stop agreement exchanges nothing in a step without a SIGTERM)
        assert comms and {c["mode"] for c in comms} == {"dp"}
        for c in comms:
            begin, end = bounds[c["step"]]
            assert c["issued_at"] <= c["completed_at"], c
            assert begin <= c["wait_begin"] <= c["wait_end"] <= end, (c, begin, end)
            # exposed = blocked in the wait + in the post (gloo: from issue to post_end)
            assert c["issued_at"] <= c["post_end"] <= c["completed_at"], c
            posted = c["post_end"] - c["issued_at"]
            assert c["wait_end"] - c["wait_begin"] + posted == pytest.approx(c["exposed_s"], abs=1e-9)


@pytest.mark.slow
def test_timeline_agrees_with_metrics(run_dir):
    """Same handles, same clocks: metrics.jsonl's comm row of a profiled step is the mean over
    ranks of what the timelines hold for that step."""
    rows = {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if "loss" in r}
    per_rank = [_timeline(run_dir, rank)[2] for rank in (0, 1)]
    for step in PROFILED:
        mine = [[c for c in comms if c["step"] == step and c["mode"] == "dp"] for comms in per_rank]
        want = rows[step]["comm"]["dp"]
        assert want["bytes"] == sum(sum(c["bytes"] for c in m) for m in mine) / 2
        assert want["ops"] == sum(len(m) for m in mine) / 2
        assert want["exposed_s"] == pytest.approx(sum(sum(c["exposed_s"] for c in m) for m in mine) / 2, rel=1e-6)
        unions = [union_length([(c["issued_at"], c["completed_at"]) for c in m]) for m in mine]
        assert want["time_s"] == pytest.approx(sum(unions) / 2, rel=1e-6)


def _timeline_cli(*args):
    return subprocess.run([str(BIN / "mpoverlap-timeline"), *map(str, args)], capture_output=True, text=True,
                          timeout=120, env=_env())


@pytest.mark.slow
def test_timeline_command_writes_png(run_dir, tmp_path):
    proc = _timeline_cli(run_dir)
    assert proc.returncode == 0, proc.stderr
    png = run_dir / "timeline.png"
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    assert "rank 0 dp:" in proc.stdout and f"wrote {png}" in proc.stdout
    one = tmp_path / "one_step.png"
    proc = _timeline_cli(run_dir, "--steps", 1, "--out", one)
    assert proc.returncode == 0, proc.stderr
    assert one.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_timeline_command_without_timeline_exits_2(tmp_path):
    proc = _timeline_cli(tmp_path)
    assert proc.returncode == 2
    assert "no communication timeline" in proc.stderr and "train.profile=true" in proc.stderr


@pytest.fixture(scope="module")
def zb1p_run_dir(tmp_path_factory):
    """A profiled zero-bubble run: pp 2, zb1p, 4 microbatches."""
    return _profiled_run(tmp_path_factory.mktemp("profiled_zb1p"), "parallel.pp=2", "parallel.pp_schedule=zb1p")


@pytest.mark.slow
def test_timeline_shows_zero_bubble_actions(zb1p_run_dir, tmp_path):
    """Every F, B (input gradient only) and W of each profiled step on each stage, inside its
    step, in the table's order (one at a time, each W after its B); the drawing labels the B's
    apart from a full backward."""
    from mpoverlap.pipeline import build_schedule
    from mpoverlap.timeline import load

    tables = build_schedule("zb1p", 2, 1, 4)
    for tl in load(zb1p_run_dir):
        bounds = {s["step"]: (s["begin"], s["end"]) for s in tl.steps}
        assert sorted(bounds) == list(PROFILED)
        for step, (begin, end) in bounds.items():
            mine = [a for a in tl.actions if a["step"] == step]
            assert [(a["action"], a["microbatch"], a["vchunk"]) for a in mine] == \
                [(a.kind, a.microbatch, a.vchunk) for a in tables[tl.coords["pp"]]]
            assert all(begin <= a["begin"] <= a["end"] <= end for a in mine), (begin, end, mine)
            assert all(x["end"] <= y["begin"] + 1e-6 for x, y in zip(mine, mine[1:]))
            done = {}
            for a in mine:
                if a["action"] == "B":
                    done[a["microbatch"]] = a["end"]
                if a["action"] == "W":
                    assert a["begin"] >= done[a["microbatch"]]
        assert {k for k, _ in tl.shown_actions()} == {"F", "B-input", "W"}
    proc = _timeline_cli(zb1p_run_dir, "--out", tmp_path / "zb1p.png")
    assert proc.returncode == 0, proc.stderr
    assert "rank 1 pp actions: 8 F (" in proc.stdout and "8 B-input (" in proc.stdout and "8 W (" in proc.stdout


def test_full_backward_is_shown_apart_from_input_gradient():
    """A B without a W (1F1B, interleaved) is a full backward; with one, the input gradient."""
    from mpoverlap.timeline import ACTION_STYLE, RankTimeline

    def act(kind, mb, step=1):
        return {"step": step, "action": kind, "microbatch": mb, "vchunk": 0, "begin": 0.0, "end": 0.0}

    tl = RankTimeline(rank=0, actions=[act("F", 0), act("B", 0), act("F", 1), act("B", 1), act("W", 1),
                                       act("B", 1, step=2)])
    assert [k for k, _ in tl.shown_actions()] == ["F", "B", "F", "B-input", "W", "B"]
    assert ACTION_STYLE["B"][0] != ACTION_STYLE["B-input"][0]


# ---- no processes ------------------------------------------------------------------------
def _cfg(**train):
    base = {"profile": True, "profile_start_step": 2, "profile_steps": 3, "steps": 10}
    return SimpleNamespace(train=SimpleNamespace(**{**base, **train}))


def test_profile_window_validation():
    assert profile_window(_cfg(profile=False, steps=1)) is None
    assert profile_window(_cfg()) == (2, 4)
    assert profile_window(_cfg(profile_start_step=8)) == (8, 10)
    with pytest.raises(ConfigError, match=r"train\.profile_steps=3 .*train\.steps=9.*set train\.profile_steps=2"):
        profile_window(_cfg(profile_start_step=8, steps=9))
    with pytest.raises(ConfigError, match=r"train\.profile_start_step=0"):
        profile_window(_cfg(profile_start_step=0))
    with pytest.raises(ConfigError, match=r"train\.profile_steps=0"):
        profile_window(_cfg(profile_steps=0))


def test_span_arithmetic():
    assert merge([(3, 4), (0, 1), (0.5, 2)]) == [(0, 2), (3, 4)]
    assert subtract((0, 10), [(1, 2), (5, 12)]) == [(0, 1), (2, 5)]
    assert subtract((0, 10), [(-5, 1), (20, 30)]) == [(1, 10)]


def test_named_range_is_free_without_profiler():
    assert named_range("comm", "dp", "all_reduce") is _NO_RANGE
    import torch

    with torch.profiler.profile() as prof:
        with named_range("comm", "dp", "all_reduce"):
            torch.ones(2).sum()
    assert any(e.name == "comm/dp/all_reduce" for e in prof.events())


def test_pipeline_actions_keep_each_step_on_its_own_clock_offset():
    """The profiler's ranges onto the timeline's perf_counter clock, step by step: two steps whose
    clock offsets differ by 5 ms (a loaded machine), each with an action ending 1 ms before its
    step does: both kept, inside their own step, at their times (one median offset for both put
    the later step's last action past its end and dropped it)."""
    from types import SimpleNamespace

    from mpoverlap.training.profiling import pipeline_actions

    def event(name, start_s, end_s):  # the profiler's microseconds from its own start
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start_s * 1e6, end=end_s * 1e6))

    events = [event("step/1", 0.0, 0.100), event("pp/F(mb0,v0)", 0.010, 0.050), event("pp/W(mb0,v0)", 0.060, 0.099),
              event("step/2", 0.200, 0.300), event("pp/F(mb0,v0)", 0.210, 0.250), event("pp/W(mb0,v0)", 0.260, 0.299),
              event("step/3", 0.400, 0.500), event("pp/W(mb0,v0)", 0.460, 0.499)]
    steps = [{"step": 1, "begin": 10.0, "end": 10.1}, {"step": 2, "begin": 10.205, "end": 10.305},
             {"step": 3, "begin": 10.4, "end": 10.5}]
    actions = pipeline_actions(events, steps)
    assert [(a["step"], a["action"]) for a in actions] == [(1, "F"), (1, "W"), (2, "F"), (2, "W"), (3, "W")]
    for a in actions:
        s = steps[a["step"] - 1]
        assert s["begin"] <= a["begin"] <= a["end"] <= s["end"], (a, s)
    assert actions[3]["end"] == pytest.approx(10.304)
