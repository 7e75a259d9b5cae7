"""A layout-free tensor store: boxes of global tensors in per-rank safetensors files, one JSON index; a
reader assembles any box of any tensor from the stored boxes. Format and design: docs/checkpoints.md.
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import DataError

INDEX = "index.json"
SHARDS = "shards"
_DTYPES = {str(t).removeprefix("torch."): t for t in (torch.float32, torch.float64, torch.bfloat16, torch.float16,
                                                      torch.int64, torch.int32, torch.uint8, torch.int8, torch.bool)}


def rank_file(rank: int) -> str:
    return f"{SHARDS}/rank_{rank:05d}.safetensors"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass
class Box:
    """A rectangular part of the global tensor ``name``, with its data."""

    name: str
    offsets: tuple[int, ...]
    data: torch.Tensor

    @property
    def key(self) -> str:
        return f"{self.name}|{','.join(map(str, self.offsets))}"


def flat_boxes(start: int, end: int, shape: Sequence[int]) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
    """``[(flat_start, offsets, lengths)]``: at most ``2·ndim − 1`` boxes covering elements ``[start, end)``
    of a row-major tensor, each the contiguous flat range ``[flat_start, flat_start + prod(lengths))``."""
    shape = tuple(int(s) for s in shape)
    if end <= start:
        return []
    if not shape:
        return [(start, (), ())]
    inner = math.prod(shape[1:])
    if inner == 0:
        return []
    first, first_off = divmod(start, inner)
    last, last_off = divmod(end, inner)
    out: list[tuple[int, tuple[int, ...], tuple[int, ...]]] = []

    def rows_part(row: int, lo: int, hi: int) -> None:
        for flat, offs, lens in flat_boxes(lo, hi, shape[1:]):
            out.append((row * inner + flat, (row, *offs), (1, *lens)))

    if first == last:
        rows_part(first, first_off, last_off)
        return out
    if first_off:
        rows_part(first, first_off, inner)
        first += 1
    if last > first:
        out.append((first * inner, (first, *([0] * (len(shape) - 1))), (last - first, *shape[1:])))
    if last_off:
        rows_part(last, 0, last_off)
    return out


def boxes_of_flat(name: str, flat: torch.Tensor, start: int, local_shape: Sequence[int],
                  shift: Sequence[int], clip: Sequence[int]) -> list[Box]:
    """Boxes of global tensor ``name`` for ``flat`` = elements ``[start, start + flat.numel())`` of a local
    tensor placed at offset ``shift`` in the global one; parts beyond the global shape ``clip`` (vocabulary
    padding) are dropped. The data is copied: an asynchronous save needs a snapshot."""
    out = []
    for flat_start, offs, lens in flat_boxes(start, start + flat.numel(), local_shape):
        piece = flat[flat_start - start:flat_start - start + math.prod(lens)].view(lens)
        goffs = [o + s for o, s in zip(offs, shift)]
        piece = piece[tuple(slice(0, max(0, limit - o)) for o, limit in zip(goffs, clip))]
        if piece.numel():
            out.append(Box(name, tuple(goffs), piece.detach().to("cpu", copy=True).contiguous()))
    return out


def entries_of(boxes: Iterable[Box], file: str) -> list[dict[str, Any]]:
    """The index entries of ``boxes`` written to ``file`` (computable before the file exists)."""
    return [{"name": b.name, "file": file, "key": b.key, "offsets": list(b.offsets), "lengths": list(b.data.shape)}
            for b in boxes]


def _umask() -> int:
    """The process umask, read without changing it (``os.umask`` sets it: racy beside a writer thread)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """``safetensors.torch.save_file``, but with mode 0666 less the umask (safetensors' own is 0600)."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, 0o666 & ~_umask())


def write_file(path: Path, boxes: Sequence[Box], extra: dict[str, torch.Tensor] | None = None) -> None:
    """One safetensors file holding ``boxes`` (and ``extra`` tensors under their own keys), fsynced."""
    path.parent.mkdir(parents=True, exist_ok=True)
    save_safetensors({**{b.key: b.data for b in boxes}, **(extra or {})}, path)
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def build_index(entries: Iterable[dict[str, Any]], tensors: dict[str, tuple[tuple[int, ...], str]],
                files: Iterable[str] = ()) -> dict[str, Any]:
    """The index of a checkpoint directory: every tensor's shape, dtype and boxes (file sizes: ``finish_index``).
    Checks that each tensor's boxes add up to its size, so an incomplete save is caught when written."""
    index: dict[str, Any] = {"tensors": {n: {"shape": list(s), "dtype": d, "boxes": []}
                                         for n, (s, d) in sorted(tensors.items())}, "files": dict.fromkeys(files, 0)}
    for e in entries:
        index["tensors"][e["name"]]["boxes"].append({k: e[k] for k in ("file", "key", "offsets", "lengths")})
        index["files"].setdefault(e["file"], 0)
    for name, t in index["tensors"].items():
        covered = sum(math.prod(b["lengths"]) for b in t["boxes"])
        if covered != math.prod(t["shape"]):
            raise RuntimeError(f"checkpoint writers stored {covered} of {math.prod(t['shape'])} elements of '{name}'")
    return index


