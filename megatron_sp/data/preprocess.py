"""JSONL → Megatron indexed dataset: ``{output_prefix}_{key}_document.bin/.idx`` per JSON key.

One JSONL line is one document: its text is tokenized, EOD appended (``append_eod``), and it is
written as a single sequence. With ``workers > 1`` lines are tokenized by a process pool
(``imap`` in chunks, which keeps the input order, so the output does not depend on ``workers``).
"""
from __future__ import annotations

import contextlib
import logging
import multiprocessing
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from megatron_sp.data.corpus import (
    check_input_files,
    iter_jsonl_lines,
    parse_jsonl_line,
)
from megatron_sp.data.indexed import IndexedDatasetWriter, best_dtype
from megatron_sp.data.tokenizer import Tokenizer

log = logging.getLogger("megatron_sp")

_LineTask = tuple[str, int, bytes]
_LineResult = tuple[list[np.ndarray], int]


def output_prefix_for(output_prefix: str | Path, json_key: str) -> str:
    """Megatron's naming: the dataset prefix of ``json_key`` is ``{output_prefix}_{json_key}_document``."""
    return f"{output_prefix}_{json_key}_document"


class _Encoder:
    """Tokenizes one JSONL line into one token array per key (runs in the workers)."""

    def __init__(self, tokenizer: Tokenizer, json_keys: Sequence[str], append_eod: bool, dtype: np.dtype) -> None:
        self.tokenizer = tokenizer
        self.json_keys = tuple(json_keys)
        self.append_eod = append_eod
        self.dtype = dtype

    def __call__(self, task: _LineTask) -> _LineResult:
        path, line_no, raw = task
        arrays = []
        for text in parse_jsonl_line(raw, path, line_no, self.json_keys):
            ids = self.tokenizer.encode(text)
            if self.append_eod:
                ids.append(self.tokenizer.eod)
            arrays.append(np.asarray(ids, dtype=self.dtype))
        return arrays, len(raw)


_worker_encoder: _Encoder | None = None


def _init_worker(encoder: _Encoder) -> None:
    global _worker_encoder
    _worker_encoder = encoder


def _encode_in_worker(task: _LineTask) -> _LineResult:
    assert _worker_encoder is not None, "worker pool started without an encoder"
    return _worker_encoder(task)


def preprocess_jsonl(input_paths: Sequence[str | Path], output_prefix: str | Path, tokenizer: Tokenizer,
                     json_keys: Sequence[str] = ("text",), append_eod: bool = True, workers: int = 1,
                     *, chunk_size: int = 16) -> dict[str, Any]:
    """Tokenize JSONL files (plain or ``.gz``) into ``{output_prefix}_{key}_document.bin/.idx``.

    Returns stats: ``docs``, ``tokens`` (all keys, EODs included), ``bytes`` (input read),
    ``seconds`` and ``outputs`` (the dataset prefixes written).
    """
    prefixes = {key: output_prefix_for(output_prefix, key) for key in json_keys}
    return tokenize_jsonl_to(input_paths, prefixes, tokenizer, append_eod=append_eod, workers=workers,
                             chunk_size=chunk_size)


def tokenize_jsonl_to(input_paths: Sequence[str | Path], prefixes: dict[str, str | Path], tokenizer: Tokenizer,
                      *, append_eod: bool = True, workers: int = 1, chunk_size: int = 16) -> dict[str, Any]:
    """Like ``preprocess_jsonl`` with an explicit dataset prefix per JSON key (``{key: prefix}``)."""
    if not prefixes:
        raise ValueError("no JSON keys to tokenize")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    paths = [Path(p) for p in input_paths]
    check_input_files(paths, next(iter(prefixes)))  # fail before starting workers or creating outputs
    dtype = best_dtype(tokenizer.vocab_size)
    encoder = _Encoder(tokenizer, list(prefixes), append_eod, dtype)
    tasks: Iterable[_LineTask] = ((str(path), line_no, raw) for path, line_no, raw in iter_jsonl_lines(paths))
    start = time.perf_counter()
    docs = tokens = read = 0
    with contextlib.ExitStack() as stack:
        writers = [stack.enter_context(IndexedDatasetWriter(prefix, dtype)) for prefix in prefixes.values()]
        if workers == 1:
            results: Iterable[_LineResult] = map(encoder, tasks)
        else:
            pool = stack.enter_context(multiprocessing.Pool(workers, initializer=_init_worker, initargs=(encoder,)))
            results = pool.imap(_encode_in_worker, tasks, chunksize=chunk_size)
        for arrays, n_bytes in results:
            for writer, array in zip(writers, arrays, strict=True):
                writer.add_document(array)
                tokens += int(array.size)
            docs += 1
            read += n_bytes
    seconds = time.perf_counter() - start
    outputs = [str(p) for p in prefixes.values()]
    if docs == 0:
        log.warning("no documents in %s: the datasets written are empty", ", ".join(map(str, paths)))
    log.info("tokenized %d documents, %d tokens (%.2f MB) into %s in %.1f s", docs, tokens, read / 1e6,
             ", ".join(outputs), seconds)
    return {"docs": docs, "tokens": tokens, "bytes": read, "seconds": seconds, "outputs": outputs}
