"""ZeRO-3: parameters sharded like the fp32 masters and all-gathered per unit (the embedding, a layer, the head, an MTP
module) before its forward and again before its backward, freed after each. ``ParamUnits`` is the reducer's gatherer;
``UnitRunner`` runs a forward's entries in order, prefetching the next ones. Theory: docs/optimizer.md, "ZeRO-3".
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import comm

Entry = tuple[str, ...]  # the units one call of the model's forward reads, gathered together


class ParamUnits:
    """The gathered state of every sharded bucket, by unit. ``buckets``: {unit: [bucket]} (``_Bucket`` of the reducer:
    ``full`` its parameters' storage, ``group``/``rank``/``numel``); ``local_chunk(bucket)``: this rank's shard of it
    (param dtype); ``prefetch``: entries gathered ahead."""

    def __init__(self, buckets: dict[str, list[Any]], local_chunk: Callable[[Any], torch.Tensor],
                 prefetch: int) -> None:
        self.buckets = buckets
        self.local_chunk = local_chunk
        self.prefetch = prefetch
        self._pending: dict[int, comm.Pending] = {}  # bucket index -> its gather in flight (its storage allocated)

    def launch(self, keys: Sequence[str]) -> None:
        """Start gathering the units ``keys`` that are neither gathered nor on the way (their storage is empty)."""
        for b in self._of(keys):
            storage = b.full.untyped_storage()
            if storage.nbytes():
                continue
            storage.resize_(b.numel * b.full.element_size())
            self._pending[b.index] = comm.all_gather_async(self.local_chunk(b), b.group, out=b.full)

    def gather(self, keys: Sequence[str]) -> None:
        """Make the units ``keys`` whole on this rank (collective over each bucket's group)."""
        self.launch(keys)
        for b in self._of(keys):
            pending = self._pending.pop(b.index, None)
            if pending is not None:
                pending.wait()

    def free_bucket(self, b: Any) -> None:
        """Give back a bucket's gathered storage (waiting for a gather in flight first)."""
        pending = self._pending.pop(b.index, None)
        if pending is not None:
            pending.wait()
        b.full.untyped_storage().resize_(0)

    def free(self, keys: Sequence[str]) -> None:
        for b in self._of(keys):
            self.free_bucket(b)

    def free_all(self) -> None:
        for buckets in self.buckets.values():
            for b in buckets:
                self.free_bucket(b)

    def _of(self, keys: Sequence[str]) -> list[Any]:
        return [b for k in keys for b in self.buckets.get(k, ())]

    def backward_gather(self, plan: list[Entry], i: int) -> None:
        """Before entry ``i``'s backward: gather it and launch the ``prefetch`` entries before it."""
        self.gather(plan[i])
        for j in range(i - 1, max(i - 1 - self.prefetch, -1), -1):
            self.launch(plan[j])


class UnitRunner:
    """Runs one forward's ``plan`` (its entries in order): ``run(keys, fn)`` gathers entry ``keys`` (the next of the
    plan), launches the gathers of the ``prefetch`` entries after it, calls ``fn()``, frees the entry and, when the
    output needs a gradient, gathers it again as the gradient reaches the output. ``units`` None: ``fn()``."""

    def __init__(self, units: ParamUnits | None, plan: list[Entry]) -> None:
        self.units, self.plan, self.cursor = units, plan, 0

    def __call__(self, keys: Entry, fn: Callable[[], Any]) -> Any:
        units = self.units
        if units is None:
            return fn()
        i = self.cursor
        if i >= len(self.plan) or self.plan[i] != keys:
            raise RuntimeError(f"ZeRO-3: forward entry {keys} is not entry {i} of the plan {self.plan}")
        self.cursor += 1
        units.gather(keys)
        for j in range(i + 1, min(i + 1 + units.prefetch, len(self.plan))):
            units.launch(self.plan[j])
        out = fn()
        units.free(keys)
        needing = [t for t in (out if isinstance(out, tuple) else (out,)) if t.requires_grad]
        if needing:  # the first output gradient arrives before any of the entry's backward runs
            plan = self.plan
            torch.autograd.graph.register_multi_grad_hook(needing, lambda _: units.backward_gather(plan, i), mode="any")
        return out
