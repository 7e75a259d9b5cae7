"""Gather every parameter's full (unsharded) gradient by name: the parity standard's witness.

The parity standard (shared/DESIGN.md) compares, after step 1, each parameter's full gradient of
a parallel layout against the 1-rank run. ``full_grads_by_name`` reassembles them from any layout:
TP-sharded parameters (``tensor_model_parallel``, ``partition_dim``) are all-gathered over the TP
group and concatenated along their partition dim; pipeline stages contribute their own parameters
(gathered over the PP group). Data/context-parallel replicas hold identical reduced gradients, so
nothing is gathered over DP/CP. ``grad_diffs`` measures max|Δ| / max|ref| per parameter.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from .mpu import ParallelState
from .optim import named_trainable


def full_grads_by_name(model: nn.Module, state: ParallelState | None) -> dict[str, torch.Tensor]:
    """{name: full fp32 gradient on CPU} for the whole model; collective over TP and PP groups."""
    out: dict[str, torch.Tensor] = {}
    for name, p in named_trainable(model):
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        grad = grad.detach().float()
        if state is not None and state.tp_size > 1 and getattr(p, "tensor_model_parallel", False):
            parts = [torch.empty_like(grad) for _ in range(state.tp_size)]
            dist.all_gather(parts, grad.contiguous(), group=state.tp_group)
            grad = torch.cat(parts, dim=p.partition_dim)
        out[name] = grad.cpu()
    if state is not None and state.pp_size > 1:
        stages: list[dict[str, torch.Tensor] | None] = [None] * state.pp_size
        dist.all_gather_object(stages, out, group=state.pp_group)
        merged: dict[str, torch.Tensor] = {}
        for stage in stages:
            merged.update(stage or {})
        out = merged
    return out


def grad_diffs(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    """max|got − ref| / max|ref| per parameter name (inf when a name or shape is missing)."""
    diffs = {}
    for name, r in ref.items():
        g = got.get(name)
        if g is None or g.shape != r.shape:
            diffs[name] = float("inf")
            continue
        scale = r.abs().max().item()
        diffs[name] = (g - r).abs().max().item() / (scale if scale > 0 else 1.0)
    for name in got.keys() - ref.keys():
        diffs[name] = float("inf")
    return diffs


def load_grads(path: str | Path) -> dict[str, torch.Tensor]:
    """Read a gradient dump written by ``logging.dump_grads_step``."""
    return torch.load(path, map_location="cpu", weights_only=True)
