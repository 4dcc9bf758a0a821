"""The plan's host lines: where each rank runs, which groups cross hosts, and a warning when a
tp group leaves a host (every layer's collectives would ride the inter-node link)."""
from mpoverlap.overlap.placement import crossing_groups, placement_lines
from mpoverlap.parallel.grid import RankGrid
from mpoverlap.training.node_failure import lost_peer

TWO_BY_TWO = ["a", "a", "b", "b"]  # torchrun: consecutive ranks per node


def test_tp_inside_hosts_dp_across():
    grid = RankGrid(tp=2, dp=2)
    assert crossing_groups(grid, TWO_BY_TWO) == {"dp": [[0, 2], [1, 3]]}
    text = "\n".join(placement_lines(grid, TWO_BY_TWO))
    assert "a: ranks 0-1" in text and "b: ranks 2-3" in text
    assert "groups inside a host: tp" in text and "warning" not in text


def test_tp_across_hosts_is_warned_with_a_fix():
    grid = RankGrid(tp=4)
    assert crossing_groups(grid, TWO_BY_TWO) == {"tp": [[0, 1, 2, 3]]}
    text = "\n".join(placement_lines(grid, TWO_BY_TWO))
    assert "warning: parallel.tp=4 groups cross hosts ([0@a, 1@a, 2@b, 3@b])" in text
    assert "parallel.tp=2" in text  # the largest tp that fits a node


def test_one_host_says_so_and_nothing_crosses():
    lines = placement_lines(RankGrid(tp=2, dp=2), ["n"] * 4)
    assert lines == ["  hosts: 1", "    n: ranks 0-3"]


def test_lost_peer_names_the_host_behind_the_address():
    import socket

    me = socket.gethostname()
    hosts = ["localhost", "localhost", me, me]  # "localhost" resolves to 127.0.0.1
    err = RuntimeError("[pair.cc:537] Read error [127.0.0.1]:4711: Connection reset by peer. ...")
    msg = str(lost_peer(err, hosts, rank=2))
    assert msg.startswith("lost host localhost (ranks 0, 1, address 127.0.0.1)"), msg
    assert lost_peer(RuntimeError("shape mismatch"), hosts, 0) is None
