"""Megatron-LM's indexed datasets (`data=megatron`), read as they are, memory-mapped.

The pair <prefix>.bin / <prefix>.idx that Megatron-LM's preprocess_data.py writes (its
"MMIDIDX" format, megatron-core `indexed_dataset.py`), all little-endian:
  .idx  magic b"MMIDIDX\\x00\\x00" (9 bytes), version u64 (= 1), dtype code u8, sequence count
        u64 S, document count u64 D, then sequence lengths int32[S], sequence pointers
        int64[S] (byte offsets into .bin), document indices int64[D] (sequence index where
        each document starts, the last one = S); a multimodal index adds modes int8[S]
  .bin  every sequence's tokens back to back, of the dtype the code names
dtype codes: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16
(floats cannot hold token ids and are refused).

Training reads the sequences back to back as one token stream (like data=indexed): windows
cross document boundaries, as Megatron's GPT dataset does.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from mpoverlap.training.data import DataError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = 9 + 8 + 1 + 8 + 8
TOKEN_DTYPES = {1: np.dtype("<u1"), 2: np.dtype("<i1"), 3: np.dtype("<i2"), 4: np.dtype("<i4"),
                5: np.dtype("<i8"), 8: np.dtype("<u2")}
FLOAT_CODES = {6: "float64", 7: "float32"}


@dataclass
class MegatronIndex:
    tokens: np.ndarray  # memmap of every token, [sum(lengths)]
    lengths: np.ndarray  # int32 [S]
    pointers: np.ndarray  # int64 [S], byte offsets
    document_indices: np.ndarray  # int64 [D]


def read_megatron(prefix: str) -> MegatronIndex:
    """Open <prefix>.bin/.idx; DataError naming the file and the reason when it is missing,
    truncated or inconsistent."""
    prefix = os.fspath(prefix)
    bin_path, idx_path = prefix + ".bin", prefix + ".idx"
    for p in (idx_path, bin_path):
        if not os.path.isfile(p):
            raise DataError(f"{p} does not exist; data.path={prefix} must be the prefix of a Megatron-LM "
                            "<prefix>.bin / <prefix>.idx pair (preprocess_data.py's output, without the .bin)")

    def bad(reason: str) -> DataError:
        return DataError(f"{idx_path} is not a usable Megatron index: {reason}; re-run Megatron-LM's "
                         "preprocess_data.py for it, or point data.path elsewhere")

    size = os.path.getsize(idx_path)
    if size < HEADER_BYTES:
        raise bad(f"{size} bytes, shorter than the {HEADER_BYTES}-byte header (truncated)")
    idx = np.memmap(idx_path, dtype=np.uint8, mode="r")
    if bytes(idx[:9]) != MAGIC:
        raise bad(f"magic {bytes(idx[:9])!r}, expected {MAGIC!r}")
    version = int(idx[9:17].view("<u8")[0])
    code = int(idx[17])
    num_seq = int(idx[18:26].view("<u8")[0])
    num_doc = int(idx[26:34].view("<u8")[0])
    if version != VERSION:
        raise bad(f"version {version}, this reader knows version {VERSION}")
    if code in FLOAT_CODES or code not in TOKEN_DTYPES:
        raise bad(f"dtype code {code} ({FLOAT_CODES.get(code, 'unknown')}) cannot hold token ids")
    dtype = TOKEN_DTYPES[code]
    body = 4 * num_seq + 8 * num_seq + 8 * num_doc
    if size < HEADER_BYTES + body:
        raise bad(f"{size} bytes but its header announces {num_seq} sequences and {num_doc} document "
                  f"indices ({HEADER_BYTES + body} bytes): truncated")
    if size not in (HEADER_BYTES + body, HEADER_BYTES + body + num_seq):  # + int8 modes (multimodal)
        raise bad(f"{size} bytes, more than the {HEADER_BYTES + body} its header announces: corrupt")
    at = HEADER_BYTES
    lengths = np.frombuffer(idx, dtype="<i4", count=num_seq, offset=at)
    at += 4 * num_seq
    pointers = np.frombuffer(idx, dtype="<i8", count=num_seq, offset=at)
    at += 8 * num_seq
    documents = np.frombuffer(idx, dtype="<i8", count=num_doc, offset=at)
    if num_seq and (lengths.min() < 0):
        raise bad("a negative sequence length")
    # Sequences lie back to back: pointer[i] = sum of the previous lengths x itemsize.
    expected = np.concatenate([[0], np.cumsum(lengths[:-1], dtype=np.int64)]) * dtype.itemsize if num_seq else pointers
    if num_seq and not np.array_equal(pointers, expected):
        first = int(np.argmax(pointers != expected))
        raise bad(f"sequence {first} points at byte {int(pointers[first])}, expected {int(expected[first])} "
                  "(sequences are stored back to back)")
    if num_doc and (documents[0] != 0 or documents[-1] != num_seq or np.any(np.diff(documents) < 0)):
        raise bad(f"document indices must rise from 0 to the sequence count {num_seq}")
    total = int(lengths.sum(dtype=np.int64))
    bin_size = os.path.getsize(bin_path)
    if bin_size != total * dtype.itemsize:
        raise DataError(f"{bin_path} is {bin_size} bytes but {idx_path} announces {total} tokens of "
                        f"{dtype.itemsize} bytes ({total * dtype.itemsize} bytes): truncated or corrupt")
    tokens = (np.memmap(bin_path, dtype=dtype, mode="r", shape=(total,)) if total
              else np.zeros(0, dtype=dtype))
    return MegatronIndex(tokens, lengths, pointers, documents)

