"""Megatron-style GPT dataset: fixed-length samples cut from shuffled, concatenated documents; its index
arrays (``doc_idx``, ``sample_idx``, ``shuffle_idx``) are cached under a hash of their inputs. See
docs/data.md, "GPT dataset"."""
from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path

import numpy as np

from megatron_sp.config.registry import check, choice
from megatron_sp.config.schema import Config
from megatron_sp.data.index_cache import cache_paths, description_hash, file_fingerprint, load_or_build
from megatron_sp.data.indexed import IndexedDataset
from megatron_sp.errors import ConfigError, DataError

log = logging.getLogger("megatron_sp")

CACHE_FORMAT = 1
"""Bumped whenever the index construction changes, so old caches are not reused."""

_ARRAYS = ("doc_idx", "sample_idx", "shuffle_idx")


def parse_split(split: str) -> list[float]:
    """``"98,2,0"`` (or ``"98/2/0"``) → three normalised ratios; missing trailing ratios are 0."""
    try:
        ratios = [float(part) for part in split.replace("/", ",").split(",") if part.strip()]
    except ValueError:
        raise ConfigError(f"data.split: '{split}' must be comma-separated ratios like 98,2,0") from None
    if not 1 <= len(ratios) <= 3 or not all(0 <= r < float("inf") for r in ratios) or sum(ratios) <= 0:
        raise ConfigError(f"data.split: '{split}' must be 1 to 3 non-negative ratios with a positive sum, like 98,2,0")
    ratios += [0.0] * (3 - len(ratios))
    total = sum(ratios)
    return [r / total for r in ratios]


@check
def check_split(cfg: Config) -> None:
    """``data.split`` parses to train,valid,test ratios."""
    parse_split(cfg.data.split)


PACKINGS = ("eod", "position_ids")
"""``data.packing``: EOD-delimited documents (this module), or pre-packed samples (``packed.PackedDataset``)."""


