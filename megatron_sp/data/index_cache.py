"""On-disk cache of index arrays (``.npy``) named by a hash of everything they depend on.

A dataset describes its parameters as a JSON-able dict; ``description_hash`` is the sha256 of its
canonical JSON. The arrays live in ``{cache_dir}/{stem}_{hash}_{key}.npy`` next to
``..._description.json`` (what was hashed, for people). A changed parameter changes the hash, so a
stale cache is never read: it is simply not found, and the arrays are rebuilt under the new name.
Writes go to a temporary name and are renamed, the arrays last, so a cache is complete once its
last array exists; several ranks writing the same cache at once write identical bytes.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger("megatron_sp")


def description_hash(description: dict[str, Any]) -> str:
    """The sha256 hex digest of ``description`` as canonical JSON (sorted keys)."""
    return hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()


def cache_paths(cache_dir: Path, stem: str, keys: Sequence[str]) -> dict[str, Path]:
    """``{key: cache_dir/stem_key.npy}`` plus ``"description"``: ``cache_dir/stem_description.json``."""
    paths = {key: cache_dir / f"{stem}_{key}.npy" for key in keys}
    paths["description"] = cache_dir / f"{stem}_description.json"
    return paths


def load_arrays(paths: dict[str, Path], keys: Sequence[str]) -> dict[str, np.ndarray] | None:
    """The cached arrays (memory-mapped, read-only), or None when one is missing or unreadable."""
    if not all(paths[key].is_file() for key in keys):
        return None
    try:
        # plain ndarray views of the maps (indexing a np.memmap runs Python code on every access)
        return {key: np.load(paths[key], mmap_mode="r", allow_pickle=False).view(np.ndarray) for key in keys}
    except (OSError, ValueError) as e:
        log.warning("ignoring unreadable index cache %s (%s); rebuilding it", paths[keys[0]], e)
        return None


def save_arrays(paths: dict[str, Path], arrays: dict[str, np.ndarray], description: dict[str, Any]) -> None:
    """Write the description, then each array, each under a temporary name renamed into place.

    An unwritable cache directory is logged and skipped (training goes on with the arrays in memory).
    """
    cache_dir = paths["description"].parent
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        tag = f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        items: list[tuple[Path, Any]] = [(paths["description"],
                                          json.dumps(description, indent=1, sort_keys=True).encode())]
        items += [(paths[key], value) for key, value in arrays.items()]  # arrays last: they mark a complete cache
        for path, value in items:
            tmp = path.with_name(path.name + tag)
            try:
                with open(tmp, "wb") as f:
                    if isinstance(value, bytes):
                        f.write(value)
                    else:
                        np.save(f, value, allow_pickle=False)
                os.replace(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)
    except OSError as e:
        log.warning("could not write the index cache in %s (%s); continuing without it", cache_dir, e)
