"""`mpoverlap-check [overrides]`: validate and print the plan; no process group is created.

Exit 0 when the configuration can run, 2 when it cannot (every problem listed).
"""
from __future__ import annotations

import sys
from typing import List, Optional

from mpoverlap.config import ConfigError, compose
from mpoverlap.overlap.plan import render_plan, render_problems
from mpoverlap.overlap.rules import all_rules, validate

EXIT_INVALID = 2


def rules_table() -> str:
    rows = ["| rule | mode | keys | what it checks |", "| --- | --- | --- | --- |"]
    for r in all_rules():
        rows.append(f"| `{r.id}` | {r.mode} | {', '.join(f'`{k}`' for k in r.keys)} | {r.summary} |")
    return "\n".join(rows)


README_MARKERS = ("<!-- rules:start -->\n", "\n<!-- rules:end -->")


def write_readme_rules(path: str) -> None:
    """Replace the rule reference between the README's markers with the registry's table."""
    from pathlib import Path

    start, end = README_MARKERS
    text = Path(path).read_text()
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    Path(path).write_text(head + start + rules_table() + end + tail)


def compose_or_report(args: List[str]):
    """The composed config, or None after printing why the overrides do not compose."""
    try:
        return compose(args)
    except ConfigError as err:
        print(f"mpoverlap: invalid override or key: {err}", file=sys.stderr)
        return None


def main(argv: Optional[List[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-h", "--help"):
        print("usage: mpoverlap-check [--rules [--write-readme README.md]] [--korthikanti] [--simulate | --search "
              "[--top N]] [hydra overrides ...]\n"
              "  validates the configuration and prints the plan; exit 0 valid, 2 invalid\n"
              "  --korthikanti: count activations as Korthikanti et al. 2022 Table 2 does (16-bit, dropout\n"
              "    masks, no flash attention) instead of as this code saves them (compute dtype, flash, no dropout)\n"
              "  --simulate: predict the step time, bubble, each mode's in-flight and exposed time, tokens/s and\n"
              "    MFU on hardware=<preset> (h100_sxm, a100_80gb, h200_sxm, measured)\n"
              "  --search: rank the layouts of parallel.world_size=N by predicted throughput on hardware=<preset>")
        return 0
    if "--rules" in args:
        if "--write-readme" in args:
            write_readme_rules(args[args.index("--write-readme") + 1])
        else:
            print(rules_table())
        return 0
    conventions = None
    if "--korthikanti" in args:
        from mpoverlap.overlap.estimate import Conventions

        args.remove("--korthikanti")
        conventions = Conventions.korthikanti()
    mode = next((a for a in ("--simulate", "--search") if a in args), None)
    if mode:
        args.remove(mode)
        from mpoverlap.simulate.cli import run

        return run(mode, args)
    cfg = compose_or_report(args)
    if cfg is None:
        return EXIT_INVALID
    problems = validate(cfg)
    if problems:
        print(render_problems(problems), file=sys.stderr)
        return EXIT_INVALID
    print(render_plan(cfg, conventions=conventions))
    return 0


if __name__ == "__main__":
    sys.exit(main())
