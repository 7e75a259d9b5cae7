"""Deferred weight gradients: the split backward of the zero-bubble pipeline schedule.

A zero-bubble schedule splits a micro-batch's backward in two: ``I`` computes the gradient of the
stage's input (what the previous stage waits for) and ``W`` computes the weight gradients later,
in what would otherwise be pipeline bubbles (Qi et al., "Zero Bubble Pipeline Parallelism", 2023).

The linear layers (``ColumnParallelLinear``, ``RowParallelLinear``, incl. the output layer) carry
almost all of the weight-gradient FLOPs. Inside ``deferring(queue)`` their backward computes only
the input gradient and appends a ``WeightGrad`` to ``queue``: a closure that computes
``grad_W = grad_outᵀ · x`` from the tensors it keeps, and the weight tensor it belongs to.
``run(queue)`` later computes them all and hands them to autograd in one
``torch.autograd.backward(weights, grads)`` call, so the gradients reach leaf parameters through
autograd's own accumulation (``.grad`` and the optimizer's post-accumulate hooks fire as usual),
also through a weight that is itself computed (SwiGLU's concatenated gate and up, kept alive by
the entry). Other parameters (norms, biases, the embedding) get their gradients during ``I``: they
are cheap.

Memory: until its ``W`` a micro-batch keeps each linear's input and output gradient — the price
of the schedule (it bounds the micro-batches in flight accordingly).
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
