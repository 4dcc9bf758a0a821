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


def main(argv: Optional[List[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-h", "--help"):
        print("usage: mpoverlap-check [--rules] [hydra overrides ...]\n"
              "  validates the configuration and prints the plan; exit 0 valid, 2 invalid")
        return 0
    if "--rules" in args:
        print(rules_table())
        return 0
    try:
        cfg = compose(args)
    except ConfigError as err:
        print(f"mpoverlap: invalid override or key: {err}", file=sys.stderr)
        return EXIT_INVALID
    problems = validate(cfg)
    if problems:
        print(render_problems(problems), file=sys.stderr)
        return EXIT_INVALID
    print(render_plan(cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
