"""Save and load training checkpoints.

Layout on disk (format version 1)::

    SAVE_DIR/
      latest                    name of the newest complete checkpoint, written last
      iter_0000100/
        meta.json               format version, step, consumed samples, resolved config (plain JSON)
        model.pt                {parameter name: full (unsharded) tensor}
        optimizer.pt            {"state": {parameter name: {exp_avg, exp_avg_sq, step}}, "groups": [...]}
        rng/rank_00000.pt       this rank's RNG states (default generators + the TP RNG tracker's streams)

Every tensor is stored whole under its unsharded parameter name (TP shards are gathered on save
and sliced again on load, see ``mpu.sharding``), so the files do not depend on the layout that
wrote them: a tp2 checkpoint loads at tp1 or tp4. A checkpoint is written under a temporary directory name and renamed when
complete; ``latest`` is replaced (temp file + rename) only after that, so a crash mid-save leaves
the previous checkpoint intact and never a half-written one under a real name. Loading uses
``torch.load(weights_only=True)`` (no pickled code runs) and non-tensor state is JSON.
"""
from __future__ import annotations

import json
import logging
import pickle
import shutil
import zipfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from . import device as device_mod
from .config import Config, to_dict
from .errors import DataError
from .mpu import ParallelState
from .mpu.random import RNGTracker
from .mpu.sharding import gather_full, local_shard, stored_name, stored_shape
from .optim import DistributedOptimizer, named_trainable

FORMAT_VERSION = 1
log = logging.getLogger("megatron_sp")


def _step_dir(step: int) -> str:
    return f"iter_{step:07d}"


def _optimizer_by_name(model: nn.Module, optimizer: DistributedOptimizer,
                       state: ParallelState | None) -> dict[str, Any]:
    """Optimizer state keyed by parameter name, each entry at its full shape (collective: dp_cp, TP, PP)."""
    local = optimizer.state_dict_by_name()  # ZeRO shards already gathered over dp_cp
    named = named_trainable(model)
    name_of = {id(p): n for n, p in named}
    keys = sorted({k for entry in local.values() for k in entry})
    full: dict[str, dict[str, torch.Tensor]] = {}
    for key in keys:
        for name, tensor in gather_full(named, state, lambda p, key=key: local[name_of[id(p)]].get(key)).items():
            full.setdefault(name, {})[key] = tensor
    return {"state": full, "format": "by_name"}


def _load_optimizer_by_name(model: nn.Module, optimizer: DistributedOptimizer, saved: dict[str, Any],
                            path: Path, state: ParallelState | None) -> None:
    named = named_trainable(model)
    entries = saved.get("state", {}) if isinstance(saved, dict) else {}
    stored = {stored_name(n, p) for n, p in named}
    unknown = sorted(set(entries) - stored) if state is None or state.pp_size == 1 else []
    if unknown:
        raise DataError(f"{path}: optimizer state for unknown parameters {unknown[:3]}; the checkpoint does not match "
                        "this model config")
    mine = {}
    for name, p in named:  # a tied copy takes the embedding's state (same init, same synced grads)
        entry = entries.get(stored_name(name, p))
        if entry is not None:
            mine[name] = {k: (local_shard(v, p, state) if v.dim() else v) for k, v in entry.items()}
    try:
        optimizer.load_state_dict_by_name(mine)
    except DataError as exc:
        raise DataError(f"{path}: {exc}") from None


def save(cfg: Config, step: int, consumed_samples: int, model: nn.Module, optimizer: DistributedOptimizer,
         state: ParallelState | None, dev: torch.device, tracker: RNGTracker | None = None,
         extra: dict[str, Any] | None = None) -> Path:
    """Collectively write the checkpoint of ``step`` (every rank calls this; rank 0 writes the tensors).

    ``state`` None: a single process without process groups. ``extra``: more JSON-able training
    state for meta.json (skipped steps, the fp16 loss scaler).
    """
    rank, world_size = (state.rank, state.dims.world_size) if state is not None else (0, 1)
    root = Path(cfg.checkpoint.save)  # type: ignore[arg-type]
    final = root / _step_dir(step)
    tmp = root / f".tmp_{_step_dir(step)}"
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        (tmp / "rng").mkdir(parents=True)
    if world_size > 1:
        dist.barrier()
    torch.save(_rng_states(dev, tracker), tmp / "rng" / f"rank_{rank:05d}.pt")
    weights = gather_full(named_trainable(model), state)
    optim_state = _optimizer_by_name(model, optimizer, state)
    if rank == 0:
        torch.save(weights, tmp / "model.pt")
        torch.save(optim_state, tmp / "optimizer.pt")
        meta = {"format_version": FORMAT_VERSION, "step": step, "consumed_samples": consumed_samples,
                "world_size": world_size, "config": to_dict(cfg), **(extra or {})}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    if world_size > 1:
        dist.barrier()
    if rank == 0:
        old = root / f".old_{_step_dir(step)}"
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
        _prune(root, cfg.checkpoint.keep)
        log.info("saved checkpoint %s", final)
    if world_size > 1:
        dist.barrier()
    return final


