"""Weighted blends of several datasets (``data.paths: [w1, PREFIX1, w2, PREFIX2, ...]``) with megatron-core's
sizes and greedy algorithm (docs/data.md, "Blending"); the index arrays are cached like the GPT dataset's."""
from __future__ import annotations

import logging
import math
import re
import time
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from megatron_sp.config.registry import check
from megatron_sp.config.schema import Config
from megatron_sp.data.index_cache import cache_paths, description_hash, load_or_build
from megatron_sp.errors import ConfigError, DataError

log = logging.getLogger("megatron_sp")

SURPLUS = 0.005
"""megatron-core's ``mid_level_dataset_surplus``: extra samples each blended dataset builds."""

CACHE_FORMAT = 1
"""Bumped whenever the blending indices change, so old caches are not reused."""

_ARRAYS = ("dataset_index", "dataset_sample_index")
_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def _as_weight(entry: Any) -> float | None:
    """``entry`` as a number when it is one (a YAML number or a numeric string), else None."""
    if isinstance(entry, bool):
        return None
    if isinstance(entry, (int, float)):
        return float(entry)
    if isinstance(entry, str) and _NUMBER.fullmatch(entry.strip()):
        return float(entry)
    return None


def parse_blend(paths: Sequence[Any]) -> tuple[list[str], list[float] | None]:
    """``data.paths`` → ``(prefixes, weights or None)``: ``[PREFIX, ...]`` has no weights; once one entry is a
    number the list must be pairs ``weight, prefix`` with positive weights (else ``ConfigError``)."""
    entries = list(paths)
    if not entries:
        raise ConfigError("data.paths is empty; give a dataset prefix (data.paths=[path/to/prefix]) or set "
                          "data.build_demo=true")
    numbers = [_as_weight(entry) for entry in entries]
    if all(number is None for number in numbers):
        return [str(entry) for entry in entries], None
    fix = "write data.paths=[w1, PREFIX1, w2, PREFIX2, ...]"
    if len(entries) % 2:
        raise ConfigError(f"data.paths: a weighted blend is pairs of weight and prefix, but {len(entries)} entries "
                          f"(an odd number) were given: {entries}; {fix}")
    weights, prefixes = [], []
    for k in range(0, len(entries), 2):
        weight, prefix = numbers[k], entries[k + 1]
        if weight is None:
            raise ConfigError(f"data.paths: entry {k} ('{entries[k]}') should be the weight of '{prefix}' but is not "
                              f"a number; {fix}")
        if not math.isfinite(weight) or weight <= 0:
            raise ConfigError(f"data.paths: the weight {entries[k]} of '{prefix}' must be a positive number")
        if numbers[k + 1] is not None:
            raise ConfigError(f"data.paths: entry {k + 1} ({prefix}) should be a dataset prefix but is a number; {fix}")
        weights.append(weight)
        prefixes.append(str(prefix).strip())
    return prefixes, weights


@check
def check_paths(cfg: Config) -> None:
    """``data.paths`` is one prefix or a valid blend (one prefix under ``data.build_demo``)."""
    prefixes, _ = parse_blend(cfg.data.paths)
    if cfg.data.build_demo and len(prefixes) != 1:
        raise ConfigError(f"data.build_demo builds one dataset but data.paths names {len(prefixes)}; drop "
                          f"data.build_demo or give one prefix")


def normalize(weights: Sequence[float]) -> list[float]:
    """Weights divided by their sum (float64, as megatron-core's ``utils.normalize``)."""
    w = np.asarray(weights, dtype=np.float64)
    return (w / w.sum()).tolist()


def samples_per_dataset(weights: Sequence[float], size: int, surplus: float = 0.0) -> list[int]:
    """Samples each dataset is asked for: ``ceil(ceil(size·w)·(1 + surplus))`` for normalised ``w``."""
    return [int(math.ceil(math.ceil(size * w) * (1 + surplus))) for w in normalize(weights)]


