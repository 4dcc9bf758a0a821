"""Wire formats (comm/wire.py) and the quantized collectives (comm/quantized.py).

Held two ways: the quantizer equals a per-block reference written out plainly here (the format's
own definition), and each collective on 3 gloo ranks equals its single-process emulation bit for
bit (every rank's shard quantized alike, dequantized and summed in fp32 in the same order). The
shard sizes leave an uneven last block; fp32 and bf16 inputs both (a bf16 tensor is quantized
from its exact fp32 value, never reinterpreted).
"""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dist_harness import run_distributed  # noqa: E402

from mpoverlap.comm.ledger import CommLedger  # noqa: E402
from mpoverlap.comm.quantized import (emulate_all_gather, emulate_reduce_scatter, quantized_all_gather,  # noqa: E402
                                      quantized_reduce_scatter, wire_bytes)
from mpoverlap.comm.wire import FORMATS, dequantize, packed_bytes, quantize, wire_format  # noqa: E402

BLOCK = 128
WORLD = 3
SHARD = 333  # 2 full blocks and one of 77
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def sample(seed: int, n: int, dtype=torch.float32) -> torch.Tensor:
    """Magnitudes over several binades per block (gradients are not uniform), one all-zero block."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 2)
    x[BLOCK:2 * BLOCK] = 0  # an all-zero block: scale 1, zeros back exactly
    return x.to(dtype)


def reference_roundtrip(x: torch.Tensor, name: str, block: int) -> torch.Tensor:
    """The format's definition, block by block: scale = amax / qmax (1 for a zero block), the value
    rounded to the format's grid, saturated at qmax, times the scale."""
    fmt = FORMATS[name]
    out = []
    for start in range(0, x.numel(), block):
        b = x[start:start + block].float()
        amax = b.abs().max()
        scale = amax / fmt.qmax if amax > 0 else torch.tensor(1.0)
        q = b / scale
        q = torch.round(q) if name == "int8" else q
        q = q.clamp(-fmt.qmax, fmt.qmax).to(fmt.dtype)
        out.append(q.float() * scale)
    return torch.cat(out)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_quantize_matches_the_blockwise_definition(name, dtype):
    fmt = wire_format(name)
    x = torch.stack([sample(1, SHARD, DTYPES[dtype]), sample(2, SHARD, DTYPES[dtype])])
    packed = quantize(x, fmt, BLOCK)
    assert packed.dtype == torch.uint8 and packed.shape == (2, packed_bytes(SHARD, fmt, BLOCK))
    assert packed_bytes(SHARD, fmt, BLOCK) == 3 * BLOCK + 3 * 4  # one byte an element (padded), 4 a block
    back = dequantize(packed, SHARD, fmt, BLOCK)
    assert back.dtype == torch.float32
    for row in range(2):  # each shard has its own blocks
        assert torch.equal(back[row], reference_roundtrip(x[row], name, BLOCK))
    # the error bound the format promises: half a step of int8's grid, 2^-4 relative for e4m3
    xf = x.float()
    scale = torch.stack([torch.nn.functional.pad(r, (0, 3 * BLOCK - SHARD)).view(3, BLOCK).abs().amax(1)
                         for r in xf]).repeat_interleave(BLOCK, 1)[:, :SHARD] / fmt.qmax
    err = (back - xf).abs()
    if name == "int8":
        assert (err <= 0.5 * scale * (1 + 1e-5)).all()
    else:
        assert (err <= torch.maximum(xf.abs() * 2.0 ** -4, scale * 2.0 ** -10) * (1 + 1e-5)).all()
    assert torch.equal(back[:, BLOCK:2 * BLOCK], torch.zeros(2, BLOCK))


def test_a_bad_block_or_format_is_refused():
    with pytest.raises(ValueError, match="multiple of 4"):
        quantize(torch.ones(1, 8), FORMATS["int8"], 6)
    with pytest.raises(ValueError, match="unknown wire format"):
        wire_format("int4")


