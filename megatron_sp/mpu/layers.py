"""Tensor- and sequence-parallel layers: ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding.

Activations are ``[s, b, h]``; ``t`` is the size of the TP group passed to each layer. Under
sequence parallelism (SP) they are ``[s/t, b, h]`` between TP regions: a column-parallel layer
all-gathers on the way in, a row-parallel layer reduce-scatters on the way out. Parameters have the
LOCAL shape and are never initialised here: the model copies in its slice of the full tensor
(``layer.shard_of(full, "weight")``). Every parameter carries ``tensor_model_parallel``,
``partition_dim``, ``sequence_parallel`` and ``shared_embedding``.

Theory and invariants (SP data flow, the per-parameter attribute table, the vocab-parallel
embedding): docs/tensor_parallel.md.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from . import comm, weight_grad
from .mappings import copy_to_tp, gather_from_tp, reduce_from_tp, reduce_scatter_to_sp, scatter_to_tp
from .memory import GatherBuffer, default_gather_buffer


def shard(full: torch.Tensor, partition_dim: int, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s ``1/size`` slice of ``full`` along ``partition_dim`` (a copy; negative dim: replicated)."""
    if partition_dim < 0 or size == 1:
        return full.detach().clone()
    if full.shape[partition_dim] % size:
        raise ValueError(f"cannot shard dim {partition_dim} of shape {tuple(full.shape)} into {size} parts")
    part = full.shape[partition_dim] // size
    return full.detach().narrow(partition_dim, rank * part, part).clone()


def set_tp_attributes(param: nn.Parameter, tensor_model_parallel: bool, partition_dim: int,
                      sequence_parallel: bool = False) -> None:
    """Tag ``param`` with the attributes distributed code reads (see the module docstring)."""
    param.tensor_model_parallel = tensor_model_parallel
    param.partition_dim = partition_dim
    param.sequence_parallel = sequence_parallel
    param.shared_embedding = False


def _divide(n: int, t: int, what: str) -> int:
    if n % t:
        raise ValueError(f"{what} = {n} is not divisible by the tensor-parallel size {t}")
    return n // t


class _TPModule(nn.Module):
    """Holds the TP group, its size and rank, and slices full tensors for this rank (``shard_of``)."""

    partition_dims: ClassVar[dict[str, int]] = {}
    """Parameter name → partition dim (negative: replicated)."""

    def __init__(self, group: Any) -> None:
        super().__init__()
        self.group = group
        self.tp_size = comm.group_size(group)
        self.tp_rank = comm.group_rank(group)

    def shard_of(self, full: torch.Tensor, param_name: str) -> torch.Tensor:
        """This rank's slice of the full value of parameter ``param_name`` (also one it does not create)."""
        if param_name not in self.partition_dims:
            raise KeyError(f"{type(self).__name__} has no parameter {param_name!r}")
        out = shard(full, self.partition_dims[param_name], self.tp_rank, self.tp_size)
        param = getattr(self, param_name, None)
        if param is not None and out.shape != param.shape:
            raise ValueError(f"{type(self).__name__}.{param_name}: the shard of a full {tuple(full.shape)} tensor is "
                             f"{tuple(out.shape)}, the parameter is {tuple(param.shape)}")
        return out


