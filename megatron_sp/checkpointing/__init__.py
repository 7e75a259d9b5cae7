"""Save and load training checkpoints: sharded, layout-free, atomic, optionally asynchronous.

Each rank writes the boxes of the global tensors it holds (``model/NAME``, ``optim/NAME/KEY``) to its own
safetensors file; any (tp, pp, cp, dp, ZeRO) layout loads any other. Directory layout, atomicity,
asynchronous saves and run ownership (``ownership.py``): docs/checkpoints.md.
"""
from __future__ import annotations

import errno
import json
import logging
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..config import Config, to_dict
from ..errors import DataError, TrainingError, write_failure
from ..mpu import ParallelState, comm
from ..mpu.random import RNGTracker
from ..mpu.sharding import ep_size, is_sharded, is_tied_copy, stored_name, stored_shape
from ..optim import DistributedOptimizer, named_trainable
from . import store
from .ownership import (FORMAT_VERSION, LOCK_FILE, Lineage, SaveDirLock, _peek_meta, _step_of,  # noqa: F401
                        check_output_dir, check_save_dir, claim_save_dir, expired, lineage_of, read_meta, resolve,
                        resume_source)
from .rng import restore as restore_rng, rng_tensors
from .store import INDEX, Reader

OPTIM_KEYS = ("exp_avg", "exp_avg_sq", "master_param")
log = logging.getLogger("megatron_sp")


def writer_layout(cfg: Config) -> dict[str, int]:
    """meta.json's ``layout``: the writer's ``{tp, pp, cp, dp, virtual_stages}``, and ``sequence_parallel: 1`` when on
    (hidden dropout then draws from the tracker's TP-different stream, not the default generator)."""
    p = cfg.parallel
    return {"tp": p.tp, "pp": p.pp, "cp": p.cp, "dp": int(p.dp or 1), "virtual_stages": p.virtual_stages,
            **({"sequence_parallel": 1} if p.sequence_parallel else {})}


def _tp(state: ParallelState | None) -> tuple[int, int]:
    return (state.tp_rank, state.tp_size) if state is not None else (0, 1)


def _shift(p: nn.Parameter, tp_rank: int) -> list[int]:
    """The local shard's offset in the full tensor."""
    shift = [0] * p.dim()
    if is_sharded(p):
        shift[p.partition_dim] = tp_rank * p.shape[p.partition_dim]
    if ep_size(p) > 1:
        shift[0] = p.ep_rank * p.shape[0]
    return shift


def rank_boxes(model: nn.Module, optimizer: DistributedOptimizer, state: ParallelState | None
               ) -> tuple[list[store.Box], dict[str, tuple[tuple[int, ...], str]]]:
    """(the boxes this rank writes, {global name: (shape, dtype)} of every tensor its stage declares)."""
    tp_rank, tp = _tp(state)
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
        if (tp_rank and not is_sharded(p) and not getattr(p, "ep_tp", False)) or name not in parts:
            continue  # TP-replicated: TP rank 0 writes it (experts folded over tp: each edp rank); or its chunk is empty
        start, flats = parts[name]
        for key, flat in flats.items():
            boxes += store.boxes_of_flat(_global(name, key), flat, start, p.shape, _shift(p, tp_rank), shape)
    return boxes, tensors


def _global(name: str, key: str) -> str:
    return f"model/{name}" if key == "param" else f"optim/{name}/{key}"


@dataclass
class _Pending:
    step: int
    tmp: Path
    final: Path
    meta: dict[str, Any]
    index: dict[str, Any] | None  # rank 0 only
    thread: threading.Thread | None = None
    error: list[OSError] = field(default_factory=list)