def _collectives(rank, world):
    import torch.distributed as dist

    group, ledger, out = dist.group.WORLD, CommLedger(), {}
    for name in sorted(FORMATS):
        fmt = FORMATS[name]
        for dtype_name, dtype in DTYPES.items():
            inputs = [sample(10 + r, world * SHARD, dtype) for r in range(world)]
            shard = torch.empty(SHARD, dtype=dtype)
            h = quantized_reduce_scatter(shard, inputs[rank], group, fmt=fmt, block=BLOCK, mode="dp", ledger=ledger)
            sent = h.nbytes
            h.wait()
            want = emulate_reduce_scatter(inputs, fmt, BLOCK)[rank].to(dtype)
            # the fp32 sum of the true values, for scale: the quantized sum is close to it
            exact = torch.stack([x.float().reshape(world, SHARD)[rank] for x in inputs]).sum(0)
            gathered = torch.empty(world * SHARD, dtype=dtype)
            shards = [sample(20 + r, SHARD, dtype) for r in range(world)]
            g = quantized_all_gather(gathered, shards[rank], group, fmt=fmt, block=BLOCK, mode="dp", ledger=ledger)
            g.wait()
            out[(name, dtype_name)] = {
                "rs_equal": torch.equal(shard, want), "rs_bytes": sent,
                "rs_rel": ((shard.float() - exact).norm() / exact.norm()).item(),
                "ag_equal": torch.equal(gathered, emulate_all_gather(shards, fmt, BLOCK).to(dtype)),
                "ag_bytes": g.nbytes, "dtype": str(shard.dtype)}
    out["link"] = _link_bytes(group, ledger, rank, world)
    ledger.close()
    return out


def _link_bytes(group, ledger, rank, world):
    """Each plain collective's link bytes on 3 ranks (a 40-byte buffer a rank, fp32)."""
    from mpoverlap.comm import all_gather, all_reduce, all_to_all, reduce_scatter, send_recv

    x = torch.ones(10)
    got = {"all_reduce": all_reduce(x.clone(), group, mode="dp", ledger=ledger).wait(),
           "reduce_scatter": reduce_scatter(torch.empty(10), torch.ones(30), group, mode="dp", ledger=ledger).wait(),
           "all_gather": all_gather(torch.empty(30), x, group, mode="dp", ledger=ledger).wait(),
           "all_to_all": all_to_all(torch.empty(30), torch.ones(30), group, mode="ep", ledger=ledger).wait()}
    # uneven: rank r keeps r + 1 of its 6 rows, sends the rest
    splits = [[1, 2, 3], [2, 2, 2], [3, 2, 1]][rank]
    recv = [[1, 2, 3], [2, 2, 2], [3, 2, 1]]
    got["all_to_all_uneven"] = all_to_all(torch.empty(sum(r[rank] for r in recv), 4), torch.ones(6, 4), group,
                                          mode="ep", ledger=ledger, output_split_sizes=[r[rank] for r in recv],
                                          input_split_sizes=splits).wait()
    peer_next, peer_prev = (rank + 1) % world, (rank - 1) % world
    got["send_recv"] = send_recv([(x, peer_next)], [(torch.empty(10), peer_prev)], None, mode="pp",
                                 ledger=ledger).wait()
    return {op: (h.nbytes, h.link_bytes) for op, h in got.items()}


@pytest.fixture(scope="module")
def collectives():
    return run_distributed(_collectives, WORLD, timeout_s=120)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_quantized_collectives_equal_their_emulation_bit_for_bit(collectives, name, dtype):
    fmt = FORMATS[name]
    for rank in collectives:
        r = rank[(name, dtype)]
        assert r["rs_equal"] and r["ag_equal"], r
        assert r["dtype"] == str(DTYPES[dtype])
        # what the collectives carry: one byte an element and 4 a block, for every shard
        assert r["rs_bytes"] == wire_bytes(WORLD * SHARD, fmt, BLOCK, WORLD) == WORLD * (3 * BLOCK + 12)
        assert r["ag_bytes"] == WORLD * packed_bytes(SHARD, fmt, BLOCK)
        # close to the exact sum (a sanity bound: int8's half step is <= 0.4% of a block's max,
        # e4m3's 6% of a value; relative to the sum's norm both stay well inside it)
        assert r["rs_rel"] < (0.02 if name == "int8" else 0.06), r


def test_link_bytes_follow_each_collective_and_its_group(collectives):
    """What a rank sends, per handle: a ring all-reduce 2(n-1)/n of its buffer, an all-gather
    (output) or reduce-scatter (input) (n-1)/n, an all-to-all its send buffer less the slot it
    keeps, a send/receive pair its send only; the buffer bytes are those the ledger counts."""
    for rank, r in enumerate(collectives):
        link = r["link"]
        assert link["all_reduce"] == (40, 40 * 4 // 3)
        assert link["reduce_scatter"] == (120, 80) and link["all_gather"] == (120, 80)
        assert link["all_to_all"] == (120, 80)
        kept = [1, 2, 1][rank]  # split r of rank r: [1, 2, 3][0], [2, 2, 2][1], [3, 2, 1][2]
        assert link["all_to_all_uneven"] == (96, (6 - kept) * 16)
        assert link["send_recv"] == (80, 40)
