"""Megatron mmap indexed dataset: round trips, the exact byte layout, and every validation error."""
from __future__ import annotations

import pickle
import struct
from pathlib import Path

import numpy as np
import pytest

from megatron_sp.data.indexed import (
    DTYPE_CODES,
    IndexedDataset,
    IndexedDatasetWriter,
    best_dtype,
    data_file_paths,
)
from megatron_sp.errors import DataError


def _docs(dtype: np.dtype, n: int = 7, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    high = 60000 if dtype == np.uint16 else 2**31 - 1
    docs = [rng.integers(0, high, size=int(rng.integers(1, 40)), dtype=np.int64) for _ in range(n)]
    docs.append(np.array([], dtype=np.int64))  # an empty document is legal
    return docs


def _write(prefix: Path, docs: list[np.ndarray], dtype: np.dtype) -> None:
    with IndexedDatasetWriter(prefix, dtype) as writer:
        for doc in docs:
            writer.add_document(doc)


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_round_trip(tmp_path: Path, dtype: type) -> None:
    docs = _docs(np.dtype(dtype))
    prefix = tmp_path / "ds_text_document"
    _write(prefix, docs, np.dtype(dtype))
    ds = IndexedDataset(prefix)
    assert ds.dtype == np.dtype(dtype)
    assert len(ds) == len(docs) and ds.num_documents == len(docs)
    assert ds.sizes.tolist() == [len(d) for d in docs]
    assert ds.document_indices.tolist() == list(range(len(docs) + 1))
    assert ds.num_tokens == sum(len(d) for d in docs)
    for i, doc in enumerate(docs):
        assert ds[i].tolist() == doc.tolist()
        assert ds.get_document(i).tolist() == doc.tolist()
    assert ds[-2].tolist() == docs[-2].tolist()
    assert [a.tolist() for a in ds[1:3]] == [docs[1].tolist(), docs[2].tolist()]
    assert ds.get(0, offset=1, length=2).tolist() == docs[0][1:3].tolist()
    assert ds.get(0, offset=1).tolist() == docs[0][1:].tolist()
    with pytest.raises(IndexError):
        ds.get(0, offset=0, length=len(docs[0]) + 1)
    with pytest.raises(IndexError):
        ds[len(docs)]
    clone = pickle.loads(pickle.dumps(ds))
    assert clone[3].tolist() == docs[3].tolist()


def test_multi_sequence_documents(tmp_path: Path) -> None:
    prefix = tmp_path / "multi"
    with IndexedDatasetWriter(prefix, np.int32) as writer:
        writer.add_item([1, 2])
        writer.add_item([3])
        writer.end_document()
        writer.add_document([4, 5, 6, 7], lengths=[1, 3])
        writer.add_item([8])  # left open: finalize ends it
    ds = IndexedDataset(prefix)
    assert ds.sizes.tolist() == [2, 1, 1, 3, 1]
    assert ds.document_indices.tolist() == [0, 2, 4, 5]
    assert ds.document_sizes.tolist() == [3, 4, 1]
    assert ds.get_document(1).tolist() == [4, 5, 6, 7]
    assert ds.get_document(1, offset=1, length=2).tolist() == [5, 6]


@pytest.mark.parametrize("dtype,code", [(np.uint16, 8), (np.int32, 4)])
def test_header_layout(tmp_path: Path, dtype: type, code: int) -> None:
    docs = [np.array([5, 6, 7]), np.array([9]), np.array([1, 2])]
    prefix = tmp_path / "layout"
    _write(prefix, docs, np.dtype(dtype))
    bin_path, idx_path = data_file_paths(prefix)
    raw = idx_path.read_bytes()
    assert raw[0:9] == b"MMIDIDX\x00\x00"
    assert struct.unpack("<Q", raw[9:17]) == (1,)  # version
    assert struct.unpack("<B", raw[17:18]) == (code,)  # dtype code
    assert DTYPE_CODES[code] == np.dtype(dtype)
    assert struct.unpack("<Q", raw[18:26]) == (3,)  # sequence count
    assert struct.unpack("<Q", raw[26:34]) == (4,)  # document count: 0 + one entry per document
    off = 34
    assert struct.unpack("<3i", raw[off:off + 12]) == (3, 1, 2)  # sizes int32
    off += 12
    item = np.dtype(dtype).itemsize
    assert struct.unpack("<3q", raw[off:off + 24]) == (0, 3 * item, 4 * item)  # byte pointers int64
    off += 24
    assert struct.unpack("<4q", raw[off:off + 32]) == (0, 1, 2, 3)  # document indices int64
    assert len(raw) == off + 32
    fmt = "<6H" if item == 2 else "<6i"
    assert bin_path.read_bytes() == struct.pack(fmt, 5, 6, 7, 9, 1, 2)


def test_best_dtype() -> None:
    assert best_dtype(258) == np.uint16
    assert best_dtype(65499) == np.uint16
    assert best_dtype(65500) == np.int32
    assert best_dtype(128_000) == np.int32


def test_writer_is_atomic(tmp_path: Path) -> None:
    prefix = tmp_path / "atomic"
    bin_path, idx_path = data_file_paths(prefix)
    writer = IndexedDatasetWriter(prefix, np.uint16)
    writer.add_document([1, 2, 3])
    assert not bin_path.exists() and not idx_path.exists()  # nothing under the final names yet
    writer.finalize()
    assert bin_path.exists() and idx_path.exists()

    with pytest.raises(RuntimeError, match="boom"), IndexedDatasetWriter(tmp_path / "failed", np.uint16) as w:
        w.add_document([1, 2])
        raise RuntimeError("boom")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["atomic.bin", "atomic.idx"]  # temporaries removed


def test_writer_rejects_ids_that_do_not_fit(tmp_path: Path) -> None:
    with IndexedDatasetWriter(tmp_path / "x", np.uint16) as writer, pytest.raises(ValueError, match="best_dtype"):
        writer.add_document([1, 70000])


def _valid(tmp_path: Path, dtype: type = np.uint16) -> tuple[Path, Path, Path]:
    prefix = tmp_path / "v"
    _write(prefix, [np.array([1, 2, 3]), np.array([4, 5])], np.dtype(dtype))
    bin_path, idx_path = data_file_paths(prefix)
    return prefix, bin_path, idx_path


def _expect_error(prefix: Path, path: Path, *words: str) -> None:
    with pytest.raises(DataError) as info:
        IndexedDataset(prefix)
    message = str(info.value)
    assert str(path) in message
    for word in words:
        assert word in message


def test_missing_files(tmp_path: Path) -> None:
    prefix, bin_path, _ = _valid(tmp_path)
    bin_path.unlink()
    _expect_error(prefix, bin_path, "not found", "tools/preprocess_data.py")
    _expect_error(tmp_path / "nothing", Path(f"{tmp_path / 'nothing'}.idx"), "not found", "tools/preprocess_data.py")


def test_bad_magic(tmp_path: Path) -> None:
    prefix, _, idx_path = _valid(tmp_path)
    raw = bytearray(idx_path.read_bytes())
    raw[0:9] = b"NOTANIDX\x00"
    idx_path.write_bytes(bytes(raw))
    _expect_error(prefix, idx_path, "magic")


def test_unsupported_version(tmp_path: Path) -> None:
    prefix, _, idx_path = _valid(tmp_path)
    raw = bytearray(idx_path.read_bytes())
    raw[9:17] = struct.pack("<Q", 2)
    idx_path.write_bytes(bytes(raw))
    _expect_error(prefix, idx_path, "version 2")


def test_unknown_dtype_code(tmp_path: Path) -> None:
    prefix, _, idx_path = _valid(tmp_path)
    raw = bytearray(idx_path.read_bytes())
    raw[17] = 99
    idx_path.write_bytes(bytes(raw))
    _expect_error(prefix, idx_path, "dtype code 99")


def test_truncated_index(tmp_path: Path) -> None:
    prefix, _, idx_path = _valid(tmp_path)
    raw = idx_path.read_bytes()
    idx_path.write_bytes(raw[:-5])
    _expect_error(prefix, idx_path, "truncated")
    idx_path.write_bytes(raw[:20])  # inside the header
    _expect_error(prefix, idx_path, "truncated")
    idx_path.write_bytes(raw + b"\x00" * 8)
    _expect_error(prefix, idx_path, "bytes after")


def test_corrupt_document_index(tmp_path: Path) -> None:
    prefix, _, idx_path = _valid(tmp_path)
    raw = bytearray(idx_path.read_bytes())
    raw[-8:] = struct.pack("<q", 7)  # last document index must equal the sequence count (2)
    idx_path.write_bytes(bytes(raw))
    _expect_error(prefix, idx_path, "document index")


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_bin_size_mismatch(tmp_path: Path, dtype: type) -> None:
    prefix, bin_path, _ = _valid(tmp_path, dtype)
    raw = bin_path.read_bytes()
    bin_path.write_bytes(raw[:-1])
    _expect_error(prefix, bin_path, "bytes")
    bin_path.write_bytes(raw + b"\x00" * np.dtype(dtype).itemsize)
    _expect_error(prefix, bin_path, "rebuild")
