"""On-disk cache of index arrays (``.npy``) named by a hash of everything they depend on (a stale cache is
never found) and checked against the CRC-32 recorded with them (a modified one is rebuilt). The arrays are renamed
into place last, so a cache is complete once its last array exists; concurrent ranks write identical bytes."""
from __future__ import annotations

import hashlib
import json
import logging
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from megatron_sp.files import atomic_file

log = logging.getLogger("megatron_sp")


def file_fingerprint(path: Path) -> dict[str, Any]:
    """What a cache depends on of a data file: its resolved path, size and modification time."""
    stat = path.stat()
    return {"path": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def description_hash(description: dict[str, Any]) -> str:
    """The sha256 hex digest of ``description`` as canonical JSON (sorted keys)."""
    return hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()


def cache_paths(cache_dir: Path, stem: str, keys: Sequence[str]) -> dict[str, Path]:
    """``{key: cache_dir/stem_key.npy}`` plus ``"description"``: ``cache_dir/stem_description.json``."""
    paths = {key: cache_dir / f"{stem}_{key}.npy" for key in keys}
    paths["description"] = cache_dir / f"{stem}_description.json"
    return paths


def _crc32(array: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(array).view(np.uint8).reshape(-1))


def load_or_build(paths: dict[str, Path] | None, keys: Sequence[str], description: dict[str, Any],
                  build: Callable[[], dict[str, np.ndarray]], consistent: Callable[[dict[str, np.ndarray]], bool],
                  what: str) -> tuple[dict[str, np.ndarray], bool]:
    """``(arrays, loaded)``: the cached arrays at ``paths`` (memory-mapped, read-only) when readable, equal to the
    CRC-32 checksums their description file records and ``consistent``, else ``build()``'s, then cached: the
    description (with the arrays' checksums) first, the arrays last (they mark a complete cache); an unwritable
    cache is logged and skipped. ``paths`` None: built in memory, never cached."""
    if paths is not None and all(paths[key].is_file() for key in keys):
        try:  # plain ndarray views of the maps (indexing a np.memmap runs Python code on every access)
            arrays = {key: np.load(paths[key], mmap_mode="r", allow_pickle=False).view(np.ndarray) for key in keys}
            sums = json.loads(paths["description"].read_text()).get("crc32", {})
        except (OSError, ValueError, AttributeError) as e:
            log.warning("ignoring unreadable index cache %s (%s); rebuilding it", paths[keys[0]], e)
        else:
            bad = next((key for key in keys if sums.get(key) != _crc32(arrays[key])), None)
            if bad is not None:  # a cache written before checksums has none: rebuilt once
                log.warning("ignoring %s %s: its contents do not match the checksum in %s (modified or corrupted); "
                            "rebuilding it", what, paths[bad], paths["description"].name)
            elif consistent(arrays):
                return arrays, True
            else:
                log.warning("ignoring inconsistent %s %s; rebuilding it", what, paths[keys[0]])
    arrays = build()
    if paths is not None:
        cache_dir = paths["description"].parent
        try:
            cache_dir.mkdir(parents=True, exist_ok=True)
            with atomic_file(paths["description"]) as f:
                record = {**description, "crc32": {key: _crc32(arrays[key]) for key in keys}}
                f.write(json.dumps(record, indent=1, sort_keys=True).encode())
            for key in keys:
                with atomic_file(paths[key]) as f:
                    np.save(f, arrays[key], allow_pickle=False)
        except OSError as e:
            log.warning("could not write the index cache in %s (%s); continuing without it", cache_dir, e)
    return arrays, False
