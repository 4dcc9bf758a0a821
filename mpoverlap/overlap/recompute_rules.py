"""Activation-recomputation rules (model.recompute, model.recompute_num_layers).

Recomputation composes with every mode (see mpoverlap/recompute/checkpointing.py): the
replayed forward issues and waits its TP, CP and EP handles exactly as the first forward does,
inside the block, so nothing is in flight across the replay's boundary and no rule ties
recomputation to an overlap mode. Only the keys' own values are checked.
"""
from __future__ import annotations

from mpoverlap.overlap.layout import Layout
from mpoverlap.overlap.rules import Problem, rule
from mpoverlap.recompute import RECOMPUTE_MODES


@rule("recompute.values", "general", ("model.recompute", "model.recompute_num_layers"),
      "recomputation is none|selective|full; recompute_num_layers (full only) is positive or null")
def _values(lo: Layout):
    m = lo.cfg.model
    if m.recompute not in RECOMPUTE_MODES:
        yield Problem("recompute.values", {"model.recompute": m.recompute},
                      f"must be one of {'|'.join(RECOMPUTE_MODES)}", ["model.recompute=none"])
    n = m.recompute_num_layers
    if n is not None and n < 1:
        yield Problem("recompute.values", {"model.recompute_num_layers": n},
                      "the number of blocks recomputed per pipeline chunk must be at least 1 (or null: all)",
                      ["model.recompute_num_layers=null"])
    elif n is not None and m.recompute != "full":
        # Asked for, it would otherwise be silently ignored.
        yield Problem("recompute.values", {"model.recompute_num_layers": n, "model.recompute": m.recompute},
                      "recompute_num_layers chooses how many whole blocks full recomputation replays; "
                      "with model.recompute other than full it would have no effect",
                      ["model.recompute=full"] if m.recompute in ("none", "full")
                      else ["model.recompute_num_layers=null"])
