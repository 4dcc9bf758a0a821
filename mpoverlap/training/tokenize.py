"""Tokenisers for mpoverlap-preprocess: byte level (built in) or a `tokenizers` tokenizer.json.

`encode_stream` tokenises documents in order, in `workers` processes (each loads the
tokenizer once) with a tqdm progress bar. The `tokenizers` library is an optional extra,
imported only when a tokenizer file is given; nothing is ever downloaded.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from itertools import islice
from typing import Iterable, Iterator, List, Optional

import numpy as np

# End-of-text tokens tried in this order when the tokenizer is asked to append one.
EOD_TOKENS = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")
_CHUNK = 64  # documents per task sent to a worker


class TokenizerError(Exception):
    """A tokenizer that cannot be used; the message names the file and the fix."""


@dataclass(frozen=True)
class TokenizerSpec:
    path: Optional[str]  # tokenizer.json, or None for byte level
    vocab_size: int
    eod_id: Optional[int]  # appended after every document when append_eod
    append_eod: bool

    @staticmethod
    def load(path: Optional[str], append_eod: bool) -> "TokenizerSpec":
        if path is None:
            return TokenizerSpec(None, 256, 0, append_eod)
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise TokenizerError(f"--tokenizer {path}: no such file (give a tokenizer.json or the directory "
                                 "holding one; nothing is downloaded)")
        tok = _open(file)
        vocab = int(tok.get_vocab_size(with_added_tokens=True))
        eod = next((tok.token_to_id(t) for t in EOD_TOKENS if tok.token_to_id(t) is not None), None)
        if append_eod and eod is None:
            raise TokenizerError(f"--append-eod: {file} has none of the end-of-text tokens {', '.join(EOD_TOKENS)}; "
                                 "add one to the tokenizer or drop --append-eod")
        return TokenizerSpec(file, vocab, eod, append_eod)


def _open(file: str):
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise TokenizerError("--tokenizer needs the `tokenizers` package: pip install 'mpoverlap[tokenizers]'") from None
    try:
        return Tokenizer.from_file(file)
    except Exception as err:  # the Rust side raises plain Exceptions
        raise TokenizerError(f"{file} is not a tokenizers tokenizer.json ({err})") from None


_worker_tokenizer = None


def _init_worker(spec: TokenizerSpec) -> None:
    global _worker_tokenizer
    # One process per worker already: the Rust thread pool would oversubscribe the cores.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker_tokenizer = _open(spec.path) if spec.path else None


def _encode_chunk(args) -> List[np.ndarray]:
    spec, docs = args
    out = []
    for doc in docs:
        if _worker_tokenizer is None:
            ids = np.frombuffer(doc, dtype=np.uint8).astype(np.int64)
        else:
            try:
                text = doc.decode("utf-8")
            except UnicodeDecodeError as err:
                raise TokenizerError(f"a document is not UTF-8 ({err}); a tokenizer reads text") from None
            ids = np.asarray(_worker_tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int64)
        if spec.append_eod:
            ids = np.append(ids, spec.eod_id)
        out.append(ids)
    return out


def _chunks(docs: Iterable[bytes], spec: TokenizerSpec) -> Iterator:
    it = iter(docs)
    while True:
        chunk = list(islice(it, _CHUNK))
        if not chunk:
            return
        yield spec, chunk


def encode_stream(spec: TokenizerSpec, docs: Iterable[bytes], workers: int = 1,
                  progress: bool = True) -> Iterator[np.ndarray]:
    """Token ids (int64) of each document, in input order."""
    from tqdm import tqdm

    bar = tqdm(unit="doc", desc="tokenising", disable=None if progress else True,  # None: off when not a terminal
               mininterval=1.0)
    try:
        if workers <= 1:
            _init_worker(spec)
            results = map(_encode_chunk, _chunks(docs, spec))
            for chunk in results:
                yield from chunk
                bar.update(len(chunk))
            return
        import multiprocessing as mp

        # fork: workers inherit the imports; the parent never ran the tokenizer, so no Rust
        # thread pool is forked.
        with mp.get_context("fork").Pool(workers, initializer=_init_worker, initargs=(spec,)) as pool:
            for chunk in pool.imap(_encode_chunk, _chunks(docs, spec)):
                yield from chunk
                bar.update(len(chunk))
    finally:
        bar.close()
