"""Sharded checkpoints, single process: the box arithmetic against tensor_parallel's own
slicing, and DCP round trips where the saving and the loading chunkings differ.

The multi-rank acceptance (ZeRO-3 at dp4 <-> tp2 x pp2 <-> dp2 x tp2 without sharding, no full
copy during a save, checkpoints written with full tensors) is in tests/test_zero.py's world-4
spawn."""
import itertools
import math
import random
import warnings

import pytest
import torch

from mpoverlap.checkpoint import ShardedEntry, ShardedLoadPlanner, ShardedSavePlanner
from mpoverlap.checkpoint.boxes import Partition, box_flat_start, flat_range_boxes
from mpoverlap.checkpoint.train_state import range_chunks
from mpoverlap.tensor_parallel.layers import shard_tensor


def test_flat_range_boxes_by_hand():
    # [2, 9) of a 3 x 4 tensor: the rest of row 0, row 1, the first element of row 2.
    assert flat_range_boxes((3, 4), 2, 9) == [((0, 2), (1, 2)), ((1, 0), (1, 4)), ((2, 0), (1, 1))]
    assert flat_range_boxes((3, 4), 4, 12) == [((1, 0), (2, 4))]
    assert flat_range_boxes((3, 4), 5, 7) == [((1, 1), (1, 2))]
    assert flat_range_boxes((3, 4), 3, 3) == []
    # 3-D: [5, 19) of 2 x 3 x 4 (19 = 12 + 4 + 3): row (0, 1) from column 1, row (0, 2), row
    # (1, 0), then row (1, 1) up to column 3.
    assert flat_range_boxes((2, 3, 4), 5, 19) == [((0, 1, 1), (1, 1, 3)), ((0, 2, 0), (1, 1, 4)),
                                                  ((1, 0, 0), (1, 1, 4)), ((1, 1, 0), (1, 1, 3))]
    with pytest.raises(ValueError):
        flat_range_boxes((3, 4), 0, 13)


def test_partition_maps_fused_blocks_by_hand():
    # qkv rows [q 8 | k 2 | v 2] over tp 2: rank 1 holds q rows 4-7, k row 9, v row 11.
    part = Partition.of((6, 3), 0, 1, 2, (8, 2, 2))
    assert part.global_shape((6, 3)) == (12, 3)
    pairs = part.to_global(((2, 0), (4, 3)))  # local rows 2-5
    assert pairs == [(((6, 0), (2, 3)), ((2, 0), (2, 3))), (((9, 0), (1, 3)), ((4, 0), (1, 3))),
                     (((11, 0), (1, 3)), ((5, 0), (1, 3)))]
    # A row-parallel weight: columns 3-5 of 6 on rank 1; a box of local columns 1-2.
    assert Partition.of((2, 3), 1, 1, 2).to_global(((0, 1), (2, 2))) == [(((0, 4), (2, 2)), ((0, 1), (2, 2)))]
    assert Partition().to_global(((1, 2), (3, 4))) == [(((1, 2), (3, 4)), ((1, 2), (3, 4)))]


CASES = [((12, 5), 0, 2, (8, 2, 2)), ((12, 5), 0, 2, 1), ((6, 8), 1, 2, 1), ((8, 4), 0, 4, 2),
         ((4, 6, 8), 2, 2, 1), ((16,), 0, 4, 1), ((7, 3), None, 1, 1)]


@pytest.mark.parametrize("full_shape,dim,size,blocks", CASES)
def test_every_rank_and_range_lands_on_its_full_tensor_elements(full_shape, dim, size, blocks):
    """Each tp rank's slice (shard_tensor, the layers' own slicing), cut into the flat ranges a
    data-parallel split makes, is placed at exactly its elements of the full tensor, and all
    ranks' chunks together cover every element once."""
    full = torch.arange(math.prod(full_shape), dtype=torch.float64).reshape(full_shape)
    covered = torch.zeros(full_shape, dtype=torch.int64)
    rng = random.Random(0)
    for rank in range(size):
        local = full if dim is None else shard_tensor(full, dim, rank, size, blocks)
        part = Partition.of(local.shape, dim, rank, size, blocks)
        assert part.global_shape(local.shape) == tuple(full_shape)
        n = local.numel()
        cuts = sorted({0, n, *(rng.randrange(n) for _ in range(3))})
        for a, b in itertools.pairwise(cuts):
            flat = local.reshape(-1)[a:b]
            for offsets, chunk in range_chunks(flat, local.shape, part, a, b):
                index = tuple(slice(o, o + s) for o, s in zip(offsets, chunk.shape))
                assert torch.equal(full[index], chunk), (rank, a, b, offsets)
                covered[index] += 1
    assert bool((covered == 1).all())