class Checkpointer:
    """Writes the checkpoints of one run (``save``/``poll``/``wait`` are collective); ``lineage`` None: a fresh run."""

    def __init__(self, cfg: Config, state: ParallelState | None, dev: torch.device,
                 lineage: Lineage | None = None) -> None:
        self.cfg, self.state, self.dev = cfg, state, dev
        self.rank, self.world = (state.rank, state.dims.world_size) if state is not None else (0, 1)
        self.lineage = lineage if lineage is not None else Lineage.start()
        self.pending: _Pending | None = None

    def _reduce(self, flag: bool, op: Any) -> bool:
        """``flag`` reduced over every rank with ``op`` (MIN: all, MAX: any)."""
        t = torch.tensor([int(flag)], dtype=torch.int32, device=self.dev)
        if self.world > 1:
            comm.all_reduce(t, None, op=op)
        return bool(t.item())

    def save(self, step: int, consumed_samples: int, model: nn.Module, optimizer: DistributedOptimizer,
             tracker: RNGTracker | None = None, extra: dict[str, Any] | None = None,
             asynchronous: bool | None = None) -> Path:
        """Start (``asynchronous``; default ``checkpoint.async_save``) or do the save of ``step``."""
        self.wait()
        asynchronous = self.cfg.checkpoint.async_save if asynchronous is None else asynchronous
        root = Path(self.cfg.checkpoint.save)  # type: ignore[arg-type]
        final, tmp = root / f"iter_{step:07d}", root / f".tmp_iter_{step:07d}"
        refusal = self._foreign(final) if self.rank == 0 else None
        if self.rank == 0 and refusal is None:
            try:
                if tmp.exists():
                    shutil.rmtree(tmp)  # a crashed save of this step (the lock keeps other runs out)
                (tmp / store.SHARDS).mkdir(parents=True)
            except OSError as exc:
                refusal = f"checkpoint of step {step} not saved: {write_failure(tmp, exc, None)}"
        if self.world > 1:  # also the barrier: nobody writes before tmp exists
            refusal = comm.broadcast_object(refusal, 0)
        if refusal:
            raise TrainingError(refusal)
        boxes, tensors = rank_boxes(model, optimizer, self.state)
        file = store.rank_file(self.rank)
        mine = (store.entries_of(boxes, file), tensors)
        everyone = comm.all_gather_object(mine) if self.world > 1 else [mine]
        index = None
        if self.rank == 0:
            declared = {name: spec for _, t in everyone for name, spec in t.items()}
            index = store.build_index((e for entries, _ in everyone for e in entries), declared,
                                      [store.rank_file(r) for r in range(self.world)])
        meta = {"format_version": FORMAT_VERSION, "step": step, "consumed_samples": consumed_samples,
                "world_size": self.world, "layout": writer_layout(self.cfg), "optimizer_step": optimizer.step_count,
                "config": to_dict(self.cfg), **self.lineage.to_meta(), **(extra or {})}
        job = _Pending(step, tmp, final, meta, index)
        rng = rng_tensors(self.dev, tracker)  # now, not when the thread writes

        def write() -> None:
            try:
                store.write_file(tmp / file, boxes, rng)
            except BaseException as exc:  # reported collectively in wait, as an OSError naming the file
                err = exc if isinstance(exc, OSError) else OSError(errno.EIO, f"{type(exc).__name__}: {exc}")
                err.filename = err.filename or str(tmp / file)
                job.error.append(err)

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

    def poll(self) -> bool:
        """Finish an asynchronous save if every rank has written its file; True when none is in flight
        (collective while one is: call it on every rank after each step)."""
        job = self.pending
        if job is None:
            return True
        if self._reduce(job.thread is None or not job.thread.is_alive(), comm.ReduceOp.MIN):
            self.wait()
            return True
        return False

    def wait(self) -> None:
        """Block until the save in flight is written, then finalise it (collective). A failure on any rank (a full
        disk, typically) removes the temporary directory and raises one ``TrainingError`` on every rank naming the
        file, the bytes the checkpoint needs and those free; ``latest`` keeps naming the previous checkpoint."""
        job, self.pending = self.pending, None
        if job is None:
            return
        if job.thread is not None:
            job.thread.join()
        failed = job.error[:1]
        if self._reduce(bool(failed), comm.ReduceOp.MAX) and self.world > 1:
            failed = [e for errors in comm.all_gather_object(failed) for e in errors]
        why = None
        if self.rank == 0:
            assert job.index is not None
            try:
                if not failed:
                    store.finish_index(job.index, job.tmp)
                    store.write_text(job.tmp / "meta.json", json.dumps(job.meta, indent=1))
                    _publish(job.tmp, job.final, self.cfg.checkpoint.keep, self.lineage)
            except OSError as exc:
                failed = [exc]
            if failed:
                shutil.rmtree(job.tmp, ignore_errors=True)
                (job.final.parent / LATEST_TMP).unlink(missing_ok=True)
                latest = job.final.parent / "latest"
                previous = latest.read_text().strip() if latest.is_file() else "nothing"
                why = (f"checkpoint of step {job.step} not saved: {write_failure(job.tmp, failed[0], store.nbytes(job.index))}; "
                       f"its temporary files were removed, 'latest' still names {previous}")
            else:
                log.info("saved checkpoint %s", job.final)
        if self.world > 1:
            why = comm.broadcast_object(why, 0)  # also the barrier: nobody goes on before the checkpoint is published
        if why:
            raise TrainingError(why)


