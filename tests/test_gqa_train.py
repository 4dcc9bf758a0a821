"""Grouped-query attention end to end: every parallel mode reproduces the single-process loss
curve, and context parallelism moves only the K/V groups.

Trainers are built inside one spawn per world size (tests/inproc_train.py). A Llama-shaped
model (8 heads, head dim 8) with model.num_query_groups = 1 (MQA) and 2 trains STEPS = 4 steps at tp 2 + SP, cp 2 and cp 4 (ring and all-to-all, on the fused block kernels),
cp 2 x tp 2 + SP, pp 2 x vpp 2, and, on an MoE model with GQA, ep 2, ep 4 and the composed
dp 2 x tp 2 x pp 2 x ep 2; each against the single-process run of the same model, seed and global batch (losses and grad norms within 1e-5 relative). tp 2 needs
tp | groups (K/V heads are never replicated: the rule tp.divides_query_groups), and all-to-all
cp needs cp | groups: those cases are the validator's, not skipped silently (checked below).
model.num_query_groups = 8 (= the heads) is multi-head attention, the model every other parity
test trains at these layouts (tests/test_train_cli.py): it builds the same model as null (checked
below, in process), so it is not trained again here.
"""
import sys
from pathlib import Path

import pytest

from mpoverlap.config import compose
from mpoverlap.overlap.estimate import estimate
from mpoverlap.overlap.rules import validate

sys.path.insert(0, str(Path(__file__).parent))
from inproc_train import train_layouts  # noqa: E402
from test_train_cli import assert_close  # noqa: E402

BASE = ["model=llama_tiny", "model.num_layers=4", "model.hidden_size=64", "model.num_attention_heads=8",
        "model.ffn_hidden_size=128", "model.seq_length=64", "train.global_batch_size=8",
        "train.micro_batch_size=2", "train.log_interval=1", "data.max_bytes=300000", "overlap.dp_bucket_mb=0.05",
        "train.progress=false", "train.eval_iters=1"]
MOE = ["model.num_experts=4", "model.moe_top_k=2", "model.moe_ffn_hidden_size=64"]
GROUPS = (1, 2)
LAYOUTS = {  # name: (world, overrides, model family)
    "tp2_sp": (2, ["parallel.tp=2", "parallel.sequence_parallel=true", "overlap.tp=true"], "dense"),
    "cp2_ring": (2, ["parallel.cp=2", "parallel.cp_comm=p2p", "overlap.cp=true"], "dense"),
    "cp2_a2a": (2, ["parallel.cp=2", "parallel.cp_comm=a2a"], "dense"),
    "pp2_vpp2": (2, ["parallel.pp=2", "parallel.vpp=2", "overlap.pp=true"], "dense"),
    # cp 4 (ring and all-to-all) and cp 2 x tp 2 + SP: the fused block kernels at every cp layout.
    "cp4_ring": (4, ["parallel.cp=4", "overlap.cp=true"], "dense"),
    "cp4_a2a": (4, ["parallel.cp=4", "parallel.cp_comm=a2a"], "dense"),
    "tp2_cp2_sp": (4, ["parallel.tp=2", "parallel.cp=2", "parallel.sequence_parallel=true", "overlap.cp=true"],
                   "dense"),
    "ep2": (2, ["parallel.dp=2", "parallel.ep=2", "overlap.ep=true", "overlap.ep_chunks=4"], "moe"),
    "ep4": (4, ["parallel.dp=4", "parallel.ep=4", "overlap.ep=true", "overlap.ep_chunks=4"], "moe"),
    "dp2_tp2_pp2_ep2": (8, ["parallel.dp=2", "parallel.tp=2", "parallel.pp=2", "parallel.ep=2",
                            "parallel.sequence_parallel=true", "overlap.dp=true", "overlap.tp=true",
                            "overlap.pp=true", "overlap.ep=true", "overlap.ep_chunks=4"], "moe"),
}
# The ring's bytes with 8 K/V groups out of 32 heads (head dim 4) against multi-head attention.
RING32 = ["model.hidden_size=128", "model.num_attention_heads=32", "parallel.cp=2", "parallel.cp_comm=p2p"]


