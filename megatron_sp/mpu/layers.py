"""Tensor- and sequence-parallel layers (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding) and
the vocab-parallel cross entropy of their sharded logits.

Activations are ``[s, b, h]`` (``[s/t, b, h]`` between TP regions under SP), ``t`` the size of each layer's TP
group. Parameters have the LOCAL shape, are never initialised here (the model copies in
``layer.shard_of(full, "weight")``) and carry ``tensor_model_parallel``, ``partition_dim``, ``sequence_parallel``
and ``shared_embedding``. Theory and invariants: docs/tensor_parallel.md.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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

    def _add_param(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None, device: torch.device | str | None,
                   create: bool = True, sequence_parallel: bool = False) -> None:
        """Register ``name`` as an uninitialised parameter of the local ``shape``, tagged from ``partition_dims``
        (a negative dim: replicated), or as None when not ``create``."""
        if not create:
            self.register_parameter(name, None)
            return
        dim = self.partition_dims[name]
        param = nn.Parameter(torch.empty(shape, dtype=dtype, device=device))
        set_tp_attributes(param, dim >= 0, dim, sequence_parallel=sequence_parallel)
        self.register_parameter(name, param)


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
    """SP all-gather of the input (dim 0) fused with the column-parallel matmul; backward reduce-scatters grad_x,
    overlapped with the weight-grad matmul. Over a group of one (``linear``) both are the identity. The weight
    gradient can be deferred (``mpu.weight_grad``).

    ``recompute_allgather=True``: only ``x_shard`` is saved (``1/t`` of ``x_full``) and gathered again in backward;
    both gathers go into the ``GatherBuffer``, which is never saved (its invariant). ``False``: the fresh ``x_full``
    is saved: ``t×`` the memory, one all-gather fewer.
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


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` with a deferrable weight gradient (``mpu.weight_grad``): ``_GatherLinear`` over a group of one
    (under ``no_grad``, F.linear itself: no autograd Function call per matmul while decoding)."""
    if not torch.is_grad_enabled():
        return F.linear(x, weight, bias)
    return _GatherLinear.apply(x, weight, bias, comm.LOCAL, False, default_gather_buffer())


class ColumnParallelLinear(_TPModule):
    """``y = x Aᵀ + b`` with ``A`` split along its output dim: rank r holds rows ``[r·out/t, (r+1)·out/t)``.

    ``in_features``/``out_features`` are full sizes. Without SP the input enters through ``copy_to_tp``; under SP
    through ``_GatherLinear`` (``recompute_allgather``: ``t×`` less activation memory for one more all-gather,
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
        self._add_param("weight", (self.out_per_rank, in_features), dtype, device, create=not skip_weight)
        self._add_param("bias", (self.out_per_rank,), dtype, device, create=bias)

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        """x ``[s/t, b, in]`` (SP) or ``[s, b, in]`` → ``[s, b, out/t]`` (``[s, b, out]`` with gather_output). An external
        ``[rows, in]`` ``weight`` (and ``bias``) replaces ``self.weight``: the tied embedding, or SwiGLU's gate and up."""
        if weight is None:
            weight = self.weight
            if weight is None:
                raise ValueError("ColumnParallelLinear(skip_weight=True) needs forward(x, weight=...)")
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

    The partial products are reduce-scattered along dim 0 (SP) or all-reduced; the replicated bias ``[out]`` is
    added after the reduction, under SP to each rank's sequence slice only, so it is tagged ``sequence_parallel``
    (its grad is all-reduced over TP by the optimizer).
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
        self._add_param("weight", (out_features, self.in_per_rank), dtype, device)
        self._add_param("bias", (out_features,), dtype, device, create=bias, sequence_parallel=sequence_parallel)

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

    Ids outside the slice give zero vectors; the partial results are all-reduced (reduce-scattered along ``s``
    under SP). ``num_embeddings`` must already be padded to a multiple of ``t`` (``padded_vocab_size``).
    ``skip_weight``: ``forward`` is given the weight (a tied output layer's copy of it).
    """

    partition_dims: ClassVar[dict[str, int]] = {"weight": 0}

    def __init__(self, num_embeddings: int, embedding_dim: int, *, group: Any, sequence_parallel: bool = False,
                 skip_weight: bool = False, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
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
        self._add_param("weight", (self.rows_per_rank, embedding_dim), dtype, device, create=not skip_weight)

    def forward(self, ids: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """ids ``[s, b]`` (sequence first) → ``[s, b, h]``, or ``[s/t, b, h]`` under SP; ``weight``: instead of
        ``self.weight``."""
        weight = self.weight if weight is None else weight
        if self.tp_size == 1:
            return F.embedding(ids, weight)  # [s, b, h]
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)  # [s, b]
        local_ids = (ids - self.vocab_start).masked_fill_(outside, 0)
        partial = F.embedding(local_ids, weight)  # [s, b, h]
        partial = partial.masked_fill_(outside.unsqueeze(-1), 0.0)  # the embedding saves ids only: in place is safe
        if self.sequence_parallel:
            return reduce_scatter_to_sp(partial, self.group)  # [s/t, b, h]
        return reduce_from_tp(partial, self.group)  # [s, b, h]

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings} (local rows [{self.vocab_start}, {self.vocab_end})), {self.embedding_dim}, "
                f"tp={self.tp_size}, sequence_parallel={self.sequence_parallel}")


CHUNK_ELEMENTS = 2 ** 22
"""Logits per cross-entropy chunk (16 MiB of fp32 temporary; docs/benchmarks.md). Change it with ``chunk_size``."""


@contextmanager
def chunk_size(elements: int) -> Iterator[None]:
    """Process ``elements`` logits per chunk inside the block (the benchmark and tests try other sizes)."""
    global CHUNK_ELEMENTS
    if elements < 1:
        raise ValueError(f"chunk size {elements} must be >= 1")
    previous, CHUNK_ELEMENTS = CHUNK_ELEMENTS, int(elements)
    try:
        yield
    finally:
        CHUNK_ELEMENTS = previous


def _chunk_rows(v_local: int) -> int:
    return max(1, CHUNK_ELEMENTS // max(1, v_local))


def _shifted(x: torch.Tensor, row_max: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = x − max`` in ``out``'s dtype (bf16 promoted exactly): the real (unpadded) columns of a chunk."""
    if x.dtype == out.dtype:
        torch.sub(x, row_max.unsqueeze(-1), out=out)
    else:  # faster than a mixed-dtype sub, which converts into a temporary first
        out.copy_(x).sub_(row_max.unsqueeze(-1))
    return out


def token_stats(x: torch.Tensor, row_max: torch.Tensor, local_target: torch.Tensor,
                smoothing: bool) -> torch.Tensor:
    """Per-token sums of the real columns ``x [k, real]`` for the loss, as one formula (``train.compile`` runs it
    through ``torch.compile``: one pass over the logits, no fp32 copy): ``[2 or 3, k]`` = the shifted target logit
    (``x − max``; meaningless where the target is on another rank), ``Σ exp(x − max)`` and with ``smoothing``
    ``Σ (x − max)``. The eager path computes the same in fp32 chunks (``_VocabParallelCrossEntropy``)."""
    compute = torch.promote_types(x.dtype, torch.float32)
    shifted = x.to(compute) - row_max.unsqueeze(-1)  # [k, real]
    target = x.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).to(compute) - row_max  # [k]
    sums = [target, shifted.exp().sum(-1)]
    if smoothing:
        sums.append(shifted.sum(-1))
    return torch.stack(sums)


def logit_grad(x: torch.Tensor, row_max: torch.Tensor, scale: torch.Tensor, local_target: torch.Tensor,
               on_target: torch.Tensor, smooth: torch.Tensor | None, real: int) -> torch.Tensor:
    """The loss gradient of ``x [k, columns]`` in x's dtype, as one formula (compiled with ``train.compile``):
    ``exp(x − max)·scale + on_target·[j = target] − smooth`` on the first ``real`` columns, 0 on the rest (vocabulary
    padding); ``scale``, ``on_target`` and ``smooth`` are ``[k]`` (see ``_VocabParallelCrossEntropy.backward``)."""
    compute = torch.promote_types(x.dtype, torch.float32)
    grad = (x.to(compute) - row_max.unsqueeze(-1)).exp() * scale.unsqueeze(-1)  # [k, columns]
    columns = torch.arange(x.shape[-1], device=x.device)
    grad = grad + torch.where(columns == local_target.unsqueeze(-1), on_target.unsqueeze(-1), 0.0)
    if smooth is not None:
        grad = grad - smooth.unsqueeze(-1)
    if real < x.shape[-1]:
        grad = torch.where(columns < real, grad, 0.0)  # selects: an inf or nan of a padded column never leaks
    return grad.to(x.dtype)


@functools.cache
def compiled_loss() -> tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]]:
    """``token_stats`` and ``logit_grad`` through ``torch.compile`` (``vocab_parallel_cross_entropy(compiled=True)``)."""
    return torch.compile(token_stats), torch.compile(logit_grad)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross entropy of vocab-sharded logits, ``CHUNK_ELEMENTS`` logits at a time (``compiled``: one
    compiled kernel for the sums and one for the gradient); padded columns are never read (they count as
    exp(−inf) = 0, and get a zero gradient).

    Saves ``logits`` itself (no copy) and O(tokens) fp32 vectors. Backward writes a fresh gradient, never into the
    saved logits (a soft-cap's tanh or a ``retain_graph`` second backward may still read them).
    """

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, group: Any,
                label_smoothing: float, vocab_size: int | None, z_loss: float, compiled: bool) -> torch.Tensor:
        compute_dtype = torch.promote_types(logits.dtype, torch.float32)
        v_local = logits.shape[-1]
        flat = logits.reshape(-1, v_local)  # [n, V/t], a view of the contiguous output-layer result
        v_full = v_local * comm.group_size(group)
        start = comm.group_rank(group) * v_local
        padded_from = v_local  # local index where padding starts
        if vocab_size is not None and vocab_size < v_full:
            padded_from = min(v_local, max(0, vocab_size - start))
            v_full = vocab_size

        n = flat.shape[0]
        if padded_from > 0:  # the max is exact in any dtype: no fp32 copy needed
            logits_max = flat[:, :padded_from].amax(dim=-1).to(compute_dtype)  # [n]
        else:
            logits_max = torch.full((n,), float("-inf"), dtype=compute_dtype)
        comm.all_reduce(logits_max, group, op=comm.ReduceOp.MAX)

        target = target.reshape(-1)
        ignored = target < 0  # [n]
        local = (target >= start) & (target < start + v_local)  # [n]; False where ignored
        local_target = torch.where(local, target - start, 0)  # [n], an index into this slice
        # [2 or 3, n]: target logit, Σ exp (and Σ shifted logits), reduced in place by one all-reduce
        if compiled and padded_from:  # one fused pass over the real columns, no temporary
            per_token = compiled_loss()[0](flat[:, :padded_from], logits_max, local_target, label_smoothing > 0)
        else:
            per_token = _token_stats_chunked(flat, logits_max, local_target, padded_from, label_smoothing > 0)
        per_token[0].masked_fill_(~local, 0.0)
        totals = comm.all_reduce(per_token, group)  # [2 or 3, n]
        log_z = totals[1].log()  # [n]
        loss = log_z - totals[0]  # [n]
        if label_smoothing > 0:
            # (1−ε)·(−log p_target) + ε·mean over the FULL vocab of (−log p_j)  (not V/t: Megatron #737)
            loss = (1.0 - label_smoothing) * loss + label_smoothing * (log_z - totals[2] / v_full)
        log_z_full = None
        if z_loss > 0:
            log_z_full = log_z + logits_max  # [n] logsumexp of the real (unpadded) logits
            loss = loss + z_loss * log_z_full.square()
        loss = loss.masked_fill_(ignored, 0.0)

        sum_exp = totals[1].clone()  # [n]; not a view of totals, so the stacked buffer is freed
        ctx.save_for_backward(logits, logits_max, sum_exp, local_target, local, ignored, log_z_full)
        ctx.label_smoothing, ctx.v_full, ctx.z_loss, ctx.padded_from = label_smoothing, v_full, z_loss, padded_from
        ctx.compiled = compiled
        return loss.view(logits.shape[:-1])

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None, None, None]:
        logits, logits_max, sum_exp, local_target, local, ignored, log_z_full = ctx.saved_tensors
        eps, padded_from = ctx.label_smoothing, ctx.padded_from
        compute_dtype = sum_exp.dtype
        flat = logits.reshape(-1, logits.shape[-1])  # [n, V/t]
        g = grad_loss.reshape(-1).to(compute_dtype).masked_fill(ignored, 0.0)  # [n]
        # d(z·log²Z)/d logit_j = 2z·log Z·softmax_j: it only rescales the softmax term
        g_softmax = g if log_z_full is None else g * (1.0 + 2.0 * ctx.z_loss * log_z_full)  # [n]
        scale = (g_softmax / sum_exp).unsqueeze(-1)  # [n, 1]: softmax_j·g = exp(x_j − max)·g/Σexp
        on_target = ((1.0 - eps) * g).masked_fill_(~local, 0.0).neg_().unsqueeze(-1)  # [n, 1]
        smooth = ((eps / ctx.v_full) * g).unsqueeze(-1) if eps > 0 else None  # [n, 1]

        if ctx.compiled and padded_from:  # one fused pass, written in the logits' dtype
            # Mostly real columns: the whole width at once (padding gets 0), so no second logits-sized buffer.
            # Mostly padding (a byte vocabulary padded far): only the real columns, then padded with zeros.
            whole = 2 * padded_from >= flat.shape[-1]
            grad = compiled_loss()[1](flat if whole else flat[:, :padded_from], logits_max, scale.squeeze(-1),
                                      local_target, on_target.squeeze(-1),
                                      None if smooth is None else smooth.squeeze(-1), padded_from)
            if grad.shape[-1] < flat.shape[-1]:
                grad = F.pad(grad, (0, flat.shape[-1] - padded_from))
            return grad.view(logits.shape), None, None, None, None, None, None
        grad = torch.empty_like(flat)  # [n, V/t] in the logits' dtype (see the class docstring)
        rows = _chunk_rows(flat.shape[-1])
        same_dtype = grad.dtype == compute_dtype
        work = None if same_dtype else torch.empty(min(rows, flat.shape[0]), padded_from, dtype=compute_dtype)
        for i in range(0, flat.shape[0], rows):
            j = min(i + rows, flat.shape[0])
            dst = grad[i:j, :padded_from]  # the real columns; padding gets 0 (exp(−inf)), never computed
            out = dst if same_dtype else work[:j - i]  # fp32/fp64: compute straight into the result
            real = _shifted(flat[i:j, :padded_from], logits_max[i:j], out).exp_().mul_(scale[i:j])
            if padded_from:
                real.scatter_add_(-1, local_target[i:j].unsqueeze(-1), on_target[i:j])
            if smooth is not None:
                real.sub_(smooth[i:j])
            if not same_dtype:
                dst.copy_(real)
            if padded_from < grad.shape[-1]:
                grad[i:j, padded_from:] = 0.0
        return grad.view(logits.shape), None, None, None, None, None, None


def _token_stats_chunked(flat: torch.Tensor, logits_max: torch.Tensor, local_target: torch.Tensor, padded_from: int,
                         smoothing: bool) -> torch.Tensor:
    """``token_stats`` of ``flat [n, V/t]``'s real columns (``[:padded_from]``) in fp32 chunks of ``CHUNK_ELEMENTS``
    (eager: one fp32 chunk temporary, computed in place). Padded columns count as exp(−inf) = 0 and are never
    computed: exp of −inf is 3x slower than of a number."""
    n = flat.shape[0]
    per_token = torch.empty(3 if smoothing else 2, n, dtype=logits_max.dtype)
    rows = _chunk_rows(flat.shape[-1])
    work = torch.empty(min(rows, n), padded_from, dtype=logits_max.dtype)  # the one fp32 chunk temporary
    for i in range(0, n, rows):
        j = min(i + rows, n)
        shifted = _shifted(flat[i:j, :padded_from], logits_max[i:j], work[:j - i])  # [k, real columns]
        per_token[0, i:j] = shifted.gather(-1, local_target[i:j].unsqueeze(-1)).squeeze(-1) if padded_from else 0
        if smoothing:
            per_token[2, i:j] = shifted.sum(dim=-1)
        per_token[1, i:j] = shifted.exp_().sum(dim=-1)
    return per_token


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group: Any,
                                 label_smoothing: float = 0.0, vocab_size: int | None = None,
                                 z_loss: float = 0.0, compiled: bool = False) -> torch.Tensor:
    """Per-token cross entropy ``[..]`` of this rank's logits ``[.., V/t]`` (vocabulary rows ``[r·V/t, (r+1)·V/t)``
    over the TP ``group``), without gathering them; computed in fp32 (fp64 logits stay fp64).

    Equals ``F.cross_entropy(full_logits, target, reduction="none", label_smoothing=ε) + z·logsumexp(full_logits)²``
    with ε spread over the full vocabulary, ids ``>= vocab_size`` (padding) excluded, and negative (ignored)
    targets at loss 0 with zero grad. ``compiled`` (``train.compile``): the per-token sums and the gradient are
    each one ``torch.compile`` kernel over the whole slice (``token_stats``, ``logit_grad``) instead of fp32
    chunks.
    """
    if tuple(target.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"target {tuple(target.shape)} does not match logits {tuple(logits.shape)} minus the vocab dim")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing = {label_smoothing} must be in [0, 1]")
    if not (math.isfinite(z_loss) and z_loss >= 0.0):
        raise ValueError(f"z_loss = {z_loss} must be a finite number >= 0")
    return _VocabParallelCrossEntropy.apply(logits, target, group, float(label_smoothing), vocab_size, float(z_loss),
                                            bool(compiled))
