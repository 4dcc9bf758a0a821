"""Property-based checks of the validator (hypothesis): it never crashes, every rejection
names a key with a fix, and accepted layouts of up to 8 ranks train two steps without a hang."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from mpoverlap.config import ConfigError, compose
from mpoverlap.overlap.layout import build_layout
from mpoverlap.overlap.rules import validate

ANY_VALUE = st.one_of(st.integers(-3, 9), st.sampled_from(["auto", "true", "false", "x", "p2p", "a2a", "0"]),
                      st.booleans())
KEYS = ["parallel.tp", "parallel.pp", "parallel.vpp", "parallel.cp", "parallel.ep", "parallel.dp",
        "parallel.sequence_parallel", "parallel.cp_comm", "overlap.dp", "overlap.tp", "overlap.pp", "overlap.cp",
        "overlap.ep", "overlap.dp_param_gather", "overlap.dp_bucket_mb", "train.distributed_optimizer",
        "train.global_batch_size", "train.micro_batch_size", "model.num_layers", "model.num_attention_heads",
        "model.seq_length", "model.num_experts", "model.tie_embeddings", "train.on_nonfinite",
        "model.moe_top_k", "model.moe_layer_freq", "model.moe_capacity_factor", "model.moe_dispatcher",
        "model.shared_expert", "overlap.ep_chunks", "train.profile", "train.profile_steps"]


def _fmt(v):
    return str(v).lower() if isinstance(v, bool) else str(v)


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(KEYS), ANY_VALUE, max_size=8), st.sampled_from([None, 1, 2, 4, 8, 16]))
def test_validator_never_crashes_and_names_keys(assignment, world):
    overrides = [f"{k}={_fmt(v)}" for k, v in assignment.items()]
    try:
        cfg = compose(overrides)
    except ConfigError as err:  # a wrong type: Hydra's message names the key
        assert any(k.split(".")[-1] in str(err) for k in assignment), str(err)
        return
    for problem in validate(cfg, world):
        assert problem.keys and problem.reason and problem.fix
        text = problem.render()
        assert any(key in text for key in problem.keys)


LAYOUT = st.fixed_dictionaries({
    "parallel.tp": st.sampled_from([1, 2, 4]), "parallel.pp": st.sampled_from([1, 2, 4]),
    "parallel.vpp": st.sampled_from([1, 2]), "parallel.cp": st.sampled_from([1, 2]),
    "parallel.dp": st.sampled_from([1, 2, 4]), "parallel.sequence_parallel": st.booleans(),
    "parallel.cp_comm": st.sampled_from(["p2p", "a2a"]), "train.distributed_optimizer": st.booleans(),
    "overlap.dp": st.sampled_from(["auto", "false"]), "overlap.tp": st.sampled_from(["auto", "false"]),
    "overlap.pp": st.sampled_from(["auto", "false"]), "overlap.cp": st.sampled_from(["auto", "false"]),
    "model.tie_embeddings": st.booleans(), "model.num_layers": st.sampled_from([2, 4]),
    "train.micro_batch_size": st.sampled_from([1, 2]), "train.global_batch_size": st.sampled_from([8, 16]),
    "model.num_experts": st.sampled_from([0, 4]), "parallel.ep": st.sampled_from([1, 2]),
    "overlap.ep": st.sampled_from(["auto", "false"]),
})
TINY = ["model.hidden_size=32", "model.num_attention_heads=4", "model.ffn_hidden_size=64", "model.seq_length=32",
        "data.max_bytes=100000", "train.progress=false", "train.eval_iters=1", "overlap.dp_bucket_mb=0.02"]


@pytest.mark.slow
@settings(max_examples=6, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow,
                                                                                  HealthCheck.filter_too_much])
@given(LAYOUT)
def test_accepted_layouts_train_two_steps(tmp_path_factory, layout):
    overrides = TINY + [f"{k}={_fmt(v)}" for k, v in layout.items()]
    cfg = compose(overrides)
    lo = build_layout(cfg)
    assume(lo.world is not None and lo.world <= 8 and not validate(cfg))  # accepted, up to 8 ranks
    run_dir = tmp_path_factory.mktemp("prop")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("RANK", None)
    cmd = [str(Path(sys.executable).parent / "mpoverlap-train"), *overrides, "train.steps=2", f"run.dir={run_dir}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)  # a hang fails here
    assert proc.returncode == 0, f"{' '.join(overrides)}\n{proc.stderr[-2000:]}"
    assert (run_dir / "metrics.jsonl").exists()
    print(f"\n  ran world {lo.world}: {' '.join(f'{k}={v}' for k, v in layout.items())}")
