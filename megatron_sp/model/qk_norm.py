"""QK-norm over the whole q and k projections (``model.qk_norm_scope=projection``, OLMo-2) under tensor parallelism.

A TP rank holds ``n/t`` query heads and ``g/t`` key heads (or, when tp > g, a copy of its kv group's key): the RMS
statistic of a token spans every head, so each rank's sum of squares is all-reduced over TP forward, and backward too,
since every rank's normalised values depend on every rank's inputs (``copy_to_tp(reduce_from_tp(.))``: Megatron's g,
then f). The mean divides by the local width × t: a kv group copied on t/g ranks is counted t/g times in the sum and
in the width alike, so it is the mean over the whole projection in both layouts. The weights ``[n·d]`` and ``[g·d]``
are split over TP like the heads (rank r holds query heads ``[r·n/t, (r+1)·n/t)``, contiguous in HF's order), except
a replicated kv group's key weight: whole on every rank, tagged ``sequence_parallel`` (its grad summed over TP, as the
replicated QKV weight's is)."""
from __future__ import annotations

import torch
from torch import nn

from megatron_sp.config.schema import ModelConfig
from megatron_sp.mpu import comm
from megatron_sp.mpu.layers import set_tp_attributes
from megatron_sp.mpu.mappings import copy_to_tp, reduce_from_tp
from megatron_sp.mpu.parallel_state import ParallelContext


def projection_norms(cfg: ModelConfig, parallel: ParallelContext, kv_replicated: bool) -> tuple[nn.RMSNorm, nn.RMSNorm]:
    """(q_norm, k_norm) holding this rank's weights: ``[n·d/t]`` and ``[g·d/t]`` (``[g·d]`` when ``kv_replicated``)."""
    t, d = parallel.tp_size, cfg.head_dim or cfg.hidden_size // cfg.num_heads
    q_norm = nn.RMSNorm(cfg.num_heads * d // t, eps=cfg.norm_eps)
    k_norm = nn.RMSNorm(cfg.num_kv_heads * d // (1 if kv_replicated else t), eps=cfg.norm_eps)
    set_tp_attributes(q_norm.weight, True, 0)
    set_tp_attributes(k_norm.weight, not kv_replicated, 0 if not kv_replicated else -1, sequence_parallel=kv_replicated)
    return q_norm, k_norm


def projection_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, group: object) -> torch.Tensor:
    """RMSNorm of ``x [..., w]`` over the last dim split over the TP ``group`` (whole width ``w·t``), in at least fp32
    as transformers' ``Olmo2RMSNorm``; ``weight [w]``: this rank's part."""
    x32 = x.to(torch.promote_types(x.dtype, torch.float32))
    sum_sq = copy_to_tp(reduce_from_tp(x32.square().sum(-1, keepdim=True), group), group)  # [..., 1], every head's
    mean = sum_sq / (x.shape[-1] * comm.group_size(group))
    return (weight * (x32 * torch.rsqrt(mean + eps))).to(x.dtype)
