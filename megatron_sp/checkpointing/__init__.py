"""Save and load training checkpoints: sharded, layout-free, atomic, optionally asynchronous.

Layout on disk (format version 2)::

    SAVE_DIR/
      latest                          name of the newest complete checkpoint, written last
      iter_0000100/
        meta.json                     format version, step, consumed samples (the data position),
                                      writer layout, optimizer step, resolved config, extra state
        index.json                    every global tensor: shape, dtype, boxes (file, key, offsets, lengths)
        shards/rank_00000.safetensors this rank's boxes + its RNG states (keys "rng/...")

Global tensors are ``model/<parameter name>`` (the unsharded parameter, vocabulary padding
trimmed) and ``optim/<parameter name>/{exp_avg, exp_avg_sq[, master_param]}`` (fp32). Each rank
writes only what it holds and nobody else writes: its TP shard (TP-replicated parameters: TP rank
0 only; a pipeline's tied output-embedding copy never), and of that only data-parallel chunk
``r`` of every optimizer bucket (``DistributedOptimizer.checkpoint_parts``: the ZeRO-1 shard, and
the same split without ZeRO), so a save moves no tensor between ranks and the bytes written are
spread over the whole world. ``store.Reader`` reads any box of a global tensor back, so a
checkpoint loads into any (tp, pp, cp, dp, ZeRO) layout; the same layout restores every rank's RNG
too, so training continues bitwise.

Atomic: everything goes under ``.tmp_iter_NNNNNNN`` and is renamed when every rank's file is
written (fsynced) and ``index.json`` (with each file's size) is in place; ``latest`` is replaced
(temp file + rename) after that. A crash at any point leaves the previous checkpoint and
``latest`` untouched. Safe: safetensors and JSON only, no pickle is ever loaded.

Asynchronous (``checkpoint.async_save``): the save snapshots this rank's boxes (a copy in host
memory) and a thread writes the file while training continues; ``Checkpointer.poll()`` after each
step agrees over the world whether every rank is done (one tiny all-reduce while a save is in
flight) and then finalises (index, rename, ``latest``, ``keep``). The next save, the end of
training and a preemption wait for it.

Ownership (nothing the user did not ask for is overwritten or deleted): every run has a random
``run_id``; meta.json records it and the ``lineage`` ``[[run_id, start step], ...]`` (fresh run:
``[[id, 0]]``; resumed: the loaded checkpoint's lineage + ``[id, its step]``). A checkpoint is in a
run's *history* if this run wrote it, or an earlier run of its lineage did at a step ≤ the step the
next run of the lineage started from. Unless ``checkpoint.overwrite``, ``check_save_dir`` refuses
before training a save directory holding ``iter_*`` when the run does not resume from a checkpoint
in it, and a resume whose planned saves (interval, end) would replace a checkpoint outside its
history (a rollback's abandoned later steps); a save that still would (SIGTERM/SIGINT at such a
step) fails on every rank before writing. ``keep`` deletes only the older checkpoints of the run's
history beyond the newest ``keep``, never the one ``latest`` names (written first) nor the one the
run loaded; other runs' checkpoints (pre-run-id ones too) are never deleted, even with
``overwrite``, which only lets the run replace the step directories it saves. Global rank 0 holds
an ``fcntl`` lock on ``SAVE_DIR/.lock`` for the whole run (``claim_save_dir``): a second run is refused.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import device as device_mod
from ..config import Config, to_dict
from ..errors import ConfigError, DataError, TrainingError
from ..mpu import ParallelState, comm
from ..mpu.random import RNGTracker
from ..mpu.sharding import is_sharded, is_tied_copy, stored_name, stored_shape
from ..optim import DistributedOptimizer, named_trainable
from . import store
from .store import INDEX, Reader

FORMAT_VERSION = 2
OPTIM_KEYS = ("exp_avg", "exp_avg_sq", "master_param")
log = logging.getLogger("megatron_sp")


def step_dir(step: int) -> str:
    return f"iter_{step:07d}"


def writer_layout(cfg: Config) -> dict[str, int]:
    """The parallel layout that writes a checkpoint, as stored under meta.json's ``layout`` key:
    ``{tp, pp, cp, dp, virtual_stages}``. (Not the CP sequence layout: that is
    ``model.attention.layout.sequence_layout``.)"""
    p = cfg.parallel
    return {"tp": p.tp, "pp": p.pp, "cp": p.cp, "dp": int(p.dp or 1), "virtual_stages": p.virtual_stages}


# ------------------------------------------------------------------------------------- ownership

LOCK_FILE = ".lock"


@dataclass(frozen=True)
class Lineage:
    """The history a run continues: ``runs`` = ((run id, start step), ...), oldest first, this run last.

    ``loaded``: the name of the checkpoint directory this run resumed from when it lies in
    ``checkpoint.save`` (``keep`` never deletes it). Only global rank 0 uses it (meta.json, ``keep``,
    the refusal of a foreign step directory).
    """

    runs: tuple[tuple[str, int], ...]
    loaded: str | None = None

    @classmethod
    def start(cls, meta: dict[str, Any] | None = None, ckpt: Path | None = None,
              save: str | Path | None = None) -> Lineage:
        """A new run's lineage: fresh, or continuing the checkpoint ``ckpt`` (with ``meta``) it loaded."""
        run_id = uuid.uuid4().hex
        if meta is None:
            return cls(((run_id, 0),))
        loaded = ckpt.name if ckpt is not None and save and _same_dir(ckpt.parent, Path(save)) else None
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


