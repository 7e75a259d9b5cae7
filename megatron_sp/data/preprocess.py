"""JSONL → Megatron indexed dataset ``{output_prefix}_{key}_{level}.bin/.idx`` per JSON key, as Megatron-LM's
``tools/preprocess_data.py``, with worker processes and all-or-nothing outputs (docs/data.md)."""
from __future__ import annotations

import contextlib
import errno
import logging
import multiprocessing
import re
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from megatron_sp.data.corpus import check_input_files, parse_jsonl_line, read_lines
from megatron_sp.data.indexed import IndexedDatasetWriter, best_dtype, staged_outputs
from megatron_sp.data.tokenizer import Tokenizer
from megatron_sp.errors import DataError, write_failure

log = logging.getLogger("megatron_sp")

_Chunk = tuple[str, int, list[bytes]]
"""(path, line number of the first line, raw lines) of one read chunk."""
_Packed = tuple[np.ndarray, np.ndarray, np.ndarray]
"""One key's tokens of a chunk: (tokens, sequence lengths int32, sequences per document int64)."""
_ChunkResult = tuple[list[_Packed], int, int]
"""(one _Packed per key, documents, input bytes)."""

DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
"""The ``OSError`` numbers of a write that ran out of room: reported in one line with the bytes needed."""

_SENTENCE_END = re.compile(r"[.!?]+[\"')\]]*\s+|\n[ \t\r\f\v]*\n\s*")


def split_sentences(text: str) -> list[str]:
    """Cut ``text`` after each ``.``/``!``/``?`` (and closing quotes or brackets) followed by whitespace, and
    after each blank line; ``"".join(split_sentences(t)) == t``. A rule, not NLTK's punkt ("e.g. " ends one)."""
    sentences, start = [], 0
    for match in _SENTENCE_END.finditer(text):
        sentences.append(text[start:match.end()])
        start = match.end()
    if start < len(text):
        sentences.append(text[start:])
    return sentences


@dataclass
class _Encoder:
    """Tokenizes one chunk of JSONL lines into one packed token array per key (runs in the workers)."""

    tokenizer: Tokenizer
    json_keys: Sequence[str]
    append_eod: bool
    dtype: np.dtype
    split: bool = False

    def __call__(self, chunk: _Chunk) -> _ChunkResult:
        path, first_line, lines = chunk
        documents: list[list[list[str]]] = [[] for _ in self.json_keys]  # [key][document] -> sentences
        n_docs = n_bytes = 0
        for offset, raw in enumerate(lines):
            n_bytes += len(raw)
            if not raw.strip():
                continue
            values = parse_jsonl_line(raw, path, first_line + offset, self.json_keys, allow_lists=True)
            n_docs += 1
            for per_key, value in zip(documents, values, strict=True):
                if isinstance(value, list):
                    per_key.append(value)
                else:
                    per_key.append(split_sentences(value) if self.split else [value])
        return [self._pack(per_key) for per_key in documents], n_docs, n_bytes

    def _pack(self, documents: list[list[str]]) -> _Packed:
        ids = self.tokenizer.encode_batch([sentence for sentences in documents for sentence in sentences])
        eod = self.tokenizer.eod
        tokens: list[int] = []
        lengths: list[int] = []
        per_document: list[int] = []
        k = 0
        for sentences in documents:
            n_sequences = 0
            for sentence_ids in ids[k:k + len(sentences)]:
                if sentence_ids:  # Megatron leaves out sentences without tokens
                    tokens.extend(sentence_ids)
                    lengths.append(len(sentence_ids))
                    n_sequences += 1
            k += len(sentences)
            if n_sequences and self.append_eod:
                tokens.append(eod)
                lengths[-1] += 1
            per_document.append(n_sequences)
        return (np.array(tokens, dtype=self.dtype), np.array(lengths, dtype=np.int32),
                np.array(per_document, dtype=np.int64))


_worker_encoder: _Encoder | None = None


def _init_worker(encoder: _Encoder) -> None:
    global _worker_encoder
    _worker_encoder = encoder


def _encode_in_worker(chunk: _Chunk) -> _ChunkResult:
    assert _worker_encoder is not None, "worker pool started without an encoder"
    return _worker_encoder(chunk)


def read_chunks(paths: Sequence[Path], chunk_bytes: int = 1 << 16, max_lines: int = 1024) -> Iterator[_Chunk]:
    """Whole lines of JSONL files (plain or ``.gz``) in chunks of about ``chunk_bytes`` bytes."""
    for path in paths:
        lines: list[bytes] = []
        size, first = 0, 1
        for line_no, raw in enumerate(read_lines(path), start=1):
            lines.append(raw)
            size += len(raw)
            if size >= chunk_bytes or len(lines) >= max_lines:
                yield str(path), first, lines
                lines, size, first = [], 0, line_no + 1
        if lines:
            yield str(path), first, lines


