"""The gradient error-feedback residuals in a checkpoint (data_parallel/grad_wire.py).

A residual is per rank, not a shard of one tensor: every holder of a parameter's gradient has
its own. So each parameter's residual is saved as a tensor with one row per holder, the rest
placed like the parameter (layout-free name, tensor-parallel slices at their offsets, experts
under their own names):

    grad_residual.sent.<name>    [R, *shape]  what each holder's reduce-scatter send lost;
                                 R = g (the bucket's reduction group), row = the group rank,
                                 times tp for a weight replicated over tp (its tp ranks hold
                                 different partial gradients under sequence parallelism):
                                 row = tp_rank * g + group rank
    grad_residual.owned.<name>   [T, *shape]  plain data parallelism: the owner's residual of
                                 its reduced shard (the gather's hop), each owner writing its
                                 shard's range; T = tp for a tp-replicated weight, else 1

and `tied_sent` / `tied_owned` for the tied embedding's second copy on the last pipeline stage.
Resumed at the same holders (R), each rank reads its own row back: the run continues exactly.
At another layout each rank reads every row of its range and keeps their sum over its new R:
the residual mass that reaches the weights (the holders' residuals are summed by the reduction)
is kept, split evenly. A checkpoint without residuals (written with error feedback off) leaves
them zero.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Tuple

import torch

from mpoverlap.checkpoint.sharded import ShardedEntry

PREFIX = "grad_residual"


def _holders(ddp, p, b: int, tp_rank: int, tp_size: int) -> Tuple[int, int]:
    """(T, this rank's tp row): a weight replicated over tp has a residual per tp rank."""
    replicated = tp_size > 1 and not getattr(p, "tensor_model_parallel", False) and not ddp.bucket_group(b).spans_tp
    return (tp_size, tp_rank) if replicated else (1, 0)


def residual_views(ddp, tp_rank: int, tp_size: int) -> List[tuple]:
    """[(kind, param, rows, row, 1-D view of the residual of elements [a, b) of param, a, b)]."""
    wire = ddp.wire
    if wire is None or not wire.error_feedback:
        return []
    out = []
    buf = ddp.buffer
    for bucket in buf.buckets:
        b = bucket.index
        if b not in wire.sent:
            continue
        g = ddp.bucket_group(b)
        s_lo, s_hi = bucket.shard_range(g.rank, g.size)
        for p in bucket.params:
            start, end, _ = buf.index[p]
            tied = "tied_" if getattr(p, "pipeline_duplicate", False) else ""
            T, t = _holders(ddp, p, b, tp_rank, tp_size)
            out.append((f"{tied}sent", p, T * g.size, t * g.size + g.rank,
                        wire.sent[b][start - bucket.offset:end - bucket.offset], 0, end - start))
            lo, hi = max(start, s_lo), min(end, s_hi)
            if b in wire.owned and lo < hi:
                out.append((f"{tied}owned", p, T, t, wire.owned[b][lo - s_lo:hi - s_lo], lo - start, hi - start))
    return out


def _per_name(chunks_of, kind_views) -> Dict[str, Dict[str, tuple]]:
    """{kind: {name: (rows, row, shape, [(offsets, view)])}} via `chunks_of(param, view, a, b)`,
    which places a range of a parameter as TrainStateChunks places the parameter."""
    out: Dict[str, Dict[str, tuple]] = {}
    for kind, p, rows, row, view, a, b in kind_views:
        for name, (shape, chunks) in chunks_of(p, view, a, b).items():
            have = out.setdefault(kind, {}).get(name)
            listed = have[3] if have else []
            listed.extend(chunks)
            out[kind][name] = (rows, row, shape, listed)
    return out


def for_save(chunks_of, views) -> Dict[str, Dict[str, ShardedEntry]]:
    out = {}
    for kind, named in _per_name(chunks_of, views).items():
        out[kind] = {name: ShardedEntry((rows, *shape), [((row, *o), v.unsqueeze(0)) for o, v in chunks])
                     for name, (rows, row, shape, chunks) in named.items()}
    return out


def for_load(chunks_of, views, saved: Dict[str, object]) -> Tuple[Dict[str, Dict[str, ShardedEntry]],
                                                                  List[Callable[[], None]]]:
    """Entries to fill in place, and what to run after the load (the sums of another layout's
    rows). `saved`: the checkpoint's metadata {fqn: its metadata (`.size`)}."""
    out, after = {}, []
    for kind, named in _per_name(chunks_of, views).items():
        for name, (rows, row, shape, chunks) in named.items():
            md = saved.get(f"{PREFIX}.{kind}.{name}")
            if md is None:
                continue  # not in the checkpoint: this residual starts at zero
            saved_rows = int(md.size[0])
            if saved_rows == rows:
                entry = [((row, *o), v.unsqueeze(0)) for o, v in chunks]
            else:
                entry = []
                for o, v in chunks:
                    every = torch.zeros((saved_rows, *v.shape), dtype=v.dtype, device=v.device)
                    entry.append(((0, *o), every))
                    after.append(lambda v=v, every=every, rows=rows: v.copy_(every.sum(0) / rows))
            out.setdefault(kind, {})[name] = ShardedEntry((saved_rows, *shape), entry)
    return out, after
