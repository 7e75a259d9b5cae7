"""Run ownership of a save directory: nothing the user did not ask for is overwritten or deleted.

``Lineage`` (run ids in meta.json), ``check_save_dir``, the lock (``SaveDirLock``), what ``keep``
deletes (``expired``) and which checkpoint a path names (``resolve``): docs/checkpoints.md, "Run ownership".
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import Config
from ..errors import ConfigError, DataError

FORMAT_VERSION = 2
LOCK_FILE = ".lock"


def resolve(load_dir: str | Path) -> Path:
    """The checkpoint directory a ``checkpoint.load`` path names (its ``latest``, or itself)."""
    root = Path(load_dir)
    if (root / "meta.json").is_file():
        return root
    latest = root / "latest"
    if not latest.is_file():
        raise DataError(f"checkpoint.load: no checkpoint in '{root}' (no 'latest' file); point it at a directory "
                        "written by checkpoint.save")
    try:
        name = latest.read_bytes().decode("utf-8").strip()
    except (OSError, UnicodeDecodeError):
        name = ""
    if not re.fullmatch(r"iter_\d+", name):
        raise DataError(f"checkpoint.load: '{latest}' does not name a checkpoint (expected one line like "
                        "iter_0000100); point checkpoint.load at an iter_* directory instead")
    target = root / name
    if not (target / "meta.json").is_file():
        raise DataError(f"checkpoint.load: '{latest}' names '{target.name}', which is missing or incomplete")
    return target


def read_meta(ckpt: Path) -> dict[str, Any]:
    path = ckpt / "meta.json"
    try:
        meta = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, ValueError) as exc:  # ValueError: JSON and UTF-8 decoding errors
        raise DataError(f"checkpoint file '{path}' is unreadable ({type(exc).__name__}: {exc})") from None
    if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
        version = meta.get("format_version") if isinstance(meta, dict) else None
        raise DataError(f"checkpoint '{ckpt}' has format version {version}; this version of megatron_sp reads "
                        f"version {FORMAT_VERSION} (sharded safetensors + index.json)")
    return meta


@dataclass(frozen=True)
class Lineage:
    """The history a run continues: ``runs`` = ((run id, start step), ...), oldest first, this run last.
    ``loaded``: the checkpoint this run resumed from when it lies in ``checkpoint.save`` (never deleted)."""

    runs: tuple[tuple[str, int], ...]
    loaded: str | None = None

    @classmethod
    def start(cls, meta: dict[str, Any] | None = None, ckpt: Path | None = None,
              save: str | Path | None = None) -> Lineage:
        """A new run's lineage: fresh, or continuing the checkpoint ``ckpt`` (with ``meta``) it loaded."""
        run_id = uuid.uuid4().hex
        if meta is None:
            return cls(((run_id, 0),))
        loaded = ckpt.name if ckpt is not None and save and ckpt.parent.resolve() == Path(save).resolve() else None
        return cls((*lineage_of(meta), (run_id, int(meta["step"]))), loaded)

    @property
    def run_id(self) -> str:
        return self.runs[-1][0]

    def holds(self, meta: dict[str, Any]) -> bool:
        """Is the checkpoint of ``meta`` part of this run's history (this run's, or an ancestor's up to its branch point)?"""
        run_id, step = meta.get("run_id"), meta.get("step")
        for i, (rid, _) in enumerate(self.runs):
            if rid == run_id:
                return i == len(self.runs) - 1 or (isinstance(step, int) and step <= self.runs[i + 1][1])
        return False

    def to_meta(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "lineage": [[rid, start] for rid, start in self.runs]}


def lineage_of(meta: dict[str, Any]) -> tuple[tuple[str, int], ...]:
    """The ``lineage`` a checkpoint's meta.json records (() for one written before run ids, or converted)."""
    runs = meta.get("lineage")
    if not isinstance(runs, list) or not all(isinstance(r, list) and len(r) == 2 and isinstance(r[0], str)
                                             and isinstance(r[1], int) for r in runs):
        return ()
    return tuple((r[0], r[1]) for r in runs)


def _peek_meta(ckpt: Path) -> dict[str, Any] | None:
    """meta.json of a checkpoint directory, or None when it is missing, unreadable or of another format."""
    try:
        return read_meta(ckpt)
    except DataError:
        return None


def _step_of(name: str) -> int | None:
    try:
        return int(name[len("iter_"):])
    except ValueError:
        return None


def _names(names: list[str], most: int = 3) -> str:
    return ", ".join(names[:most]) + (f" … ({len(names)} in all)" if len(names) > most else "")


