"""Faults during training: preemption (SIGTERM, Ctrl-C: every rank saves the same step, then exits 0 or 130; a
second Ctrl-C stops at once), collectives whose peer died or hung (the error names the silent ranks), and the
one-line error handed to torchrun's failure report. See docs/launcher.md, "Faults".
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .errors import TrainingError
from .mpu import comm

log = logging.getLogger("megatron_sp")

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
STOP_NOW_GRACE_S = 5.0  # after a second Ctrl-C, how long a local rank may take to exit before SIGKILL
_PEER_ERRORS = ("timed out", "timeout", "connection reset", "connection closed", "connection refused",
                "broken pipe", "end of file", "nccl", "socket")


# ----------------------------------------------------------------------------- stop signals, at once

class _Watcher:
    """One per process: a daemon thread reading the signal numbers CPython's C-level handler writes to
    ``signal.set_wakeup_fd``, and calling ``react`` with each stop signal.

    Why: Python runs signal handlers in the main thread between bytecodes, so during one long ATen op (a 35 s step
    on a CPU without native bf16 is a few such ops) a handler waits for the op to end. The op releases the GIL, and
    the C-level handler writes the byte at once, so this thread reacts at once. Invariants: only signals with a
    Python handler write the byte (the caller installs one, e.g. ``_ignore``); ``set_wakeup_fd`` is process-wide and
    main-thread only (a previous fd is restored by ``watch_stop_signals(None)``); a child forked later (a DataLoader
    worker) drops the fd, else its signals would read as this process's."""

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.write_fd, False)
        self.react: Callable[[signal.Signals], None] | None = None
        self.previous_fd = -1
        threading.Thread(target=self._run, name="stop-signals", daemon=True).start()

    def _run(self) -> None:
        while data := os.read(self.read_fd, 64):
            for signum in data:
                react = self.react
                if react is not None and signum in STOP_SIGNALS:
                    react(signal.Signals(signum))

    def set(self, react: Callable[[signal.Signals], None] | None) -> None:
        if react is not None and self.react is None:
            self.previous_fd = signal.set_wakeup_fd(self.write_fd, warn_on_full_buffer=False)
        elif react is None and self.react is not None:
            signal.set_wakeup_fd(self.previous_fd)
        self.react = react


_watcher: _Watcher | None = None


def watch_stop_signals(react: Callable[[signal.Signals], None] | None) -> None:
    """From now on call ``react(signum)`` in a daemon thread the moment SIGINT or SIGTERM arrives, even while the
    main thread is inside a long op (None: stop). The signal needs a Python handler; main thread only."""
    global _watcher
    if _watcher is None and react is not None:
        _watcher = _Watcher()
    if _watcher is not None:
        _watcher.set(react)


def _forget_watcher_in_child() -> None:
    global _watcher
    if _watcher is not None:
        with contextlib.suppress(ValueError):  # forked from another thread: that child never runs Python handlers
            signal.set_wakeup_fd(-1)
        os.close(_watcher.read_fd)
        os.close(_watcher.write_fd)
        _watcher = None


os.register_at_fork(after_in_child=_forget_watcher_in_child)


def _ignore(signum: int, frame: Any) -> None:
    """The Python-level handler of a watched signal: the watcher thread acts (see ``_Watcher``)."""


def _seconds(s: float) -> str:
    return f"{s / 60:.1f} min" if s >= 90 else f"{s:.0f} s" if s >= 9.5 else f"{s:.2g} s"


