"""Multi-token prediction on the first stage of the loop layouts (parallel.mtp_stage=0 with
1f1b, interleaved or zb1p): the depths become an extra terminal model chunk on stage 0 (the
"loop_mtp" layout, pipeline/actions.py). Pure schedule checks here (no processes): the tables
with the MTP chunk validate and run in the timed simulation for every pp, vpp and microbatch
count tried."""
import pytest

from mpoverlap.pipeline import build_schedule
from mpoverlap.pipeline.actions import BACKWARD, FORWARD, LOOP_MTP, WEIGHT, layout_of_tables
from mpoverlap.pipeline.schedules import _timed_run
from mpoverlap.pipeline.validate import validate_schedule

GRID = [(kind, pp, vpp, m) for kind, vpps in (("1f1b", (1,)), ("interleaved", (2,)), ("zb1p", (1, 2)))
        for pp in (2, 3, 4) for vpp in vpps for m in (1, 2, 3, 4, 5, 8) if vpp == 1 or m >= pp]


@pytest.mark.parametrize("kind,pp,vpp,m", GRID)
def test_tables_with_the_mtp_chunk_validate_and_simulate(kind, pp, vpp, m):
    tables = build_schedule(kind, pp, vpp, m, mtp_chunk=True)
    validate_schedule(tables)
    _timed_run(tables, 1, 1, 1)
    assert layout_of_tables(tables) == LOOP_MTP
    N = pp * vpp
    mtp = [a for a in tables[0] if a.chunk == N]
    assert sorted((a.kind, a.microbatch) for a in mtp) == sorted((k, mb) for mb in range(m) for k in (FORWARD, BACKWARD))
    assert not any(a.kind == WEIGHT and a.chunk == N for a in tables[0])  # the MTP chunk's B is a full one
    head = [a for a in tables[pp - 1] if a.chunk == N - 1 and a.kind == FORWARD]
    assert all(a.send is not None and a.send.dst_chunk == N for a in head)  # the head chunk sends on
    for stage in range(1, pp):
        assert all(a.chunk < N for a in tables[stage])


def test_the_checker_sees_a_missing_mtp_backward():
    from mpoverlap.pipeline.actions import ScheduleError

    tables = build_schedule("1f1b", 2, 1, 2, mtp_chunk=True)
    broken = [list(t) for t in tables]
    broken[0] = [a for a in broken[0] if not (a.chunk == 2 and a.kind == BACKWARD and a.microbatch == 1)]
    with pytest.raises(ScheduleError, match="appears 0 times"):
        validate_schedule(broken)
