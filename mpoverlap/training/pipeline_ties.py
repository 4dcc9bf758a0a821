"""Weights held more than once in the pipeline, and the sum of their copies' gradients.

`pipeline_glue.pipeline_ties` names them, each with the group kind its copies span: the
embedding of a tied head or of MTP depths on the last stage (copies on the first and the last
stage, "embedding"), and in the loop_mtp layouts (parallel.mtp_stage=s < pp-1 in a loop
schedule) the MTP chunk's copies on stage s of the embedding and of an untied output layer: with
s = 0 beside chunk 0's embedding, the output layer over "embedding"; with a middle s over the
groups of the stages holding the copies ("mtp_tied" = {0, s, pp-1} for a tied head,
"mtp_embedding" = {0, s} and "mtp_output" = {s, pp-1} untied; parallel/grid.py). After the
data-parallel reduction each copy's gradient becomes the sum over every copy: on the stage
first (two copies of one rank), then over the name's group where the copies span stages. Every copy is a bucket of its own (`own_buckets`, at every
ZeRO level; under ZeRO-3 gathered with each unit that reads it), so under ZeRO-1/2/3 the reduced
shards of the copies are alike and add up element by element; the optimizer
then makes the same update to each, and they stay equal. The group sum is comm/'s all_reduce,
as the ledger records it (mode "pp").
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from mpoverlap.comm import all_reduce


class PipelineTies:
    """`named`: (layout-free name, parameter) of this rank's chunks, duplicates included;
    `ties`: {name: the group kind its copies span, None for one stage} (pipeline_ties)."""

    def __init__(self, named: List[Tuple[str, nn.Parameter]], ties: Dict[str, Optional[str]]) -> None:
        copies: Dict[str, List[nn.Parameter]] = {}
        for name, p in named:
            if name in ties and all(q is not p for q in copies.get(name, [])):
                copies.setdefault(name, []).append(p)
        # a name held once on a stage whose group sum is not needed has nothing to add
        self.copies = {n: ps for n, ps in copies.items() if ties[n] or len(ps) > 1}
        self.spans = {n: ties[n] for n in self.copies}

    @property
    def params(self) -> List[nn.Parameter]:
        return [p for ps in self.copies.values() for p in ps]

    def __bool__(self) -> bool:
        return bool(self.copies)

    @torch.no_grad()
    def fill_copies(self) -> None:
        """The copies of a weight whose original this rank holds set to it (after a load that
        fills weights by name: params_by_name keeps the originals)."""
        for params in self.copies.values():
            original = next((p for p in params if not getattr(p, "pipeline_duplicate", False)), None)
            for p in params:
                if original is not None and p is not original:
                    p.copy_(original)

    def sum_grads(self, ddp: Any, group_of: Callable[[str], Any], ledger: Any) -> None:
        """Each copy's reduced gradient (ddp.reduced_grads) becomes the sum over all copies;
        `group_of(kind)`: this rank's process group of a kind (ParallelState.group)."""
        for name, params in self.copies.items():
            grads = ddp.reduced_grads(params)
            total = grads[0]
            if len(grads) > 1:
                total = torch.stack(grads).sum(0)
            group = group_of(self.spans[name]) if self.spans[name] else None
            if group is not None:
                all_reduce(total, group, mode="pp", ledger=ledger).wait()
            for g in grads:
                if g is not total:
                    g.copy_(total)
