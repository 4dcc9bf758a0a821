"""The gradient norm's views (mpoverlap/data_parallel/grad_norm.py): adjacent regions merged,
a few norms per region whatever its size, sums per key that match fp64."""
import torch

from mpoverlap.data_parallel.grad_norm import ROW, SquareSum, coalesce, row_views


def _ref(tensors):
    return sum(float((t.double() ** 2).sum()) for t in tensors)


def test_adjacent_regions_of_one_storage_merge_per_key():
    flat = torch.randn(3 * ROW + 5, generator=torch.Generator().manual_seed(0))
    a, b, c, d = flat[:100], flat[100:ROW], flat[ROW:2 * ROW + 7], flat[2 * ROW + 9:]  # a gap before d
    merged, keys = coalesce([a, b, c, d], keys=[0, 0, 0, 0])
    assert [m.numel() for m in merged] == [2 * ROW + 7, d.numel()] and keys == [0, 0]
    assert merged[0].data_ptr() == flat.data_ptr()  # a view, no copy
    merged, keys = coalesce([a, b, c, d], keys=[0, 1, 1, 1])
    assert [m.numel() for m in merged] == [100, 2 * ROW + 7 - 100, d.numel()] and keys == [0, 1, 1]
    other = torch.randn(10)  # another storage never merges
    assert len(coalesce([flat[:10], other])[0]) == 2


def test_views_are_rows_and_a_tail_whatever_the_size():
    for n, shapes in ((5, [(1, 5)]), (ROW, [(1, ROW)]), (3 * ROW, [(3, ROW)]), (3 * ROW + 1, [(3, ROW), (1, 1)])):
        assert [tuple(v.shape) for v in row_views(torch.zeros(n))] == shapes
    big = torch.zeros(1000 * ROW + 3)
    assert len(row_views(big)) == 2  # launches independent of the size


def test_square_sums_per_key_match_fp64():
    g = torch.Generator().manual_seed(1)
    flat = torch.randn(5 * ROW + 333, generator=g)
    flat[ROW:2 * ROW] *= 1e-3  # magnitudes apart
    regions = [flat[:ROW + 10], flat[ROW + 10:3 * ROW], flat[3 * ROW:3 * ROW + 7], flat[3 * ROW + 7:]]
    keys = [2, 0, 2, 3]
    square_sums = SquareSum(regions, torch.device("cpu"), keys=keys, num_keys=4)
    sums = square_sums()
    assert sums.dtype == torch.float64 and sums.shape == (4,)
    for k in range(4):
        want = _ref([r for r, kk in zip(regions, keys) if kk == k])
        assert abs(float(sums[k]) - want) <= 1e-6 * max(want, 1e-30), (k, float(sums[k]), want)
    assert float(sums[1]) == 0.0  # a key without regions
    # The same memory read again after an in-place change: the views are persistent.
    flat.mul_(2)
    assert abs(float(square_sums()[3]) - 4 * float(sums[3])) <= 1e-6 * float(sums[3])


def test_fp64_and_bf16_regions_and_one_dtype_per_sum():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2 * ROW + 9, generator=g, dtype=torch.float64)
    assert abs(float(SquareSum([x], torch.device("cpu"))()[0]) - _ref([x])) <= 1e-12 * _ref([x])
    b = x.bfloat16()
    # fp32 partial sums of 2^14 squares (as the chunked _foreach_norm was: same bits on CPU)
    assert abs(float(SquareSum([b], torch.device("cpu"))()[0]) - _ref([b])) <= 1e-5 * _ref([b])
    try:
        SquareSum([x, b], torch.device("cpu"))
    except TypeError as err:
        assert "one dtype" in str(err)
    else:
        raise AssertionError("mixed dtypes were accepted")


def test_rows_give_the_bits_of_the_chunked_foreach_norm():
    """The accuracy did not change: a region's row norms are the 2^14-element chunk norms that
    the optimizer's former `_foreach_norm` over `split(2^14)` views computed (bit for bit on the
    machines tried; bounded at 1e-12 so another kernel path's last bit does not fail it, while
    other rows or an fp32 total, ~1e-7 apart, would)."""
    for seed in range(3):
        f = torch.randn(3 * ROW + 17, generator=torch.Generator().manual_seed(seed))
        chunked = torch.stack(torch._foreach_norm(list(f.split(1 << 14)), 2)).double().pow(2).sum()
        rows = SquareSum([f], torch.device("cpu"))()[0]
        assert abs(float(rows - chunked)) <= 1e-12 * float(chunked), (seed, float(rows), float(chunked))
