"""Optimization: the distributed optimizer (DP gradient reduction, ZeRO-1, mixed precision, AdamW),
the learning-rate schedule and the fp16 loss scaler."""
from __future__ import annotations

from torch import nn

from .distributed import DistributedOptimizer
from .lr import lr_at

__all__ = ["DistributedOptimizer", "lr_at", "named_trainable"]


def named_trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) pairs of a model's trainable parameters, any wrapper prefix (``module.``) removed."""
    inner = getattr(model, "module", model)
    return [(n, p) for n, p in inner.named_parameters() if p.requires_grad]