def _ordered(pool: Any, chunks: Iterable[_Chunk], in_flight: int) -> Iterator[_ChunkResult]:
    """Results of the pool in input order, with at most ``in_flight`` chunks submitted ahead."""
    pending: deque[Any] = deque()
    for chunk in chunks:
        pending.append(pool.apply_async(_encode_in_worker, (chunk,)))
        if len(pending) >= in_flight:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


def preprocess_jsonl(input_paths: Sequence[str | Path], output_prefix: str | Path, tokenizer: Tokenizer,
                     json_keys: Sequence[str] = ("text",), append_eod: bool = True, workers: int = 1,
                     *, split_sentences: bool = False, chunk_bytes: int = 1 << 16,
                     log_interval: int = 1000, overwrite: bool = True) -> dict[str, Any]:
    """Tokenize JSONL files (plain or ``.gz``) into ``{output_prefix}_{key}_{document|sentence}.bin/.idx``.
    Returns stats: ``docs``, ``tokens`` (EODs included), ``bytes`` read, ``seconds``, ``outputs`` (prefixes)."""
    level = "sentence" if split_sentences else "document"
    prefixes = {key: f"{output_prefix}_{key}_{level}" for key in json_keys}  # Megatron's naming
    return tokenize_jsonl_to(input_paths, prefixes, tokenizer, append_eod=append_eod, workers=workers,
                             split_sentences=split_sentences, chunk_bytes=chunk_bytes, log_interval=log_interval,
                             overwrite=overwrite)


def tokenize_jsonl_to(input_paths: Sequence[str | Path], prefixes: dict[str, str | Path], tokenizer: Tokenizer,
                      *, append_eod: bool = True, workers: int = 1, split_sentences: bool = False,
                      chunk_bytes: int = 1 << 16, log_interval: int = 1000, overwrite: bool = True) -> dict[str, Any]:
    """Like ``preprocess_jsonl`` with an explicit dataset prefix per JSON key (``{key: prefix}``)."""
    if not prefixes:
        raise ValueError("no JSON keys to tokenize")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    paths = [Path(p) for p in input_paths]
    check_input_files(paths, next(iter(prefixes)))  # fail before starting workers or creating outputs
    dtype = best_dtype(tokenizer.vocab_size)
    encoder = _Encoder(tokenizer, list(prefixes), append_eod, dtype, split_sentences)
    chunks = read_chunks(paths, chunk_bytes)
    start = time.perf_counter()
    docs = tokens = read = 0
    next_log = log_interval
    try:
        with staged_outputs(list(prefixes.values()), overwrite) as staged, contextlib.ExitStack() as stack:
            writers = [stack.enter_context(IndexedDatasetWriter(prefix, dtype)) for prefix in staged]
            if workers == 1:
                results: Iterable[_ChunkResult] = map(encoder, chunks)
            else:
                pool = stack.enter_context(multiprocessing.Pool(workers, initializer=_init_worker, initargs=(encoder,)))
                results = _ordered(pool, chunks, 2 * workers)
            for packed, n_docs, n_bytes in results:
                for writer, (chunk_tokens, lengths, per_document) in zip(writers, packed, strict=True):
                    writer.add_packed(chunk_tokens, lengths, per_document)
                    tokens += int(chunk_tokens.size)
                docs += n_docs
                read += n_bytes
                if log_interval and docs >= next_log:
                    elapsed = max(time.perf_counter() - start, 1e-9)
                    log.info("processed %d documents (%.1f docs/s, %.2f MB/s)", docs, docs / elapsed,
                             read / 1e6 / elapsed)
                    next_log = (docs // log_interval + 1) * log_interval
            if docs == 0:
                raise DataError(f"no documents in {', '.join(map(str, paths))} (every line is blank); nothing was "
                                f"written: give a JSONL corpus with one JSON object per line")
    except OSError as exc:  # a full disk: the outputs and their temporary files are gone (staged_outputs)
        if exc.errno not in DISK_FULL:
            raise
        total = sum(p.stat().st_size for p in paths)  # the bytes needed: the tokens per input byte so far, or one
        need = int(total * (tokens / read if tokens and read else len(prefixes)) * dtype.itemsize)
        raise DataError(f"nothing was written: {write_failure(f'{next(iter(prefixes.values()))}.bin', exc, need)}") from None
    seconds = time.perf_counter() - start
    outputs = [str(p) for p in prefixes.values()]
    log.info("tokenized %d documents, %d tokens (%.2f MB) into %s in %.1f s", docs, tokens, read / 1e6,
             ", ".join(outputs), seconds)
    return {"docs": docs, "tokens": tokens, "bytes": read, "seconds": seconds, "outputs": outputs}
