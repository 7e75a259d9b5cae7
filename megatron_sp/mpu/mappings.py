"""Paired autograd communication: each wrapper ``fn(x, group)`` runs a collective forward and its adjoint backward,
and returns ``x`` itself when the group has one rank. The table and the ownership rule: docs/tensor_parallel.md.
"""
from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from . import comm

_Op = Callable[[torch.Tensor, Any], torch.Tensor]


def _all_reduce_owned(t: torch.Tensor, group: Any) -> torch.Tensor:
    """All-reduce a contiguous copy of ``t`` (one copy at most): ``comm.all_reduce`` works in place, and ``t`` may be
    referenced elsewhere (an ``AddBackward`` hands one grad tensor to both inputs)."""
    out = t.contiguous()
    return comm.all_reduce(out.clone() if out is t else out, group)


def _view(t: torch.Tensor, group: Any) -> torch.Tensor:
    return t.view_as(t)


def _same(t: torch.Tensor, group: Any) -> torch.Tensor:
    return t


class _Paired(torch.autograd.Function):
    """``forward_op(x, group)`` forward, ``backward_op(grad, group)`` backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, forward_op: _Op, backward_op: _Op) -> torch.Tensor:
        ctx.group, ctx.backward_op = group, backward_op
        return forward_op(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return ctx.backward_op(grad, ctx.group), None, None, None


def _paired(x: torch.Tensor, group: Any, forward_op: _Op, backward_op: _Op) -> torch.Tensor:
    return x if comm.group_size(group) == 1 else _Paired.apply(x, group, forward_op, backward_op)


def copy_to_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Megatron's f, entering the tensor-parallel region: identity forward, all-reduce backward."""
    return _paired(x, group, _view, _all_reduce_owned)


def reduce_from_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Megatron's g, leaving the tensor-parallel region: all-reduce forward, identity backward."""
    return _paired(x, group, _all_reduce_owned, _same)


def scatter_to_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Split the last dim forward (``[.., h]`` → ``[.., h/t]``), all-gather the last dim backward."""
    return _paired(x, group, partial(comm.split, dim=-1), partial(comm.all_gather, dim=-1))


def gather_from_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """All-gather the last dim forward (``[.., h/t]`` → ``[.., h]``), split the last dim backward."""
    return _paired(x, group, partial(comm.all_gather, dim=-1), partial(comm.split, dim=-1))


def scatter_to_sp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Enter the sequence-parallel region: split dim 0 forward (``[s, ..]`` → ``[s/t, ..]``), all-gather backward."""
    return _paired(x, group, partial(comm.split, dim=0), partial(comm.all_gather, dim=0))


def gather_from_sp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Megatron's g under SP: all-gather dim 0 forward (``[s/t, ..]`` → ``[s, ..]``), reduce-scatter backward
    (summing the ranks' grads: right when the result feeds tensor-parallel computation)."""
    return _paired(x, group, partial(comm.all_gather, dim=0), partial(comm.reduce_scatter, dim=0))


def reduce_scatter_to_sp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Megatron's ḡ under SP: reduce-scatter dim 0 forward (``[s, ..]`` partial sums → ``[s/t, ..]``), all-gather backward."""
    return _paired(x, group, partial(comm.reduce_scatter, dim=0), partial(comm.all_gather, dim=0))


def all_to_all(x: torch.Tensor, group: Any, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Differentiable ``comm.all_to_all``; backward is the all-to-all with the two dims swapped (Ulysses:
    ``[s/t, b, heads, d]`` with ``scatter_dim=2, gather_dim=0`` → ``[s, b, heads/t, d]``)."""
    return _paired(x, group, partial(comm.all_to_all, scatter_dim=scatter_dim, gather_dim=gather_dim),
                   partial(comm.all_to_all, scatter_dim=gather_dim, gather_dim=scatter_dim))


def all_to_all_rows(x: torch.Tensor, group: Any, send_splits: list[int], recv_splits: list[int]) -> torch.Tensor:
    """Differentiable ``comm.all_to_all_uneven`` (MoE dispatch and combine): ``send_splits[j]`` rows to rank j
    forward; backward the gradients of the received rows go back, the same exchange with the splits swapped."""
    return _paired(x, group, partial(comm.all_to_all_uneven, send_splits=send_splits, recv_splits=recv_splits),
                   partial(comm.all_to_all_uneven, send_splits=recv_splits, recv_splits=send_splits))
