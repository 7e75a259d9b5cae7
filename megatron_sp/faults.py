"""Faults during training: preemption (SIGTERM, Ctrl-C: every rank saves the same step, then exits 0 or 130)
and collectives whose peer died or hung (the error names the silent ranks). See docs/launcher.md, "Faults".
"""
from __future__ import annotations

import signal
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from .errors import TrainingError
from .mpu import comm

_PEER_ERRORS = ("timed out", "timeout", "connection reset", "connection closed", "connection refused",
                "broken pipe", "end of file", "nccl", "socket")


class Preemption:
    """SIGTERM or SIGINT → ``agreed()`` turns True on every rank after the step in which any rank got it."""

    def __init__(self, enabled: bool) -> None:
        self.requested = 0  # the first stop signal this rank got (0: none)
        self.signum = 0  # the one the ranks agreed on
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        if self.enabled:
            signal.signal(signal.SIGTERM, self._handler)
            if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
                signal.signal(signal.SIGINT, self._handler)

    def _handler(self, signum: int, frame: Any) -> None:
        if self.requested and (signum == signal.SIGINT or self.requested == signal.SIGINT):
            raise KeyboardInterrupt(f"second stop signal ({signal.Signals(signum).name}): aborted without saving")
        self.requested = self.requested or signum

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