def build_blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """Megatron's greedy blend of ``size`` samples: ``(dataset_index int16, dataset_sample_index int64)``.
    Sample ``i`` is the next sample of the first dataset with the largest ``w_j·max(i, 1) − count_j``
    (float64; ``weights`` normalised). Sequential, about 1 µs per sample and 3 datasets (hence cached)."""
    w = [float(v) for v in weights]
    n_datasets = len(w)
    if not 1 <= n_datasets < 32767:
        raise ValueError(f"need 1 to 32766 datasets, got {n_datasets}")
    if n_datasets == 1:
        dataset_index = np.zeros(size, dtype=np.int16)
    else:
        choice = array("h")
        counts = [0] * n_datasets
        rest = range(1, n_datasets)
        append = choice.append
        for i in range(size):
            x = float(i) if i > 1 else 1.0
            best, best_error = 0, w[0] * x - counts[0]
            for j in rest:
                error = w[j] * x - counts[j]
                if error > best_error:
                    best, best_error = j, error
            append(best)
            counts[best] += 1
        dataset_index = np.frombuffer(choice, dtype=np.int16).copy() if size else np.zeros(0, dtype=np.int16)
    dataset_sample_index = np.empty(size, dtype=np.int64)
    for j in range(n_datasets):
        where = np.flatnonzero(dataset_index == j)
        dataset_sample_index[where] = np.arange(where.size, dtype=np.int64)
    return dataset_index, dataset_sample_index


class BlendedDataset:
    """``size`` samples drawn from ``datasets`` (each with ``hash``, ``len``, ``[]``) in the proportions
    ``weights``; ``cache_dir=None`` builds in memory."""

    def __init__(self, datasets: Sequence[Any], weights: Sequence[float], size: int, cache_dir: Path | None,
                 name: str) -> None:
        self.datasets = list(datasets)
        self.weights = normalize(weights)
        self.size = size
        self.name = name
        self.description = {
            "format": CACHE_FORMAT,
            "class": type(self).__name__,
            "datasets": [d.hash for d in self.datasets],
            "weights": self.weights,
            "size": size,
            "name": name,
        }
        self.hash = description_hash(self.description)
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        start = time.perf_counter()
        arrays, self.loaded_from_cache = load_or_build(
            self.cache_paths() if self.cache_dir is not None else None, _ARRAYS, self.description,
            lambda: dict(zip(_ARRAYS, build_blending_indices(self.weights, size), strict=True)),
            lambda a: a["dataset_index"].shape == a["dataset_sample_index"].shape == (size,), "blending cache")
        if not self.loaded_from_cache:
            log.info("built %s blending indices: %d samples from %d datasets in %.2f s", name, size,
                     len(self.datasets), time.perf_counter() - start)
        self.dataset_index: np.ndarray = arrays["dataset_index"]
        self.dataset_sample_index: np.ndarray = arrays["dataset_sample_index"]
        self.counts = np.bincount(self.dataset_index, minlength=len(self.datasets))
        for j, (count, dataset) in enumerate(zip(self.counts, self.datasets, strict=True)):
            if count > len(dataset):
                raise DataError(f"the {name} blend takes {count} samples from dataset {j} ({dataset!r}) which has "
                                f"only {len(dataset)}; build that dataset with at least this many samples")

    def cache_paths(self) -> dict[str, Path]:
        """The cache file of each index array (and ``description``)."""
        assert self.cache_dir is not None
        return cache_paths(self.cache_dir, f"blend_{self.name}_{self.hash}", _ARRAYS)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < self.size:
            raise IndexError(f"sample {i} out of range for the {self.name} blend of {self.size} samples")
        return self.datasets[int(self.dataset_index[i])][int(self.dataset_sample_index[i])]

    def __repr__(self) -> str:
        parts = ", ".join(f"{w:.3g}: {d!r}" for w, d in zip(self.weights, self.datasets, strict=True))
        return f"BlendedDataset(name={self.name!r}, samples={self.size}, {{{parts}}})"
