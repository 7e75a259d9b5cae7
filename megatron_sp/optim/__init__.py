"""Optimizer construction, learning-rate schedule and gradient clipping."""
from __future__ import annotations

import torch
from torch import nn

from ..config import TrainConfig
from .grads import clip_grads, global_grad_norm, sync_tp_replicated_grads
from .lr import lr_at

__all__ = ["build_optimizer", "lr_at", "set_lr", "clip_grads", "global_grad_norm", "sync_tp_replicated_grads",
           "named_trainable"]


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