def finish_index(index: dict[str, Any], ckpt: Path) -> None:
    """Record the files' sizes (after every writer finished) and write ``index.json``."""
    for file in index["files"]:
        index["files"][file] = (ckpt / file).stat().st_size
    (ckpt / INDEX).write_text(json.dumps(index, separators=(",", ":")))


def _require(path: Path) -> None:
    if not path.is_file():
        raise DataError(f"checkpoint file '{path}' is missing; the checkpoint is incomplete")


class Reader:
    """Reads boxes of the global tensors of one checkpoint directory (any writer layout)."""

    def __init__(self, ckpt: Path) -> None:
        self.ckpt = Path(ckpt)
        path = self.ckpt / INDEX
        _require(path)
        try:
            self.index = json.loads(path.read_text())
            self.tensors: dict[str, dict[str, Any]] = self.index["tensors"]
            files: dict[str, int] = self.index["files"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise DataError(f"checkpoint file '{path}' is unreadable ({exc})") from None
        for file, size in files.items():
            full = self.ckpt / file
            _require(full)
            if full.stat().st_size != size:
                raise DataError(f"checkpoint file '{full}' has {full.stat().st_size} bytes, {INDEX} says {size}: "
                                "the file is truncated or was replaced")
        self._open: dict[str, Any] = {}

    def names(self, prefix: str = "") -> list[str]:
        return [n for n in self.tensors if n.startswith(prefix)]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        return _DTYPES[self.tensors[name]["dtype"]]

    def file(self, file: str) -> Any:
        """The open safetensors ``file`` (its presence and size were checked with the index)."""
        if file not in self._open:
            from safetensors import safe_open

            try:
                self._open[file] = safe_open(str(self.ckpt / file), framework="pt", device="cpu")
            except Exception as exc:  # safetensors raises its own error type for every malformed file
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise DataError(f"checkpoint file '{self.ckpt / file}' is corrupted or truncated ({first[:120]})") from None
        return self._open[file]

    def read(self, name: str, offsets: Sequence[int] | None = None, lengths: Sequence[int] | None = None) -> torch.Tensor:
        """The box ``offsets``/``lengths`` (default: the whole tensor) of global tensor ``name``."""
        if name not in self.tensors:
            raise DataError(f"checkpoint '{self.ckpt}' holds no tensor '{name}'")
        shape = self.shape(name)
        offsets = tuple(offsets) if offsets is not None else (0,) * len(shape)
        lengths = tuple(lengths) if lengths is not None else shape
        out = torch.empty(lengths, dtype=self.dtype(name))
        filled = 0
        for box in self.tensors[name]["boxes"]:
            lo = [max(a, b) for a, b in zip(offsets, box["offsets"])]
            hi = [min(a + la, b + lb) for a, la, b, lb in zip(offsets, lengths, box["offsets"], box["lengths"])]
            if any(h <= lo_ for lo_, h in zip(lo, hi)):
                continue
            src = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, box["offsets"]))
            dst = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offsets))
            f = self.file(box["file"])
            try:
                part = f.get_slice(box["key"])[src] if shape else f.get_tensor(box["key"])
            except Exception as exc:
                raise DataError(f"checkpoint file '{self.ckpt / box['file']}': cannot read '{box['key']}' ({exc}); "
                                "the checkpoint is corrupted") from None
            out[dst] = part
            filled += math.prod(b - a for a, b in zip(lo, hi))
        if filled != math.prod(lengths):
            raise DataError(f"checkpoint '{self.ckpt}': {INDEX} covers {filled} of {math.prod(lengths)} requested "
                            f"elements of '{name}'; the checkpoint is incomplete")
        return out

    def read_extra(self, file: str, prefix: str) -> dict[str, torch.Tensor]:
        """The non-indexed tensors of ``file`` whose key starts with ``prefix`` (per-rank RNG states)."""
        f = self.file(file)
        return {k[len(prefix):]: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}
