"""Pre-packed samples as Hugging Face produces them (documents start where ``position_ids`` reset):
``convert_packed_jsonl`` writes ``PREFIX_packed`` (+ ``_positions``, ``_labels``), ``PackedDataset`` serves
them as ``[3, seq_length + 1]`` arrays and ``collate_packed`` makes the batch. Format and semantics:
docs/data.md, "Pre-packed samples".
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from megatron_sp.data.corpus import check_input_files, load_json_object, read_lines
from megatron_sp.data.gpt_dataset import shuffled_epochs
from megatron_sp.data.index_cache import description_hash, file_fingerprint
from megatron_sp.data.indexed import IndexedDataset, IndexedDatasetWriter, best_dtype, data_file_paths, staged_outputs
from megatron_sp.errors import DataError

if TYPE_CHECKING:
    import torch

log = logging.getLogger("megatron_sp")

IGNORE_INDEX = -100
"""Hugging Face's label of a token that is not trained."""

SUFFIX = "_packed"
"""``--output-prefix P`` writes ``P_packed`` (tokens), ``P_packed_positions`` and ``P_packed_labels``."""

CONVERT_HINT = ("convert the packed JSONL with `python tools/preprocess_data.py --packed-samples --seq-length "
                "SEQ_LENGTH --input PACKED.jsonl --output-prefix PREFIX --tokenizer-type ...` and give "
                "data.paths=[PREFIX_packed]")


def side_prefixes(prefix: str | Path) -> tuple[str, str]:
    """The positions and labels datasets that go with the tokens dataset ``prefix``."""
    return f"{prefix}_positions", f"{prefix}_labels"


# --------------------------------------------------------------------------------------------------- conversion

def _int_list(record: dict, key: str, where: str) -> list[int]:
    value = record[key]
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise DataError(f"{where}: '{key}' must be a list of integers, got {type(value).__name__}"
                        + ("" if not isinstance(value, list) else " with a non-integer entry"))
    return value


