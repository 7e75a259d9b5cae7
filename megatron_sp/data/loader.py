"""The training batch loader: one rank's share (``batch_indices``) of consecutive global batches from
``start_sample`` on (any sample: a resume with another global batch size continues from ``consumed_samples``),
optionally read ahead by ``DataLoader`` workers (the batches are the same either way). See docs/data.md, "Batches"."""
from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import signal
import sys
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from megatron_sp.data import batch_indices


class _RankBatches(torch.utils.data.Dataset):
    """Item ``k``: this rank's block (``batch_indices``) of the ``k``-th global batch from sample ``start_sample``,
    read and collated in one worker call."""

    def __init__(self, dataset: Any, collate_fn: Callable[[list[np.ndarray]], dict[str, torch.Tensor]],
                 start_sample: int, global_batch_size: int, dp_rank: int, dp_size: int) -> None:
        self.dataset, self.collate_fn, self.start_sample = dataset, collate_fn, start_sample
        self.global_batch_size, self.dp_rank, self.dp_size = global_batch_size, dp_rank, dp_size

    def __getitem__(self, k: int) -> dict[str, torch.Tensor]:
        indices = batch_indices(k, self.global_batch_size, self.dp_rank, self.dp_size)
        return self.collate_fn([self.dataset[self.start_sample + i] for i in indices])


def _init_worker(parent_pid: int, worker_id: int) -> None:
    """Tie a loader worker's life to its rank's, and only to it: leave the rank's process group (torchrun's
    ``killpg`` SIGTERM must not kill it while the rank saves a preemption checkpoint), and on Linux get
    SIGKILLed when the rank dies (``PR_SET_PDEATHSIG``; DataLoader's own watchdog takes up to 5 s)."""
    with contextlib.suppress(OSError):  # a session leader cannot: it then stays in the rank's group
        os.setpgid(0, 0)
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):  # no prctl: DataLoader's watchdog still ends the worker
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent_pid:  # the rank died before prctl took effect
        os._exit(0)


_PR_SET_PDEATHSIG = 1
"""Linux prctl option: the signal this process gets when its parent dies."""


def _unwrap(batch: Any) -> Any:
    """The DataLoader's collate_fn: batches are collated in ``_RankBatches`` already."""
    return batch


class BatchLoader:
    """Iterator over this rank's collated share of global batches from ``start_sample`` (``consumed_samples``)
    to the last whole global batch of ``dataset``; ``next_sample`` is the first sample of the next batch. It never
    draws from torch's default generator (dropout's stream): ``iter(DataLoader)`` draws the workers' base seed from
    the loader's own ``generator``, else a loader rebuilt at a resume would shift the restored RNG state."""

    def __init__(self, dataset: Any, start_sample: int, global_batch_size: int, dp_rank: int, dp_size: int,
                 collate_fn: Callable[[list[np.ndarray]], dict[str, torch.Tensor]], num_workers: int = 1,
                 prefetch_factor: int = 2, pin_memory: bool = False) -> None:
        if start_sample < 0:
            raise ValueError(f"start_sample {start_sample} must be non-negative")
        num_steps = max(0, (len(dataset) - start_sample) // global_batch_size)
        self.global_batch_size = global_batch_size
        self.next_sample = start_sample
        self.num_workers = num_workers
        self._loader = torch.utils.data.DataLoader(
            _RankBatches(dataset, collate_fn, start_sample, global_batch_size, dp_rank, dp_size),
            sampler=range(num_steps), batch_size=None, collate_fn=_unwrap,
            num_workers=num_workers, prefetch_factor=prefetch_factor if num_workers else None,
            pin_memory=pin_memory, persistent_workers=False,
            worker_init_fn=functools.partial(_init_worker, os.getpid()) if num_workers else None,
            generator=torch.Generator())
        self._iterator: Iterator[dict[str, torch.Tensor]] | None = None

    def __iter__(self) -> BatchLoader:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self._iterator is None:
            self._iterator = iter(self._loader)  # workers start here and read ahead
        batch = next(self._iterator)
        self.next_sample += self.global_batch_size
        return batch

    def close(self) -> None:
        """Stop the worker processes (also done when the loader is garbage collected)."""
        iterator, self._iterator = self._iterator, None
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()


def rank_collate(eod: int, eod_mask_loss: bool, reset_position_ids: bool,
                 reset_attention_mask: bool) -> Callable[[list[np.ndarray]], dict[str, torch.Tensor]]:
    """``collate`` with the packing flags bound (picklable, for spawned workers)."""
    from megatron_sp.data import collate

    return functools.partial(collate, eod=eod, eod_mask_loss=eod_mask_loss, reset_position_ids=reset_position_ids,
                             reset_attention_mask=reset_attention_mask)
