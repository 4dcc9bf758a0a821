"""`mpoverlap-preprocess`: text corpora -> memory-mapped token files for data=indexed.

Tokeniser: byte level, the UTF-8 bytes of each document are its token ids (0..255).
With --append-eod, token 0 (the NUL byte, which text practically never contains) is appended
after every document as the end-of-document marker; it is an ordinary token for training
(no loss masking, no attention reset).

Inputs: `.txt` files (one document per file, raw bytes) and `.jsonl` files (one document per
non-blank line, the string under --json-key).

Outputs, both written atomically (temporary file + os.replace):
  <prefix>.bin  raw little-endian uint16 tokens, all documents concatenated
  <prefix>.idx  header of 5 little-endian 8-byte fields
                  magic b"MPOIDX\\x00\\x00", version (uint64 = 1), dtype code (uint64:
                  1 uint8, 2 uint16, 3 uint32), number of tokens, number of documents
                then number-of-documents int64 document start offsets (in tokens).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Iterator, List, Optional, Sequence, Tuple

import numpy as np

from mpoverlap.training.data import DataError

MAGIC = b"MPOIDX\x00\x00"
VERSION = 1
DTYPES = {1: np.dtype("<u1"), 2: np.dtype("<u2"), 3: np.dtype("<u4")}
HEADER_BYTES = 8 + 4 * 8
EOD_ID = 0


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
                  append_eod: bool = False) -> Tuple[int, int]:
    """Tokenise inputs into <prefix>.bin/.idx; returns (documents, tokens)."""
    out_dir = os.path.dirname(os.path.abspath(prefix))
    os.makedirs(out_dir, exist_ok=True)
    bin_path, idx_path = prefix + ".bin", prefix + ".idx"
    bin_tmp, idx_tmp = f"{bin_path}.tmp.{os.getpid()}", f"{idx_path}.tmp.{os.getpid()}"
    offsets: List[int] = []
    num_tokens = 0
    try:
        with open(bin_tmp, "wb") as fbin:
            for path in inputs:
                for doc in _documents(path, json_key):
                    offsets.append(num_tokens)
                    toks = np.frombuffer(doc, dtype=np.uint8).astype("<u2")
                    if append_eod:
                        toks = np.append(toks, np.array([EOD_ID], dtype="<u2"))
                    fbin.write(toks.tobytes())
                    num_tokens += len(toks)
        if not offsets:
            raise InputError(f"{', '.join(inputs)}: no documents found")
        header = np.array([VERSION, 2, num_tokens, len(offsets)], dtype="<u8")
        with open(idx_tmp, "wb") as fidx:
            fidx.write(MAGIC + header.tobytes() + np.asarray(offsets, dtype="<i8").tobytes())
        os.replace(bin_tmp, bin_path)
        os.replace(idx_tmp, idx_path)
    finally:
        for tmp in (bin_tmp, idx_tmp):
            if os.path.exists(tmp):
                os.remove(tmp)
    return len(offsets), num_tokens


def read_index(prefix: str) -> Tuple[np.ndarray, np.ndarray]:
    """(tokens memmap [num_tokens], doc start offsets int64 [num_docs]) of <prefix>.bin/.idx.

    Raises DataError naming the file when it is missing, truncated or not in this format.
    """
    prefix = os.fspath(prefix)
    bin_path, idx_path = prefix + ".bin", prefix + ".idx"
    fix = "re-create it with mpoverlap-preprocess --output-prefix " + prefix
    for p in (idx_path, bin_path):
        if not os.path.isfile(p):
            raise DataError(f"{p} does not exist; data.path={prefix} must be the prefix of the "
                            f"<prefix>.bin / <prefix>.idx pair written by mpoverlap-preprocess.")
    with open(idx_path, "rb") as f:
        raw = f.read()
    if len(raw) < HEADER_BYTES or raw[:8] != MAGIC:
        raise DataError(f"{idx_path} is not an mpoverlap index (bad magic or truncated header); "
                        f"{fix}.")
    version, code, num_tokens, num_docs = (int(v) for v in
                                           np.frombuffer(raw[8:HEADER_BYTES], dtype="<u8"))
    if version != VERSION or code not in DTYPES:
        raise DataError(f"{idx_path} has version {version} / dtype code {code}, this reader "
                        f"knows version {VERSION} and codes {sorted(DTYPES)}; {fix}.")
    if len(raw) != HEADER_BYTES + 8 * num_docs:
        raise DataError(f"{idx_path} is {len(raw)} bytes but its header announces {num_docs} "
                        f"documents ({HEADER_BYTES + 8 * num_docs} bytes): truncated or "
                        f"corrupt; {fix}.")
    offsets = np.frombuffer(raw[HEADER_BYTES:], dtype="<i8").astype(np.int64)
    if num_docs and (offsets[0] != 0 or np.any(np.diff(offsets) < 0)
                     or offsets[-1] > num_tokens):
        raise DataError(f"{idx_path} has inconsistent document offsets; {fix}.")
    dtype = DTYPES[code]
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
        description="Tokenise .txt / .jsonl files (byte level) into <prefix>.bin/.idx for "
                    "data=indexed data.path=<prefix>.")
    parser.add_argument("inputs", nargs="+", help=".txt (one document per file) or .jsonl "
                        "(one document per line) files")
    parser.add_argument("--output-prefix", required=True, help="writes <prefix>.bin, .idx")
    parser.add_argument("--json-key", default="text", help="text field of .jsonl records")
    parser.add_argument("--append-eod", action="store_true",
                        help=f"append token {EOD_ID} (NUL byte) after every document")
    args = parser.parse_args(argv)
    try:
        docs, tokens = write_dataset(args.inputs, args.output_prefix, args.json_key,
                                     args.append_eod)
    except InputError as err:
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