def _same_dir(a: Path, b: Path) -> bool:
    return a.resolve() == b.resolve()


def _peek_meta(ckpt: Path) -> dict[str, Any] | None:
    """meta.json of a checkpoint directory, or None when it is missing or unreadable (no checks)."""
    try:
        meta = json.loads((ckpt / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def _step_of(name: str) -> int | None:
    try:
        return int(name[len("iter_"):])
    except ValueError:
        return None


def _names(names: list[str], most: int = 3) -> str:
    return ", ".join(names[:most]) + (f" … ({len(names)} in all)" if len(names) > most else "")


def check_output_dir(path: str | Path, key: str) -> None:
    """Refuse (one ``ConfigError`` naming ``key``) a directory path that is, or lies under, a regular file,
    or whose nearest existing folder is not writable."""
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
    """The checkpoint a run starts from: checkpoint.save's ``latest`` under auto_resume when it exists,
    else checkpoint.load's; None for a fresh run."""
    c = cfg.checkpoint
    if c.auto_resume and c.save and (Path(c.save) / "latest").is_file():
        return resolve(c.save)
    return resolve(c.load) if c.load else None


def _saves(cfg: Config, step: int) -> bool:
    """Does the run plan to save ``step`` (interval or end of training; preemption saves are not planned)?"""
    c, iters = cfg.checkpoint, cfg.train.iters
    return step <= iters and bool((c.interval and step % c.interval == 0) or (c.save_at_end and step == iters))


def check_save_dir(cfg: Config, lock: SaveDirLock | None = None) -> None:
    """Refuse, before training, a ``checkpoint.save`` this run may not write into (one ``ConfigError``).

    A path that is a file; a directory another run has locked (skipped when ``lock`` is ours); one
    holding checkpoints the run does not resume from; a resume that would save a step directory
    outside its history. ``checkpoint.overwrite`` lifts the last two (see the module docstring).
    """
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
    if not _same_dir(source.parent, root):
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
    """Exclusive use of a save directory: a non-blocking ``fcntl.flock`` on ``SAVE_DIR/.lock``, which
    records the holder (pid, host, time). Released on ``release``/exit of the ``with`` block, or by the
    kernel when the process ends however it ends. The file stays (deleting a lock file races)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.fd: int | None = None

    def acquire(self) -> SaveDirLock:
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip()
            os.close(fd)
            raise self._refusal(holder) from None
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

    def _refusal(self, holder: str) -> ConfigError:
        return ConfigError(f"checkpoint.save '{self.root}' is in use by another run ({holder or 'holder unknown'}, "
                           f"lock file {self.root / LOCK_FILE}); wait for it to end or choose another checkpoint.save")

    @classmethod
    def check(cls, root: str | Path) -> None:
        """Raise the refusal if another process holds the lock now; creates nothing."""
        lock = cls(root)
        try:
            fd = os.open(lock.root / LOCK_FILE, os.O_RDONLY)
        except OSError:
            return  # no lock file: nobody holds it
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise lock._refusal(os.pread(fd, 200, 0).decode(errors="replace").strip()) from None
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


# ------------------------------------------------------------------------------------------ save


def _shift(p: nn.Parameter, tp_rank: int) -> list[int]:
    """The local shard's offset in the full tensor."""
    shift = [0] * p.dim()
    if is_sharded(p):
        shift[p.partition_dim] = tp_rank * p.shape[p.partition_dim]
    return shift


def rank_boxes(model: nn.Module, optimizer: DistributedOptimizer, state: ParallelState | None
               ) -> tuple[list[store.Box], dict[str, tuple[tuple[int, ...], str]]]:
    """(the boxes this rank writes, {global name: (shape, dtype)} of every tensor its stage declares)."""
    tp_rank, tp = (state.tp_rank, state.tp_size) if state is not None else (0, 1)
    parts = optimizer.checkpoint_parts()
    boxes: list[store.Box] = []
    tensors: dict[str, tuple[tuple[int, ...], str]] = {}
    for name, p in named_trainable(model):
        if is_tied_copy(name, p):
            continue  # stored once, as embedding.weight, by the first stage
        shape = stored_shape(p, tp)
        keys = ["param", "exp_avg", "exp_avg_sq"] + (["master_param"] if optimizer.precision != "fp32" else [])
        for key in keys:
            tensors[_global(name, key)] = (shape, store.dtype_name(p.dtype if key == "param" else torch.float32))
        if (tp_rank and not is_sharded(p)) or name not in parts:
            continue  # TP-replicated: TP rank 0 writes it; or this dp rank's chunk holds none of it
        start, flats = parts[name]
        for key, flat in flats.items():
            boxes += store.boxes_of_flat(_global(name, key), flat, start, p.shape, _shift(p, tp_rank), shape)
    return boxes, tensors


def _global(name: str, key: str) -> str:
    return f"model/{name}" if key == "param" else f"optim/{name}/{key}"


def _rng_tensors(dev: torch.device, tracker: RNGTracker | None) -> dict[str, torch.Tensor]:
    states = dict(device_mod.rng_state(dev))
    if tracker is not None:
        states.update({f"tracker/{k}": v for k, v in tracker.get_states().items()})
    return {f"rng/{k}": v.detach().cpu().contiguous().clone() for k, v in states.items()}


@dataclass
class _Pending:
    step: int
    tmp: Path
    final: Path
    meta: dict[str, Any]
    index: dict[str, Any] | None  # rank 0 only
    thread: threading.Thread | None = None
    error: list[BaseException] = field(default_factory=list)


class Checkpointer:
    """Writes the checkpoints of one run (every rank holds one; ``save``/``poll``/``wait`` are collective).

    ``lineage``: the run's history (``Lineage.start`` from the checkpoint it loaded); None: a fresh run.
    """

    def __init__(self, cfg: Config, state: ParallelState | None, dev: torch.device,
                 lineage: Lineage | None = None) -> None:
        self.cfg, self.state, self.dev = cfg, state, dev
        self.rank, self.world = (state.rank, state.dims.world_size) if state is not None else (0, 1)
        self.lineage = lineage if lineage is not None else Lineage.start()
        self.pending: _Pending | None = None

    def _barrier(self) -> None:
        if self.world > 1:
            comm.barrier()

    def save(self, step: int, consumed_samples: int, model: nn.Module, optimizer: DistributedOptimizer,
             tracker: RNGTracker | None = None, extra: dict[str, Any] | None = None,
             asynchronous: bool | None = None) -> Path:
        """Start (``asynchronous``; default ``checkpoint.async_save``) or do the save of ``step``."""
        self.wait()
        asynchronous = self.cfg.checkpoint.async_save if asynchronous is None else asynchronous
        root = Path(self.cfg.checkpoint.save)  # type: ignore[arg-type]
        final, tmp = root / step_dir(step), root / f".tmp_{step_dir(step)}"
        refusal = self._foreign(final) if self.rank == 0 else None
        if self.rank == 0 and refusal is None:
            if tmp.exists():
                shutil.rmtree(tmp)  # a crashed save of this step (the lock keeps other runs out)
            (tmp / store.SHARDS).mkdir(parents=True)
        refusal = self._from_rank0(refusal)  # also the barrier: nobody writes before tmp exists
        if refusal:
            raise TrainingError(refusal)
        boxes, tensors = rank_boxes(model, optimizer, self.state)
        file = store.rank_file(self.rank)
        mine = (store.entries_of(boxes, file), tensors)
        everyone = [mine]
        if self.world > 1:
            everyone = comm.all_gather_object(mine)
        index = None
        if self.rank == 0:
            declared: dict[str, tuple[tuple[int, ...], str]] = {}
            for _, t in everyone:
                declared.update(t)
            index = store.build_index((e for entries, _ in everyone for e in entries), declared,
                                      [store.rank_file(r) for r in range(self.world)])
        meta = {"format_version": FORMAT_VERSION, "step": step, "consumed_samples": consumed_samples,
                "world_size": self.world, "layout": writer_layout(self.cfg), "optimizer_step": optimizer.step_count,
                "config": to_dict(self.cfg), **self.lineage.to_meta(), **(extra or {})}
        job = _Pending(step, tmp, final, meta, index)
        rng = _rng_tensors(self.dev, tracker)

        def write() -> None:
            try:
                store.write_file(tmp / file, boxes, rng)
            except BaseException as exc:  # reported collectively in _finish
                job.error.append(exc)

        self.pending = job
        if asynchronous:
            job.thread = threading.Thread(target=write, name=f"checkpoint-{step}", daemon=True)
            job.thread.start()
        else:
            write()
            self.wait()
        return final

    def _foreign(self, final: Path) -> str | None:
        """Why ``final`` may not be replaced (it holds another run's checkpoint), or None."""
        if self.cfg.checkpoint.overwrite or not final.exists():
            return None
        meta = _peek_meta(final)
        if meta is not None and meta.get("run_id") == self.lineage.run_id:
            return None  # this run saving the same step again
        return (f"checkpoint of step {_step_of(final.name)} not saved: '{final}' holds a checkpoint of another run, "
                "not in this run's history; move it away or set checkpoint.overwrite=true to replace it")

    def _from_rank0(self, value: str | None) -> str | None:
        if self.world > 1:
            value = comm.broadcast_object(value, 0)
        return value

    def poll(self) -> bool:
        """Finish an asynchronous save if every rank has written its file; True when none is in flight.

        Collective while a save is in flight (call it on every rank at the same point, e.g. after
        each step)."""
        job = self.pending
        if job is None:
            return True
        done = torch.tensor([0 if job.thread is not None and job.thread.is_alive() else 1], dtype=torch.int32,
                            device=self.dev)
        if self.world > 1:
            comm.all_reduce(done, None, op=comm.ReduceOp.MIN)
        if int(done.item()):
            self.wait()
            return True
        return False

    def wait(self) -> None:
        """Block until the save in flight is written, then finalise it (collective)."""
        job, self.pending = self.pending, None
        if job is None:
            return
        if job.thread is not None:
            job.thread.join()
        failed = torch.tensor([1 if job.error else 0], dtype=torch.int32, device=self.dev)
        if self.world > 1:
            comm.all_reduce(failed, None, op=comm.ReduceOp.MAX)
        if int(failed.item()):
            why = f": {type(job.error[0]).__name__}: {job.error[0]}" if job.error else " on another rank"
            raise TrainingError(f"checkpoint of step {job.step} could not be written under '{job.tmp}'{why}; "
                                f"'latest' still names the previous checkpoint")
        if self.rank == 0:
            assert job.index is not None
            store.finish_index(job.index, job.tmp)
            (job.tmp / "meta.json").write_text(json.dumps(job.meta, indent=1))
            _publish(job.tmp, job.final, self.cfg.checkpoint.keep, self.lineage)
            log.info("saved checkpoint %s", job.final)
        self._barrier()


def _publish(tmp: Path, final: Path, keep: int, lineage: Lineage) -> None:
    """Rename the complete ``tmp`` to ``final``, point ``latest`` at it, then prune ``lineage``'s history to ``keep``."""
    root = final.parent
    old = root / f".old_{final.name}"
    if final.exists():  # saving a step again (e.g. after a resume): move the old copy aside, delete it last
        if old.exists():
            shutil.rmtree(old)
        final.rename(old)
    tmp.rename(final)
    latest_tmp = root / ".latest.tmp"
    latest_tmp.write_text(final.name + "\n")
    latest_tmp.replace(root / "latest")
    if old.exists():
        shutil.rmtree(old)
    if keep > 0:
        history = sorted((m["step"], p.name) for p in root.glob("iter_*") if p.is_dir()
                         and (m := _peek_meta(p)) is not None and isinstance(m.get("step"), int) and lineage.holds(m))
        for _, name in history[:-keep]:
            if name not in (final.name, lineage.loaded):  # never what `latest` names, nor the resume source
                shutil.rmtree(root / name)


def save(cfg: Config, step: int, consumed_samples: int, model: nn.Module, optimizer: DistributedOptimizer,
         state: ParallelState | None, dev: torch.device, tracker: RNGTracker | None = None,
         extra: dict[str, Any] | None = None, lineage: Lineage | None = None) -> Path:
    """Collectively write the checkpoint of ``step`` and return its directory (synchronous).

    ``state`` None: a single process without process groups. ``extra``: more JSON-able training
    state for meta.json (skipped steps, the fp16 loss scaler). ``lineage``: the run's (None: each
    call is a fresh run of its own, which may not replace another call's step directory).
    """
    return Checkpointer(cfg, state, dev, lineage).save(step, consumed_samples, model, optimizer, tracker, extra,
                                                       asynchronous=False)


def write_weights(ckpt: Path, meta: dict[str, Any], weights: dict[str, torch.Tensor]) -> None:
    """A weights-only checkpoint directory from full tensors, in one process (tools/convert_checkpoint.py)."""
    boxes = [store.Box(f"model/{n}", (0,) * t.dim(), t.detach().cpu().contiguous()) for n, t in weights.items()]
    file = store.rank_file(0)
    store.write_file(ckpt / file, boxes)
    index = store.build_index(store.entries_of(boxes, file),
                              {b.name: (tuple(b.data.shape), store.dtype_name(b.data.dtype)) for b in boxes})
    store.finish_index(index, ckpt)
    (ckpt / "meta.json").write_text(json.dumps({**meta, "format_version": FORMAT_VERSION}, indent=1))


# ------------------------------------------------------------------------------------------ load


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


def read_full(ckpt: Path, prefix: str = "model/") -> dict[str, torch.Tensor]:
    """{name without ``prefix``: full tensor} of every stored tensor under ``prefix`` (one process)."""
    reader = Reader(ckpt)
    return {n[len(prefix):]: reader.read(n) for n in reader.names(prefix)}


def _read_local(reader: Reader, name: str, p: nn.Parameter, state: ParallelState | None) -> torch.Tensor:
    """This rank's shard of global tensor ``name`` for parameter ``p`` (vocabulary padding zero-filled)."""
    tp_rank, tp = (state.tp_rank, state.tp_size) if state is not None else (0, 1)
    want = stored_shape(p, tp)
    if reader.shape(name) != want:
        raise DataError(f"checkpoint file '{reader.ckpt / INDEX}': '{name}' has shape {reader.shape(name)}, the model "
                        f"config needs {want}; the checkpoint does not match this model config")
    offsets = _shift(p, tp_rank)
    lengths = [min(n, limit - o) for n, o, limit in zip(p.shape, offsets, want)]
    part = reader.read(name, offsets, [max(n, 0) for n in lengths])
    if tuple(part.shape) != tuple(p.shape):  # vocabulary padding rows of this layout
        padded = torch.zeros(p.shape, dtype=part.dtype)
        padded[tuple(slice(0, n) for n in part.shape)] = part
        part = padded
    return part


def load_model_state(model: nn.Module, ckpt: Path, state: ParallelState | None, reader: Reader | None = None) -> None:
    """Copy this rank's shards of the checkpoint's tensors into ``model`` (names and full shapes must match).

    Pipeline stages check only the names they hold; the checkpoint must hold every one of them.
    """
    reader = reader or Reader(ckpt)
    own = {stored_name(n, p): p for n, p in named_trainable(model)}
    saved = {n[len("model/"):] for n in reader.names("model/")}
    missing = sorted(set(own) - saved)
    unexpected = sorted(saved - set(own)) if state is None or state.pp_size == 1 else []
    if missing or unexpected:
        raise DataError(f"checkpoint file '{ckpt / INDEX}' does not match this model config: missing {missing[:3]}, "
                        f"unexpected {unexpected[:3]}")
    with torch.no_grad():
        for name, p in own.items():
            p.copy_(_read_local(reader, f"model/{name}", p, state))


def _load_optimizer(model: nn.Module, optimizer: DistributedOptimizer, reader: Reader, meta: dict[str, Any],
                    state: ParallelState | None) -> None:
    named = named_trainable(model)
    stored = {stored_name(n, p) for n, p in named}
    saved = {n[len("optim/"):].rsplit("/", 1)[0] for n in reader.names("optim/")}
    unknown = sorted(saved - stored) if state is None or state.pp_size == 1 else []
    if unknown:
        raise DataError(f"checkpoint file '{reader.ckpt / INDEX}': optimizer state for unknown parameters "
                        f"{unknown[:3]}; the checkpoint does not match this model config")
    entries: dict[str, dict[str, torch.Tensor]] = {}
    for name, p in named:  # a tied copy takes the embedding's state (same init, same synced grads)
        entry = {"step": torch.tensor(float(meta.get("optimizer_step", 0)))}
        for key in OPTIM_KEYS:
            gname = f"optim/{stored_name(name, p)}/{key}"
            if gname in reader.tensors:
                entry[key] = _read_local(reader, gname, p, state)
        entries[name] = entry
    try:
        optimizer.load_state_dict_by_name(entries)
    except DataError as exc:
        raise DataError(f"checkpoint '{reader.ckpt}': {exc}") from None


def load(ckpt: Path, model: nn.Module, optimizer: DistributedOptimizer, state: ParallelState | None,
         dev: torch.device, seed: int, tracker: RNGTracker | None = None,
         layout: dict[str, int] | None = None) -> dict[str, Any]:
    """Restore model, optimizer and (same layout) this rank's RNG; return the meta (step, consumed samples).

    ``layout``: this run's (``writer_layout(cfg)``); the RNG states load only if it equals the
    writer's (otherwise every rank reseeds from the seed, step and rank). A converted checkpoint
    (meta ``converted_from``, see tools/convert_checkpoint.py) may hold weights only: the optimizer
    keeps its fresh state.
    """
    meta = read_meta(ckpt)
    reader = Reader(ckpt)
    rank, world_size = (state.rank, state.dims.world_size) if state is not None else (0, 1)
    load_model_state(model, ckpt, state, reader)
    if reader.names("optim/") or not meta.get("converted_from"):
        _load_optimizer(model, optimizer, reader, meta, state)
    else:
        log.info("%s has no optimizer state (converted weights only): starting with a fresh optimizer", ckpt)
    same = meta.get("world_size") == world_size and (layout is None or meta.get("layout") == layout)
    states = reader.read_extra(store.rank_file(rank), "rng/") if same and store.rank_file(rank) in \
        reader.index["files"] else {}
    if states:
        device_mod.set_rng_state({k: v for k, v in states.items() if not k.startswith("tracker/")}, dev)
        if tracker is not None:
            tracker.set_states({k[len("tracker/"):]: v for k, v in states.items() if k.startswith("tracker/")})
    else:
        log.warning("no RNG state for rank %d in %s (written by another layout); reseeding from seed and step",
                    rank, ckpt)
        device_mod.manual_seed_all(seed + 1_000_003 * meta["step"] + rank)
    return meta