def _rng_states(dev: torch.device, tracker: RNGTracker | None) -> dict[str, torch.Tensor]:
    states = dict(device_mod.rng_state(dev))
    if tracker is not None:
        states.update({f"tracker/{k}": v for k, v in tracker.get_states().items()})
    return states


def _prune(root: Path, keep: int) -> None:
    if keep <= 0:
        return
    existing = sorted(p for p in root.glob("iter_*") if p.is_dir())
    for old in existing[:-keep]:
        shutil.rmtree(old)


def resolve(load_dir: str | Path) -> Path:
    """The checkpoint directory a ``checkpoint.load`` path names (its ``latest``, or itself)."""
    root = Path(load_dir)
    if (root / "meta.json").is_file():
        return root
    latest = root / "latest"
    if not latest.is_file():
        raise DataError(f"checkpoint.load: no checkpoint in '{root}' (no 'latest' file); point it at a directory "
                        "written by checkpoint.save")
    target = root / latest.read_text().strip()
    if not (target / "meta.json").is_file():
        raise DataError(f"checkpoint.load: '{latest}' names '{target.name}', which is missing or incomplete")
    return target


def _torch_load(path: Path) -> Any:
    if not path.is_file():
        raise DataError(f"checkpoint file '{path}' is missing; the checkpoint is incomplete")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(f"checkpoint file '{path}' is corrupted or truncated ({first[:120]})") from None


def read_meta(ckpt: Path) -> dict[str, Any]:
    path = ckpt / "meta.json"
    try:
        meta = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise DataError(f"checkpoint file '{path}' is unreadable ({exc})") from None
    if meta.get("format_version") != FORMAT_VERSION:
        raise DataError(f"checkpoint '{ckpt}' has format version {meta.get('format_version')}; this version reads "
                        f"{FORMAT_VERSION}")
    return meta


def load_model_state(model: nn.Module, ckpt: Path, state: ParallelState | None) -> None:
    """Copy this rank's shards of the checkpoint's full tensors into ``model`` (names and full shapes must match).

    Pipeline stages check only the names they hold; the file must hold every one of them.
    """
    path = ckpt / "model.pt"
    saved = _torch_load(path)
    own = {stored_name(n, p): p for n, p in named_trainable(model)}
    tp = state.tp_size if state is not None else 1
    missing = sorted(set(own) - set(saved))
    unexpected = sorted(set(saved) - set(own)) if state is None or state.pp_size == 1 else []
    if missing or unexpected:
        raise DataError(f"checkpoint file '{path}' does not match this model config: missing {missing[:3]}, "
                        f"unexpected {unexpected[:3]}")
    for name, p in own.items():
        if tuple(saved[name].shape) != stored_shape(p, tp):
            raise DataError(f"checkpoint file '{path}': '{name}' has shape {tuple(saved[name].shape)}, the model "
                            f"config needs {stored_shape(p, tp)}")
    with torch.no_grad():
        for name, p in own.items():
            p.copy_(local_shard(saved[name], p, state))


def load(ckpt: Path, model: nn.Module, optimizer: DistributedOptimizer, state: ParallelState | None,
         dev: torch.device, seed: int, tracker: RNGTracker | None = None) -> dict[str, Any]:
    """Restore model, optimizer and this rank's RNG; return the meta (step, consumed samples).

    A converted checkpoint (meta ``converted_from``, see tools/convert_checkpoint.py) may lack
    optimizer.pt: the weights load and the optimizer keeps its fresh state.
    """
    meta = read_meta(ckpt)
    rank, world_size = (state.rank, state.dims.world_size) if state is not None else (0, 1)
    load_model_state(model, ckpt, state)
    if (ckpt / "optimizer.pt").is_file() or not meta.get("converted_from"):
        _load_optimizer_by_name(model, optimizer, _torch_load(ckpt / "optimizer.pt"), ckpt / "optimizer.pt", state)
    else:  # a weights-only checkpoint written by tools/convert_checkpoint.py
        log.info("%s has no optimizer state (converted weights only): starting with a fresh optimizer", ckpt)
    rng_path = ckpt / "rng" / f"rank_{rank:05d}.pt"
    if rng_path.is_file() and meta.get("world_size") == world_size:
        states = _torch_load(rng_path)
        device_mod.set_rng_state({k: v for k, v in states.items() if not k.startswith("tracker/")}, dev)
        if tracker is not None:
            tracker.set_states({k[len("tracker/"):]: v for k, v in states.items() if k.startswith("tracker/")})
    else:
        log.warning("no RNG state for rank %d in %s (different world size); reseeding from seed and step", rank, ckpt)
        device_mod.manual_seed_all(seed + 1_000_003 * meta["step"] + rank)
    return meta