def parse_packed_line(raw: bytes, path: str | Path, line_no: int, sample_length: int,
                      vocab_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One JSONL line → ``(input_ids, position_ids, labels)`` int64 arrays of its length (≤ ``sample_length``);
    labels default to ``input_ids``. ``DataError`` naming the file, the line and the fix otherwise."""
    where = f"{path}:{line_no}"
    record = load_json_object(raw, where, '{"input_ids": [...], "position_ids": [...]} (datasets.Dataset.to_json)')
    for key in ("input_ids", "position_ids"):
        if key not in record:
            raise DataError(f"{where}: key '{key}' missing (keys present: {sorted(record)}); a packed sample needs "
                            f"input_ids and position_ids (labels optional)")
    ids = _int_list(record, "input_ids", where)
    positions = _int_list(record, "position_ids", where)
    labels = _int_list(record, "labels", where) if record.get("labels") is not None else ids
    n = len(ids)
    if n == 0:
        raise DataError(f"{where}: empty sample (input_ids is []); drop the line")
    for key, values in (("position_ids", positions), ("labels", labels)):
        if len(values) != n:
            raise DataError(f"{where}: {key} has {len(values)} entries but input_ids has {n}; they must match "
                            f"one to one")
    if n > sample_length:
        raise DataError(f"{where}: a sample of {n} tokens is longer than --seq-length + 1 = {sample_length}; pass "
                        f"--seq-length {n - 1} or more (and train with that model.seq_length), or pack with a "
                        f"maximum length of at most {sample_length} tokens")
    id_array = np.asarray(ids, dtype=np.int64)
    pos_array = np.asarray(positions, dtype=np.int64)
    label_array = np.asarray(labels, dtype=np.int64)
    if pos_array[0] != 0:
        raise DataError(f"{where}: position_ids starts at {positions[0]}, not 0; each packed sample must begin "
                        f"a document (position_ids resets to 0 at every document start)")
    bad = np.flatnonzero((pos_array < 0) | (pos_array > np.arange(n)))
    if bad.size:
        k = int(bad[0])
        raise DataError(f"{where}: position_ids[{k}] = {positions[k]} is negative or larger than its index {k}; "
                        f"positions count up from 0 inside each document of the sample")
    for key, values, allowed in (("input_ids", id_array, None), ("labels", label_array, IGNORE_INDEX)):
        bad = np.flatnonzero(((values < 0) | (values >= vocab_size)) & (values != allowed))
        if bad.size:
            k = int(bad[0])
            raise DataError(f"{where}: {key}[{k}] = {int(values[k])} is outside the tokenizer's {vocab_size} ids"
                            + (" (and is not -100)" if allowed is not None else "")
                            + "; convert with the tokenizer the samples were made with")
    return id_array, pos_array, label_array


def pad_sample(ids: np.ndarray, positions: np.ndarray, labels: np.ndarray, sample_length: int,
               pad: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Extend a sample to ``sample_length`` with one padding document: ``pad`` tokens, positions 0, 1, …,
    labels -100 (never trained, and attended by nothing before it)."""
    k = sample_length - ids.size
    if k <= 0:
        return ids, positions, labels
    return (np.concatenate([ids, np.full(k, pad, dtype=np.int64)]),
            np.concatenate([positions, np.arange(k, dtype=np.int64)]),
            np.concatenate([labels, np.full(k, IGNORE_INDEX, dtype=np.int64)]))


def convert_packed_jsonl(input_paths: Sequence[str | Path], output_prefix: str | Path, seq_length: int,
                         vocab_size: int, pad: int, *, overwrite: bool = True, log_interval: int = 1000) -> dict[str, Any]:
    """HF-packed JSONL → ``{output_prefix}_packed`` (+ ``_positions``, ``_labels``) indexed datasets of one
    ``seq_length + 1``-value sequence per sample; shorter samples are padded (``pad_sample``). All three
    appear together or not at all; existing outputs are refused unless ``overwrite``.
    Returns stats: ``samples``, ``padded`` (samples), ``pad_tokens``, ``tokens``, ``bytes``, ``seconds``, ``outputs``."""
    if seq_length < 1:
        raise DataError(f"--seq-length must be >= 1 (the model.seq_length the samples are for), got {seq_length}")
    paths = [Path(p) for p in input_paths]
    check_input_files(paths, "input_ids")
    tokens_prefix = f"{output_prefix}{SUFFIX}"
    finals = [tokens_prefix, *side_prefixes(tokens_prefix)]
    sample_length = seq_length + 1
    dtypes = [best_dtype(vocab_size), best_dtype(sample_length), np.dtype(np.int32)]
    start = time.perf_counter()
    samples = padded = pad_tokens = read = 0
    with staged_outputs(finals, overwrite) as staged, contextlib.ExitStack() as stack:
        writers = [stack.enter_context(IndexedDatasetWriter(p, d)) for p, d in zip(staged, dtypes, strict=True)]
        for path in paths:
            for line_no, raw in enumerate(read_lines(path), start=1):
                read += len(raw)
                if not raw.strip():
                    continue
                arrays = parse_packed_line(raw, path, line_no, sample_length, vocab_size)
                if arrays[0].size < sample_length:
                    padded += 1
                    pad_tokens += sample_length - arrays[0].size
                for writer, array in zip(writers, pad_sample(*arrays, sample_length, pad), strict=True):
                    writer.add_document(array)
                samples += 1
                if log_interval and samples % log_interval == 0:
                    log.info("converted %d packed samples (%.1f samples/s)", samples,
                             samples / max(time.perf_counter() - start, 1e-9))
        if samples == 0:
            raise DataError(f"no samples in {', '.join(map(str, paths))} (every line is blank); nothing was "
                            f"written: give a JSONL file with one packed sample per line")
    seconds = time.perf_counter() - start
    if padded:
        log.info("padded %d of %d samples to %d tokens (%.1f %% of the tokens are padding)", padded, samples,
                 sample_length, 100.0 * pad_tokens / (samples * sample_length))
    return {"samples": samples, "padded": padded, "pad_tokens": pad_tokens, "tokens": samples * sample_length,
            "bytes": read, "seconds": seconds, "outputs": finals}


# --------------------------------------------------------------------------------------------------- reading

def open_packed(prefix: str | Path, seq_length: int) -> tuple[IndexedDataset, IndexedDataset, IndexedDataset]:
    """The tokens, positions and labels datasets of ``prefix``, checked to belong together and to hold samples
    of ``seq_length + 1``; ``DataError`` naming the file and the fix otherwise."""
    parts = [IndexedDataset(prefix)] + [_open_side(side, prefix) for side in side_prefixes(prefix)]
    tokens = parts[0]
    for part in parts[1:]:
        if not np.array_equal(part.sizes, tokens.sizes) or part.num_documents != tokens.num_documents:
            raise DataError(f"{part.idx_path} does not match {tokens.idx_path} (sequence sizes differ); they were "
                            f"not written together: {CONVERT_HINT}")
    sizes = np.asarray(tokens.sizes)
    want = seq_length + 1
    if sizes.size and (sizes.min() != want or sizes.max() != want or tokens.num_documents != sizes.size):
        got = int(sizes[0]) if sizes.size else 0
        raise DataError(f"{tokens.bin_path} holds packed samples of {got} tokens but model.seq_length + 1 = {want}; "
                        f"train with model.seq_length={got - 1}, or convert again with --seq-length {seq_length}")
    return parts[0], parts[1], parts[2]


def _open_side(side: str, prefix: str | Path) -> IndexedDataset:
    if not all(p.is_file() for p in data_file_paths(side)):
        raise DataError(f"{side}.bin/.idx not found: data.packing=position_ids needs the positions and labels "
                        f"that go with {prefix}; {CONVERT_HINT}")
    return IndexedDataset(side)


class PackedDataset:
    """``len(ds)`` pre-packed samples of the ``documents`` (= sample ids) of ``indexed`` (a ``PREFIX_packed``),
    each epoch shuffled by one ``np.random.RandomState(seed)`` stream; ``ds[i]`` is a ``[3, seq_length + 1]``
    int64 array: tokens, position_ids, labels (-100: not trained)."""

    def __init__(self, indexed: IndexedDataset, documents: np.ndarray, seq_length: int, num_samples: int,
                 seed: int, name: str) -> None:
        self.indexed, self.positions, self.labels = open_packed(indexed.prefix, seq_length)
        self.documents = np.asarray(documents, dtype=np.int64)
        if self.documents.size == 0:
            raise DataError(f"the {name} split of {indexed.prefix} has no samples; change data.split or use more data")
        self.seq_length, self.num_samples, self.seed, self.name = seq_length, num_samples, seed, name
        self.description = {
            "class": type(self).__name__,
            "files": [file_fingerprint(p) for ds in (self.indexed, self.positions, self.labels)
                      for p in (ds.idx_path, ds.bin_path)],
            "documents_sha256": hashlib.sha256(self.documents.tobytes()).hexdigest(),
            "seq_length": seq_length,
            "num_samples": num_samples,
            "seed": seed,
        }
        self.hash = description_hash(self.description)
        epochs = max(1, -(-num_samples // self.documents.size))
        self.sample_ids: np.ndarray = shuffled_epochs(self.documents, epochs, np.random.RandomState(seed))[:num_samples]

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range for the {self.name} dataset of {len(self)} samples")
        j = int(self.sample_ids[i])
        return np.stack([np.asarray(ds.get(j), dtype=np.int64) for ds in (self.indexed, self.positions, self.labels)])

    def __repr__(self) -> str:
        return (f"PackedDataset(name={self.name!r}, prefix={str(self.indexed.prefix)!r}, samples={len(self)}, "
                f"seq_length={self.seq_length}, packed_samples={self.documents.size}, seed={self.seed})")


def collate_packed(samples: Sequence[np.ndarray]) -> dict[str, torch.Tensor]:
    """Stack ``[3, s + 1]`` samples (tokens, position_ids, labels) into ``[b, s]`` tensors: ``tokens``,
    ``position_ids`` (from the file), ``document_ids`` (documents counted from the position resets),
    ``labels`` (the next token's label) and ``loss_mask``: 0 where that label is -100 or belongs to the next
    document (the last token of each document), so no loss crosses a document boundary."""
    import torch

    batch = torch.from_numpy(np.stack([np.asarray(s, dtype=np.int64) for s in samples]))  # [b, 3, s+1]
    ids, positions, labels = batch[:, 0], batch[:, 1], batch[:, 2]  # [b, s+1] each
    starts = positions == 0  # a document starts where the position is 0 or lower than the one before it
    starts[:, 1:] |= positions[:, 1:] < positions[:, :-1]
    documents = starts.to(torch.int64).cumsum(dim=1) - 1  # [b, s+1]
    target = labels[:, 1:]  # [b, s]
    trained = (target != IGNORE_INDEX) & (documents[:, 1:] == documents[:, :-1])
    return {"tokens": ids[:, :-1].contiguous(),
            "labels": torch.where(trained, target, ids[:, 1:]).contiguous(),  # masked: a valid id, never used
            "loss_mask": trained.to(torch.float32),
            "position_ids": positions[:, :-1].contiguous(),
            "document_ids": documents[:, :-1].contiguous()}


def check_dataset_kind(prefix: str | Path, packing: str, seq_length: int) -> None:
    """``DataError`` when the dataset at ``prefix`` is not of the kind ``data.packing`` reads."""
    if packing == "position_ids":
        open_packed(prefix, seq_length)
    elif any(p.exists() for side in side_prefixes(prefix) for p in data_file_paths(side)):
        raise DataError(f"{prefix} is a pre-packed dataset (it has {side_prefixes(prefix)[0]}.bin/.idx) but "
                        f"data.packing=eod would cut it as EOD-delimited text; set data.packing=position_ids")
