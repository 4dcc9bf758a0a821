"""Datasets and the layout-independent sample order.

A dataset is a 1-D token array cut into non-overlapping windows of seq_length + 1 tokens
(inputs = window[:-1], targets = window[1:]). The order in which windows are visited is a
function of (seed, number of windows) alone: it does not depend on train.steps or on the
parallel layout, so every layout and every resumed run sees the same global batches.
"""
from __future__ import annotations

import functools
import os
import sysconfig
from typing import List, Tuple

import numpy as np
import torch

STDLIB_VOCAB = 256  # byte-level


class DataError(Exception):
    """A dataset that cannot be used; the message names the path or key and the fix."""


class TokenWindows:
    """Non-overlapping windows of seq_length + 1 tokens over a 1-D token array.

    tokens: numpy array (uint8/uint16/uint32, possibly a np.memmap); trailing tokens that do
    not fill a whole window are dropped. Item i -> LongTensor[seq_length + 1].
    """

    def __init__(self, tokens: np.ndarray, seq_length: int):
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tokens.shape}")
        self.tokens = tokens
        self.seq_length = int(seq_length)
        self.window = self.seq_length + 1
        self._len = len(tokens) // self.window

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> torch.Tensor:
        i = int(i)
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError(f"window {i} out of range for {self._len} windows")
        start = i * self.window
        return torch.from_numpy(np.asarray(self.tokens[start:start + self.window], dtype=np.int64))


def load_stdlib_tokens(max_bytes: int) -> np.ndarray:
    """The standard library's .py sources as bytes (uint8 tokens), at most max_bytes of them.

    Files in sorted relative-path order (posix separators), skipping site-packages,
    dist-packages and __pycache__ directories, concatenated without separators.
    """
    root = sysconfig.get_paths()["stdlib"]
    skip = {"site-packages", "dist-packages", "__pycache__"}
    rel_paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip]
        rel_dir = os.path.relpath(dirpath, root)
        for fn in filenames:
            if fn.endswith(".py"):
                rel = fn if rel_dir == "." else os.path.join(rel_dir, fn)
                rel_paths.append(rel.replace(os.sep, "/"))
    rel_paths.sort()
    buf = bytearray()
    for rel in rel_paths:
        if len(buf) >= max_bytes:
            break
        try:
            with open(os.path.join(root, rel), "rb") as f:
                buf += f.read(max_bytes - len(buf))
        except OSError:
            continue  # unreadable file (permissions, broken link): skip it deterministically
    if not buf:
        raise DataError(f"no Python sources found under the standard library directory "
                        f"{root!r}; use data=indexed data.path=<prefix> with a preprocessed "
                        f"corpus instead.")
    return np.frombuffer(bytes(buf), dtype=np.uint8)


def _split(tokens: np.ndarray, seq_length: int, val_fraction: float,
           source: str) -> Tuple[TokenWindows, TokenWindows]:
    window = seq_length + 1
    n = len(tokens) // window
    n_val = max(1, int(n * float(val_fraction)))
    if n - n_val < 1:
        raise DataError(f"{source} holds {len(tokens)} tokens, {n} windows of "
                        f"model.seq_length+1={window}; at least 2 are needed (1 train, 1 "
                        f"validation). Provide more data or lower model.seq_length.")
    n_train = n - n_val
    train = TokenWindows(tokens[:n_train * window], seq_length)
    val = TokenWindows(tokens[n_train * window:n * window], seq_length)
    return train, val


def build_datasets(data_cfg, seq_length: int, vocab_size: int) -> Tuple[TokenWindows, TokenWindows]:
    """(train, val): val is the last data.val_fraction of the windows (at least one)."""
    name = data_cfg.name
    if name == "stdlib":
        if vocab_size < STDLIB_VOCAB:
            raise DataError(f"data=stdlib is byte-level and needs model.vocab_size >= 256, got "
                            f"model.vocab_size={vocab_size}; set model.vocab_size=256.")
        tokens = load_stdlib_tokens(int(data_cfg.max_bytes))
        return _split(tokens, seq_length, data_cfg.val_fraction, "data=stdlib")
    if name in ("indexed", "megatron"):
        blend = getattr(data_cfg, "blend", None)
        if blend:
            from mpoverlap.training.blend import BlendedWindows, ConcatWindows, parse_blend

            weights, prefixes = parse_blend(blend)
            splits = [_split(load_token_file(name, p, vocab_size), seq_length, data_cfg.val_fraction, f"{p}.bin")
                      for p in prefixes]
            return (BlendedWindows([t for t, _ in splits], weights, prefixes),
                    ConcatWindows([v for _, v in splits]))
        path = data_cfg.path
        if not path:
            raise DataError(f"data={name} needs data.path, the prefix of the <prefix>.bin / "
                            "<prefix>.idx files (mpoverlap-preprocess's, or Megatron-LM's for "
                            "data=megatron); set data.path=<prefix>.")
        path = os.fspath(path)
        return _split(load_token_file(name, path, vocab_size), seq_length, data_cfg.val_fraction, f"{path}.bin")
    raise DataError(f"data.name={name!r} is not a known dataset; use data=stdlib, "
                    f"data=indexed data.path=<prefix> or data=megatron data.path=<prefix>.")


