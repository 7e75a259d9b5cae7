"""Learning-rate schedule: linear warm-up, then cosine / linear / constant decay to ``min_lr``."""
from __future__ import annotations

import math

from ..config import TrainConfig


def lr_at(step: int, cfg: TrainConfig) -> float:
    """The learning rate for optimizer step ``step`` (0-based: the first update uses step 0). Warm-up: ``lr · (step +
    1) / warmup`` for the first ``lr_warmup_iters`` steps, so no step has lr 0. Then decay from ``lr`` to ``min_lr``
    until ``lr_decay_iters``, and ``min_lr`` after it."""
    warmup = cfg.lr_warmup_iters or 0  # None before finalize derives it
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    if cfg.lr_decay_style == "constant":
        return cfg.lr
    decay_steps = max(1, (cfg.lr_decay_iters or cfg.iters) - warmup)
    progress = min(1.0, (step - warmup) / decay_steps)
    if cfg.lr_decay_style == "linear":
        coeff = 1.0 - progress
    else:  # cosine
        coeff = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr + coeff * (cfg.lr - cfg.min_lr)
