"""Run a function on several gloo ranks: the multi-rank test harness (in the package: training and tools use it).

``run_distributed(fn, world_size, **kwargs)`` forks ``world_size`` ranks from a ``forkserver`` with torch and the
training modules preloaded; each joins a gloo group on a free localhost port and returns ``fn(rank, world_size, **kwargs)``
(a module-level function). A rank that raises makes it raise ``RankError`` naming that rank. See docs/parity.md.
``train_ranks(argv)`` runs train.py's ``main(argv)`` on the ranks its config asks for, as torchrun would start them
(without the launching process): the parity runs' fast path (~1 s a run instead of ~6 s).
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
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

_PRELOAD = ["torch", "torch.distributed", "megatron_sp.testing", "megatron_sp.training"]
TRAIN_PY = Path(__file__).resolve().parents[1] / "train.py"


class RankError(RuntimeError):
    """A rank raised (or died) inside ``run_distributed``."""

    def __init__(self, rank: int, detail: str) -> None:
        super().__init__(f"rank {rank} failed:\n{detail}")
        self.rank = rank


@functools.cache
def _context() -> Any:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


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
    errors: list[tuple[float, int, str]] = []  # (when it raised, rank, traceback)
    failure: RankError | None = None  # a rank that died without reporting, or the timeout

    def take(item: Any) -> None:
        rank, status, data = item
        if status == "ok":
            out[rank] = pickle.loads(data)
        else:
            errors.append((data[0], rank, data[1]))

    deadline = time.monotonic() + timeout_s + 30
    while len(out) < world_size and not errors and failure is None:
        item = _get(results, 0.05)
        dead = [r for r, p in enumerate(procs) if r not in out and not p.is_alive() and p.exitcode not in (None, 0)]
        if item is None and dead:
            item = _get(results, 0.5)  # its report may still be in the pipe
            if item is None:
                failure = RankError(dead[0], f"process exited with code {procs[dead[0]].exitcode} without reporting")
        if item is not None:
            take(item)
        elif time.monotonic() > deadline:
            missing = [r for r in range(world_size) if r not in out]
            failure = RankError(missing[0], f"timed out after {timeout_s:.0f}s; ranks {missing} did not finish")
    if errors or failure is not None:
        # Give the other ranks a moment to report their own errors, then stop them. The error that
        # was raised first is the cause; the others are usually peers losing their connection to it.
        grace = time.monotonic() + 1.0
        while time.monotonic() < grace and any(p.is_alive() for p in procs):
            item = _get(results, 0.02)
            if item is not None and item[1] == "error":
                take(item)
        if errors:
            failure = RankError(*min(errors)[1:])
        for p in procs:
            if p.is_alive():
                p.kill()
    for p in procs:
        p.join(timeout=10)
    results.close()
    if failure is not None:
        raise failure
    return [out[r] for r in range(world_size)]


@functools.cache
def _train_py() -> Any:
    """The repository's train.py as a module (its ``parse_args`` and ``main``)."""
    spec = importlib.util.spec_from_file_location("_megatron_sp_train", TRAIN_PY)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def _train_rank(rank: int, world_size: int, argv: list[str]) -> tuple[int, str]:
    """One rank of ``train_ranks``: train.py's exit code and what it printed (stdout and stderr, in order)."""
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = _train_py().main(argv)
    return code, out.getvalue()


def train_ranks(argv: list[str], *, timeout_s: float = 600.0) -> list[tuple[int, str]]:
    """train.py ``argv`` (``--conf`` files and overrides) on the config's world size of ``run_distributed`` ranks,
    each running ``main(argv)`` under the torchrun variables (``train.preflight`` off: no launching process runs it);
    returns every rank's (exit code, output)."""
    from . import config

    args = _train_py().parse_args(argv)
    world = config.load(args.conf, args.overrides).parallel.world_size
    return run_distributed(_train_rank, world, init=False, timeout_s=timeout_s,
                           argv=[*argv, "train.preflight=false"])


def _get(q: Any, timeout: float) -> Any:
    try:
        return q.get(timeout=timeout)
    except queue_mod.Empty:
        return None
