"""Deferred weight gradients, the split backward of the zero-bubble schedule: inside ``deferring(queue)`` the linear
layers compute only the input gradient and queue a ``WeightGrad``; ``run(queue)`` computes them and accumulates them
through autograd (``.grad`` and the optimizer's hooks fire as usual). Theory: docs/tensor_parallel.md.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

_queue: list[WeightGrad] | None = None


@dataclass
class WeightGrad:
    """One deferred weight gradient: ``compute()`` returns the gradient of ``weight``."""

    compute: Callable[[], torch.Tensor]
    weight: torch.Tensor


@contextlib.contextmanager
def deferring(queue: list[WeightGrad]) -> Iterator[list[WeightGrad]]:
    """Within this context, linear layers' backward defers their weight gradients into ``queue``."""
    global _queue
    previous, _queue = _queue, queue
    try:
        yield queue
    finally:
        _queue = previous


def defer(compute: Callable[[], torch.Tensor], weight: torch.Tensor) -> bool:
    """Queue ``compute`` for ``weight`` if deferring (return True), else return False (compute it now)."""
    if _queue is None:
        return False
    _queue.append(WeightGrad(compute, weight))
    return True


def run(queue: list[WeightGrad]) -> None:
    """Compute every queued weight gradient and accumulate it through autograd; empties ``queue``."""
    if not queue:
        return
    with torch.no_grad():  # plain math on saved tensors (and buffers) outside any graph
        grads = [item.compute().to(item.weight.dtype) for item in queue]
    weights = [item.weight for item in queue]
    queue.clear()
    torch.autograd.backward(weights, grads)
