"""Dynamic loss scaling for fp16 training (bf16 and fp32: ``enabled=False``, scale 1, never skip).

The loss is multiplied by ``scale`` before backward and the grads divided by it. A step with inf/NaN
grads is skipped, and after ``hysteresis`` such overflows the scale is multiplied by ``backoff`` (as
Megatron); after ``growth_interval`` clean steps in a row it is multiplied by ``growth``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class DynamicLossScaler:
    """The loss scale and its bookkeeping; ``update(found_inf)`` after every step."""

    enabled: bool = True
    scale: float = 2.0**16
    growth: float = 2.0
    backoff: float = 0.5
    growth_interval: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0
    good_steps: int = 0
    overflows_left: int = 2

    def __post_init__(self) -> None:
        if not self.enabled:
            self.scale = 1.0
        self.overflows_left = self.hysteresis

    @property
    def inv_scale(self) -> float:
        return 1.0 / self.scale

    def update(self, found_inf: bool) -> None:
        """Record one step: back off on overflow (after hysteresis), grow after a clean interval."""
        if not self.enabled:
            return
        if found_inf:
            self.good_steps = 0
            self.overflows_left -= 1
            if self.overflows_left <= 0:
                self.scale = max(self.min_scale, self.scale * self.backoff)
                self.overflows_left = self.hysteresis
            return
        self.good_steps += 1
        if self.good_steps % self.growth_interval == 0:
            self.scale *= self.growth
            self.overflows_left = self.hysteresis

    def state_dict(self) -> dict[str, float | int | bool]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, float | int | bool]) -> None:
        for key, value in state.items():
            setattr(self, key, type(getattr(self, key))(value))
