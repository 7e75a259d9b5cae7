"""Megatron-LM's mmap indexed dataset: a ``PREFIX.bin`` of raw tokens and a ``PREFIX.idx`` index,
byte-compatible with megatron-core's. The byte layout of ``.idx``: docs/data.md.
"""
from __future__ import annotations

import contextlib
import logging
import os
import struct
import array
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import numpy as np

from megatron_sp.files import temp_path
from megatron_sp.errors import DataError, refuse_existing_outputs

log = logging.getLogger("megatron_sp")

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")
"""magic, version, dtype code, sequence count, document count: 34 bytes."""

DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
"""Megatron's dtype codes of the token array."""

_CODE_OF_DTYPE = {dtype: code for code, dtype in DTYPE_CODES.items()}

PREPROCESS_HINT = ("it is created by `python tools/preprocess_data.py --input CORPUS.jsonl --output-prefix PREFIX "
                   "--tokenizer-type sentencepiece --tokenizer-model TOKENIZER.model --append-eod`, which writes "
                   "PREFIX_text_document.bin/.idx")


def best_dtype(vocab_size: int) -> np.dtype:
    """The token dtype Megatron picks for a vocabulary: uint16 below 65500 ids, else int32."""
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


def data_file_paths(prefix: str | Path) -> tuple[Path, Path]:
    """``(PREFIX.bin, PREFIX.idx)``; the suffixes are appended (a prefix may contain dots)."""
    prefix = str(prefix)
    return Path(prefix + ".bin"), Path(prefix + ".idx")


def refuse_existing(prefixes: Iterable[str | Path]) -> None:
    """``DataError`` when a ``.bin`` or ``.idx`` of ``prefixes`` exists (outputs without ``--overwrite``)."""
    refuse_existing_outputs((p for prefix in prefixes for p in data_file_paths(prefix)), "choose another --output-prefix")


@contextlib.contextmanager
def staged_outputs(prefixes: Sequence[str | Path], overwrite: bool) -> Iterator[list[str]]:
    """Temporary prefixes to write ``prefixes`` under, all renamed into place (``.bin`` then ``.idx``) when
    the block succeeds and deleted when it raises; unless ``overwrite``, existing outputs are refused before
    and after. See docs/data.md, "Outputs are all-or-nothing"."""
    if not overwrite:
        refuse_existing(prefixes)
    staged = [str(temp_path(Path(prefix))) for prefix in prefixes]
    try:
        yield staged
        if not overwrite:
            refuse_existing(prefixes)  # created meanwhile: still never replaced
        for tmp_prefix, prefix in zip(staged, prefixes, strict=True):
            for tmp, final in zip(data_file_paths(tmp_prefix), data_file_paths(prefix), strict=True):
                os.replace(tmp, final)  # .bin first, .idx last (a reader checks the pair)
    finally:
        for tmp_prefix in staged:
            for tmp in data_file_paths(tmp_prefix):
                tmp.unlink(missing_ok=True)


def _le(dtype: np.dtype) -> np.dtype:
    """The little-endian variant of a dtype (the on-disk byte order)."""
    return dtype.newbyteorder("<") if dtype.itemsize > 1 else dtype