def _grad_weight(grad_out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``grad_outᵀ @ x`` over all leading dims: ``[.., out]``, ``[.., in]`` → ``[out, in]``."""
    grad_2d = grad_out.reshape(-1, grad_out.shape[-1])
    return grad_2d.t().matmul(x.reshape(-1, x.shape[-1]).to(grad_2d.dtype))


def _autocast_cast(device_type: str, *tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """Under autocast, cast floating tensors to the autocast dtype (what ``F.linear`` would do), else no-op."""
    if not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) if t is not None and t.is_floating_point() else t for t in tensors)


class _GatherLinear(torch.autograd.Function):
    """Sequence-parallel all-gather of the input fused with the column-parallel matmul.

    Forward: ``x_full = all_gather(x_shard, dim 0)``, ``out = x_full @ Wᵀ + b``.
    Backward: ``grad_x = reduce_scatter(grad_out @ W, dim 0)``, ``grad_W = grad_outᵀ @ x_full``,
    ``grad_b = Σ grad_out``.

    ``recompute_allgather=True``: only ``x_shard`` is saved, ``x_full`` is gathered again in
    backward (overlapped with ``grad_out @ W``), and both gathers go into the ``GatherBuffer`` (the
    buffer is never saved: see its invariant). Saved activation bytes: ``1/t`` of ``x_full``.
    ``False``: ``x_full`` itself (a fresh tensor) is saved: ``t×`` the memory, one all-gather fewer.
    The reduce-scatter of ``grad_x`` overlaps the weight-grad matmul.
    """

    @staticmethod
    def forward(ctx: Any, x_shard: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group: Any,
                recompute_allgather: bool, buffer: GatherBuffer) -> torch.Tensor:
        weight_input = weight
        x_shard, weight, bias = _autocast_cast(x_shard.device.type, x_shard, weight, bias)
        t = comm.group_size(group)
        full_shape = (t * x_shard.shape[0], *x_shard.shape[1:])
        out_buf = buffer.get(full_shape, x_shard.dtype, x_shard.device) if recompute_allgather else None
        x_full = comm.all_gather(x_shard, group, dim=0, out=out_buf)  # [s, b, in]
        out = F.linear(x_full, weight, bias)  # [s, b, out/t]
        ctx.save_for_backward(x_shard if recompute_allgather else x_full, weight)
        ctx.weight_input = weight_input  # the tensor autograd knows (a deferred weight grad goes to it)
        ctx.group, ctx.recompute, ctx.buffer = group, recompute_allgather, buffer
        ctx.full_shape, ctx.has_bias = full_shape, bias is not None
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        saved, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_out = grad_out.contiguous()  # [s, b, out/t]
        if need_w and weight_grad.defer(_GatherLinear._deferred_grad_w(ctx, saved, grad_out), ctx.weight_input):
            need_w = False  # computed later by weight_grad.run (zero-bubble W)
        gather = None
        if need_w and ctx.recompute:
            gather = comm.all_gather_async(saved, ctx.group, out=ctx.buffer.get(ctx.full_shape, saved.dtype,
                                                                                saved.device))
        scatter = None
        if need_x:
            grad_x_full = grad_out.matmul(weight.to(grad_out.dtype))  # [s, b, in] (overlaps the gather)
            scatter = comm.reduce_scatter_async(grad_x_full, ctx.group)
        grad_w = grad_b = None
        if need_w:
            x_full = gather.wait() if gather is not None else saved  # [s, b, in]
            grad_w = _grad_weight(grad_out, x_full)  # [out/t, in]
        if need_b and ctx.has_bias:
            grad_b = grad_out.reshape(-1, grad_out.shape[-1]).sum(0)  # [out/t]
        grad_x = scatter.wait() if scatter is not None else None  # [s/t, b, in]
        return grad_x, grad_w, grad_b, None, None, None

    @staticmethod
    def _deferred_grad_w(ctx: Any, saved: torch.Tensor, grad_out: torch.Tensor) -> Callable[[], torch.Tensor]:
        group, recompute, buffer, full_shape = ctx.group, ctx.recompute, ctx.buffer, ctx.full_shape

        def grad_w() -> torch.Tensor:
            x_full = (comm.all_gather(saved, group, dim=0, out=buffer.get(full_shape, saved.dtype, saved.device))
                      if recompute else saved)  # [s, b, in]
            return _grad_weight(grad_out, x_full)  # [out/t, in]
        return grad_w


class _Linear(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` whose weight gradient can be deferred (``mpu.weight_grad``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.weight_input = weight
        x, weight, bias = _autocast_cast(x.device.type, x, weight, bias)
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad
        grad_out = grad_out.contiguous()

        def grad_w() -> torch.Tensor:
            return _grad_weight(grad_out, x)  # [out, in]
        grad_x = grad_out.matmul(weight.to(grad_out.dtype)) if need_x else None
        weight_grad_now = grad_w() if need_w and not weight_grad.defer(grad_w, ctx.weight_input) else None
        grad_b = grad_out.reshape(-1, grad_out.shape[-1]).sum(0) if need_b and ctx.has_bias else None
        return grad_x, weight_grad_now, grad_b


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` with a deferrable weight gradient (see ``_Linear``)."""
    return _Linear.apply(x, weight, bias)


class ColumnParallelLinear(_TPModule):
    """``y = x Aᵀ + b`` with ``A`` split along its output dim: rank r holds rows ``[r·out/t, (r+1)·out/t)``.

    Input: ``[s/t, b, in]`` under SP, else ``[s, b, in]`` (entering through ``copy_to_tp``, so the
    input grad is all-reduced). Under SP the input all-gather and the matmul are one autograd
    Function (``_GatherLinear``) whose backward reduce-scatters the input grad. Output:
    ``[s, b, out/t]``, or ``[s, b, out]`` with ``gather_output``.

    ``in_features``/``out_features`` are full sizes. ``recompute_allgather`` (SP): save only the input
    shard and gather it again in backward (``t×`` less activation memory for one more all-gather,
    nanotron #203). ``skip_weight``: ``forward`` is given the weight (tied output layer).
    """

    partition_dims: ClassVar[dict[str, int]] = {"weight": 0, "bias": 0}

    def __init__(self, in_features: int, out_features: int, *, bias: bool, group: Any,
                 sequence_parallel: bool = False, gather_output: bool = False, recompute_allgather: bool = True,
                 skip_weight: bool = False, gather_buffer: GatherBuffer | None = None,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> None:
        super().__init__(group)
        self.in_features = in_features
        self.out_features = out_features
        self.out_per_rank = _divide(out_features, self.tp_size, "ColumnParallelLinear out_features")
        self.sequence_parallel = sequence_parallel
        self.gather_output = gather_output
        self.recompute_allgather = recompute_allgather
        self.skip_weight = skip_weight
        self.gather_buffer = gather_buffer if gather_buffer is not None else default_gather_buffer()
        factory = {"dtype": dtype, "device": device}
        if skip_weight:
            self.register_parameter("weight", None)
        else:
            self.weight = nn.Parameter(torch.empty(self.out_per_rank, in_features, **factory))  # [out/t, in]
            set_tp_attributes(self.weight, True, 0)
        if bias:
            self.bias = nn.Parameter(torch.empty(self.out_per_rank, **factory))  # [out/t]
            set_tp_attributes(self.bias, True, 0)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        """x ``[s/t, b, in]`` (SP) or ``[s, b, in]`` → ``[s, b, out/t]`` (``[s, b, out]`` with gather_output).

        An external ``[rows, in]`` ``weight`` (and its ``bias``) replaces ``self.weight``: the tied
        embedding, or SwiGLU's gate and up concatenated to share one input all-gather.
        """
        if weight is None:
            weight = self.weight
            if weight is None:
                raise ValueError("ColumnParallelLinear(skip_weight=True) needs forward(x, weight=...)")
            if tuple(weight.shape) != (self.out_per_rank, self.in_features):
                raise ValueError(f"ColumnParallelLinear: weight {tuple(weight.shape)} is not the local "
                                 f"[{self.out_per_rank}, {self.in_features}]")
            bias = self.bias
        elif weight.dim() != 2 or weight.shape[1] != self.in_features:
            raise ValueError(f"ColumnParallelLinear: external weight {tuple(weight.shape)} must be [rows, {self.in_features}]")
        if self.sequence_parallel and self.tp_size > 1:
            out = _GatherLinear.apply(x, weight, bias, self.group, self.recompute_allgather,
                                      self.gather_buffer)  # [s, b, rows]
        else:
            out = linear(copy_to_tp(x, self.group), weight, bias)  # [s, b, rows]
        if self.gather_output:
            out = gather_from_tp(out, self.group)  # [s, b, out]
        return out

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features} (local {self.out_per_rank}), tp={self.tp_size}, "
                f"bias={self.bias is not None}, sequence_parallel={self.sequence_parallel}, "
                f"gather_output={self.gather_output}, recompute_allgather={self.recompute_allgather}, "
                f"skip_weight={self.skip_weight}")