@check
def check_packing(cfg: Config) -> None:
    """``data.packing`` is known; with ``position_ids`` the EOD-based flags are off and attention dropout is 0."""
    d = cfg.data
    choice("data.packing", d.packing, PACKINGS)
    if d.packing != "position_ids":
        return
    eod_flags = [k for k in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss") if getattr(d, k)]
    if eod_flags:
        raise ConfigError(f"data.packing=position_ids takes positions, documents and trained labels from the "
                          f"packed samples, so {', '.join('data.' + k for k in eod_flags)} (EOD rules) cannot apply; "
                          f"set {', '.join('data.' + k + '=false' for k in eod_flags)}")
    if d.build_demo:
        raise ConfigError("data.build_demo builds EOD-delimited data, not pre-packed samples; drop data.build_demo "
                          "or set data.packing=eod")
    if cfg.model.attention_dropout > 0:
        raise ConfigError("data.packing=position_ids (documents kept apart in attention) with "
                          "model.attention_dropout > 0 is not available; set model.attention_dropout=0")


def split_documents(num_docs: int, split: str = "98,2,0") -> list[np.ndarray]:
    """Megatron's split by ratio: ``[train, valid, test]`` contiguous document-id ranges (maybe empty), cut at
    the cumulative normalised ratios times ``num_docs``, rounded (``"98,2,0"`` over 1000: 0..979, 980..999)."""
    cumulative = np.cumsum([0.0, *parse_split(split)])
    bounds = [round(float(c) * num_docs) for c in cumulative]
    bounds[-1] = num_docs
    return [np.arange(bounds[k], bounds[k + 1], dtype=np.int64) for k in range(3)]


def shuffled_epochs(documents: np.ndarray, epochs: int, rng: np.random.RandomState) -> np.ndarray:
    """``epochs`` copies of ``documents`` back to back, each shuffled in turn by ``rng``."""
    out = []
    for _ in range(epochs):
        epoch = documents.copy()
        rng.shuffle(epoch)
        out.append(epoch)
    return np.concatenate(out)


class GPTDataset:
    """``len(ds)`` samples of ``seq_length + 1`` int64 tokens from ``documents`` (document ids of ``indexed``).
    ``cache_dir=None`` builds the indices in memory; building is deterministic, so ranks may share a cache."""

    def __init__(self, indexed: IndexedDataset, documents: np.ndarray, seq_length: int, num_samples: int,
                 seed: int, cache_dir: Path | None, name: str) -> None:
        self.indexed = indexed
        self.documents = np.asarray(documents, dtype=np.int64)
        self.seq_length = seq_length
        self.num_samples = num_samples
        self.seed = seed
        self.name = name
        self._document_sizes = np.asarray(indexed.document_sizes, dtype=np.int64)
        self.tokens_per_epoch = int(self._document_sizes[self.documents].sum())
        if self.tokens_per_epoch == 0:
            raise DataError(f"the {name} split of {indexed.prefix} ({self.documents.size} documents) has no tokens; "
                            f"change data.split or use more data")
        self.description = {
            "format": CACHE_FORMAT,
            "class": type(self).__name__,
            "idx": file_fingerprint(indexed.idx_path),
            "bin": file_fingerprint(indexed.bin_path),
            "documents_sha256": hashlib.sha256(self.documents.tobytes()).hexdigest(),
            "num_documents": int(self.documents.size),
            "seq_length": seq_length,
            "num_samples": num_samples,
            "seed": seed,
        }
        self.hash = description_hash(self.description)
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        start = time.perf_counter()
        arrays, self.loaded_from_cache = load_or_build(
            self.cache_paths() if self.cache_dir is not None else None, _ARRAYS, self.description, self._build_indices,
            lambda a: a["sample_idx"].shape[0] == a["shuffle_idx"].shape[0] + 1, "index cache")
        if self.loaded_from_cache:
            log.info("loaded %s indices of %s from cache (%d samples)", name, indexed.prefix, len(arrays["shuffle_idx"]))
        else:
            log.info("built %s indices for %s: %d samples, %d epochs of %d tokens in %.2f s", name,
                     indexed.prefix, len(arrays["shuffle_idx"]), self.num_epochs(), self.tokens_per_epoch,
                     time.perf_counter() - start)
        self.doc_idx: np.ndarray = arrays["doc_idx"]
        self.sample_idx: np.ndarray = arrays["sample_idx"]
        self.shuffle_idx: np.ndarray = arrays["shuffle_idx"]

    def num_epochs(self) -> int:
        """The least E with ``(E·tokens_per_epoch - 1) // seq_length ≥ num_samples``."""
        needed = self.num_samples * self.seq_length + 1
        return max(1, -(-needed // self.tokens_per_epoch))

    def _build_indices(self) -> dict[str, np.ndarray]:
        rng = np.random.RandomState(self.seed)
        doc_idx = shuffled_epochs(self.documents, self.num_epochs(), rng)

        sizes = self._document_sizes[doc_idx]
        ends = np.cumsum(sizes)  # token position one past each doc_idx entry
        total = int(ends[-1])
        n = (total - 1) // self.seq_length
        starts = np.arange(n + 1, dtype=np.int64) * self.seq_length
        positions = np.searchsorted(ends, starts, side="right")  # first entry whose end is past the start
        offsets = starts - (ends[positions] - sizes[positions])
        sample_idx = np.stack([positions, offsets], axis=1).astype(np.int64)

        shuffle_idx = np.arange(n, dtype=np.int64)
        rng.shuffle(shuffle_idx)
        return {"doc_idx": doc_idx, "sample_idx": sample_idx, "shuffle_idx": shuffle_idx}

    def cache_paths(self) -> dict[str, Path]:
        """The cache file of each index array (and ``description``, the JSON of what was hashed)."""
        assert self.cache_dir is not None
        return cache_paths(self.cache_dir, f"{self.indexed.prefix.name}_{self.name}_{self.hash}", _ARRAYS)

    def __len__(self) -> int:
        """The requested number of samples (the indices may hold a few more from the last epoch)."""
        return self.num_samples

    def __getitem__(self, i: int) -> np.ndarray:
        """Sample ``i``: ``seq_length + 1`` consecutive tokens (int64) of the shuffled document stream."""
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range for the {self.name} dataset of {len(self)} samples")
        j = int(self.shuffle_idx[i])
        first_pos, first_off = (int(v) for v in self.sample_idx[j])
        last_pos, last_off = (int(v) for v in self.sample_idx[j + 1])
        get = self.indexed.get_document
        if first_pos == last_pos:
            parts = [get(int(self.doc_idx[first_pos]), first_off, last_off - first_off + 1)]
        else:
            parts = [get(int(self.doc_idx[first_pos]), first_off)]
            parts += [get(int(self.doc_idx[pos])) for pos in range(first_pos + 1, last_pos)]
            parts.append(get(int(self.doc_idx[last_pos]), 0, last_off + 1))
        sample = np.concatenate(parts).astype(np.int64)
        assert sample.shape[0] == self.seq_length + 1, (sample.shape, self.seq_length)
        return sample

    def __repr__(self) -> str:
        return (f"GPTDataset(name={self.name!r}, prefix={str(self.indexed.prefix)!r}, samples={len(self)}, "
                f"seq_length={self.seq_length}, documents={self.documents.size}, seed={self.seed})")
