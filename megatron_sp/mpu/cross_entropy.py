"""Vocab-parallel cross entropy: the per-token loss from vocab-sharded logits, never gathering them.

Rank r holds the logits of vocabulary rows ``[r·V/t, (r+1)·V/t)``. Forward: all-reduce MAX of the
local max, then one all-reduce SUM of the stacked per-token values (target logit, Σ exp, Σ logits);
``loss = log Σexp − target logit``, with optional label smoothing (mean over the real vocabulary
``V``) and PaLM's z-loss at no extra collective. Backward needs no communication. Padded vocabulary
rows (ids ≥ ``vocab_size``) count as −inf, so the loss does not depend on the TP layout's padding.

Theory and invariants (the forward steps, label-smoothing and z-loss formulas, the backward):
docs/tensor_parallel.md.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from . import comm


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross entropy of vocab-sharded logits (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, group: Any,
                label_smoothing: float, vocab_size: int | None, z_loss: float) -> torch.Tensor:
        compute_dtype = torch.promote_types(logits.dtype, torch.float32)
        x = logits.to(compute_dtype)  # [.., V/t]
        v_local = x.shape[-1]
        v_full = v_local * comm.group_size(group)
        start = comm.group_rank(group) * v_local
        padded_from = v_local
        if vocab_size is not None and vocab_size < v_full:
            padded_from = min(v_local, max(0, vocab_size - start))  # local index where padding starts
            if padded_from < v_local:
                x = x.clone() if x is logits else x
                x[..., padded_from:] = float("-inf")
            v_full = vocab_size

        logits_max = x.amax(dim=-1)  # [..]
        comm.all_reduce(logits_max, group, op=comm.ReduceOp.MAX)
        shifted = x - logits_max.unsqueeze(-1)  # [.., V/t], a new tensor

        ignored = target < 0  # [..]
        local = (target >= start) & (target < start + v_local)  # [..]; False where ignored
        local_target = torch.where(local, target - start, 0)  # [..], an index into this slice
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill_(~local, 0.0)  # [..]
        sum_shifted = shifted[..., :padded_from].sum(dim=-1) if label_smoothing > 0 else None  # [..]
        exp = shifted.exp_()  # [.., V/t], in place: shifted is not needed any more
        per_token = [target_logit, exp.sum(dim=-1)] + ([sum_shifted] if sum_shifted is not None else [])
        totals = comm.all_reduce(torch.stack(per_token), group)  # [2 or 3, ..]
        log_z = totals[1].log()  # [..]
        loss = log_z - totals[0]  # [..]
        if label_smoothing > 0:
            # (1−ε)·(−log p_target) + ε·mean over the FULL vocab of (−log p_j)  (not V/t: Megatron #737)
            loss = (1.0 - label_smoothing) * loss + label_smoothing * (log_z - totals[2] / v_full)
        log_z_full = None
        if z_loss > 0:
            log_z_full = log_z + logits_max  # [..] logsumexp of the real (unpadded) logits
            loss = loss + z_loss * log_z_full.square()
        loss = loss.masked_fill_(ignored, 0.0)
        probs = exp.div_(totals[1].unsqueeze(-1))  # [.., V/t] softmax slice

        ctx.save_for_backward(probs, local_target, local, ignored, log_z_full)
        ctx.label_smoothing, ctx.v_full, ctx.in_dtype, ctx.z_loss = label_smoothing, v_full, logits.dtype, z_loss
        ctx.padded_from = padded_from
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None, None]:
        probs, local_target, local, ignored, log_z_full = ctx.saved_tensors
        eps = ctx.label_smoothing
        g = grad_loss.to(probs.dtype).masked_fill(ignored, 0.0)  # [..]
        # d(z·log²Z)/d logit_j = 2z·log Z·softmax_j: it only rescales the softmax term
        g_softmax = g if log_z_full is None else g * (1.0 + 2.0 * ctx.z_loss * log_z_full)  # [..]
        grad = probs * g_softmax.unsqueeze(-1)  # [.., V/t]
        on_target = ((1.0 - eps) * g).masked_fill_(~local, 0.0)  # [..]
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -on_target.unsqueeze(-1))
        if eps > 0:
            grad.sub_((eps / ctx.v_full) * g.unsqueeze(-1))
        if eps > 0 and ctx.padded_from < grad.shape[-1]:
            grad[..., ctx.padded_from:] = 0.0
        return grad.to(ctx.in_dtype), None, None, None, None, None


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
