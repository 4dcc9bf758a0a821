"""`mpoverlap-check --simulate` and `--search` (check.py hands the arguments over)."""
from __future__ import annotations

import sys
from typing import List

from mpoverlap.check import EXIT_INVALID, compose_or_report


def run(mode: str, args: List[str]) -> int:
    from mpoverlap.overlap.plan import render_problems
    from mpoverlap.overlap.rules import validate
    from mpoverlap.simulate.core import simulate
    from mpoverlap.simulate.hardware import from_config, fp8_speedup
    from mpoverlap.simulate.planner import parse_top, render_search, search
    from mpoverlap.simulate.report import render

    top, args = parse_top(args)
    from mpoverlap.config import ConfigError

    cfg = compose_or_report(args)
    if cfg is None:
        return EXIT_INVALID
    hw = from_config(cfg)
    try:
        fp8_speedup(cfg, hw)  # a preset without FP8 GEMMs refuses train.precision=fp8 here
    except ConfigError as err:
        print(f"mpoverlap: {err}", file=sys.stderr)
        return EXIT_INVALID
    if mode == "--search":
        from mpoverlap.overlap.layout import as_positive_int

        world = as_positive_int(cfg.parallel.world_size)
        if world is None:
            print("mpoverlap: --search needs parallel.world_size=N (the number of GPUs to plan for)", file=sys.stderr)
            return EXIT_INVALID
        print(render_search(cfg, hw, search(cfg, hw, args, world), world, top))
        return 0
    problems = validate(cfg)
    if problems:
        print(render_problems(problems), file=sys.stderr)
        return EXIT_INVALID
    from mpoverlap.simulate.formats import format_lines

    result = simulate(cfg, hw)
    print("\n".join([render(cfg, hw, result), *format_lines(cfg, hw, args, result)]))
    return 0