class Preemption:
    """SIGTERM or SIGINT → ``agreed()`` turns True on every rank after the step in which any rank got it; a second
    stop signal (SIGINT after anything, anything after SIGINT) ends the process at once with exit code 130.

    The signals are handled by a watcher thread (``watch_stop_signals``), so the first one is acknowledged and the
    second obeyed at once even inside a long op. Stopping at once skips the step's save; the last complete
    checkpoint stays, since a save publishes its directory by a rename and ``latest`` last. Without
    ``enabled`` (no checkpoint.save) a SIGINT stops at once and SIGTERM keeps its default action."""

    def __init__(self, enabled: bool, save_dir: str | None = None) -> None:
        self.requested = 0  # the first stop signal this rank got (0: none)
        self.signum = 0  # the one the ranks agreed on
        self.step = 0  # the step being computed (step_started)
        self.typical_s: float | None = None
        self.save_dir = save_dir
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        in_main = threading.current_thread() is threading.main_thread()
        self.enabled = enabled and in_main
        watched = [signal.SIGTERM] if self.enabled else []
        if in_main and signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # an ignored SIGINT stays so
            watched.append(signal.SIGINT)
        self._previous = {s: signal.signal(s, _ignore) for s in watched}
        if watched:
            watch_stop_signals(self._react)

    def close(self) -> None:
        """The signals' handlers of before, and no watching: after the loop a Ctrl-C (during the sample) stops at once
        as usual, and a later ``Preemption`` in this process starts clean."""
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        if self._previous:
            watch_stop_signals(None)
        self._previous = {}

    def step_started(self, step: int, typical_s: float | None) -> None:
        """Step ``step`` is being computed; steps take about ``typical_s`` seconds (None: not measured yet)."""
        self.step, self.typical_s = step, typical_s

    def _react(self, signum: signal.Signals) -> None:
        """In the watcher thread, the moment a stop signal arrives."""
        first = self.requested
        if not self.enabled:
            self._stop_now(signum, "no checkpoint.save, nothing to save")
        elif not first:
            self.requested = signum
            took = f"steps take ~{_seconds(self.typical_s)}" if self.typical_s else "the step time is not known yet"
            again = "Ctrl-C again" if signum == signal.SIGINT else "Ctrl-C (SIGINT)"
            if self.rank == 0:
                log.warning("%s: saving a checkpoint at the end of step %d (%s), then exiting; %s to stop at once "
                            "without saving", signum.name, self.step, took, again)
        elif signum == signal.SIGINT or first == signal.SIGINT:
            self._stop_now(signum, f"{signal.Signals(first).name} then {signum.name}")
        # SIGTERM after SIGTERM changes nothing: a scheduler and torchrun may each send one

    def _stop_now(self, signum: signal.Signals, why: str) -> None:
        """Flush one line (rank 0) and end the process: exit code 130, at once, whatever the main thread does."""
        if self.rank == 0:
            kept = last_checkpoint(self.save_dir) if self.save_dir else None
            line = (f"interrupted: stopped at once in step {self.step} without saving ({why})"
                    + (f"; the last checkpoint, {kept}, stays" if kept else "") + "\n")
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            with contextlib.suppress(OSError):
                os.write(sys.stderr.fileno(), line.encode())
        os._exit(130)

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else "no signal"

    def agreed(self, dev: torch.device) -> bool:
        """Collective (every rank, once per step): did any rank get SIGTERM or SIGINT?"""
        if not self.enabled:
            return False
        flag = torch.tensor([int(self.requested)], dtype=torch.int32, device=dev)
        comm.all_reduce(flag, None, op=comm.ReduceOp.MAX)  # the identity in a one-rank run
        self.signum = int(flag.item())
        return bool(self.signum)

    def finish(self, step: int) -> None:
        """After the agreed stop's checkpoint of ``step``: SIGINT raises KeyboardInterrupt (exit 130); SIGTERM returns."""
        if self.signum == signal.SIGINT:
            raise KeyboardInterrupt(f"saved a checkpoint of step {step}")