class IndexedDatasetWriter:
    """Writes ``PREFIX.bin`` and ``PREFIX.idx`` under temporary names; ``finalize`` (or leaving the
    ``with`` block without error) renames them into place, ``.bin`` first, so no half-written pair is
    ever visible. Sizes and document indices are kept in typed arrays (12 bytes per sequence)."""

    def __init__(self, prefix: str | Path, dtype: np.dtype | type = np.int32) -> None:
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODE_OF_DTYPE:
            raise ValueError(f"dtype {self.dtype} has no Megatron dtype code; use one of "
                             f"{sorted(str(d) for d in _CODE_OF_DTYPE)}")
        self.bin_path, self.idx_path = data_file_paths(prefix)
        self.bin_path.parent.mkdir(parents=True, exist_ok=True)
        self._tmp_bin, self._tmp_idx = temp_path(self.bin_path), temp_path(self.idx_path)
        self._bin = open(self._tmp_bin, "wb")
        self._sizes = array.array("i")  # int32 tokens per sequence
        self._documents = array.array("q", [0])  # document_indices: 0, then one past each document's last sequence
        self._closed = False
        info = np.iinfo(self.dtype) if self.dtype.kind in "iu" else None
        self._bounds = (info.min, info.max) if info is not None else None

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"writer for {self.bin_path} is already finalized")

    def _write_tokens(self, array: np.ndarray) -> None:
        # Ids are range-checked unless their dtype already fits (workers hand over arrays of self.dtype).
        if array.size and self._bounds is not None and not np.can_cast(array.dtype, self.dtype, "safe"):
            low, high = int(array.min()), int(array.max())
            if low < self._bounds[0] or high > self._bounds[1]:
                raise ValueError(f"token ids {low}..{high} do not fit {self.dtype} (range {self._bounds[0]}.."
                                 f"{self._bounds[1]}); pick the dtype with best_dtype(vocab_size)")
        self._bin.write(memoryview(np.ascontiguousarray(array, dtype=_le(self.dtype))).cast("B"))

    def add_item(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Append one sequence to the current document (end it with ``end_document``)."""
        self._check_open()
        array = np.asarray(tokens)
        if array.ndim != 1:
            raise ValueError(f"a sequence must be 1-D, got shape {array.shape}")
        self._write_tokens(array)
        self._sizes.append(int(array.size))

    def end_document(self) -> None:
        """Close the current document: the sequences added since the previous call form one document."""
        self._check_open()
        self._documents.append(len(self._sizes))

    def add_document(self, tokens: Sequence[int] | np.ndarray, lengths: Sequence[int] | None = None) -> None:
        """Append one document: a single sequence, or ``tokens`` cut into sequences of ``lengths``."""
        if lengths is None:
            self.add_item(tokens)
        else:
            array = np.asarray(tokens)
            if sum(lengths) != array.size:
                raise ValueError(f"lengths sum to {sum(lengths)} but the document has {array.size} tokens")
            start = 0
            for length in lengths:
                self.add_item(array[start:start + length])
                start += length
        self.end_document()

    def add_documents(self, documents: Iterable[Sequence[int] | np.ndarray]) -> None:
        """Append several single-sequence documents."""
        for tokens in documents:
            self.add_document(tokens)

    def add_packed(self, tokens: np.ndarray, sequence_lengths: np.ndarray, sequences_per_document: np.ndarray) -> None:
        """Append whole documents in one write: ``tokens`` back to back, cut into sequences of
        ``sequence_lengths``, which group into documents of ``sequences_per_document`` sequences each."""
        self._check_open()
        if self._documents[-1] != len(self._sizes):
            raise RuntimeError(f"add_packed on {self.bin_path} inside an open document; call end_document first")
        tokens = np.asarray(tokens)
        lengths = np.asarray(sequence_lengths, dtype=np.int64)
        per_doc = np.asarray(sequences_per_document, dtype=np.int64)
        if tokens.ndim != 1 or int(lengths.sum()) != tokens.size or int(per_doc.sum()) != lengths.size:
            raise ValueError(f"add_packed: {tokens.size} tokens, sequence lengths summing to {int(lengths.sum())}, "
                             f"{lengths.size} sequences but documents of {int(per_doc.sum())} sequences")
        if (lengths.size and lengths.min() < 0) or (per_doc.size and per_doc.min() < 0):
            raise ValueError("add_packed: negative sequence lengths or sequence counts")
        self._write_tokens(tokens)
        self._documents.frombytes((len(self._sizes) + np.cumsum(per_doc)).astype(np.int64).tobytes())
        self._sizes.frombytes(lengths.astype(np.int32).tobytes())

    def finalize(self) -> None:
        """Write the index and move both files to their final names. Ends an open document first."""
        if self._closed:
            return
        if self._documents[-1] != len(self._sizes):
            self.end_document()
        try:
            self._bin.close()
            sizes = np.frombuffer(self._sizes, dtype=np.int32).astype("<i4")
            pointers = np.zeros(len(sizes), dtype="<i8")
            if len(sizes) > 1:
                np.cumsum(sizes[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
            document_indices = np.frombuffer(self._documents, dtype=np.int64).astype("<i8")
            with open(self._tmp_idx, "wb") as f:
                f.write(HEADER.pack(MAGIC, VERSION, _CODE_OF_DTYPE[self.dtype], len(sizes), len(document_indices)))
                f.write(sizes.tobytes())
                f.write(pointers.tobytes())
                f.write(document_indices.tobytes())
            os.replace(self._tmp_bin, self.bin_path)
            os.replace(self._tmp_idx, self.idx_path)
        except BaseException:
            self.discard()
            raise
        self._closed = True
        log.debug("wrote %s (%d sequences, %d documents)", self.idx_path, len(sizes), len(document_indices) - 1)

    def discard(self) -> None:
        """Abandon the output: close and delete the temporary files (the final names are untouched)."""
        self._closed = True
        self._bin.close()
        for path in (self._tmp_bin, self._tmp_idx):
            path.unlink(missing_ok=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.discard()


class IndexedDataset:
    """Read-only, memory-mapped view of ``PREFIX.bin`` / ``PREFIX.idx``: ``ds[i]`` is sequence ``i``,
    ``get_document(d, offset, length)`` part of a document. Opening validates both files (``DataError``)."""

    def __init__(self, prefix: str | Path) -> None:
        self.prefix = Path(prefix)
        self.bin_path, self.idx_path = data_file_paths(prefix)
        self._open()

    def _open(self) -> None:
        for path in (self.idx_path, self.bin_path):
            if not path.is_file():
                raise DataError(f"dataset file {path} not found; {PREPROCESS_HINT}")
        idx_size = self.idx_path.stat().st_size
        with open(self.idx_path, "rb") as f:
            header = f.read(HEADER.size)
        if len(header) >= len(MAGIC) and header[:len(MAGIC)] != MAGIC:
            raise DataError(f"{self.idx_path} is not a Megatron mmap index (magic bytes {header[:len(MAGIC)]!r}, "
                            f"expected {MAGIC!r}); rebuild it with tools/preprocess_data.py")
        if len(header) < HEADER.size:
            raise DataError(f"{self.idx_path} is truncated ({idx_size} bytes, the header alone is {HEADER.size}); "
                            f"rebuild it with tools/preprocess_data.py")
        _, version, code, num_sequences, num_doc_entries = HEADER.unpack(header)
        if version != VERSION:
            raise DataError(f"{self.idx_path} has index version {version}; only version {VERSION} is supported: "
                            f"rebuild it with tools/preprocess_data.py")
        if code not in DTYPE_CODES:
            raise DataError(f"{self.idx_path} has unknown dtype code {code} (known: {sorted(DTYPE_CODES)}); rebuild "
                            f"it with tools/preprocess_data.py")
        self.dtype: np.dtype = DTYPE_CODES[code]
        expected = HEADER.size + num_sequences * (4 + 8) + num_doc_entries * 8
        if idx_size < expected:
            raise DataError(f"{self.idx_path} is truncated: {idx_size} bytes, but its header ({num_sequences} "
                            f"sequences, {num_doc_entries} document entries) needs {expected}; rebuild it with "
                            f"tools/preprocess_data.py")
        if idx_size > expected:
            raise DataError(f"{self.idx_path} has {idx_size - expected} bytes after the document index "
                            f"(multimodal indices are not supported); rebuild it with tools/preprocess_data.py")

        index = np.memmap(self.idx_path, dtype=np.uint8, mode="r") if idx_size else np.empty(0, np.uint8)
        offset = HEADER.size
        self.sizes: np.ndarray = np.frombuffer(index, dtype="<i4", count=num_sequences, offset=offset)
        offset += 4 * num_sequences
        self.pointers: np.ndarray = np.frombuffer(index, dtype="<i8", count=num_sequences, offset=offset)
        offset += 8 * num_sequences
        self.document_indices: np.ndarray = np.frombuffer(index, dtype="<i8", count=num_doc_entries, offset=offset)
        self._index = index
        self._check_index()

        bin_size = self.bin_path.stat().st_size
        expected_bin = (int(self.pointers[-1]) + int(self.sizes[-1]) * self.dtype.itemsize) if num_sequences else 0
        if bin_size != expected_bin:
            raise DataError(f"{self.bin_path} has {bin_size} bytes but {self.idx_path} describes {expected_bin} "
                            f"(last pointer + last size * {self.dtype.itemsize}); the pair does not belong together "
                            f"or was cut short: rebuild it with tools/preprocess_data.py")
        # A plain ndarray view of the map: slicing a np.memmap runs Python code per slice (5x slower reads).
        self._bin = (np.memmap(self.bin_path, dtype=_le(self.dtype), mode="r").view(np.ndarray) if bin_size
                     else np.empty(0, dtype=_le(self.dtype)))
        # Token offset of each sequence and of each document in the .bin (sequences are contiguous).
        self._sequence_starts = self.pointers // self.dtype.itemsize
        self._document_sizes: np.ndarray | None = None
        self._document_starts: np.ndarray = np.zeros(0, dtype=np.int64)

    def _check_index(self) -> None:
        sizes, pointers, doc = self.sizes, self.pointers, self.document_indices
        where = f"{self.idx_path} is corrupt"
        if len(doc) == 0 or doc[0] != 0 or doc[-1] != len(sizes):
            raise DataError(f"{where}: its document index must run from 0 to the sequence count {len(sizes)}")
        if np.any(np.diff(doc) < 0):
            raise DataError(f"{where}: its document index is not non-decreasing")
        if len(sizes) and sizes.min() < 0:
            raise DataError(f"{where}: it has negative sequence sizes")
        if len(sizes) and (pointers[0] != 0 or not np.array_equal(
                pointers[1:], pointers[:-1] + sizes[:-1].astype(np.int64) * self.dtype.itemsize)):
            raise DataError(f"{where}: its pointers are not the running byte offsets of the sequences")

    def __len__(self) -> int:
        """Number of sequences."""
        return len(self.sizes)

    @property
    def num_documents(self) -> int:
        """Number of documents."""
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        """Total tokens in the ``.bin``."""
        return int(self._bin.shape[0])

    @property
    def document_sizes(self) -> np.ndarray:
        """Tokens per document (int64), the sum of its sequences' sizes."""
        if self._document_sizes is None:
            ends = np.concatenate([[0], np.cumsum(self.sizes, dtype=np.int64)])
            self._document_starts = ends[self.document_indices[:-1]]
            self._document_sizes = ends[self.document_indices[1:]] - self._document_starts
        return self._document_sizes

    def __getitem__(self, i: int | slice) -> Any:
        """Sequence ``i`` (an int, negative allowed) or a list of sequences for a slice."""
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return self.get(i)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``offset … offset+length-1`` of sequence ``i`` (to its end when ``length`` is None)."""
        return self._slice("sequence", i, self._sequence_starts, self.sizes, offset, length)

    def get_document(self, d: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``offset … offset+length-1`` of document ``d`` (all of its sequences, concatenated)."""
        sizes = self.document_sizes  # also fills _document_starts: token offset of each document
        return self._slice("document", d, self._document_starts, sizes, offset, length)

    def token_range(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``start … stop-1`` of the whole ``.bin`` (all sequences back to back)."""
        return self._bin[start:stop]

    def _slice(self, kind: str, i: int, starts: np.ndarray, sizes: np.ndarray, offset: int,
               length: int | None) -> np.ndarray:
        n = len(sizes)
        if not -n <= i < n:
            raise IndexError(f"{kind} {i} out of range for {n} {kind}s in {self.idx_path}")
        i %= n
        start, size = int(starts[i]), int(sizes[i])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"tokens {offset}..{offset + length} out of range for {kind} {i} of {size} tokens")
        return self._bin[start + offset:start + offset + length]

    def __getstate__(self) -> dict[str, Any]:
        return {"prefix": self.prefix}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.prefix = Path(state["prefix"])
        self.bin_path, self.idx_path = data_file_paths(self.prefix)
        self._open()

    def __repr__(self) -> str:
        return (f"IndexedDataset({str(self.prefix)!r}, sequences={len(self)}, documents={self.num_documents}, "
                f"dtype={self.dtype})")
