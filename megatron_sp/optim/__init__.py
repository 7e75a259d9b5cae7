"""Optimizer construction, learning-rate schedule and gradient clipping."""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ..config import TrainConfig
from .lr import lr_at

__all__ = ["build_optimizer", "lr_at", "set_lr", "clip_grad_norm", "named_trainable"]


def named_trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) pairs of a model with any wrapper prefix (DDP's ``module.``) removed."""
    inner = getattr(model, "module", model)
    return [(n, p) for n, p in inner.named_parameters() if p.requires_grad]


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (embeddings included; biases and norm weights excluded).

    The two groups are named ``decay`` and ``no_decay``; parameter order follows the model's, so a
    checkpoint keyed by parameter name maps back unambiguously.
    """
    decay, no_decay = [], []
    for _, p in named_trainable(model):
        (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay, "name": "decay"},
              {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                             foreach=True)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def clip_grad_norm(params: Iterable[nn.Parameter], max_norm: float) -> torch.Tensor:
    """The global L2 norm of the gradients (before clipping); scales them to ``max_norm`` if positive.

    Every rank here holds whole, already reduced gradients, so the local norm is the global one.
    """
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]))
    if max_norm > 0:
        coeff = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        torch._foreach_mul_(grads, coeff)
    return norm
