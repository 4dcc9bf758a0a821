"""Single-process tests of datasets, sample order and the preprocessing command."""
import json
import os

import numpy as np
import pytest
import torch

from mpoverlap.config import DataConfig
from mpoverlap.training.data import (DataError, TokenWindows, build_datasets, global_batch,
                                     load_stdlib_tokens, rank_microbatches, sample_index)
from mpoverlap.training.preprocess import main as preprocess, read_index


def test_stdlib_tokens_deterministic():
    a = load_stdlib_tokens(200_000)
    b = load_stdlib_tokens(200_000)
    assert a.dtype == np.uint8 and len(a) == 200_000
    assert np.array_equal(a, b)
    assert np.array_equal(load_stdlib_tokens(1000), a[:1000])


def test_token_windows():
    ds = TokenWindows(np.arange(50, dtype=np.uint16), seq_length=4)
    assert len(ds) == 10
    assert ds[1].dtype == torch.int64 and ds[1].tolist() == [5, 6, 7, 8, 9]
    assert ds[-1].tolist() == [45, 46, 47, 48, 49]
    with pytest.raises(IndexError):
        ds[10]


def test_sample_order_layout_and_steps_independent():
    N = 13
    order = [sample_index(g, N, seed=3) for g in range(3 * N)]
    for e in range(3):
        assert sorted(order[e * N:(e + 1) * N]) == list(range(N))
    assert order[:N] != order[N:2 * N]  # a fresh permutation per epoch
    # Asking for fewer samples (a shorter run), or starting late (resume), changes nothing.
    assert [sample_index(g, N, seed=3) for g in range(20, 30)] == order[20:30]
    assert [sample_index(g, N, seed=4) for g in range(N)] != order[:N]

    ds = TokenWindows(np.arange(13 * 5, dtype=np.uint8), seq_length=4)
    b_long = torch.cat([global_batch(ds, s, 4, seed=3) for s in range(6)])
    b_short = torch.cat([global_batch(ds, s, 4, seed=3) for s in range(2)])
    assert torch.equal(b_long[:8], b_short)
    assert torch.equal(global_batch(ds, 5, 4, seed=3), b_long[20:24])
    assert not torch.equal(global_batch(ds, 0, 4, seed=9), b_short[:4])


def test_rank_microbatches_cover_global_batch():
    ds = TokenWindows(np.arange(200, dtype=np.uint16), seq_length=4)
    batch = global_batch(ds, step=2, global_batch_size=8, seed=1)
    for dp in (1, 2, 4):
        parts = [mb for r in range(dp) for mb in rank_microbatches(batch, r, dp, 2)]
        assert all(mb.shape == (2, 5) for mb in parts)
        assert torch.equal(torch.cat(parts), batch)
    with pytest.raises(ValueError, match="micro_batch_size"):
        rank_microbatches(batch, 0, 2, 3)
    with pytest.raises(ValueError, match="global_batch_size"):
        rank_microbatches(batch, 0, 3, 1)


def test_stdlib_split_disjoint():
    train, val = build_datasets(DataConfig(max_bytes=20_000, val_fraction=0.1), 16, 256)
    n = 20_000 // 17
    assert len(train) + len(val) == n and len(val) == max(1, int(n * 0.1))
    # val is the tail of the same byte stream, after every train window
    all_tokens = load_stdlib_tokens(20_000)
    assert np.array_equal(val[0].numpy(), all_tokens[len(train) * 17:len(train) * 17 + 17])
    with pytest.raises(DataError, match="model.vocab_size"):
        build_datasets(DataConfig(max_bytes=1000), 16, 100)
    with pytest.raises(DataError, match="data.name"):
        build_datasets(DataConfig(name="webtext"), 16, 256)


