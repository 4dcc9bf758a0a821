"""overlap.dp_bucket_mb=auto (simulate/bucket_size.py): the simulator's fastest candidate size,
printed with its reason by mpoverlap-check, searched by --search; a number is used as given."""
from __future__ import annotations

import re

import pytest

from mpoverlap.check import main
from mpoverlap.config import compose
from mpoverlap.overlap.rules import validate
from mpoverlap.simulate.bucket_size import CANDIDATES_MB, choose_bucket_mb, resolve_bucket_mb
from mpoverlap.simulate.core import simulate
from mpoverlap.simulate.hardware import from_config
from mpoverlap.simulate.plain import plain, with_values

LLAMA_64_H100 = ["model=llama3_8b", "hardware=h100_sxm", "parallel.world_size=64", "parallel.tp=8",
                 "parallel.sequence_parallel=true", "train.micro_batch_size=2"]
BUCKET_LINE = re.compile(r"overlap\.dp_bucket_mb\s+(\S+) -> ([0-9.]+) MiB\s+(.*)")


def test_check_prints_the_chosen_size_for_llama3_8b_on_64_h100(capsys):
    assert main(LLAMA_64_H100) == 0
    found = BUCKET_LINE.search(capsys.readouterr().out)
    assert found, "the plan names the bucket size"
    requested, mb, reason = found.groups()
    assert requested == "auto" and float(mb) in CANDIDATES_MB
    assert "predicted on h100_sxm" in reason and "dp exposed" in reason
    # the size printed is the simulator's fastest candidate
    cfg = compose(LLAMA_64_H100)
    hw = from_config(cfg)
    steps = {m: simulate(with_values(plain(cfg), {"overlap.dp_bucket_mb": float(m)}), hw).step_s for m in CANDIDATES_MB}
    assert steps[float(mb)] == min(steps.values())
    assert max(steps.values()) > 1.05 * min(steps.values()), "the size matters for this model and link"


def test_a_number_is_used_as_given(capsys):
    assert main([*LLAMA_64_H100, "overlap.dp_bucket_mb=4"]) == 0
    requested, mb, reason = BUCKET_LINE.search(capsys.readouterr().out).groups()
    assert (requested, float(mb), reason) == ("4", 4.0, "as set")
    assert resolve_bucket_mb(compose(["overlap.dp_bucket_mb=0.25"])).mb == 0.25


def test_the_choice_follows_the_link():
    """A slower link latency per collective step favours fewer, larger buckets."""
    base = ["model=llama3_1b", "hardware=h100_sxm", "parallel.dp=16", "parallel.world_size=16",
            "train.global_batch_size=32", "train.micro_batch_size=2"]
    chosen = []
    for latency in (1e-6, 1e-3):
        cfg = compose([*base, f"hardware.inter_latency={latency}", f"hardware.intra_latency={latency}"])
        chosen.append(choose_bucket_mb(cfg, from_config(cfg)).mb)
    assert chosen[0] < chosen[1], chosen


@pytest.mark.parametrize("value, ok", [("auto", True), ("16", True), ("0", False), ("big", False)])
def test_the_rule_takes_auto_or_a_positive_size(value, ok):
    problems = [p for p in validate(compose([f"overlap.dp_bucket_mb={value}"])) if p.rule == "dp.bucket_size"]
    assert (not problems) == ok, problems


def test_search_includes_the_bucket_size(capsys):
    assert main(["--search", "model=gpt_tiny", "hardware=h100_sxm", "parallel.world_size=4", "--top", "3"]) == 0
    out = capsys.readouterr().out
    ranked = [line for line in out.splitlines() if re.match(r"\s+\d+ \| tp", line)]
    assert ranked and all("bucket=" in line for line in ranked), out
    assert "overlap.dp_bucket_mb=" in out  # the best layout's overrides carry it
