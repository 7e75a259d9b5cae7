"""Rotary frequency scaling (``model.rope_scaling``): the inverse frequencies and the cos/sin factor of transformers'
``linear``, ``llama3`` and ``yarn`` rope types, in the same operations (so the same values) as
``transformers.modeling_rope_utils``; ``none`` leaves ``base^(-2i/d)`` untouched."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatron_sp.config.schema import ModelConfig

ROPE_SCALINGS = ("none", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    """A ``model.rope_*`` setting; ``kind`` one of ``ROPE_SCALINGS``."""

    kind: str = "none"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_positions: int = 8192  # llama3, yarn
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn: None → 0.1·ln(factor) + 1

    @classmethod
    def of(cls, cfg: ModelConfig) -> RopeScaling:
        return cls(cfg.rope_scaling, cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor,
                   cfg.rope_original_max_positions, cfg.rope_beta_fast, cfg.rope_beta_slow, cfg.rope_attention_factor)

    def cos_sin_factor(self) -> float:
        """The factor on cos and sin (yarn's attention scaling; 1 otherwise)."""
        if self.kind != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        return 0.1 * math.log(self.factor) + 1.0 if self.factor > 1 else 1.0

    def inv_freq(self, pos_freqs: torch.Tensor, base: float, dim: int) -> torch.Tensor:
        """The scaled inverse frequencies from ``pos_freqs = base^(2i/dim)`` ``[dim/2]``."""
        inv_freq = 1.0 / pos_freqs
        if self.kind == "linear":
            return inv_freq / self.factor
        if self.kind == "llama3":  # low frequencies / factor, high kept, a smooth band between
            old, low, high = self.original_max_positions, self.low_freq_factor, self.high_freq_factor
            wavelen = 2 * math.pi / inv_freq
            scaled = torch.where(wavelen > old / low, inv_freq / self.factor, inv_freq)
            smooth = (old / wavelen - low) / (high - low)
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            medium = ~(wavelen < old / high) * ~(wavelen > old / low)
            return torch.where(medium, smoothed, scaled)
        if self.kind == "yarn":  # NTK-by-parts: interpolated below the correction range, extrapolated above it

            def correction_dim(rotations: float) -> float:
                return dim * math.log(self.original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(base))

            lo = max(math.floor(correction_dim(self.beta_fast)), 0)
            hi = min(math.ceil(correction_dim(self.beta_slow)), dim - 1)
            ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo if hi != lo else 0.001)).clamp(0, 1)
            extrapolation = (1 - ramp).to(pos_freqs)
            return 1.0 / (self.factor * pos_freqs) * (1 - extrapolation) + inv_freq * extrapolation
        return inv_freq


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary (HF's ``rotate_half``) on the first ``rd = cos.shape[-1]`` dims of ``x [..., d]``; the
    rest pass. ``x·cos``, then each half adds the other half times its part of the (signed) sin in place: no
    swapped copy of ``x`` (a ``flip`` of the strided q/k views cost 2–6× this on CPU)."""
    rd, d = cos.shape[-1], x.shape[-1]
    h = rd // 2
    x_rot = x if rd == d else x[..., :rd]
    rotated = x_rot * cos
    rotated[..., :h].addcmul_(x_rot[..., h:], sin[..., :h])
    rotated[..., h:].addcmul_(x_rot[..., :h], sin[..., h:])
    return rotated if rd == d else torch.cat([rotated, x[..., rd:]], dim=-1)
