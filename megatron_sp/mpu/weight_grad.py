"""Deferred weight gradients: the split backward of the zero-bubble pipeline schedule.

Zero-bubble schedules split a micro-batch's backward into ``I`` (input gradient) and ``W`` (weight
gradients, run later in the bubbles; Qi et al. 2023). Inside ``deferring(queue)`` the parallel
linear layers compute only the input gradient and append a ``WeightGrad`` (closure computing
``grad_W = grad_outᵀ · x``, and its weight) to ``queue``; ``run(queue)`` computes them all and hands
them to autograd in one ``torch.autograd.backward`` call, so ``.grad`` and the optimizer's hooks
fire as usual. Other parameters get their gradients during ``I``.

Theory and invariants (why only linears are deferred, computed weights, memory cost):
docs/tensor_parallel.md.
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