def check_output_dir(path: str | Path, key: str) -> None:
    """Refuse a directory path ``key`` that is or lies under a file, or whose nearest existing folder is read-only."""
    target = Path(path)
    probe = target
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    if not probe.is_dir():
        where = "is a file" if probe == target else f"lies under the file '{probe}'"
        raise ConfigError(f"{key} '{target}' {where}, not a directory; point {key} at a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"{key} '{target}': '{probe}' is not writable; choose a directory you can write to")


def resume_source(cfg: Config) -> Path | None:
    """The checkpoint a run starts from: under auto_resume checkpoint.save's ``latest`` if any, else checkpoint.load."""
    c = cfg.checkpoint
    if c.auto_resume and c.save and (Path(c.save) / "latest").is_file():
        return resolve(c.save)
    return resolve(c.load) if c.load else None


def _saves(cfg: Config, step: int) -> bool:
    """Does the run plan to save ``step`` (interval or end of training; preemption saves are not planned)?"""
    c, iters = cfg.checkpoint, cfg.train.iters
    return step <= iters and bool((c.interval and step % c.interval == 0) or (c.save_at_end and step == iters))


def check_save_dir(cfg: Config, lock: SaveDirLock | None = None) -> None:
    """Refuse a ``checkpoint.save`` this run may not write into: a file, another run's lock (unless ``lock`` is
    ours), or (unless ``checkpoint.overwrite``) checkpoints outside this run's history."""
    c = cfg.checkpoint
    if not c.save:
        return
    root = Path(c.save)
    check_output_dir(root, "checkpoint.save")
    if lock is None:
        SaveDirLock.check(root)
    existing = sorted(p.name for p in root.glob("iter_*") if p.is_dir()) if root.is_dir() else []
    if not existing or c.overwrite:
        return
    source = resume_source(cfg)
    if source is None:
        hint = f"checkpoint.load={root} (or checkpoint.auto_resume=true)" if (root / "latest").is_file() \
            else f"checkpoint.load={root / existing[-1]}"
        raise ConfigError(f"checkpoint.save '{root}' holds checkpoints of another run ({_names(existing)}); resume "
                          f"with {hint}, choose another directory, or set checkpoint.overwrite=true")
    if source.parent.resolve() != root.resolve():
        raise ConfigError(f"checkpoint.save '{root}' holds checkpoints ({_names(existing)}) that checkpoint.load "
                          f"'{c.load}' does not continue; choose another checkpoint.save, resume from a checkpoint "
                          "in it, or set checkpoint.overwrite=true")
    start = int(read_meta(source)["step"])
    clash = [n for n in existing if (s := _step_of(n)) is not None and s > start and _saves(cfg, s)]
    if clash:
        raise ConfigError(f"checkpoint.save '{root}': this run resumes from {source.name} and would save "
                          f"{_names(clash)} again, replacing checkpoints of another branch (later steps it does not "
                          "continue); set checkpoint.overwrite=true to replace them, or choose another checkpoint.save")


class SaveDirLock:
    """Exclusive use of a save directory: a non-blocking ``flock`` on ``SAVE_DIR/.lock`` (naming the holder),
    released by ``release`` or at exit. The file stays (deleting it races)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.fd: int | None = None

    def acquire(self) -> SaveDirLock:
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            self._lock(fd)
        except ConfigError:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
                  .encode(), 0)
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the only descriptor releases the flock
            self.fd = None

    def __enter__(self) -> SaveDirLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _lock(self, fd: int) -> None:
        """flock ``fd``, or raise the refusal naming the holder."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip()
            raise ConfigError(f"checkpoint.save '{self.root}' is in use by another run ({holder or 'holder unknown'}, "
                              f"lock file {self.root / LOCK_FILE}); wait for it to end or choose another "
                              "checkpoint.save") from None

    @classmethod
    def check(cls, root: str | Path) -> None:
        """Raise the refusal if another process holds the lock now; creates nothing."""
        lock = cls(root)
        try:
            fd = os.open(lock.root / LOCK_FILE, os.O_RDONLY)
        except OSError:
            return  # no lock file: nobody holds it
        try:
            lock._lock(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def claim_save_dir(cfg: Config) -> Iterator[None]:
    """Global rank 0, around the whole run: lock ``checkpoint.save`` and check it again under the lock."""
    if not cfg.checkpoint.save:
        yield
        return
    with SaveDirLock(cfg.checkpoint.save) as lock:
        check_save_dir(cfg, lock)
        yield


def expired(root: Path, keep: int, lineage: Lineage, latest: str) -> list[str]:
    """``lineage``'s checkpoints in ``root`` beyond the newest ``keep`` (if > 0), never ``latest`` nor the loaded one."""
    if keep <= 0:
        return []
    history = sorted((m["step"], p.name) for p in root.glob("iter_*") if p.is_dir()
                     and (m := _peek_meta(p)) is not None and isinstance(m.get("step"), int) and lineage.holds(m))
    return [name for _, name in history[:-keep] if name not in (latest, lineage.loaded)]