class RowParallelLinear(_TPModule):
    """``y = x Aᵀ + b`` with ``A`` split along its input dim: rank r holds columns ``[r·in/t, (r+1)·in/t)``.

    Input: ``[s, b, in/t]`` (``input_is_parallel``, the output of a column-parallel layer) or
    ``[s, b, in]`` (split here). The partial products are summed over TP by a reduce-scatter along
    dim 0 under SP (output ``[s/t, b, out]``) or an all-reduce (``[s, b, out]``); the bias
    ``[out]`` is replicated and added after the reduction — under SP to each rank's sequence slice
    only, so it is tagged ``sequence_parallel`` and its grad all-reduced over TP by the trainer.
    """

    partition_dims: ClassVar[dict[str, int]] = {"weight": 1, "bias": -1}

    def __init__(self, in_features: int, out_features: int, *, bias: bool, group: Any,
                 sequence_parallel: bool = False, input_is_parallel: bool = True,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> None:
        super().__init__(group)
        self.in_features = in_features
        self.out_features = out_features
        self.in_per_rank = _divide(in_features, self.tp_size, "RowParallelLinear in_features")
        self.sequence_parallel = sequence_parallel
        self.input_is_parallel = input_is_parallel
        factory = {"dtype": dtype, "device": device}
        self.weight = nn.Parameter(torch.empty(out_features, self.in_per_rank, **factory))  # [out, in/t]
        set_tp_attributes(self.weight, True, 1)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, **factory))  # [out]
            set_tp_attributes(self.bias, False, -1, sequence_parallel=sequence_parallel)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[s, b, in/t]`` (or ``[s, b, in]``) → ``[s/t, b, out]`` (SP) or ``[s, b, out]``."""
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.group)  # [s, b, in/t]
        partial = linear(x, self.weight)  # [s, b, out], this rank's partial sum
        if self.sequence_parallel:
            out = reduce_scatter_to_sp(partial, self.group)  # [s/t, b, out]
        else:
            out = reduce_from_tp(partial, self.group)  # [s, b, out]
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out

    def extra_repr(self) -> str:
        return (f"in={self.in_features} (local {self.in_per_rank}), out={self.out_features}, tp={self.tp_size}, "
                f"bias={self.bias is not None}, sequence_parallel={self.sequence_parallel}, "
                f"input_is_parallel={self.input_is_parallel}")


class VocabParallelEmbedding(_TPModule):
    """Embedding table split along the vocabulary: rank r holds rows ``[r·V/t, (r+1)·V/t)``.

    Ids outside this rank's slice are looked up as row 0 and their vectors zeroed; the ranks'
    partial results are then summed: all-reduce (output ``[s, b, h]``) or, under SP, a
    reduce-scatter along ``s`` (output ``[s/t, b, h]``). ``num_embeddings`` must already be padded
    to a multiple of ``t`` (the config's ``padded_vocab_size``).
    """

    partition_dims: ClassVar[dict[str, int]] = {"weight": 0}

    def __init__(self, num_embeddings: int, embedding_dim: int, *, group: Any, sequence_parallel: bool = False,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> None:
        super().__init__(group)
        if num_embeddings % self.tp_size:
            raise ValueError(f"VocabParallelEmbedding: num_embeddings = {num_embeddings} must be padded to a multiple "
                             f"of the tensor-parallel size {self.tp_size} (use the config's padded_vocab_size)")
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.sequence_parallel = sequence_parallel
        self.rows_per_rank = num_embeddings // self.tp_size
        self.vocab_start = self.tp_rank * self.rows_per_rank
        self.vocab_end = self.vocab_start + self.rows_per_rank
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, embedding_dim, dtype=dtype, device=device))
        set_tp_attributes(self.weight, True, 0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids ``[s, b]`` (sequence first) → ``[s, b, h]``, or ``[s/t, b, h]`` under SP."""
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)  # [s, b, h]
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)  # [s, b]
        local_ids = (ids - self.vocab_start).masked_fill_(outside, 0)
        partial = F.embedding(local_ids, self.weight)  # [s, b, h]
        partial = partial.masked_fill_(outside.unsqueeze(-1), 0.0)  # the embedding saves ids only: in place is safe
        if self.sequence_parallel:
            return reduce_scatter_to_sp(partial, self.group)  # [s/t, b, h]
        return reduce_from_tp(partial, self.group)  # [s, b, h]

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings} (local rows [{self.vocab_start}, {self.vocab_end})), {self.embedding_dim}, "
                f"tp={self.tp_size}, sequence_parallel={self.sequence_parallel}")
