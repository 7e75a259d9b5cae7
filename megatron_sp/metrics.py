"""Throughput (tokens/s, TFLOP/s, MFU ≤ 1), the console and the metric sinks (metrics.jsonl, wandb, tensorboard).
MFU, the CPU peak and file rotation: docs/metrics.md.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .config import Config, to_dict
from .errors import ConfigError

if TYPE_CHECKING:
    import torch

    from .mpu import ParallelState

log = logging.getLogger("megatron_sp")


def setup_logging(level: str, rank: int) -> None:
    """One logger: rank 0 at the configured level, other ranks warnings and errors only, rank-tagged."""
    handler = logging.StreamHandler(sys.stdout if rank == 0 else sys.stderr)
    prefix = "" if rank == 0 else f"[rank {rank}] "
    handler.setFormatter(logging.Formatter(prefix + "%(message)s"))
    log.handlers[:] = [handler]
    log.propagate = False
    log.setLevel(getattr(logging, level.upper()) if rank == 0 else logging.WARNING)


def log_host_load(threads: int, local_ranks: int, cores: int, load: float, cpu: bool) -> None:
    """The start-up line on this host's threads and load, and on CPU one warning when ranks × threads exceed its
    cores or its load average already does (steps then wait for cores: docs/metrics.md)."""
    log.info("host: %d local rank%s × %d torch threads on %d cores, load average %.2f", local_ranks,
             "s" if local_ranks > 1 else "", threads, cores, load)
    busy = []
    if local_ranks * threads > cores:
        busy.append(f"{local_ranks} ranks × {threads} threads = {local_ranks * threads} > {cores} cores")
    if load > cores:
        busy.append(f"load average {load:.2f} > {cores} cores before training")
    if cpu and busy:
        log.warning("host oversubscribed: %s; steps wait for cores (fewer threads: OMP_NUM_THREADS, fewer ranks, or "
                    "a quieter host)", "; ".join(busy))


class Peak:
    """The MFU denominator: peak FLOP/s of all devices (0: unknown, MFU 0). ``given`` (logging.peak_tflops): MFU
    capped at 1; measured: raised to any achieved rate above it (``on_raise`` caches it). See docs/metrics.md."""

    def __init__(self, flops: float, given: bool = False, on_raise: Callable[[float], object] | None = None,
                 warn: bool = True) -> None:
        self.flops = flops
        self.given = given
        self.on_raise = on_raise
        self._warned = not warn

    def mfu(self, achieved: float) -> float:
        """Model FLOPs utilisation of ``achieved`` FLOP/s (all devices): never above 1."""
        if self.flops <= 0:
            return 0.0
        if achieved > self.flops:
            if self.given:
                self._warn("MFU reported as 100%%: the run achieves %.4g TFLOP/s, above logging.peak_tflops × devices "
                           "= %.4g TFLOP/s (is logging.peak_tflops too low?)", achieved / 1e12, self.flops / 1e12)
                return 1.0
            self._warn("the run achieves %.1f GFLOP/s, above the measured peak %.1f GFLOP/s (measured while the host "
                       "was busy): the achieved rate is the peak from now on", achieved / 1e9, self.flops / 1e9)
            self.flops = achieved
            if self.on_raise is not None:
                self.on_raise(achieved)
        return achieved / self.flops

    def _warn(self, message: str, *args: Any) -> None:
        if not self._warned:
            self._warned = True
            log.warning(message, *args)


def throughput(tokens: int, seconds: float, flops_per_token: float, peak: Peak) -> dict[str, float]:
    """tokens/s, achieved TFLOP/s (all devices) and MFU (≤ 1, see ``Peak``) for ``tokens`` processed in ``seconds``."""
    tok_s = tokens / max(seconds, 1e-9)
    flops = tok_s * flops_per_token
    return {"tokens_per_s": tok_s, "tflops": flops / 1e12, "mfu": peak.mfu(flops)}


def peak_flops_total(cfg: Config, st: ParallelState, device: torch.device) -> Peak:
    """The peak FLOP/s of all devices of the run: one GPU each, or on CPU one host's cores each (measured by
    local rank 0 of each host while the others wait; the largest host's rate). Collective."""
    import torch

    from . import device as device_mod
    from .mpu import comm

    world = st.dims.world_size
    n_devices = world if device.type == "cuda" else max(1, world // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    rank0 = st.rank == 0
    if cfg.logging.peak_tflops:
        return Peak(cfg.logging.peak_tflops * 1e12 * n_devices, given=True, warn=rank0)
    if device.type == "cuda":
        log.info("MFU is not reported: set logging.peak_tflops to the GPU's peak for %s", cfg.train.precision)
        return Peak(0.0)
    comm.barrier()
    t0 = time.perf_counter()
    measures = int(os.environ.get("LOCAL_RANK", "0")) == 0
    per_host = torch.tensor(host_cpu_peaks(cfg.train.precision) if measures else (0.0, 0.0, 0.0), dtype=torch.float64)
    comm.all_reduce(per_host, None, op=comm.ReduceOp.MAX)
    best, now, fp32 = per_host.tolist()
    log.info("CPU peak: %.1f GFLOP/s %s per host, the best seen on this host (measured now: %.1f GFLOP/s in %.1f s; "
             "cache %s): the MFU denominator", best / 1e9, cfg.train.precision, now / 1e9, time.perf_counter() - t0,
             device_mod.peak_cache_path())
    dtype = torch.bfloat16 if cfg.train.precision == "bf16" else torch.float32
    if not native_bf16(best, fp32):  # no native bf16 matmuls: the bf16 peak is no bound on what the run does
        if rank0:
            log.warning("train.precision=bf16: this CPU's bf16 matmuls peak at %.1f GFLOP/s, %.0f× below its fp32 "
                        "peak (%.1f GFLOP/s): it lacks native bf16 (AVX512-BF16 or AMX), so bf16 steps run that much "
                        "slower; use train.precision=fp32. MFU is taken against the fp32 peak", best / 1e9,
                        fp32 / max(best, 1.0), fp32 / 1e9)
        return Peak(fp32 * n_devices, warn=rank0)
    on_raise = (lambda total: device_mod.record_peak_flops(dtype, total / n_devices)) if rank0 else None
    return Peak(best * n_devices, on_raise=on_raise, warn=rank0)


SLOW_BF16 = 0.5
"""bf16 matmuls slower than this fraction of fp32's mean the CPU has no native bf16 (measured: 2.2–4.5× faster
than fp32 with AVX512-BF16/AMX here, ~100× slower on an AVX2-only host)."""


def host_cpu_peaks(precision: str) -> tuple[float, float, float]:
    """This host's (best matmul peak for ``precision``, its measurement now, fp32's best peak if bf16 else 0),
    FLOP/s (``device.cpu_peak_flops``). Call it while no other rank of the host computes."""
    import torch

    from . import device as device_mod

    bf16 = precision == "bf16"
    best, now = device_mod.cpu_peak_flops(torch.bfloat16 if bf16 else torch.float32)
    return best, now, device_mod.cpu_peak_flops(torch.float32)[0] if bf16 else 0.0


def native_bf16(best: float, fp32: float) -> bool:
    """Whether ``host_cpu_peaks``' run peak ``best`` is its own MFU denominator: always unless bf16 (``fp32`` set)
    runs below ``SLOW_BF16`` of fp32, where the fp32 peak is taken instead."""
    return not fp32 or best >= SLOW_BF16 * fp32


ETA_STEPS = 20  # steps the ETA looks back over


def eta_seconds(step_seconds: Sequence[float], remaining: int) -> float:
    """Seconds for ``remaining`` steps at the median of ``step_seconds`` (inf when empty)."""
    if remaining <= 0:
        return 0.0
    if not step_seconds:
        return math.inf
    return remaining * statistics.median(step_seconds)


STEP_PROGRESS_AFTER_S = 60.0  # a step running longer than this logs its progress (rank 0) ...
STEP_PROGRESS_EVERY_S = 30.0  # ... at most this often


class StepProgress:
    """Progress inside a long step: ``tick()`` at each micro-batch forward of this rank (``total`` in the step) logs,
    once the step has run ``STEP_PROGRESS_AFTER_S`` and at most every ``STEP_PROGRESS_EVERY_S``, the forwards done
    and the step's ETA at their mean time (a no-op unless ``enabled``: rank 0, which holds the first stage)."""

    def __init__(self, step: int, total: int, enabled: bool) -> None:
        self.step, self.total, self.enabled = step, total, enabled
        self.done, self.start, self.logged = 0, time.perf_counter(), -math.inf

    def tick(self) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        elapsed = now - self.start
        if self.done and elapsed > STEP_PROGRESS_AFTER_S and now - self.logged >= STEP_PROGRESS_EVERY_S:
            self.logged = now
            log.info("step %d in progress: %d/%d micro-batches done in %s, ETA %s", self.step, self.done, self.total,
                     format_eta(elapsed), format_eta(elapsed / self.done * max(0, self.total - self.done)))
        self.done += 1


def format_eta(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    h, rem = divmod(int(seconds), 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def parameter_summary(total: int, on_rank: int, tp: int, pp: int, vocab: int | None, padded_vocab: int) -> str:
    """``5.12M parameters (2.63M on this rank: tp2 pp1)``: the whole model (a tied embedding once) and this rank's
    tensors, both with padded vocabulary rows."""
    text = f"{_count(total)} parameters"
    if tp * pp > 1:
        text += f" ({_count(on_rank)} on this rank: tp{tp} pp{pp})"
    if vocab and vocab != padded_vocab:
        text += f", incl. vocab padding {vocab}→{padded_vocab}"
    return text


def _sink_missing(key: str) -> str:
    return f"logging.{key}=true needs {key}: pip install 'megatron_sp[logging]' (or set logging.{key}=false)"


def check_sinks(cfg: Config) -> None:
    """Refuse an enabled optional sink whose package is not installed (nothing is imported)."""
    for key in ("wandb", "tensorboard"):
        if getattr(cfg.logging, key) and importlib.util.find_spec(key) is None:
            raise ConfigError(_sink_missing(key))


def next_run_suffix(log_dir: Path) -> int:
    """The N an earlier run's metrics.jsonl.N / tensorboard.N / config.yml.N get in ``log_dir`` (1 + the largest)."""
    if not log_dir.is_dir():
        return 1
    taken = [int(p.name.rsplit(".", 1)[1]) for p in log_dir.iterdir()
             if p.name.startswith(("metrics.jsonl.", "tensorboard.")) and p.name.rsplit(".", 1)[1].isdigit()]
    return max(taken, default=0) + 1


def keep_earlier_config(path: Path, text: str) -> None:
    """Before ``text`` replaces ``logging.dir/config.yml``: keep a different earlier one as ``config.yml.N``."""
    if path.is_file() and path.read_text(errors="replace") != text:
        kept = path.with_name(f"{path.name}.{next_run_suffix(path.parent)}")
        if not kept.exists():
            path.rename(kept)
            log.info("config.yml of an earlier run kept as %s", kept.name)


class MetricsLogger:
    """Writes records to ``logging.dir/metrics.jsonl`` and the optional sinks (numeric fields as scalars at
    ``step``); a no-op off rank 0. An earlier run's records are kept as ``.N`` files (docs/metrics.md)."""

    def __init__(self, cfg: Config, enabled: bool, resume_step: int = 0) -> None:
        self.enabled = enabled
        self.path = Path(cfg.logging.dir) / "metrics.jsonl"
        self._wandb: Any = None
        self._tb: Any = None
        if not enabled:
            return
        check_sinks(cfg)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._keep_earlier_runs(resume_step)
        if cfg.logging.wandb:
            try:
                import wandb  # type: ignore[import-not-found]
            except ImportError:
                raise ConfigError(_sink_missing("wandb")) from None
            try:
                self._wandb = wandb.init(project=cfg.logging.wandb_project,
                                         dir=os.environ.get("WANDB_DIR") or str(self.path.parent),
                                         config=to_dict(cfg), resume="allow")
            except wandb.errors.Error as exc:  # no API key, no network, ...: a setup problem, not a bug
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise ConfigError(f"logging.wandb: wandb.init failed: {first} (run `wandb login`, or set "
                                  "WANDB_MODE=offline and `wandb sync` later, or set logging.wandb=false)") from None
        if cfg.logging.tensorboard:
            try:
                import tensorboard  # noqa: F401  (torch.utils.tensorboard needs it)
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ConfigError(_sink_missing("tensorboard")) from None
            self._tb = SummaryWriter(log_dir=str(self.path.parent / "tensorboard"),
                                     purge_step=resume_step + 1 if resume_step else None)

    def _keep_earlier_runs(self, resume_step: int) -> None:
        """Rotate (fresh run) or trim a kept copy (resume with records past ``resume_step``)."""
        lines = [line for line in self.path.read_text().splitlines() if line.strip()] if self.path.is_file() else []
        tb = self.path.parent / "tensorboard"
        if resume_step:
            kept = [line for line in lines if self._step_of(line) <= resume_step]
            if len(kept) < len(lines):
                rotated = self.path.with_name(f"{self.path.name}.{next_run_suffix(self.path.parent)}")
                tmp = self.path.with_name(self.path.name + ".tmp")
                tmp.write_text("".join(line + "\n" for line in kept))
                shutil.copyfile(self.path, rotated)  # the whole file under its new name, then the trimmed one
                tmp.replace(self.path)
                log.info("metrics.jsonl: %d records past step %d moved aside, the full file kept as %s",
                         len(lines) - len(kept), resume_step, rotated)
            return
        n = next_run_suffix(self.path.parent)
        if lines:
            self.path.rename(self.path.with_name(f"{self.path.name}.{n}"))
            log.info("metrics.jsonl of an earlier run kept as %s.%d", self.path.name, n)
        elif self.path.exists():
            self.path.unlink()  # empty: nothing to keep
        if tb.is_dir() and any(tb.iterdir()):
            tb.rename(tb.with_name(f"tensorboard.{n}"))

    @staticmethod
    def _step_of(line: str) -> float:
        """The step of a metrics.jsonl line (inf when unreadable: e.g. cut short by a crash)."""
        try:
            step = json.loads(line).get("step", 0)
        except (ValueError, AttributeError):
            return math.inf
        return step if isinstance(step, (int, float)) else math.inf

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