def load_token_file(name: str, path: str, vocab_size: int) -> np.ndarray:
    """The token stream of one data=indexed|megatron pair, checked against model.vocab_size:
    by the vocabulary recorded in the index when there is one (before any worker starts),
    else by the largest id in the file."""
    path = os.fspath(path)
    vocab = None
    if name == "indexed":
        from mpoverlap.training.preprocess import read_header, read_index

        tokens, _ = read_index(path)
        vocab = read_header(path)["vocab_size"]
        if vocab is not None and vocab > vocab_size:
            raise DataError(f"{path}.idx was tokenised with a vocabulary of {vocab} ids but "
                            f"model.vocab_size={vocab_size} is smaller; set model.vocab_size={vocab} "
                            "(or larger), or re-tokenise the corpus.")
    else:
        from mpoverlap.training.megatron_data import read_megatron

        tokens = read_megatron(path).tokens
    if vocab is None and len(tokens):
        max_id = int(tokens.max())
        if max_id >= vocab_size:
            raise DataError(f"{path}.bin contains token id {max_id} but "
                            f"model.vocab_size={vocab_size}; set model.vocab_size="
                            f"{max_id + 1} or larger, or re-tokenise the corpus.")
    return tokens


@functools.lru_cache(maxsize=16)  # a blend keeps one per dataset in use
def _epoch_permutation(seed: int, num_samples: int, epoch: int) -> np.ndarray:
    perm = np.random.default_rng([seed, epoch]).permutation(num_samples)
    perm.flags.writeable = False
    return perm


def sample_index(global_sample: int, num_samples: int, seed: int) -> int:
    """Dataset index of global sample g: epoch e = g // N shuffled by default_rng([seed, e])."""
    if num_samples <= 0:
        raise ValueError("sample_index needs a non-empty dataset")
    epoch, pos = divmod(int(global_sample), int(num_samples))
    return int(_epoch_permutation(int(seed), int(num_samples), epoch)[pos])


def batch_rows(dataset, first: int, count: int, seed: int) -> torch.Tensor:
    """LongTensor[count, S+1] of global samples [first, first + count)."""
    n = len(dataset)
    first = int(first)
    if hasattr(dataset, "sample"):  # a blend (blend.py) orders its own samples
        rows = [dataset.sample(g, seed) for g in range(first, first + count)]
    else:
        rows = [dataset[sample_index(g, n, seed)] for g in range(first, first + count)]
    return torch.stack(rows)


def global_batch(dataset, step: int, global_batch_size: int, seed: int) -> torch.Tensor:
    """LongTensor[G, S+1] of global samples [step*G, (step+1)*G), same on every rank."""
    return batch_rows(dataset, int(step) * int(global_batch_size), int(global_batch_size), seed)


def _samples_per_rank(G: int, dp_size: int, micro_batch_size: int) -> int:
    if G % dp_size:
        raise ValueError(f"train.global_batch_size={G} is not divisible by the data-parallel "
                         f"size {dp_size}")
    per_rank = G // dp_size
    if per_rank % micro_batch_size:
        raise ValueError(f"train.global_batch_size={G} / dp={dp_size} = {per_rank} samples per "
                         f"rank is not divisible by train.micro_batch_size={micro_batch_size}")
    return per_rank


def rank_microbatches(batch_GS: torch.Tensor, dp_rank: int, dp_size: int,
                      micro_batch_size: int) -> List[torch.Tensor]:
    """This DP rank's contiguous G/dp samples, split into G/dp/mbs microbatches [mbs, S+1]."""
    per_rank = _samples_per_rank(batch_GS.shape[0], dp_size, micro_batch_size)
    mine = batch_GS[dp_rank * per_rank:(dp_rank + 1) * per_rank]
    return list(mine.split(micro_batch_size))


def rank_batch(dataset, step: int, global_batch_size: int, seed: int, dp_rank: int, dp_size: int,
               micro_batch_size: int) -> List[torch.Tensor]:
    """`rank_microbatches(global_batch(...))` without building the other ranks' samples: this
    DP rank's G/dp samples of step `step`, as G/dp/mbs microbatches [mbs, S+1]."""
    per_rank = _samples_per_rank(int(global_batch_size), dp_size, micro_batch_size)
    first = int(step) * int(global_batch_size) + dp_rank * per_rank
    return list(batch_rows(dataset, first, per_rank, seed).split(micro_batch_size))
