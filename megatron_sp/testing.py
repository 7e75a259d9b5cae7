"""Run a function on several gloo ranks: the multi-rank test harness.

``run_distributed(fn, world_size, **kwargs)`` starts ``world_size`` processes from a ``forkserver``
with torch preloaded (a launch costs a fork, not an import); each rank uses one thread, joins a gloo
group on a free localhost port and returns ``fn(rank, world_size, **kwargs)``. A rank that raises
makes it raise ``RankError`` naming that rank; the others are terminated. ``fn`` must be a
module-level function (of an importable module or of ``__main__``). In the package, not under
tests/, because training and tools use it: docs/parity.md, "Other oracles".
"""
from __future__ import annotations

import contextlib
import importlib
import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import socket
import sys
import time
import traceback
from pathlib import Path
from collections.abc import Callable
from typing import Any

_PRELOAD = ["torch", "torch.distributed", "megatron_sp.testing"]
_CTX: Any = None


class RankError(RuntimeError):
    """A rank raised (or died) inside ``run_distributed``."""

    def __init__(self, rank: int, detail: str) -> None:
        super().__init__(f"rank {rank} failed:\n{detail}")
        self.rank = rank


def _context() -> Any:
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(_PRELOAD)
    return _CTX


def _importable(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` itself, or for a function of the ``__main__`` script the same function from that file
    imported by module name (children unpickle functions by module name)."""
    if getattr(fn, "__module__", None) != "__main__":
        return fn
    main_file = Path(sys.modules["__main__"].__file__).resolve()  # type: ignore[arg-type]
    if str(main_file.parent) not in sys.path:
        sys.path.insert(0, str(main_file.parent))
    return getattr(importlib.import_module(main_file.stem), fn.__name__)


def free_port() -> int:
    """A TCP port on localhost that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn: Callable[..., Any], rank: int, world_size: int, port: int, init: bool, timeout_s: float,
            kwargs: dict[str, Any], results: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size)})
    try:
        if init:
            from datetime import timedelta
            dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
        out = fn(rank, world_size, **kwargs)
        payload = ("ok", pickle.dumps(out))
    except BaseException:  # report everything, including SystemExit from code under test
        payload = ("error", (time.time(), traceback.format_exc()))
    results.put((rank, *payload))  # before closing the group: peers fail only after this report is queued
    with contextlib.suppress(Exception):
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable[..., Any], world_size: int, *, timeout_s: float = 300.0, init: bool = True,
                    **kwargs: Any) -> list[Any]:
    """Run ``fn(rank, world_size, **kwargs)`` on ``world_size`` gloo ranks; return the per-rank results.
    ``init=False`` leaves process-group creation to ``fn`` (the torchrun variables are set)."""
    fn = _importable(fn)
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, init, timeout_s, kwargs, results), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    error: RankError | None = None
    deadline = time.monotonic() + timeout_s + 30
    pending: list[Any] = []
    errors: list[tuple[float, int, str]] = []  # (when it raised, rank, traceback)
    while len(out) < world_size and error is None:
        item = pending.pop(0) if pending else _get(results, 0.05)
        if item is not None:
            rank, status, data = item
            if status == "ok":
                out[rank] = pickle.loads(data)
            else:
                errors.append((data[0], rank, data[1]))
                error = RankError(rank, data[1])
            continue
        for r, p in enumerate(procs):
            if r not in out and not p.is_alive() and p.exitcode not in (None, 0):
                late = _get(results, 0.5)  # its report may still be in the pipe
                if late is not None:
                    pending.append(late)
                    break
                error = RankError(r, f"process exited with code {p.exitcode} without reporting")
                break
        if time.monotonic() > deadline:
            missing = [r for r in range(world_size) if r not in out]
            error = RankError(missing[0], f"timed out after {timeout_s:.0f}s; ranks {missing} did not finish")
    if error is not None:
        # Give the other ranks a moment to report their own errors, then stop them. The error that
        # was raised first is the cause; the others are usually peers losing their connection to it.
        grace = time.monotonic() + 1.0
        while time.monotonic() < grace and any(p.is_alive() for p in procs):
            item = _get(results, 0.02)
            if item is not None and item[1] == "error":
                errors.append((item[2][0], item[0], item[2][1]))
        if errors:
            _, rank, detail = min(errors)
            error = RankError(rank, detail)
        for p in procs:
            if p.is_alive():
                p.kill()
    for p in procs:
        p.join(timeout=10)
    results.close()
    if error is not None:
        raise error
    return [out[r] for r in range(world_size)]


def _get(q: Any, timeout: float) -> Any:
    try:
        return q.get(timeout=timeout)
    except queue_mod.Empty:
        return None
