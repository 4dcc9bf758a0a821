"""`mpoverlap-preprocess`: text corpora -> memory-mapped token files for data=indexed.

Tokeniser: byte level by default (no file: the UTF-8 bytes of each document are its ids
0..255, vocabulary 256, end-of-document id 0, the NUL byte, which text practically never
contains), or `--tokenizer <tokenizer.json or a directory holding one>` read with the
`tokenizers` library (optional extra; never downloaded). With --append-eod the end-of-document
id follows every document; it is an ordinary token for training (no loss masking).
`--workers N` tokenises in N processes (documents keep their order), with a progress bar.

Inputs: `.txt` files (one document per file, raw bytes) and `.jsonl` files (one document per
non-blank line, the string under --json-key).

Outputs, both written atomically (temporary file + os.replace):
  <prefix>.bin  raw little-endian tokens, all documents concatenated; uint16 when the
                vocabulary has fewer than 65536 ids, else int32
  <prefix>.idx  header of little-endian 8-byte fields
                  magic b"MPOIDX\\x00\\x00", version (uint64 = 2), dtype code (uint64:
                  1 uint8, 2 uint16, 3 uint32, 4 int32), number of tokens, number of documents,
                  vocabulary size (uint64), end-of-document id (int64, -1 = none)
                then number-of-documents int64 document start offsets (in tokens).
                Version 1 (no vocabulary size, no end-of-document id) is still read.
Training checks model.vocab_size against the vocabulary size in the index before any
worker starts.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Iterator, List, Optional, Sequence, Tuple

import numpy as np

from mpoverlap.training.data import DataError
from mpoverlap.training.tokenize import TokenizerError

MAGIC = b"MPOIDX\x00\x00"
VERSION = 2
DTYPES = {1: np.dtype("<u1"), 2: np.dtype("<u2"), 3: np.dtype("<u4"), 4: np.dtype("<i4")}
HEADER_BYTES = {1: 8 + 4 * 8, 2: 8 + 6 * 8}  # per version
EOD_ID = 0  # byte level


class InputError(Exception):
    """A bad input file; the message is printed as one line."""


def _documents(path: str, json_key: str) -> Iterator[bytes]:
    if not os.path.isfile(path):
        raise InputError(f"{path}: no such file")
    if path.endswith(".txt"):
        with open(path, "rb") as f:
            yield f.read()
    elif path.endswith(".jsonl"):
        with open(path, "rb") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError) as err:
                    raise InputError(f"{path}:{lineno}: invalid JSON ({err})") from None
                if not isinstance(record, dict) or json_key not in record:
                    raise InputError(f"{path}:{lineno}: no key {json_key!r} "
                                     f"(choose the text field with --json-key)")
                text = record[json_key]
                if not isinstance(text, str):
                    raise InputError(f"{path}:{lineno}: {json_key!r} is "
                                     f"{type(text).__name__}, expected a string")
                yield text.encode("utf-8")
    else:
        raise InputError(f"{path}: unsupported input type, expected .txt or .jsonl")


def write_dataset(inputs: Sequence[str], prefix: str, json_key: str = "text",
                  append_eod: bool = False, tokenizer: Optional[str] = None,
                  workers: int = 1, progress: bool = True) -> Tuple[int, int]:
    """Tokenise inputs into <prefix>.bin/.idx; returns (documents, tokens)."""
    from mpoverlap.training.tokenize import TokenizerSpec, encode_stream  # noqa: I001

    spec = TokenizerSpec.load(tokenizer, append_eod)
    dtype_code = 2 if spec.vocab_size < 65536 else 4
    dtype = DTYPES[dtype_code]
    out_dir = os.path.dirname(os.path.abspath(prefix))
    os.makedirs(out_dir, exist_ok=True)
    bin_path, idx_path = prefix + ".bin", prefix + ".idx"
    bin_tmp, idx_tmp = f"{bin_path}.tmp.{os.getpid()}", f"{idx_path}.tmp.{os.getpid()}"
    offsets: List[int] = []
    num_tokens = 0
    docs = (doc for path in inputs for doc in _documents(path, json_key))
    try:
        with open(bin_tmp, "wb") as fbin:
            for ids in encode_stream(spec, docs, workers, progress):
                offsets.append(num_tokens)
                fbin.write(np.asarray(ids, dtype=dtype).tobytes())
                num_tokens += len(ids)
        if not offsets:
            raise InputError(f"{', '.join(inputs)}: no documents found")
        header = np.array([VERSION, dtype_code, num_tokens, len(offsets), spec.vocab_size], dtype="<u8")
        eod = np.array([spec.eod_id if spec.eod_id is not None else -1], dtype="<i8")
        with open(idx_tmp, "wb") as fidx:
            fidx.write(MAGIC + header.tobytes() + eod.tobytes() + np.asarray(offsets, dtype="<i8").tobytes())
        os.replace(bin_tmp, bin_path)
        os.replace(idx_tmp, idx_path)
    finally:
        for tmp in (bin_tmp, idx_tmp):
            if os.path.exists(tmp):
                os.remove(tmp)
    return len(offsets), num_tokens


def read_header(prefix: str) -> dict:
    """{"version", "dtype", "num_tokens", "num_docs", "vocab_size" (None in version 1),
    "eod_id" (None when absent)} of <prefix>.idx; DataError naming the file when unusable."""
    idx_path = os.fspath(prefix) + ".idx"
    fix = "re-create it with mpoverlap-preprocess --output-prefix " + os.fspath(prefix)
    if not os.path.isfile(idx_path):
        raise DataError(f"{idx_path} does not exist; data.path={prefix} must be the prefix of the "
                        f"<prefix>.bin / <prefix>.idx pair written by mpoverlap-preprocess.")
    with open(idx_path, "rb") as f:
        raw = f.read(HEADER_BYTES[2])
    if len(raw) < HEADER_BYTES[1] or raw[:8] != MAGIC:
        raise DataError(f"{idx_path} is not an mpoverlap index (bad magic or truncated header); {fix}.")
    version, code, num_tokens, num_docs = (int(v) for v in np.frombuffer(raw[8:40], dtype="<u8"))
    if version not in HEADER_BYTES or code not in DTYPES:
        raise DataError(f"{idx_path} has version {version} / dtype code {code}, this reader "
                        f"knows versions {sorted(HEADER_BYTES)} and codes {sorted(DTYPES)}; {fix}.")
    if len(raw) < HEADER_BYTES[version]:
        raise DataError(f"{idx_path} is truncated inside its header; {fix}.")
    vocab = eod = None
    if version >= 2:
        vocab = int(np.frombuffer(raw[40:48], dtype="<u8")[0])
        eod = int(np.frombuffer(raw[48:56], dtype="<i8")[0])
        eod = None if eod < 0 else eod
    return {"version": version, "dtype": DTYPES[code], "num_tokens": num_tokens, "num_docs": num_docs,
            "vocab_size": vocab, "eod_id": eod, "header_bytes": HEADER_BYTES[version]}


def read_index(prefix: str) -> Tuple[np.ndarray, np.ndarray]:
    """(tokens memmap [num_tokens], doc start offsets int64 [num_docs]) of <prefix>.bin/.idx.

    Raises DataError naming the file when it is missing, truncated or not in this format.
    """
    prefix = os.fspath(prefix)
    bin_path, idx_path = prefix + ".bin", prefix + ".idx"
    fix = "re-create it with mpoverlap-preprocess --output-prefix " + prefix
    head = read_header(prefix)
    if not os.path.isfile(bin_path):
        raise DataError(f"{bin_path} does not exist; data.path={prefix} must be the prefix of the "
                        f"<prefix>.bin / <prefix>.idx pair written by mpoverlap-preprocess.")
    num_tokens, num_docs, start = head["num_tokens"], head["num_docs"], head["header_bytes"]
    with open(idx_path, "rb") as f:
        raw = f.read()
    if len(raw) != start + 8 * num_docs:
        raise DataError(f"{idx_path} is {len(raw)} bytes but its header announces {num_docs} "
                        f"documents ({start + 8 * num_docs} bytes): truncated or "
                        f"corrupt; {fix}.")
    offsets = np.frombuffer(raw[start:], dtype="<i8").astype(np.int64)
    if num_docs and (offsets[0] != 0 or np.any(np.diff(offsets) < 0)
                     or offsets[-1] > num_tokens):
        raise DataError(f"{idx_path} has inconsistent document offsets; {fix}.")
    dtype = head["dtype"]
    expected = num_tokens * dtype.itemsize
    actual = os.path.getsize(bin_path)
    if actual != expected:
        raise DataError(f"{bin_path} is {actual} bytes but {idx_path} announces {num_tokens} "
                        f"tokens of {dtype.itemsize} bytes ({expected} bytes): truncated or "
                        f"corrupt; {fix}.")
    if num_tokens == 0:
        return np.zeros(0, dtype=dtype), offsets
    return np.memmap(bin_path, dtype=dtype, mode="r", shape=(num_tokens,)), offsets


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="mpoverlap-preprocess",
        description="Tokenise .txt / .jsonl files (byte level or --tokenizer) into <prefix>.bin/.idx for "
                    "data=indexed data.path=<prefix>.")
    parser.add_argument("inputs", nargs="+", help=".txt (one document per file) or .jsonl "
                        "(one document per line) files")
    parser.add_argument("--output-prefix", required=True, help="writes <prefix>.bin, .idx")
    parser.add_argument("--json-key", default="text", help="text field of .jsonl records")
    parser.add_argument("--append-eod", action="store_true",
                        help=f"append the end-of-document id after every document (byte level: "
                             f"{EOD_ID}, the NUL byte; a tokenizer: its end-of-text token)")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer.json (or a directory holding one) for the `tokenizers` "
                             "library; default: byte level")
    parser.add_argument("--workers", type=int, default=1, help="tokenising processes (default 1)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        docs, tokens = write_dataset(args.inputs, args.output_prefix, args.json_key,
                                     args.append_eod, args.tokenizer, args.workers,
                                     not args.no_progress)
    except (InputError, TokenizerError) as err:
        print(f"mpoverlap-preprocess: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"mpoverlap-preprocess: error: {err.filename or args.output_prefix}: "
              f"{err.strerror or err}", file=sys.stderr)
        return 2
    print(f"mpoverlap-preprocess: {docs} documents, {tokens} tokens -> "
          f"{args.output_prefix}.bin, {args.output_prefix}.idx")
    return 0


if __name__ == "__main__":
    sys.exit(main())
