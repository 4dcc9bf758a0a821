"""Rank arithmetic of the grid, for every layout of world sizes up to 64, without processes."""
import itertools

import pytest

from mpoverlap.parallel.grid import GROUP_KINDS, RankGrid


def layouts(max_world=64):
    for tp, cp, dp, pp in itertools.product([1, 2, 4, 8], [1, 2, 4], [1, 2, 3, 4, 8], [1, 2, 4]):
        if tp * cp * dp * pp > max_world:
            continue
        for ep in range(1, dp * cp + 1):
            if (dp * cp) % ep == 0:
                yield RankGrid(tp=tp, cp=cp, dp=dp, pp=pp, ep=ep)


ALL = list(layouts())


def test_many_layouts_covered():
    assert len(ALL) > 200
    assert max(g.world for g in ALL) == 64


@pytest.mark.parametrize("grid", ALL, ids=str)
def test_partitions_and_coords(grid):
    W = grid.world
    for rank in range(W):
        c = grid.coords(rank)
        assert grid.rank(c.tp, c.cp, c.dp, c.pp) == rank
    sizes = {"tp": grid.tp, "cp": grid.cp, "tp_cp": grid.tp * grid.cp, "dp": grid.dp, "dp_cp": grid.dp * grid.cp, "pp": grid.pp,
             "ep": grid.ep, "edp": grid.edp, "tp_edp": grid.tp * grid.edp, "mp": grid.tp * grid.pp}
    for kind in GROUP_KINDS:
        groups = grid.groups(kind)
        flat = sorted(r for g in groups for r in g)
        if kind == "embedding":
            stages = {0, grid.pp - 1}
            assert flat == sorted(r for r in range(W) if grid.coords(r).pp in stages)
            continue
        if kind.startswith("mtp_"):  # only with a middle mtp_stage (test_mtp_middle_stage.py)
            assert groups == [], kind
            continue
        assert flat == list(range(W)), kind  # a partition of the world
        assert all(len(g) == sizes[kind] for g in groups), kind
    # Members of a group share every other coordinate and cover the group's one in full
    # (pipeline groups in stage order).
    varying = {"tp": ("tp", ("cp", "dp", "pp")), "dp": ("dp", ("tp", "cp", "pp")), "pp": ("pp", ("tp", "cp", "dp")),
               "ep": ("ep", ("tp", "pp", "edp")), "edp": ("edp", ("tp", "pp", "ep"))}
    for kind, (coord, fixed) in varying.items():
        for g in grid.groups(kind):
            cs = [grid.coords(r) for r in g]
            assert len({tuple(getattr(c, f) for f in fixed) for c in cs}) == 1, kind
            values = [getattr(c, coord) for c in cs]
            assert (values if kind == "pp" else sorted(values)) == list(range(getattr(grid, coord))), kind
    # tp_cp: the tp x cp ranks of one (dp, pp), i.e. one replica's sequence holders.
    for g in grid.groups("tp_cp"):
        cs = [grid.coords(r) for r in g]
        assert len({(c.dp, c.pp) for c in cs}) == 1
        assert sorted((c.tp, c.cp) for c in cs) == [(t, c) for t in range(grid.tp) for c in range(grid.cp)]
    # tp_edp: the ranks holding the same experts when they are replicated over tp (one ep rank
    # and stage, every tp and edp rank).
    for g in grid.groups("tp_edp"):
        cs = [grid.coords(r) for r in g]
        assert len({(c.ep, c.pp) for c in cs}) == 1
        assert sorted((c.tp, c.edp) for c in cs) == [(t, k) for t in range(grid.tp) for k in range(grid.edp)]
    # ep x edp tiles exactly the dp x cp ranks of one (tp, pp) slice.
    for g in grid.groups("dp_cp"):
        eps = {r: frozenset(grid.group_of("ep", r)) for r in g}
        assert set().union(*eps.values()) == set(g)


def test_megatron_order_example():
    # tp fastest, then cp, dp, pp: world 16 = tp2 cp2 dp2 pp2.
    g = RankGrid(tp=2, cp=2, dp=2, pp=2, ep=2)
    assert g.groups("tp")[:2] == [[0, 1], [2, 3]]
    assert g.group_of("cp", 0) == [0, 2]
    assert g.group_of("dp", 0) == [0, 4]
    assert g.group_of("pp", 0) == [0, 8]
    assert g.group_of("dp_cp", 0) == [0, 2, 4, 6]
    assert g.group_of("ep", 0) == [0, 2] and g.group_of("edp", 0) == [0, 4]
    assert g.group_of("embedding", 0) == [0, 8]


def test_expert_gradients_span_tp_only_when_replicated_over_tp_under_sp():
    assert RankGrid(tp=2, dp=2).expert_grad_kind(sequence_parallel=True) == "tp_edp"
    assert RankGrid(tp=2, dp=2).expert_grad_kind(sequence_parallel=False) == "edp"  # each tp rank sees every token
    assert RankGrid(tp=2, dp=2, etp=2).expert_grad_kind(sequence_parallel=True) == "edp"  # split, not replicated
    assert RankGrid(dp=2).expert_grad_kind(sequence_parallel=True) == "edp"


def test_invalid_grid_raises():
    with pytest.raises(ValueError):
        RankGrid(dp=2, ep=3)
    with pytest.raises(ValueError):
        RankGrid(tp=0)
    with pytest.raises(ValueError):
        RankGrid(dp=2).coords(2)
