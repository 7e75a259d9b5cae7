"""The pointwise regions of a transformer layer: the work between its matmuls, attention and collectives.

A layer calls them through ``layer.regions``: ``EAGER`` (plain PyTorch) or ``compiled()``, the same
functions through ``torch.compile`` (``train.compile``), which fuses each region's pointwise ops and
their backward into a few kernels. No region communicates, draws random numbers or reads state
outside its arguments, so compiling them leaves the TP/SP/CP collectives, pipeline stages,
recompute with RNG replay and the zero-bubble weight-gradient split exactly where they were.
Why regions and not whole layers, and the measured gains: docs/compile.md.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from collections.abc import Callable

import torch
import torch.nn.functional as F


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary on the first ``rd = cos.shape[-1]`` dims of ``x [..., d]``; the rest pass.

    ``x_rot · cos + cat(x2, x1) · sin = cat(x1·c − x2·s, x2·c + x1·s)`` (HF's ``rotate_half``); the
    swapped halves are one ``flip`` of a ``[..., 2, rd/2]`` view, no concatenation for full rotary.
    """
    rd = cos.shape[-1]
    d = x.shape[-1]
    x_rot, x_pass = (x, None) if rd == d else x.split([rd, d - rd], dim=-1)
    swapped = x_rot.unflatten(-1, (2, rd // 2)).flip(-2).flatten(-2)  # cat(x2, x1)
    rotated = x_rot * cos + swapped * sin
    return rotated if x_pass is None else torch.cat([rotated, x_pass], dim=-1)


def rotary_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               r: int, d: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split the fused QKV output ``[s, b, g·(r+2)·d]`` into q ``[s, b, g·r, d]``, k and v ``[s, b, g, d]``,
    queries and keys rotated (cos/sin ``[s, b|1, rd]``)."""
    s, b = qkv.shape[0], qkv.shape[1]
    qkv = qkv.view(s, b, -1, r + 2, d)  # [s, b, g, r+2, d]
    cos = cos.to(qkv.dtype)[:, :, None, None, :]  # [s, b|1, 1, 1, rd]
    sin = sin.to(qkv.dtype)[:, :, None, None, :]
    qk, v = qkv.split([r + 1, 1], dim=3)  # [s, b, g, r+1, d], [s, b, g, 1, d]
    qk = apply_rotary(qk, cos, sin)  # queries and keys rotated together
    q, k = qk.split([r, 1], dim=3)
    # v is a view into the projection output: copy it so autograd does not keep all of qkv alive.
    return q.reshape(s, b, -1, d), k.squeeze(3), v.squeeze(3).contiguous()


def norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """LayerNorm (with ``bias``) or RMSNorm (``bias`` None) over the last dim."""
    if bias is not None:
        return F.layer_norm(x, x.shape[-1:], weight, bias, eps)
    return F.rms_norm(x, x.shape[-1:], weight, eps)


def add_norm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual ``x + y`` and its norm (a sequential-residual layer's second half begins so)."""
    x = x + y
    return x, norm(x, weight, bias, eps)


def add3(x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """``x + y + z``: the parallel residual."""
    return x + y + z


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) · up`` of the concatenated ``[..., 2·f]`` gate and up projections → ``[..., f]``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@dataclass(frozen=True)
class Regions:
    """The pointwise regions a layer calls (eager or compiled)."""

    rotary_qkv: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = rotary_qkv
    norm: Callable[..., torch.Tensor] = norm
    add_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]] = add_norm
    add3: Callable[..., torch.Tensor] = add3
    swiglu: Callable[..., torch.Tensor] = swiglu


EAGER = Regions()


@functools.cache
def compiled() -> Regions:
    """The regions through ``torch.compile`` (inductor; shapes static until one changes, then dynamic)."""
    return Regions(**{f.name: torch.compile(getattr(EAGER, f.name)) for f in fields(Regions)})


def cache_dir() -> str:
    """Where inductor caches compiled kernels for later runs (``TORCHINDUCTOR_CACHE_DIR``)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_cache_dir

    return inductor_cache_dir()
