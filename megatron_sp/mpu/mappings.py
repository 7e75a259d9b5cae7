"""Paired autograd communication Functions behind functional wrappers.

Each Function's backward is the adjoint of its forward (all-reduce ↔ identity, all-gather ↔
reduce-scatter or split, all-to-all ↔ the reverse all-to-all). Every wrapper takes its process
group explicitly, ``fn(x, group)``, and returns ``x`` itself when the group has one rank.

==========================  ==============================  ==============================  =========
wrapper                     forward                         backward                        Megatron
==========================  ==============================  ==============================  =========
``copy_to_tp``              identity                        all-reduce                      f
``reduce_from_tp``          all-reduce                      identity                        g
``scatter_to_tp``           split last dim                  all-gather last dim
``gather_from_tp``          all-gather last dim             split last dim
``scatter_to_sp``           split dim 0                     all-gather dim 0
``gather_from_sp``          all-gather dim 0                reduce-scatter dim 0            g (SP)
``reduce_scatter_to_sp``    reduce-scatter dim 0            all-gather dim 0                ḡ (SP)
``all_to_all``              all-to-all (scatter→gather)     all-to-all (gather→scatter)
==========================  ==============================  ==============================  =========

The all-reduces never modify a tensor they do not own: ``comm.all_reduce`` (like torch's) works in place, so
``reduce_from_tp`` reduces a copy of its input and ``copy_to_tp`` a copy of the incoming grad (an
``AddBackward`` hands the very same grad tensor to both of its inputs, e.g. to a residual branch).
"""
from __future__ import annotations

from typing import Any

import torch

from . import comm


def _owned_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor with the values of ``t`` that nobody else references (one copy at most)."""
    out = t.contiguous()
    return out.clone() if out is t else out


class _CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce of the grad backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return comm.all_reduce(_owned_copy(grad), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        return comm.all_reduce(_owned_copy(x), group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _ScatterToTP(torch.autograd.Function):
    """Split the last dim forward, all-gather the last dim backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return comm.split(x, group, dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return comm.all_gather(grad, ctx.group, dim=-1), None


class _GatherFromTP(torch.autograd.Function):
    """All-gather the last dim forward, split the last dim backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return comm.all_gather(x, group, dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return comm.split(grad, ctx.group, dim=-1), None


class _ScatterToSP(torch.autograd.Function):
    """Split dim 0 forward, all-gather dim 0 backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return comm.split(x, group, dim=0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return comm.all_gather(grad, ctx.group, dim=0), None


class _GatherFromSP(torch.autograd.Function):
    """All-gather dim 0 forward, reduce-scatter dim 0 backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return comm.all_gather(x, group, dim=0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return comm.reduce_scatter(grad, ctx.group, dim=0), None


class _ReduceScatterToSP(torch.autograd.Function):
    """Reduce-scatter dim 0 forward, all-gather dim 0 backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return comm.reduce_scatter(x, group, dim=0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return comm.all_gather(grad, ctx.group, dim=0), None


class _AllToAll(torch.autograd.Function):
    """All-to-all (scatter_dim → gather_dim) forward, the reverse all-to-all backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        return comm.all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return comm.all_to_all(grad, ctx.group, ctx.gather_dim, ctx.scatter_dim), None, None, None


def copy_to_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Megatron's f, entering the tensor-parallel region: identity forward, all-reduce backward."""
    return x if comm.group_size(group) == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Megatron's g, leaving the tensor-parallel region: all-reduce forward, identity backward."""
    return x if comm.group_size(group) == 1 else _ReduceFromTP.apply(x, group)


def scatter_to_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Split the last dim forward (``[.., h]`` → ``[.., h/t]``), all-gather the last dim backward."""
    return x if comm.group_size(group) == 1 else _ScatterToTP.apply(x, group)


def gather_from_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """All-gather the last dim forward (``[.., h/t]`` → ``[.., h]``), split the last dim backward."""
    return x if comm.group_size(group) == 1 else _GatherFromTP.apply(x, group)


def scatter_to_sp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Enter the sequence-parallel region: split dim 0 forward (``[s, ..]`` → ``[s/t, ..]``), all-gather backward."""
    return x if comm.group_size(group) == 1 else _ScatterToSP.apply(x, group)


def gather_from_sp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Megatron's g under SP: all-gather dim 0 forward (``[s/t, ..]`` → ``[s, ..]``), reduce-scatter backward.

    The backward sums the ranks' grads, which is right when the gathered tensor feeds
    tensor-parallel (rank-different) computation, e.g. a column-parallel linear.
    """
    return x if comm.group_size(group) == 1 else _GatherFromSP.apply(x, group)


def reduce_scatter_to_sp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Megatron's ḡ under SP: reduce-scatter dim 0 forward (``[s, ..]`` partial sums → ``[s/t, ..]``), all-gather backward."""
    return x if comm.group_size(group) == 1 else _ReduceScatterToSP.apply(x, group)


def all_to_all(x: torch.Tensor, group: Any, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Differentiable ``comm.all_to_all``; backward is the all-to-all with the two dims swapped.

    E.g. Ulysses attention: ``[s/t, b, heads, d]`` with ``scatter_dim=2, gather_dim=0`` →
    ``[s, b, heads/t, d]`` and back with the dims swapped.
    """
    return x if comm.group_size(group) == 1 else _AllToAll.apply(x, group, scatter_dim, gather_dim)
