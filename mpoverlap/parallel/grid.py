"""Pure rank arithmetic of the five-dimensional grid; no process groups, no torch.distributed.

Layout (Megatron's default order, fastest-varying first): tp, cp, dp, pp.

    rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

Expert layers re-divide the dp x cp ranks of one (tp, pp) slice into ep x edp: with
c = cp_rank + cp * dp_rank, the expert-parallel rank is c % ep and the expert-data-parallel
rank c // ep, so expert-parallel peers are neighbours (the cheapest link) and expert weights
are replicated over edp = dp * cp / ep ranks.

Expert tensor parallelism (etp = 1 or tp): with etp = tp the experts' FFN is split over the
tp group itself (kind `etp` lists those groups; one-rank groups when etp = 1), so the ep and
edp groups, which never mix tp ranks, stay as above: world = etp x ep x edp x pp x (tp / etp),
and an expert weight's gradient is reduced over edp = world / (ep * tp * pp) ranks holding the
same slice of the same experts. No process group of its own: the layers use the tp group.

With etp = 1 under sequence parallelism every tp rank holds the same whole experts but routes
only its S/tp positions, so an expert's gradient is partial over tp as well as over edp. Kind
`tp_edp` (Megatron's expert-data-parallel group when etp = 1: world / (ep x etp x pp) ranks)
lists the tp x edp ranks holding the same experts; the trainer reduces those gradients over it
in its overlapped data-parallel buckets (`expert_grad_kind`) instead of summing them over tp in
a flat buffer after backward.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List

GROUP_KINDS = ("tp", "cp", "tp_cp", "dp", "dp_cp", "pp", "ep", "edp", "tp_edp", "mp", "embedding",
               "mtp_tied", "mtp_embedding", "mtp_output")
# The kinds of the MTP chunk's copies on a middle stage s (parallel.mtp_stage, 0 < s < pp-1), by
# the stages their groups hold: a tied embedding on {0, s, pp-1}, an untied one on {0, s}, the
# untied output layer on {s, pp-1} (training/pipeline_ties.py). No groups for another mtp_stage.
MTP_GROUP_STAGES = {"mtp_tied": lambda s, last: (0, s, last), "mtp_embedding": lambda s, last: (0, s),
                    "mtp_output": lambda s, last: (s, last)}
# Kinds the grid describes whose communicators are another kind's (etp: the tp group).
ALIAS_KINDS = ("etp",)


@dataclass(frozen=True)
class RankCoords:
    tp: int
    cp: int
    dp: int
    pp: int
    ep: int
    edp: int


@dataclass(frozen=True)
class RankGrid:
    """Sizes of each dimension. `world == tp * cp * dp * pp`; `ep` divides `dp * cp`.
    `mtp_stage`: the stage of an MTP chunk of its own (parallel.mtp_stage; -1 none), for the
    mtp_* kinds."""

    tp: int = 1
    cp: int = 1
    dp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    mtp_stage: int = -1

    def __post_init__(self) -> None:
        # Internal invariant: user-facing checks with fixes live in the rule engine, which runs
        # before a grid is ever built.
        for name in ("tp", "cp", "dp", "pp", "ep"):
            if getattr(self, name) < 1:
                raise ValueError(f"RankGrid.{name} must be >= 1, got {getattr(self, name)}")
        if (self.dp * self.cp) % self.ep:
            raise ValueError(f"ep={self.ep} must divide dp*cp={self.dp * self.cp}")
        if self.etp not in (1, self.tp):
            raise ValueError(f"etp={self.etp} must be 1 or tp={self.tp}")

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def edp(self) -> int:
        return self.dp * self.cp // self.ep

    def expert_grad_kind(self, sequence_parallel: bool) -> str:
        """The group kind expert weights' gradients are reduced (and, under ZeRO, sharded) over:
        `tp_edp` when they are partial over tp (etp = 1, tp > 1, sequence parallelism: each tp
        rank routed only its S/tp positions through the same whole experts), else `edp`."""
        return "tp_edp" if self.tp > 1 and self.etp == 1 and sequence_parallel else "edp"

    def rank(self, tp: int = 0, cp: int = 0, dp: int = 0, pp: int = 0) -> int:
        return tp + self.tp * (cp + self.cp * (dp + self.dp * pp))

    def coords(self, rank: int) -> RankCoords:
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} outside world of {self.world}")
        tp = rank % self.tp
        rest = rank // self.tp
        cp = rest % self.cp
        rest //= self.cp
        dp = rest % self.dp
        pp = rest // self.dp
        c = cp + self.cp * dp
        return RankCoords(tp=tp, cp=cp, dp=dp, pp=pp, ep=c % self.ep, edp=c // self.ep)

    def _rank_from_c(self, tp: int, c: int, pp: int) -> int:
        return self.rank(tp=tp, cp=c % self.cp, dp=c // self.cp, pp=pp)

    def groups(self, kind: str) -> List[List[int]]:
        """Every group of `kind`, each a sorted list of global ranks; together they partition
        the world (except `embedding`, which covers the first and last pipeline stage only, and
        the mtp_* kinds, MTP_GROUP_STAGES' stages, with a middle `mtp_stage` only)."""
        if kind not in GROUP_KINDS + ALIAS_KINDS:
            raise ValueError(f"unknown group kind {kind!r}; one of {GROUP_KINDS + ALIAS_KINDS}")
        T, C, D, P, E = self.tp, self.cp, self.dp, self.pp, self.ep
        out: List[List[int]] = []
        if kind == "etp":
            return self.groups("tp") if self.etp > 1 else [[r] for r in range(self.world)]
        if kind == "tp":
            out = [[self.rank(t, c, d, p) for t in range(T)] for p in range(P) for d in range(D) for c in range(C)]
        elif kind == "cp":
            out = [[self.rank(t, c, d, p) for c in range(C)] for p in range(P) for d in range(D) for t in range(T)]
        elif kind == "tp_cp":  # the ranks that together hold one replica's sequences
            out = [[self.rank(t, c, d, p) for c in range(C) for t in range(T)] for p in range(P) for d in range(D)]
        elif kind == "dp":
            out = [[self.rank(t, c, d, p) for d in range(D)] for p in range(P) for c in range(C) for t in range(T)]
        elif kind == "dp_cp":
            out = [[self.rank(t, c, d, p) for d in range(D) for c in range(C)] for p in range(P) for t in range(T)]
        elif kind == "pp":
            out = [[self.rank(t, c, d, p) for p in range(P)] for d in range(D) for c in range(C) for t in range(T)]
        elif kind == "ep":
            out = [
                [self._rank_from_c(t, e + E * k, p) for e in range(E)]
                for p in range(P) for t in range(T) for k in range(self.edp)
            ]
        elif kind == "edp":
            out = [
                [self._rank_from_c(t, e + E * k, p) for k in range(self.edp)]
                for p in range(P) for t in range(T) for e in range(E)
            ]
        elif kind == "tp_edp":
            out = [
                [self._rank_from_c(t, e + E * k, p) for k in range(self.edp) for t in range(T)]
                for p in range(P) for e in range(E)
            ]
        elif kind == "mp":
            out = [
                [self.rank(t, c, d, p) for p in range(P) for t in range(T)] for d in range(D) for c in range(C)
            ]
        elif kind == "embedding":
            stages = sorted({0, P - 1})
            out = [[self.rank(t, c, d, p) for p in stages] for d in range(D) for c in range(C) for t in range(T)]
        elif kind in MTP_GROUP_STAGES and 0 < self.mtp_stage < P - 1:
            stages = MTP_GROUP_STAGES[kind](self.mtp_stage, P - 1)
            out = [[self.rank(t, c, d, p) for p in stages] for d in range(D) for c in range(C) for t in range(T)]
        return [sorted(g) for g in out]

    def group_of(self, kind: str, rank: int) -> List[int]:
        """The ranks of `rank`'s group of `kind` (empty for `embedding` on a middle stage, and
        for an mtp_* kind on a stage its groups leave out)."""
        for group in self.groups(kind):
            if rank in group:
                return group
        return []

    def describe(self) -> Dict[str, List[List[int]]]:
        return {kind: self.groups(kind) for kind in GROUP_KINDS + ALIAS_KINDS}
