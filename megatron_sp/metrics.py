"""Throughput numbers and the run's metric sinks (metrics.jsonl, console, wandb, tensorboard).

One function computes tokens/s, TFLOP/s and MFU; one logger (rank 0 only) writes them.
MFU follows PaLM appendix B: model FLOPs per token ≈ 6N + 12·L·h·s, divided by the peak dense
matmul rate of the devices used (on CPU measured at start-up, see ``device.measured_peak_flops``).
"""
from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
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


# config key → (the package it imports, what to tell the user when it is absent)
_SINKS = {
    "wandb": ("wandb", "logging.wandb=true needs wandb: pip install 'megatron_sp[logging]' "
                       "(or set logging.wandb=false)"),
    "tensorboard": ("tensorboard", "logging.tensorboard=true needs tensorboard: pip install 'megatron_sp[logging]' "
                                   "(or set logging.tensorboard=false)"),
}


def check_sinks(cfg: Config) -> None:
    """Raise the ``ConfigError`` of an enabled optional sink whose package is not installed.

    Cheap (nothing is imported): ``train.py`` calls it before it starts any rank, so a missing
    package is one line at once rather than a failure of rank 0 after the model is built.
    """
    for key, (package, message) in _SINKS.items():
        if getattr(cfg.logging, key) and importlib.util.find_spec(package) is None:
            raise ConfigError(message)


class MetricsLogger:
    """Writes records to ``logging.dir/metrics.jsonl`` and the optional sinks; a no-op off rank 0.

    Every numeric field of a record (``step`` aside) goes to wandb and TensorBoard as a scalar at
    that step. wandb writes under ``$WANDB_DIR`` if set, else under ``logging.dir``; with
    ``WANDB_MODE=offline`` it needs no account or network (``wandb sync`` uploads later).
    TensorBoard event files go to ``logging.dir/tensorboard``.
    """

    def __init__(self, cfg: Config, enabled: bool, resume_step: int = 0) -> None:
        self.enabled = enabled
        self.path = Path(cfg.logging.dir) / "metrics.jsonl"
        self._wandb: Any = None
        self._tb: Any = None
        if not enabled:
            return
        check_sinks(cfg)
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
                raise ConfigError(_SINKS["wandb"][1]) from None
            try:
                self._wandb = wandb.init(project=cfg.logging.wandb_project,
                                         dir=os.environ.get("WANDB_DIR") or str(self.path.parent),
                                         config=_plain(cfg), resume="allow")
            except wandb.errors.Error as exc:  # no API key, no network, ...: a setup problem, not a bug
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise ConfigError(f"logging.wandb: wandb.init failed: {first} (run `wandb login`, or set "
                                  "WANDB_MODE=offline and `wandb sync` later, or set logging.wandb=false)") from None
        if cfg.logging.tensorboard:
            try:
                import tensorboard  # noqa: F401  (torch.utils.tensorboard needs it)
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ConfigError(_SINKS["tensorboard"][1]) from None
            # On resume, TensorBoard drops the earlier run's events past the resume step, as metrics.jsonl does.
            self._tb = SummaryWriter(log_dir=str(self.path.parent / "tensorboard"),
                                     purge_step=resume_step + 1 if resume_step else None)

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        step = int(record.get("step", 0))
        numbers = {k: v for k, v in record.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}
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