class StopRelay:
    """The local launcher's side of ``Preemption``'s rules (``launcher.start_local``, via ``watch_stop_signals``).

    torchrun passes a first SIGTERM or SIGINT on to the ranks, which save at the end of their step; start_local
    lets it wait as long as that takes (``launcher.LOCAL_STOP_WAIT_S``: torchrun's default, 30 s, is shorter than
    a slow step, and it then SIGKILLs the ranks unsaved). A second signal that stops at once under those rules
    (SIGINT after anything, anything after SIGINT) is sent on as SIGINT, which a rank obeys at once; torchrun
    itself would send SIGTERM, which after a SIGTERM changes nothing. A rank alive ``STOP_NOW_GRACE_S`` later
    is killed."""

    def __init__(self) -> None:
        self.first: signal.Signals | None = None
        self.first_at = 0.0  # time.time() of the first signal: a checkpoint written since is the ranks' save
        self.at_once = False

    def __call__(self, signum: signal.Signals) -> None:
        if self.first is None:
            self.first, self.first_at = signum, time.time()
            return
        if signum != signal.SIGINT and self.first != signal.SIGINT:
            return
        self.at_once = True
        ranks = _children()
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGINT)
        deadline = time.monotonic() + STOP_NOW_GRACE_S
        while (ranks := [pid for pid in ranks if _running(pid)]) and time.monotonic() < deadline:
            time.sleep(0.05)
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _children() -> list[int]:
    """This process's child processes (the ranks torchrun started), from /proc ([] elsewhere)."""
    me, pids = os.getpid(), []
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if entry.isdigit() and _stat(int(entry))[1:2] == [str(me)]:
                pids.append(int(entry))
    return pids


def _running(pid: int) -> bool:
    return _stat(pid)[:1] not in ([], ["Z"])  # gone, or a zombie not reaped yet


def _stat(pid: int) -> list[str]:
    """State, parent pid, ... of ``pid`` from /proc/PID/stat ([] if it is gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def last_checkpoint(save_dir: str | Path) -> str | None:
    """The directory ``save_dir``'s ``latest`` names (None: no checkpoint there)."""
    with contextlib.suppress(OSError, UnicodeDecodeError):
        name = (Path(save_dir) / "latest").read_bytes().decode().strip()
        return str(Path(save_dir) / name) if name else None
    return None


def record_error(message: str) -> None:
    """Under torchrun: ``message`` as this rank's error in torchelastic's error file (``TORCHELASTIC_ERROR_FILE``,
    the JSON that ``torch.distributed.elastic.multiprocessing.errors`` writes), so that torchrun's failure report
    shows it as the root cause instead of "To enable traceback see: ..."."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": message, "extraInfo": {"py_callstack": message, "timestamp": str(int(time.time()))}}}
    with contextlib.suppress(OSError):
        Path(path).write_text(json.dumps(data))


# ----------------------------------------------------------------------------- dead or hung peers

def peer_failure(exc: BaseException, timeout_s: float, listen_s: float = 5.0) -> TrainingError | None:
    """The one-line error for a collective that failed because of another rank, or None (not such a failure)."""
    text = str(exc).strip()
    if not dist.is_initialized() or dist.get_world_size() == 1 or not any(k in text.lower() for k in _PEER_ERRORS):
        return None
    rank, world = dist.get_rank(), dist.get_world_size()
    first = text.splitlines()[0] if text else type(exc).__name__
    first = first.split("] ", 1)[-1] if first.startswith("[") else first  # drop gloo's source-file prefix
    silent = _silent_ranks(rank, world, listen_s)
    who = (f"rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))} stopped answering (dead or hung)"
           if silent else "another rank failed")
    return TrainingError(f"[rank {rank}] a collective failed: {who}; {first[:160]} (parallel.timeout_s = "
                         f"{timeout_s:g} s)")


def _silent_ranks(rank: int, world: int, listen_s: float) -> list[int]:
    """Ranks that did not check in as survivors within ``listen_s`` ([] if the store is unreachable)."""
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(f"megatron_sp/alive/{rank}", "1")
        deadline = time.monotonic() + listen_s
        while True:
            silent = [r for r in range(world) if not store.check([f"megatron_sp/alive/{r}"])]
            if not silent or time.monotonic() > deadline:
                return silent
            time.sleep(0.1)
    except Exception:  # the store's host is gone too: no names, the plain message stays
        return []
