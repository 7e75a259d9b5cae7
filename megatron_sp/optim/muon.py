"""Muon (momentum orthogonalised by Newton–Schulz) for the 2-D weights of attention, MLPs and experts, on whole logical
matrices whatever the layout: the momentum is elementwise on each rank's owned elements; the matrix it orthogonalises
is assembled over ZeRO (dp·cp, edp) and TP first. Theory and choices: docs/optimizer.md, "Muon"."""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ..config import ModelConfig, TrainConfig
from ..config.registry import check, choice
from ..config.schema import Config
from ..errors import ConfigError
from ..model.transformer import head_dim
from ..mpu.sharding import full_shape

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic (torch.optim.Muon's default)
NS_EPS = 1e-7
UPDATE_SCALES = ("moonlight", "spectral", "none")
OPTIMIZERS = ("adamw", "muon")
ADAMW_KEEPS = ("router.weight",)  # 2-D weights in the layers that stay with AdamW


@check
def check_muon_config(cfg: Config) -> None:
    """``train.optimizer`` and the ``train.muon_*`` keys."""
    t = cfg.train
    choice("train.optimizer", t.optimizer, OPTIMIZERS)
    choice("train.muon_update_scale", t.muon_update_scale, UPDATE_SCALES)
    if not 0.0 <= t.muon_momentum < 1.0:
        raise ConfigError(f"train.muon_momentum: {t.muon_momentum} must be in [0, 1)")
    if not 1 <= t.muon_ns_steps < 100:
        raise ConfigError(f"train.muon_ns_steps: {t.muon_ns_steps} must be in 1..99")


def is_muon_param(name: str, param: nn.Parameter) -> bool:
    """Whether Muon updates ``name``: a 2-D (or stacked-expert 3-D) weight inside a transformer layer or an MTP module
    (``eh_proj`` too), not the router; embeddings, the output layer, norms and biases keep AdamW."""
    return (param.ndim >= 2 and name.endswith(".weight") and name.startswith(("layers.", "mtp."))
            and not name.endswith(ADAMW_KEEPS))  # (stacked experts' biases are 2-D: [E, f])


def ns_flops(shape: tuple[int, ...], steps: int) -> float:
    """Newton–Schulz FLOPs of a weight of (full) ``shape`` (stacked experts: each), as if one matrix."""
    *stack, m, n = shape
    a, b = min(m, n), max(m, n)
    return math.prod(stack) * steps * (4.0 * a * a * b + 2.0 * a ** 3)


def muon_owners(infos: list[Any], buckets: list[Any], tp: int, steps: int) -> dict[int, int]:
    """{parameter index: the rank of its bucket's group that orthogonalises it}: largest first to the least loaded
    rank of that group (by ``ns_flops`` of the full shape), so every rank of a group computes a similar share.
    Deterministic: every rank derives the same owners."""
    load: dict[int, list[float]] = {}
    owners = {}
    cost = {info.index: ns_flops(full_shape(info.param, tp), steps) for info in infos}
    for info in sorted(infos, key=lambda i: (-cost[i.index], i.index)):
        b = buckets[info.bucket]
        ranks = load.setdefault(id(b.group), [0.0] * b.size)
        owner = min(range(b.size), key=lambda r: (ranks[r], r))
        ranks[owner] += cost[info.index]
        owners[info.index] = owner
    return owners


def update_scale(mode: str, rows: int, cols: int) -> float:
    """The factor on a ``rows × cols`` orthogonalised update (``train.muon_update_scale``): ``moonlight`` 0.2·√max(m, n)
    (Moonlight: AdamW's update RMS, so AdamW's lr and weight decay carry over), ``spectral`` √max(1, m/n) (Keller
    Jordan's; torch.optim.Muon's default), ``none`` 1."""
    if mode == "moonlight":
        return 0.2 * math.sqrt(max(rows, cols))
    return math.sqrt(max(1.0, rows / cols)) if mode == "spectral" else 1.0


def newton_schulz(u: torch.Tensor, steps: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The quintic Newton–Schulz iteration of ``u`` (2-D) towards U·Vᵀ of its SVD, in ``dtype`` (the arithmetic of
    torch.optim.Muon, which runs it in bf16; fp32 here, so layouts compare at the parity standard)."""
    a, b, c = NS_COEFFICIENTS
    x = u.to(dtype)
    tall = u.shape[0] > u.shape[1]
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=NS_EPS)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def orthogonalised(name: str, u: torch.Tensor, cfg: ModelConfig, t: TrainConfig) -> torch.Tensor:
    """The scaled orthogonalised update of the whole (stored-shape) tensor ``u`` of parameter ``name``: each logical
    matrix on its own: each expert of a stacked ``[E, m, n]``; the fused QKV as q, k and v (``muon_split_heads``: every
    head of each); latent attention's up projections per head with ``muon_split_heads`` (its key and value parts apart);
    any other weight whole."""
    def orth(m: torch.Tensor) -> torch.Tensor:
        return newton_schulz(m, t.muon_ns_steps).mul_(update_scale(t.muon_update_scale, *m.shape))

    if u.ndim == 3:
        return torch.stack([orthogonalised(name, e, cfg, t) for e in u])
    module = name.rsplit(".", 2)[-2]
    out = torch.empty_like(u, dtype=torch.float32)
    if module == "qkv":
        d, g, r = head_dim(cfg), cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads
        x, o = u.view(g, r + 2, d, -1), out.view(g, r + 2, d, -1)
        if t.muon_split_heads:
            for i in range(g):
                for j in range(r + 2):
                    o[i, j] = orth(x[i, j])
        else:
            o[:, :r] = orth(x[:, :r].reshape(g * r * d, -1)).view(g, r, d, -1)
            o[:, r] = orth(x[:, r].reshape(g * d, -1)).view(g, d, -1)
            o[:, r + 1] = orth(x[:, r + 1].reshape(g * d, -1)).view(g, d, -1)
        return out
    if t.muon_split_heads and module in ("q_up", "q_proj", "kv_up"):
        n = cfg.num_heads
        x, o = u.view(n, -1, u.shape[-1]), out.view(n, -1, u.shape[-1])
        parts = [cfg.qk_nope_head_dim, cfg.v_head_dim] if module == "kv_up" else [x.shape[1]]
        for h in range(n):
            for xs, os_ in zip(x[h].split(parts), o[h].split(parts)):
                os_.copy_(orth(xs))
        return out
    return out.copy_(orth(u))