LATEST_TMP = ".latest.tmp"


def _publish(tmp: Path, final: Path, keep: int, lineage: Lineage) -> None:
    """Rename the complete ``tmp`` to ``final``, point ``latest`` at it, then prune ``lineage``'s history to ``keep``.
    The new ``latest`` is written and fsynced first: a full disk fails before anything is renamed."""
    root = final.parent
    latest_tmp = root / LATEST_TMP
    store.write_text(latest_tmp, final.name + "\n")
    old = root / f".old_{final.name}"
    if final.exists():  # saving a step again (e.g. after a resume): move the old copy aside, delete it last
        if old.exists():
            shutil.rmtree(old)
        final.rename(old)
    tmp.rename(final)
    latest_tmp.replace(root / "latest")
    store.fsync_dir(root)
    for name in [old.name] + expired(root, keep, lineage, final.name):  # never `latest`'s, nor the resume source
        shutil.rmtree(root / name, ignore_errors=True)  # the checkpoint is published: a failure here is no failed save


def save(cfg: Config, step: int, consumed_samples: int, model: nn.Module, optimizer: DistributedOptimizer,
         state: ParallelState | None, dev: torch.device, tracker: RNGTracker | None = None,
         extra: dict[str, Any] | None = None, lineage: Lineage | None = None) -> Path:
    """Collectively write the checkpoint of ``step`` (``extra``: more meta.json state) and return its directory."""
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
    store.write_text(ckpt / "meta.json", json.dumps({**meta, "format_version": FORMAT_VERSION}, indent=1))


def read_full(ckpt: Path, prefix: str = "model/") -> dict[str, torch.Tensor]:
    """{name without ``prefix``: full tensor} of every stored tensor under ``prefix`` (one process)."""
    reader = Reader(ckpt)
    return {n[len(prefix):]: reader.read(n) for n in reader.names(prefix)}


def _read_local(reader: Reader, name: str, p: nn.Parameter, state: ParallelState | None) -> torch.Tensor:
    """This rank's shard of global tensor ``name`` for parameter ``p`` (vocabulary padding zero-filled)."""
    tp_rank, tp = _tp(state)
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
    """Copy this rank's shards into ``model`` (names and full shapes must match; a pipeline stage checks its own)."""
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
         layout: dict[str, int] | None = None, weights_only: bool = False) -> dict[str, Any]:
    """Restore model, optimizer and this rank's RNG streams (``rng.restore``: those that map from the writer's layout
    to ``layout``, the others reseeded from ``seed`` and the step); return the meta. A converted checkpoint may hold
    weights only (fresh optimizer); ``weights_only``: keep a fresh optimizer anyway (another ``train.optimizer``)."""
    meta = read_meta(ckpt)
    reader = Reader(ckpt)
    with optimizer.full_params():  # (ZeRO-3: the parameters are shards between uses)
        load_model_state(model, ckpt, state, reader)
    if not weights_only and (reader.names("optim/") or not meta.get("converted_from")):
        _load_optimizer(model, optimizer, reader, meta, state)
    else:
        log.info("%s: %s: starting with a fresh optimizer", ckpt, "another train.optimizer (checkpoint."
                 "allow_optimizer_change)" if weights_only else "no optimizer state (converted weights only)")
        optimizer.sync_master_from_params()  # 16-bit parameters: the fp32 masters from the loaded weights
    restore_rng(reader, meta, state, dev, seed, tracker, layout)
    return meta
