"""The AdamW side of ``DistributedOptimizer`` on this rank's owned shard: fp64 grad norm, clip, step
(docs/optimizer.md)."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from ..config import TrainConfig
from ..mpu import ParallelState, comm

NORM_CHUNK = 2**20  # elements per fp64 batch of the grad norm: an 8 MiB scratch buffer
_NormBatch = tuple[list[torch.Tensor], list[torch.Tensor], int]  # fp32 sources, their fp64 scratch slices, numel


class NormBatches:
    """``views`` packed into batches of at most ``NORM_CHUNK`` elements over one fp64 scratch buffer. Invariant:
    batches are processed one after the other, so one scratch buffer serves them all and memory stays at
    ``NORM_CHUNK`` fp64 elements whatever the model size."""

    def __init__(self, views: Sequence[torch.Tensor], device: torch.device) -> None:
        self.device = device
        total = sum(v.numel() for v in views)
        self.scratch = torch.empty(min(total, NORM_CHUNK), dtype=torch.float64, device=device)
        self.batches: list[_NormBatch] = []
        sources: list[torch.Tensor] = []
        slices: list[torch.Tensor] = []
        fill = 0
        for view in views:
            for a in range(0, view.numel(), NORM_CHUNK):
                piece = view[a:a + NORM_CHUNK]
                if fill + piece.numel() > NORM_CHUNK:
                    self.batches.append((sources, slices, fill))
                    sources, slices, fill = [], [], 0
                sources.append(piece)
                slices.append(self.scratch[fill:fill + piece.numel()])
                fill += piece.numel()
        if sources:
            self.batches.append((sources, slices, fill))

    def sum_of_squares(self) -> torch.Tensor:
        """This rank's fp64 sum of squares (squares of fp32 values are exact in fp64). No communication."""
        partials = torch.zeros(len(self.batches), dtype=torch.float64, device=self.device)
        for i, (sources, slices, numel) in enumerate(self.batches):
            torch._foreach_copy_(slices, sources)  # fp32 → fp64
            batch = self.scratch[:numel]
            torch.dot(batch, batch, out=partials[i])
        return partials.sum()


def global_norm(batches: NormBatches, state: ParallelState | None, sharded: bool, dp_group: object,
                experts: tuple[NormBatches, bool] | None = None) -> torch.Tensor:
    """The global L2 norm (fp64 scalar): local sums all-reduced in fp64 over dp_cp (ZeRO) and mp. ``experts``
    (ep > 1): the expert parameters' batches and whether they are ZeRO-sharded; their sum is all-reduced over edp
    (sharded: each rank owns a chunk; else every edp rank holds the same full sum) and over ep (different experts),
    so each expert counts once: experts replicated over tp are in TP rank 0's batches only (TP-split ones in every
    TP rank's, summed by mp); experts folded over tp (SP) are in every rank's, and the folded sum is added by TP
    rank 0."""
    total = batches.sum_of_squares()
    if state is not None:
        if sharded:
            comm.all_reduce(total, dp_group)
        if experts is not None:
            part = experts[0].sum_of_squares()
            if experts[1]:
                comm.all_reduce(part, state.edp_group)
            comm.all_reduce(part, state.ep_group)
            if state.tp_rank == 0 or not state.dims.ep_tp:
                total += part
        comm.all_reduce(total, state.mp_group)
    return total.sqrt()


def clip_(grad_pieces: list[torch.Tensor], norm: torch.Tensor, clip: float) -> None:
    """Scale the grads so their global norm is at most ``clip`` (coefficient computed in fp64)."""
    if clip > 0 and grad_pieces:
        coeff = torch.clamp(clip / (norm + 1e-6), max=1.0)  # fp64, from the fp64 norm
        torch._foreach_mul_(grad_pieces, coeff.to(torch.float32))


AdamGroup = tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]
"""Views of owned runs, one list each: fp32 masters, grads, exp_avg, exp_avg_sq."""


def adamw_(cfg: TrainConfig, lr: float, step: int, groups: dict[bool, AdamGroup]) -> None:
    """One AdamW update (``step`` counted from 1) of the masters, in place, by torch's fused kernel (the arithmetic
    of ``torch.optim.AdamW(fused=True)``: one pass, no temporaries); ``groups``: {decays: views}, weight decay
    applied to the ``True`` group only."""
    for decays, (masters, grads, avgs, avg_sqs) in groups.items():
        if not masters:
            continue
        steps = [torch.tensor(float(step), dtype=torch.float32, device=masters[0].device)] * len(masters)  # read only
        torch._fused_adamw_(masters, grads, avgs, avg_sqs, [], steps, lr=lr, beta1=cfg.adam_beta1,
                            beta2=cfg.adam_beta2, weight_decay=cfg.weight_decay if decays else 0.0,
                            eps=cfg.adam_eps, amsgrad=False, maximize=False)
