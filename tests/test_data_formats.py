"""Real tokenizers, Megatron-LM indexed datasets, data blends and TensorBoard, end to end."""
import struct
from pathlib import Path

import numpy as np
import pytest

from mpoverlap.config import compose
from mpoverlap.training.data import DataError, build_datasets, load_stdlib_tokens
from mpoverlap.training.megatron_data import read_megatron
from mpoverlap.training.preprocess import main as preprocess, read_header, read_index
from test_train_cli import SMALL, rows, train


def stdlib_docs(n=40, size=3000):
    """n documents of stdlib source text (ASCII/UTF-8), each about `size` bytes."""
    text = bytes(load_stdlib_tokens(n * size)).decode("utf-8", errors="ignore")
    return [text[i * size:(i + 1) * size] for i in range(n)]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """A byte-level BPE tokenizer (vocabulary 400) trained here on stdlib text."""
    tk = pytest.importorskip("tokenizers")
    root = tmp_path_factory.mktemp("bpe")
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    docs = stdlib_docs()
    tok.train_from_iterator(docs, trainer)
    tok.save(str(root / "tokenizer.json"))
    corpus = root / "docs.jsonl"
    import json

    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    prefix = str(root / "bpe")
    assert preprocess([str(corpus), "--output-prefix", prefix, "--tokenizer", str(root), "--workers", "2",
                       "--append-eod", "--no-progress"]) == 0
    return tok, docs, prefix


def test_tokenizer_preprocess_decodes_back_to_the_documents(bpe):
    tok, docs, prefix = bpe
    head = read_header(prefix)
    eod = tok.token_to_id("<|endoftext|>")
    assert head["vocab_size"] == tok.get_vocab_size() == 400 and head["eod_id"] == eod
    tokens, offsets = read_index(prefix)
    assert tokens.dtype == np.uint16 and len(offsets) == len(docs)
    ends = list(offsets[1:]) + [len(tokens)]
    for doc, a, b in zip(docs, offsets, ends):
        ids = tokens[a:b].tolist()
        assert ids[-1] == eod
        assert tok.decode(ids[:-1]) == doc


def test_large_vocabulary_is_written_as_int32(tmp_path):
    tk = pytest.importorskip("tokenizers")
    vocab = {f"w{i}": i for i in range(70000)}
    vocab["[UNK]"] = 70000
    tok = tk.Tokenizer(tk.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tk.pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "a.txt").write_text("w1 w69999 w65536 w3")
    assert preprocess([str(tmp_path / "a.txt"), "--output-prefix", str(tmp_path / "big"),
                       "--tokenizer", str(tmp_path / "tokenizer.json"), "--no-progress"]) == 0
    tokens, _ = read_index(str(tmp_path / "big"))
    assert tokens.dtype == np.int32 and tokens.tolist() == [1, 69999, 65536, 3]
    assert read_header(str(tmp_path / "big"))["vocab_size"] == 70001


@pytest.mark.slow
def test_training_on_tokenized_data_and_smaller_vocab_refused(bpe, tmp_path, capsys):
    from mpoverlap.train import main as train_main

    _, _, prefix = bpe
    data = ["data=indexed", f"data.path={prefix}"]
    # Refused by the launcher before any worker starts (in this process: nothing is spawned).
    assert train_main(data + ["model.vocab_size=300", f"run.dir={tmp_path / 'small'}"]) == 2
    err = capsys.readouterr().err
    assert "model.vocab_size=300" in err and "set model.vocab_size=400" in err
    assert not (tmp_path / "small").exists()
    train(tmp_path / "ok", *data, "model.vocab_size=400", steps=2)
    assert len(rows(tmp_path / "ok")) == 2


def write_megatron(prefix: Path, docs, dtype=np.uint16, code=8):
    """The MMIDIDX pair, written here from the format's description (not with our reader's code)."""
    arrays = [np.asarray(d, dtype=dtype) for d in docs]
    lengths = [len(a) for a in arrays]
    pointers, at = [], 0
    for n in lengths:
        pointers.append(at)
        at += n * np.dtype(dtype).itemsize
    doc_idx = list(range(len(docs) + 1))
    with open(f"{prefix}.bin", "wb") as f:
        for a in arrays:
            f.write(a.astype(np.dtype(dtype).newbyteorder("<")).tobytes())
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code)
                + struct.pack("<Q", len(docs)) + struct.pack("<Q", len(doc_idx)))
        f.write(struct.pack(f"<{len(docs)}i", *lengths) + struct.pack(f"<{len(docs)}q", *pointers)
                + struct.pack(f"<{len(doc_idx)}q", *doc_idx))


def byte_docs(n=30, size=2500, shift=0):
    raw = np.asarray(load_stdlib_tokens(n * size), dtype=np.int64) + shift
    return [raw[i * size:(i + 1) * size - (i % 7)] for i in range(n)]  # uneven lengths


