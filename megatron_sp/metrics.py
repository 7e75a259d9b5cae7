"""Throughput numbers and the run's metric sinks (metrics.jsonl, console, wandb, tensorboard).

One function computes tokens/s, TFLOP/s and MFU; one logger (rank 0 only) writes them.
MFU follows PaLM appendix B: model FLOPs per token ≈ 6N + 12·L·h·s, divided by the peak dense
matmul rate of the devices used (on CPU measured at start-up, see ``device.measured_peak_flops``).
"""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from .config import Config
from .errors import ConfigError

log = logging.getLogger("megatron_sp")


def throughput(tokens: int, seconds: float, flops_per_token: float, peak_flops_total: float) -> dict[str, float]:
    """tokens/s, achieved TFLOP/s (all devices) and MFU for ``tokens`` processed in ``seconds``."""
    tok_s = tokens / max(seconds, 1e-9)
    flops = tok_s * flops_per_token
    return {"tokens_per_s": tok_s, "tflops": flops / 1e12, "mfu": flops / peak_flops_total if peak_flops_total else 0.0}


def format_eta(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class MetricsLogger:
    """Writes records to ``logging.dir/metrics.jsonl`` and the optional sinks; a no-op off rank 0."""

    def __init__(self, cfg: Config, enabled: bool, resume_step: int = 0) -> None:
        self.enabled = enabled
        self.path = Path(cfg.logging.dir) / "metrics.jsonl"
        self._wandb: Any = None
        self._tb: Any = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step and self.path.exists():
            # Drop records past the resume point so the file reads as one continuous run.
            kept = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= resume_step]
            self.path.write_text("".join(line + "\n" for line in kept))
        elif self.path.exists():
            self.path.unlink()
        if cfg.logging.wandb:
            try:
                import wandb  # type: ignore[import-not-found]
            except ImportError:
                raise ConfigError("logging.wandb=true needs wandb: pip install 'megatron_sp[logging]' "
                                  "(or set logging.wandb=false)") from None
            self._wandb = wandb.init(project=cfg.logging.wandb_project, dir=str(self.path.parent),
                                     config=_plain(cfg), resume="allow")
        if cfg.logging.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ConfigError("logging.tensorboard=true needs tensorboard: pip install 'megatron_sp[logging]' "
                                  "(or set logging.tensorboard=false)") from None
            self._tb = SummaryWriter(log_dir=str(self.path.parent / "tensorboard"))

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        step = int(record.get("step", 0))
        numbers = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
        if self._wandb is not None:
            self._wandb.log(numbers, step=step)
        if self._tb is not None:
            for k, v in numbers.items():
                self._tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()
        if self._tb is not None:
            self._tb.close()


def _plain(cfg: Config) -> dict[str, Any]:
    from .config import to_dict
    return to_dict(cfg)
