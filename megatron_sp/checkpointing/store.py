"""A layout-free tensor store: boxes of global tensors in per-rank safetensors files, one JSON index; a
reader assembles any box of any tensor from the stored boxes. Format and design: docs/checkpoints.md.
"""
from __future__ import annotations

import errno
import json
import math
import mmap
import os
import re
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import DataError

INDEX = "index.json"
SHARDS = "shards"
CHECKSUMS = "crc32"  # a shard file's metadata key: JSON {tensor key: zlib.crc32 of its bytes}, verified on read
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


def crc32(t: torch.Tensor) -> int:
    """zlib's CRC-32 of the bytes of ``t`` (any dtype; ~1 GB/s, the GIL released: docs/checkpoints.md, "Checksums")."""
    return zlib.crc32(t.detach().reshape(-1).view(torch.uint8).numpy())


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """``safetensors.torch.save_file``, but with mode 0666 less the umask (safetensors' own is 0600) and its I/O
    errors raised as ``OSError`` naming ``path`` (a full disk: ENOSPC)."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        save_file(tensors, str(path), metadata=metadata)
    except SafetensorError as exc:
        code = re.search(r"os error (\d+)|code: (\d+)", str(exc))
        num = int(code.group(1) or code.group(2)) if code else errno.EIO
        raise OSError(num, os.strerror(num) if code else str(exc).splitlines()[0], str(path)) from None
    os.chmod(path, 0o666 & ~_umask())


def write_file(path: Path, boxes: Sequence[Box], extra: dict[str, torch.Tensor] | None = None) -> None:
    """One safetensors file holding ``boxes`` (and ``extra`` tensors under their own keys) with each tensor's
    checksum in its metadata, fsynced."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {**{b.key: b.data for b in boxes}, **(extra or {})}
    save_safetensors(tensors, path, {CHECKSUMS: json.dumps({k: crc32(t) for k, t in tensors.items()})})
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def write_text(path: Path, text: str) -> None:
    """``path`` holding ``text``, fsynced; an ``OSError`` names ``path``."""
    try:
        with open(path, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        exc.filename = exc.filename or str(path)
        raise


def fsync_dir(path: Path) -> None:
    """Make the renames in directory ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def nbytes(index: dict[str, Any]) -> int:
    """The bytes of the tensors an index lists (what a checkpoint needs on disk, headers aside)."""
    return sum(math.prod(t["shape"]) * _DTYPES[t["dtype"]].itemsize for t in index["tensors"].values())


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
    write_text(ckpt / INDEX, json.dumps(index, separators=(",", ":")))


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
        self._sums: dict[str, tuple[int, dict[str, Any], dict[str, int]]] = {}  # file: (data start, header, sums)

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

    def verify(self, file: str, key: str, data: torch.Tensor | None = None) -> None:
        """Check the bytes of tensor ``key`` of ``file`` (``data``: all of it, already read; else streamed from the
        file) against the checksum saved with it, once per key (a file written before checksums has none)."""
        path = self.ckpt / file
        if file not in self._sums:
            self.file(file)  # a malformed file fails there
            try:
                with open(path, "rb") as fh:  # safetensors: u64 header length, JSON header, data
                    size = int.from_bytes(fh.read(8), "little")
                    header = json.loads(fh.read(size))
                sums = json.loads(header.get("__metadata__", {}).get(CHECKSUMS, "{}"))
            except (OSError, ValueError, AttributeError) as exc:
                raise DataError(f"checkpoint file '{path}' is corrupted ({exc})") from None
            self._sums[file] = (8 + size, header, sums)
        start, header, sums = self._sums[file]
        if key not in sums:
            return
        if data is None:
            begin, end = (start + o for o in header[key]["data_offsets"])
            with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm, memoryview(mm) as view:
                crc = zlib.crc32(view[begin:end])
        else:
            crc = crc32(data)
        if crc != sums.pop(key):
            raise DataError(f"checkpoint file '{path}' is corrupted: the bytes of '{key}' do not match "
                            "the checksum saved with them; restore the file or load another checkpoint")

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
            whole = [b - a for a, b in zip(lo, hi)] == box["lengths"]
            if not whole:
                self.verify(box["file"], box["key"])
            try:
                part = f.get_slice(box["key"])[src] if shape else f.get_tensor(box["key"])
            except Exception as exc:
                raise DataError(f"checkpoint file '{self.ckpt / box['file']}': cannot read '{box['key']}' ({exc}); "
                                "the checkpoint is corrupted") from None
            if whole:
                self.verify(box["file"], box["key"], part)
            out[dst] = part
            filled += math.prod(b - a for a, b in zip(lo, hi))
        if filled != math.prod(lengths):
            raise DataError(f"checkpoint '{self.ckpt}': {INDEX} covers {filled} of {math.prod(lengths)} requested "
                            f"elements of '{name}'; the checkpoint is incomplete")
        return out

    def read_extra(self, file: str, prefix: str) -> dict[str, torch.Tensor]:
        """The non-indexed tensors of ``file`` whose key starts with ``prefix`` (per-rank RNG states)."""
        f = self.file(file)
        keys = [k for k in f.keys() if k.startswith(prefix)]
        for k in keys:
            self.verify(file, k)
        return {k[len(prefix):]: f.get_tensor(k) for k in keys}