def _write_inputs(tmp_path):
    txt = tmp_path / "a.txt"
    txt.write_text("hello world, héllo bytes\n", encoding="utf-8")
    jsonl = tmp_path / "b.jsonl"
    docs = [{"text": "first document " * 5}, {"text": "second ✓ " * 7, "id": 2}]
    jsonl.write_text("\n".join(json.dumps(d) for d in docs) + "\n\n", encoding="utf-8")
    expected = [txt.read_bytes()] + [d["text"].encode("utf-8") for d in docs]
    return str(txt), str(jsonl), expected


@pytest.mark.parametrize("eod", [False, True])
def test_preprocess_round_trip(tmp_path, capsys, eod):
    txt, jsonl, docs = _write_inputs(tmp_path)
    prefix = str(tmp_path / "out" / "corpus")
    argv = [txt, jsonl, "--output-prefix", prefix] + (["--append-eod"] if eod else [])
    assert preprocess(argv) == 0
    assert "3 documents" in capsys.readouterr().out
    stream = b"".join(d + (b"\x00" if eod else b"") for d in docs)
    tokens, offsets = read_index(prefix)
    assert tokens.dtype == np.uint16 and bytes(tokens.astype(np.uint8)) == stream
    starts = np.cumsum([0] + [len(d) + eod for d in docs[:-1]])
    assert offsets.tolist() == starts.tolist()
    train, val = build_datasets(DataConfig(name="indexed", path=prefix, val_fraction=0.2),
                                seq_length=8, vocab_size=256)
    got = b"".join(bytes(w.numpy().astype(np.uint8)) for ds in (train, val)
                   for w in (ds[i] for i in range(len(ds))))
    assert got == stream[:len(got)] and len(got) == (len(stream) // 9) * 9
    assert not [p for p in os.listdir(tmp_path / "out") if ".tmp" in p]


def test_indexed_errors(tmp_path):
    txt, jsonl, _ = _write_inputs(tmp_path)
    prefix = str(tmp_path / "c")
    assert preprocess([txt, jsonl, "--output-prefix", prefix]) == 0
    with pytest.raises(DataError, match="data.path=<prefix>"):
        build_datasets(DataConfig(name="indexed"), 8, 256)
    with pytest.raises(DataError, match="nothere.idx"):
        build_datasets(DataConfig(name="indexed", path=str(tmp_path / "nothere")), 8, 256)
    with pytest.raises(DataError, match=r"c\.idx.*vocabulary of 256.*model\.vocab_size=200"):
        build_datasets(DataConfig(name="indexed", path=prefix), 8, 200)  # 'é' bytes >= 200

    raw_bin = open(prefix + ".bin", "rb").read()
    open(prefix + ".bin", "wb").write(raw_bin[:-3])
    with pytest.raises(DataError, match=r"c\.bin.*truncated"):
        build_datasets(DataConfig(name="indexed", path=prefix), 8, 256)
    open(prefix + ".bin", "wb").write(raw_bin)

    raw_idx = open(prefix + ".idx", "rb").read()
    open(prefix + ".idx", "wb").write(b"BADMAGIC" + raw_idx[8:])
    with pytest.raises(DataError, match=r"c\.idx.*magic"):
        read_index(prefix)
    open(prefix + ".idx", "wb").write(raw_idx[:-4])
    with pytest.raises(DataError, match=r"c\.idx.*truncated"):
        read_index(prefix)


def test_preprocess_bad_inputs(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": oops}\n', encoding="utf-8")
    nokey = tmp_path / "nokey.jsonl"
    nokey.write_text('{"body": "x"}\n', encoding="utf-8")
    out = str(tmp_path / "o")
    cases = [([str(bad)], "bad.jsonl:2: invalid JSON"),
             ([str(nokey)], "nokey.jsonl:1: no key 'text'"),
             ([str(tmp_path / "missing.txt")], "missing.txt: no such file")]
    for inputs, msg in cases:
        assert preprocess(inputs + ["--output-prefix", out]) == 2
        err = capsys.readouterr().err
        assert msg in err and "Traceback" not in err and err.count("\n") == 1
    assert os.listdir(tmp_path) and not [p for p in os.listdir(tmp_path) if p.startswith("o.")]