def overrides(groups, family, layout=()):
    return [*BASE, f"model.num_query_groups={groups}", *(MOE if family == "moe" else []), *layout]


def accepted(world, ov):
    return not validate(compose(ov), world)


STEPS = 4  # as tests/test_pairing.py STEPS: a wrong gradient shows at the first step already


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    specs = {}
    for groups in GROUPS:
        for family in ("dense", "moe"):
            specs[f"ref_{family}_g{groups}"] = (1, overrides(groups, family), STEPS)
        for name, (world, layout, family) in LAYOUTS.items():
            ov = overrides(groups, family, layout)
            if accepted(world, ov):
                specs[f"{name}_g{groups}"] = (world, ov, STEPS)
    for groups in (8, "null"):
        specs[f"ring32_g{groups}"] = (2, [*BASE, *RING32, f"model.num_query_groups={groups}"], 2)
    return train_layouts(specs, tmp_path_factory.mktemp("gqa"))


@pytest.mark.slow
def test_gqa_layouts_reproduce_the_single_process_reference(runs):
    trained = 0
    for groups in GROUPS:
        for name, (world, layout, family) in LAYOUTS.items():
            key = f"{name}_g{groups}"
            if key not in runs:
                # Refused by a rule with a fix (never silently run another way): tp needs tp |
                # groups, the all-to-all variant cp | groups.
                problems = validate(compose(overrides(groups, family, layout)), world)
                assert {p.rule for p in problems} <= {"tp.divides_query_groups", "cp.a2a_heads_divisible"}, key
                assert problems and all(p.fix for p in problems), key
                continue
            ref = runs[f"ref_{family}_g{groups}"]
            assert len(ref) == STEPS and ref[-1]["loss"] < ref[0]["loss"]
            assert_close([r["loss"] for r in runs[key]], [r["loss"] for r in ref])
            assert_close([r["grad_norm"] for r in runs[key]], [r["grad_norm"] for r in ref])
            trained += 1
    # MQA runs everywhere but the tp 2 layouts (tp2_sp, tp2_cp2_sp, the composed one) and the
    # all-to-all ones (cp2, cp4); 2 groups everywhere but cp4 a2a.
    assert trained == (len(LAYOUTS) - 5) + (len(LAYOUTS) - 1)
    # The models differ: fewer groups, fewer parameters, another curve.
    assert runs["ref_dense_g1"][0]["loss"] != runs["ref_dense_g2"][0]["loss"]


def test_groups_equal_to_the_heads_is_multi_head_attention():
    """num_query_groups = heads builds the multi-head model (null): the same parameters, bitwise,
    and the same logits; the single-process first loss of 2 groups differs from it."""
    import torch

    from mpoverlap.models.gpt import GPT

    def model(groups):
        return GPT(compose([*overrides(groups, "dense")]).model, seed=3)

    mha, g8, g2 = model("null"), model(8), model(2)
    assert {k: v.shape for k, v in mha.state_dict().items()} == {k: v.shape for k, v in g8.state_dict().items()}
    assert all(torch.equal(v, g8.state_dict()[k]) for k, v in mha.state_dict().items())
    tokens = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    assert torch.equal(mha(tokens), g8(tokens))
    assert sum(p.numel() for p in g2.parameters()) < sum(p.numel() for p in mha.parameters())


@pytest.mark.slow
def test_ring_moves_a_quarter_with_8_of_32_groups(runs):
    """32 heads over 8 K/V groups: the ring's measured bytes per step are a quarter of multi-head
    attention's, and mpoverlap-check's estimate says the same bytes."""
    gqa, mha = runs["ring32_g8"][-1]["comm"]["cp"], runs["ring32_gnull"][-1]["comm"]["cp"]
    assert gqa["ops"] == mha["ops"] and gqa["bytes"] * 4 == mha["bytes"]
    for groups, row in (("8", gqa), ("null", mha)):
        est = estimate(compose([*BASE, *RING32, f"model.num_query_groups={groups}"]), 2).comm_bytes_per_step["cp"]
        assert est == row["bytes"], (groups, est, row["bytes"])
