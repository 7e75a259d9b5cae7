"""Vocab-parallel cross entropy: the per-token loss from vocab-sharded logits, never gathering them.

Rank r holds the logits of vocabulary rows ``[r·V/t, (r+1)·V/t)``. Forward: all-reduce MAX of the
local max, then one all-reduce SUM of the stacked per-token values (target logit, Σ exp, Σ logits);
``loss = log Σexp − target logit``, with optional label smoothing (mean over the real vocabulary
``V``) and PaLM's z-loss at no extra collective. Backward needs no communication. Padded vocabulary
rows (ids ≥ ``vocab_size``) count as −inf, so the loss does not depend on the TP layout's padding.
Memory: tokens are processed in chunks of ``CHUNK_ELEMENTS`` logits, so one chunk's fp32 temporary
exists at a time; backward keeps the logits in their own dtype plus per-token vectors and
recomputes the softmax chunk by chunk.

Theory and invariants (the forward steps, label-smoothing and z-loss formulas, the backward, the
memory plan): docs/tensor_parallel.md.
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from . import comm

CHUNK_ELEMENTS = 2 ** 22
"""Logits per chunk (rows = max(1, CHUNK_ELEMENTS // (V/t))): 16 MiB of fp32 temporary; measured by
tools/bench/cross_entropy.py (docs/benchmarks.md). Change it with ``chunk_size``."""


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


def _shifted_exp(x: torch.Tensor, row_max: torch.Tensor, padded_from: int, out: torch.Tensor) -> torch.Tensor:
    """``out[:, :padded_from] = x − max`` in ``out``'s dtype (bf16 promoted exactly), padding −inf."""
    if x.dtype == out.dtype:
        torch.sub(x, row_max.unsqueeze(-1), out=out)
    else:  # faster than a mixed-dtype sub, which converts into a temporary first
        out.copy_(x).sub_(row_max.unsqueeze(-1))
    if padded_from < out.shape[-1]:
        out[:, padded_from:] = float("-inf")
    return out


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross entropy of vocab-sharded logits (see the module docstring).

    Saved for backward: ``logits`` itself (no copy: it is the output layer's result and alive anyway)
    and per-token vectors (max, Σexp, target index/flags, log Z for the z-loss): O(tokens) fp32.
    Backward writes the gradient into a fresh tensor of the logits' dtype, not in place into the
    saved logits: other graph nodes (a soft-cap's tanh) or the caller may still read them, and a
    ``retain_graph`` second backward would recompute the softmax from overwritten values.
    """

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, group: Any,
                label_smoothing: float, vocab_size: int | None, z_loss: float) -> torch.Tensor:
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
        per_token = torch.empty(3 if label_smoothing > 0 else 2, n, dtype=compute_dtype)
        rows = _chunk_rows(v_local)
        work = torch.empty(min(rows, n), v_local, dtype=compute_dtype)  # the one fp32 chunk temporary
        for i in range(0, n, rows):
            j = min(i + rows, n)
            shifted = _shifted_exp(flat[i:j], logits_max[i:j], padded_from, work[:j - i])  # [k, V/t]
            per_token[0, i:j] = shifted.gather(-1, local_target[i:j].unsqueeze(-1)).squeeze(-1)
            if label_smoothing > 0:
                per_token[2, i:j] = shifted[:, :padded_from].sum(dim=-1)
            per_token[1, i:j] = shifted.exp_().sum(dim=-1)
        del work
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
        return loss.view(logits.shape[:-1])

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None, None]:
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

        grad = torch.empty_like(flat)  # [n, V/t] in the logits' dtype (see the class docstring)
        rows = _chunk_rows(flat.shape[-1])
        same_dtype = grad.dtype == compute_dtype
        work = None if same_dtype else torch.empty(min(rows, flat.shape[0]), flat.shape[-1], dtype=compute_dtype)
        for i in range(0, flat.shape[0], rows):
            j = min(i + rows, flat.shape[0])
            out = grad[i:j] if same_dtype else work[:j - i]  # fp32/fp64: compute straight into the result
            _shifted_exp(flat[i:j], logits_max[i:j], padded_from, out).exp_().mul_(scale[i:j])
            out.scatter_add_(-1, local_target[i:j].unsqueeze(-1), on_target[i:j])
            if smooth is not None:
                out.sub_(smooth[i:j])
                if padded_from < out.shape[-1]:
                    out[:, padded_from:] = 0.0
            if not same_dtype:
                grad[i:j].copy_(out)
        return grad.view(logits.shape), None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group: Any,
                                 label_smoothing: float = 0.0, vocab_size: int | None = None,
                                 z_loss: float = 0.0) -> torch.Tensor:
    """Per-token cross entropy ``[..]`` of vocab-sharded logits ``[.., V/t]`` without gathering them.

    Args:
        logits: this rank's slice of the logits, vocabulary rows ``[r·V/t, (r+1)·V/t)``, any float dtype.
        target: ``[..]`` global vocabulary ids; negative ids are ignored (loss 0, zero grad).
        group: the TP group the vocabulary is split over.
        label_smoothing: ε of ``F.cross_entropy``, spread over the full vocabulary ``V``.
        vocab_size: the real vocabulary size; logits of ids at or beyond it (padding) are excluded.
        z_loss: PaLM's z-loss coefficient ``z``: adds ``z·log²Z`` per token, ``log Z`` the logsumexp
            of the token's (real) logits; it pulls ``log Z`` towards 0 to keep the softmax stable.

    Returns:
        the unreduced loss, computed in fp32 whatever the logits' dtype (fp64 logits stay fp64);
        equals ``F.cross_entropy(full_logits, target, reduction="none", label_smoothing=ε)
        + z·logsumexp(full_logits)²`` with ignored targets at 0.
    """
    if tuple(target.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"target {tuple(target.shape)} does not match logits {tuple(logits.shape)} minus the vocab dim")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing = {label_smoothing} must be in [0, 1]")
    if not (math.isfinite(z_loss) and z_loss >= 0.0):
        raise ValueError(f"z_loss = {z_loss} must be a finite number >= 0")
    return _VocabParallelCrossEntropy.apply(logits, target, group, float(label_smoothing), vocab_size, float(z_loss))
