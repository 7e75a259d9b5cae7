"""Multi-token prediction (DeepSeek-V3 §2.2; docs/mtp.md): ``model.mtp_layers`` = D sequential modules on the last
pipeline stage, after the main model's layers. Module k (1..D) at position i joins module k-1's state ``h`` (the
main model's last hidden state, before the final norm, for k = 1) with the embedding of token i + k,
``eh_proj([enorm(emb); hnorm(h)])``, runs one transformer layer (global number ``num_layers + k - 1``: dense or MoE
like a main layer there) and predicts token i + k + 1 through its own ``final_norm`` and the shared output layer.

Inputs and targets come shifted on the whole sequence (``data.batching.mtp_targets``: ``mtp_tokens`` and
``mtp_labels``, -100 where masked), so context parallelism shards them like any per-token tensor. The objective
gains ``λ/D · Σ_k S_k / N_k`` (``S_k`` this rank's summed cross entropy of module k, ``N_k`` its valid targets in the
global batch: ``set_loss_scales``) through ``moe.AuxLossGrad``; the LM loss the schedule sums stays the main one.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from megatron_sp.config.schema import ModelConfig
from megatron_sp.model.attention.context_parallel import AttentionMeta
from megatron_sp.model.transformer import TransformerLayer, make_norm, norm_args
from megatron_sp.mpu import comm
from megatron_sp.mpu.layers import ColumnParallelLinear
from megatron_sp.mpu.mappings import scatter_to_sp
from megatron_sp.mpu.parallel_state import ParallelContext
from megatron_sp.mpu.random import checkpoint

if TYPE_CHECKING:
    from megatron_sp.mpu.parallel_state import ParallelState


class MTPModule(nn.Module):
    """One prediction depth: ``enorm``, ``hnorm``, ``eh_proj`` (``[h, 2h]``, column-parallel, its output gathered
    over TP and, under SP, split along the sequence again), ``layer``, ``final_norm``."""

    def __init__(self, cfg: ModelConfig, depth: int, parallel: ParallelContext) -> None:
        super().__init__()
        self.parallel = parallel
        self.enorm, self.hnorm = make_norm(cfg, parallel), make_norm(cfg, parallel)
        self.eh_proj = ColumnParallelLinear(2 * cfg.hidden_size, cfg.hidden_size, bias=False, group=parallel.tp_group,
                                            sequence_parallel=parallel.sp, gather_output=True,
                                            recompute_allgather=parallel.recompute_allgather)
        self.layer = TransformerLayer(cfg, cfg.num_layers + depth, parallel)
        self.final_norm = make_norm(cfg, parallel)

    def forward(self, h: torch.Tensor, emb: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMeta | None, recompute: bool) -> torch.Tensor:
        """h, emb ``[s/t, b, h]`` (SP) or ``[s, b, h]`` → this depth's state, same shape (before ``final_norm``)."""
        norm = self.layer.regions.norm
        x = self.eh_proj(torch.cat([norm(emb, *norm_args(self.enorm)), norm(h, *norm_args(self.hnorm))], dim=-1))
        if self.parallel.sp:
            x = scatter_to_sp(x, self.parallel.tp_group)  # [s/t, b, h]
        if recompute:
            return checkpoint(self.layer, x, cos, sin, meta, tracker=self.parallel.tracker)
        return self.layer(x, cos, sin, meta)


def set_loss_scales(model: nn.Module, cfg: ModelConfig, valid_targets: Sequence[float], grad_scale: float) -> None:
    """Before a step: module k's summed loss weighs ``grad_scale · λ / (D · N_k)`` (``valid_targets`` = N_k of the
    global batch), so its gradient is that of ``λ/D · Σ_k L_k`` whatever the layout; the sums restart."""
    d = cfg.mtp_layers
    scales = [grad_scale * cfg.mtp_loss_coeff / (d * max(n, 1.0)) for n in valid_targets]
    for module in model.modules():
        if hasattr(module, "mtp_loss_scales"):
            module.mtp_loss_scales, module.mtp_sums = scales, None


def step_losses(model: nn.Module, cfg: ModelConfig, valid_targets: Sequence[float],
                state: ParallelState) -> list[float]:
    """After a step, on every rank: each module's mean cross entropy ``L_k`` over the global batch (the sums of
    the last stage's micro-batches, summed over pp and dp_cp; the TP ranks hold the same sums)."""
    sums = torch.zeros(cfg.mtp_layers, dtype=torch.float64)
    for module in model.modules():
        if getattr(module, "mtp_sums", None) is not None:
            sums += module.mtp_sums.double().cpu()
    sums = comm.all_reduce(comm.all_reduce(sums, state.pp_group), state.dp_cp_group)
    return [s / max(n, 1.0) for s, n in zip(sums.tolist(), valid_targets)]