@pytest.mark.parametrize("dtype,code", [(np.uint16, 8), (np.int32, 4)])
def test_megatron_index_reads_back_exactly(tmp_path, dtype, code):
    docs = byte_docs()
    write_megatron(tmp_path / "m", docs, dtype, code)
    ix = read_megatron(str(tmp_path / "m"))
    assert ix.lengths.tolist() == [len(d) for d in docs]
    assert ix.document_indices.tolist() == list(range(len(docs) + 1))
    assert ix.tokens.dtype == np.dtype(dtype) and isinstance(ix.tokens, np.memmap)
    assert np.array_equal(np.asarray(ix.tokens, dtype=np.int64), np.concatenate(docs))


def test_megatron_corrupt_index_is_refused_naming_the_file(tmp_path):
    write_megatron(tmp_path / "m", byte_docs(5))
    idx = tmp_path / "m.idx"
    raw = idx.read_bytes()
    cases = [(raw[:-5], "truncated"), (raw[:20], "truncated"), (b"MMIDIDY\x00\x00" + raw[9:], "magic"),
             (raw[:17] + b"\x06" + raw[18:], "float64")]
    for content, reason in cases:
        idx.write_bytes(content)
        with pytest.raises(DataError, match=rf"m\.idx.*{reason}"):
            read_megatron(str(tmp_path / "m"))
    idx.write_bytes(raw)
    (tmp_path / "m.bin").write_bytes((tmp_path / "m.bin").read_bytes()[:-2])
    with pytest.raises(DataError, match=r"m\.bin.*truncated"):
        build_datasets(compose(["data=megatron", f"data.path={tmp_path / 'm'}"]).data, 64, 256)


def test_blend_reproduces_its_weights(tmp_path):
    write_megatron(tmp_path / "a", byte_docs(10))
    write_megatron(tmp_path / "b", byte_docs(10, size=1500))
    cfg = compose(["data=megatron", f"data.blend=[0.3,{tmp_path / 'a'},0.7,{tmp_path / 'b'}]"])
    blend, _ = build_datasets(cfg.data, 64, 256)
    in_order = [blend.source(g, seed=1234) for g in range(10 * 1024)]
    # Exact per block of 1,024 samples: the largest-remainder split of 0.3 / 0.7 is 307 / 717.
    picks = np.array([d for d, _ in in_order]).reshape(10, 1024)
    for block in picks:
        assert np.bincount(block, minlength=2).tolist() == [307, 717]
    # A function of the seed and the blend alone: a fresh dataset (no cached block) asked in a
    # shuffled order, across blocks, gives the same samples as the in-order pass.
    fresh, _ = build_datasets(cfg.data, 64, 256)
    order = np.random.default_rng(7).permutation(len(in_order))[:3000]
    assert [fresh.source(int(g), 1234) for g in order] == [in_order[g] for g in order]
    assert [blend.source(g, 1) for g in range(50)] != in_order[:50]


@pytest.mark.slow
def test_blended_run_resumes_its_exact_curve(tmp_path):
    write_megatron(tmp_path / "a", byte_docs(10))
    write_megatron(tmp_path / "b", byte_docs(10, size=1500))
    common = ["data=megatron", f"data.blend=[0.3,{tmp_path / 'a'},0.7,{tmp_path / 'b'}]",
              "train.lr_decay_steps=4", "checkpoint.interval=2"]
    from inproc_train import run_chains

    run_chains({"full": [(1, [*SMALL, *common], 4)], "part": [(1, [*SMALL, *common], 2), (1, [*SMALL, *common], 4)]},
               tmp_path)
    part = rows(tmp_path / "part")
    assert [r["step"] for r in part] == [1, 2, 3, 4]  # steps 3-4 from the resumed segment
    assert [r["loss"] for r in part] == [r["loss"] for r in rows(tmp_path / "full")]


@pytest.mark.slow
def test_megatron_data_trains_and_tensorboard_holds_every_scalar(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    write_megatron(tmp_path / "m", byte_docs())
    run = tmp_path / "run"
    train(run, "data=megatron", f"data.path={tmp_path / 'm'}", "parallel.dp=2", "train.tensorboard=true", steps=2)
    assert len(rows(run)) == 2
    events = list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1  # rank 0 only
    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    wanted = {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "val/loss"}
    wanted |= {f"comm/dp/{k}" for k in ("in_flight_s", "exposed_s", "exposed_share")}
    assert wanted <= tags, wanted - tags
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2]
    assert [e.value for e in acc.Scalars("train/loss")] == pytest.approx([r["loss"] for r in rows(run)])


def test_tensorboard_missing_is_refused_before_workers(tmp_path, capsys, monkeypatch):
    import importlib.util

    from mpoverlap.train import main as train_main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    assert train_main(["train.tensorboard=true", f"run.dir={tmp_path / 'r'}"]) == 2
    err = capsys.readouterr().err
    assert "mpoverlap[tensorboard]" in err and "train.tensorboard=false" in err
    assert not (tmp_path / "r").exists()
