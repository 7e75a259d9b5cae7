"""The RNG streams of a checkpoint: what each rank saves (``rng/...`` in its shard file), which saved streams a
resuming rank restores, and the deterministic reseed of the others (docs/checkpoints.md, "RNG streams on resume").

The streams are a rank's default generators (``cpu``, and ``cuda`` on a GPU: the TP-same stream) and its tracker's
streams (``tracker/tp-different``). A stream maps to a rank of the resuming layout only when that rank will draw
from it exactly what the writer's rank would have drawn next:

- same layout: every stream, from the rank's own file;
- only tp changed: the default generators, from the writer rank at this rank's (cp, dp, pp) and tp 0 (they are
  equal on all TP ranks and draw full-size masks at any tp); the tracker streams are reseeded;
- pp, virtual stages, cp or dp changed: nothing (a rank draws for other layers, tokens or micro-batches).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from .. import device as device_mod
from ..mpu import ParallelDims, ParallelState
from ..mpu.random import RNGTracker, init_rng, model_parallel_seed
from . import store

STEP_SEED_STRIDE = 1_000_003
"""A stream reseeded at step ``n`` gets ``init_rng``'s seed for ``train.seed + 1_000_003·n`` (TP-same stays TP-same)."""
_ORIGIN = {"tp": 0, "cp": 0, "dp": 0, "pp": 0}
log = logging.getLogger("megatron_sp")


def rng_tensors(dev: torch.device, tracker: RNGTracker | None) -> dict[str, torch.Tensor]:
    """This rank's streams as ``{"rng/cpu", "rng/cuda", "rng/tracker/NAME": uint8 CPU tensor}`` (copies)."""
    states = dict(device_mod.rng_state(dev))
    if tracker is not None:
        states.update({f"tracker/{k}": v for k, v in tracker.get_states().items()})
    return {f"rng/{k}": v.detach().cpu().contiguous().clone() for k, v in states.items()}


def sources(writer: dict[str, int] | None, reader: dict[str, int], coords: dict[str, int],
            rank: int) -> tuple[int | None, int | None]:
    """(writer rank whose default generators, writer rank whose tracker streams) the rank at ``coords`` of layout
    ``reader`` restores from a checkpoint written at layout ``writer``; None: reseeded."""
    if writer is None:
        return None, None
    if writer == reader:
        return rank, rank
    if any(writer.get(axis) != reader.get(axis) for axis in ("pp", "cp", "dp", "virtual_stages", "sequence_parallel")):
        return None, None
    dims = ParallelDims(tp=writer["tp"], cp=writer["cp"], dp=writer["dp"], pp=writer["pp"])
    return dims.rank_of(cp=coords["cp"], dp=coords["dp"], pp=coords["pp"]), None


def _layout_text(layout: dict[str, int] | None) -> str:
    return " ".join(f"{k}{v}" for k, v in layout.items()) if layout else "unknown"


def restore(reader: store.Reader, meta: dict[str, Any], state: ParallelState | None, dev: torch.device, seed: int,
            tracker: RNGTracker | None, layout: dict[str, int] | None) -> None:
    """Set this rank's streams: reseed them all from ``seed`` and the checkpoint's step, then restore the saved ones
    that map (``sources``; ``layout`` None: the writer's when the world size is). Logs one line naming the streams
    reseeded, if any."""
    rank, world = (state.rank, state.dims.world_size) if state is not None else (0, 1)
    coords = state.coords if state is not None else _ORIGIN
    writer = meta.get("layout")
    if layout is None:
        layout = writer if meta.get("world_size") == world else {}
    default_src, tracker_src = sources(writer, layout, coords, rank)

    reseed = seed + STEP_SEED_STRIDE * int(meta["step"])
    if tracker is not None:
        init_rng(tracker, reseed, coords["tp"], coords["pp"])
    else:
        device_mod.manual_seed_all(model_parallel_seed(reseed, coords["tp"], coords["pp"])[0])
    defaults = device_mod.rng_state(dev)
    tracked = tracker.get_states() if tracker is not None else {}
    saved = {src: _read(reader, src) for src in {default_src, tracker_src} if src is not None}
    own, tracked_saved = saved.get(default_src, {}), saved.get(tracker_src, {})  # type: ignore[arg-type]
    device_mod.set_rng_state({k: own.get(k, v) for k, v in defaults.items()}, dev)
    if tracker is not None:
        tracker.set_states({k: tracked_saved.get(f"tracker/{k}", v) for k, v in tracked.items()})
    restored = [k for k in defaults if k in own] + [f"tracker/{k}" for k in tracked if f"tracker/{k}" in tracked_saved]
    reseeded = [k for k in [*defaults, *(f"tracker/{k}" for k in tracked)] if k not in restored]
    if reseeded:
        log.warning("%s (written at %s) resumed at %s: RNG streams %s reseeded from train.seed and step %d%s",
                    Path(reader.ckpt).name, _layout_text(writer), _layout_text(layout), ", ".join(reseeded),
                    meta["step"], f"; restored: {', '.join(restored)}" if restored else "")


def _read(reader: store.Reader, rank: int) -> dict[str, torch.Tensor]:
    file = store.rank_file(rank)
    return reader.read_extra(file, "rng/") if file in reader.index["files"] else {}