def test_box_flat_start_matches_row_major():
    shape = (3, 4, 5)
    t = torch.arange(60).reshape(shape)
    for box in flat_range_boxes(shape, 7, 53):
        assert box_flat_start(shape, box) == int(t[box[0]])


def _dcp(fn, *args, **kwargs):
    with warnings.catch_warnings():  # "assuming the intent is to save/load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        return fn(*args, no_dist=True, **kwargs)


def test_saved_in_one_chunking_loads_in_another(tmp_path):
    """Chunks written as one layout's row ranges are read back as another's column slices and
    as the whole tensor; a plain full tensor (the format before sharded saves) loads into
    chunks too; a chunk outside the tensor and a shape mismatch are refused."""
    import torch.distributed.checkpoint as dcp

    full = torch.randn(6, 4)
    saved = ShardedEntry((6, 4), [((0, 1), full[0:1, 1:]), ((0, 0), full[0:1, :1]), ((1, 0), full[1:6])])
    _dcp(dcp.save, {"w": saved, "step": 3}, checkpoint_id=str(tmp_path / "a"), planner=ShardedSavePlanner())
    left, right, whole = torch.zeros(6, 2), torch.zeros(6, 2), torch.zeros(6, 4)
    target = {"w": ShardedEntry((6, 4), [((0, 0), left), ((0, 2), right)]), "step": 0}
    _dcp(dcp.load, target, checkpoint_id=str(tmp_path / "a"), planner=ShardedLoadPlanner())
    assert torch.equal(torch.cat([left, right], 1), full) and target["step"] == 3
    _dcp(dcp.load, {"w": ShardedEntry((6, 4), [((0, 0), whole)])}, checkpoint_id=str(tmp_path / "a"),
         planner=ShardedLoadPlanner())
    assert torch.equal(whole, full)

    _dcp(dcp.save, {"w": full.clone()}, checkpoint_id=str(tmp_path / "plain"))  # one full box
    rows = torch.zeros(2, 4)
    _dcp(dcp.load, {"w": ShardedEntry((6, 4), [((3, 0), rows)])}, checkpoint_id=str(tmp_path / "plain"),
         planner=ShardedLoadPlanner())
    assert torch.equal(rows, full[3:5])

    with pytest.raises(ValueError, match="outside"):
        ShardedEntry((6, 4), [((5, 0), torch.zeros(2, 4))])
    with pytest.raises(BaseException, match="Size mismatch"):  # DCP wraps it in a BaseException
        _dcp(dcp.load, {"w": ShardedEntry((6, 5), [((0, 0), torch.zeros(6, 5))])},
             checkpoint_id=str(tmp_path / "a"), planner=ShardedLoadPlanner())


def test_overlapping_or_incomplete_chunks_are_refused_at_save(tmp_path):
    """DCP's global plan check is what stops two ranks writing the same element or none
    writing some: make sure it runs for our chunks."""
    import torch.distributed.checkpoint as dcp

    full = torch.randn(4, 4)
    overlap = ShardedEntry((4, 4), [((0, 0), full[0:3]), ((2, 0), full[2:4])])
    with pytest.raises(BaseException, match="overlap|validate"):
        _dcp(dcp.save, {"w": overlap}, checkpoint_id=str(tmp_path / "o"), planner=ShardedSavePlanner())
    hole = ShardedEntry((4, 4), [((0, 0), full[0:3])])
    with pytest.raises(BaseException, match="do not cover"):
        _dcp(dcp.save, {"w": hole}, checkpoint_id=str(tmp_path / "h"), planner=ShardedSavePlanner())


def test_staged_copies_are_independent():
    t = torch.ones(2, 3)
    staged = ShardedEntry((4, 3), [((0, 0), t)]).staged()
    t.fill_(5.0)
    assert torch.equal(staged.chunks[0][1], torch.ones(2, 3))
