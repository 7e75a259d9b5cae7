"""The one place that knows about accelerators: device and backend, RNG state, memory in use, flash-attn
and the CPU peak FLOP/s for MFU (docs/metrics.md)."""
from __future__ import annotations

import ctypes
import functools
import json
import logging
import math
import os
import platform
import resource
import shutil
import socket
import time
from pathlib import Path
from typing import Any
from collections.abc import Callable

import torch

from .config.registry import check, choice
from .config.schema import Config
from .errors import ConfigError

log = logging.getLogger("megatron_sp")


def cuda_available() -> bool:
    """True when a CUDA device is visible to this process."""
    return torch.cuda.is_available()


def default_device_type() -> str:
    """'cuda' when a GPU is visible, else 'cpu'."""
    return "cuda" if cuda_available() else "cpu"


@check
def check_device_config(cfg: Config) -> None:
    """``parallel.device`` and ``parallel.backend``: this machine's defaults when unset, and a valid pair."""
    p = cfg.parallel
    if p.device is None:
        p.device = default_device_type()
    choice("parallel.device", p.device, ("cpu", "cuda"))
    if p.backend is None:
        p.backend = "nccl" if p.device == "cuda" else "gloo"
    choice("parallel.backend", p.backend, ("gloo", "nccl"))
    if p.backend == "nccl" and p.device != "cuda":
        raise ConfigError("parallel.backend=nccl needs parallel.device=cuda; use parallel.backend=gloo on CPU")
    if cfg.train.compile is None:  # measured: on CPU compiling costs more than short runs win (docs/compile.md)
        cfg.train.compile = p.device == "cuda"
    if cfg.train.compile and p.device == "cpu" and not any(map(shutil.which, (os.environ.get("CXX", "g++"), "clang++"))):
        raise ConfigError("train.compile=true on CPU needs a C++ compiler for torch.compile (g++, clang++ or $CXX): "
                          "install one, or set train.compile=false")


# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MALLOPT_MAX = 2**31 - 1  # mallopt takes a C int


def cache_host_memory() -> bool:
    """Keep the memory this process frees for its next allocations: glibc's malloc neither maps blocks of up to
    2 GiB on their own (``M_MMAP_THRESHOLD``; by default it does from 32 MiB, e.g. fp32 logits) nor returns the
    heap's free top to the system (``M_TRIM_THRESHOLD``). Otherwise every step page-faults such tensors back in,
    zero-filled by the kernel (~17 ms per 64 MiB here). The CPU counterpart of CUDA's caching allocator: the
    resident size stays at its peak. Returns False, changing nothing, off glibc (macOS, musl)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library this process already runs on
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, _MALLOPT_MAX)) and bool(mallopt(_M_TRIM_THRESHOLD, _MALLOPT_MAX))


def local_device(device_type: str, local_rank: int = 0) -> torch.device:
    """The torch.device this rank computes on (binds the CUDA device to the local rank)."""
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels (a no-op on CPU). Used around timers."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def manual_seed_all(seed: int) -> None:
    """Seed the CPU generator and, when present, every CUDA generator."""
    torch.manual_seed(seed)
    if cuda_available():
        torch.cuda.manual_seed_all(seed)


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """The RNG state of the CPU generator and of this rank's accelerator, as tensors."""
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    """Restore what ``rng_state`` returned."""
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def host_memory_available() -> int:
    """Bytes of RAM this host can give new processes now (Linux ``MemAvailable``), else its physical memory; 0 when
    the OS does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def accelerator_memory_bytes(local_rank: int = 0) -> int:
    """Total memory of this host's CUDA device ``local_rank`` (0 without one)."""
    return int(torch.cuda.get_device_properties(local_rank).total_memory) if cuda_available() else 0


def accelerator_name(local_rank: int = 0) -> str:
    """The name of this host's CUDA device ``local_rank`` (e.g. ``NVIDIA H100 80GB HBM3``), else its CPU model."""
    return torch.cuda.get_device_name(local_rank) if cuda_available() else _cpu_model()


def memory_bytes(device: torch.device) -> int:
    """Memory in use for metrics: CUDA max allocated on GPU, peak resident set size on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


@functools.cache
def flash_attn_func() -> Callable[..., Any] | None:
    """flash-attn's ``flash_attn_func`` when it imports and a GPU is present, else None (logged once)."""
    if not cuda_available():
        return None
    try:
        from flash_attn import flash_attn_func as fn  # type: ignore[import-not-found]
    except Exception as exc:  # ImportError, or a broken CUDA build raising at import
        log.info("flash-attn not usable (%s); attention uses torch scaled_dot_product_attention", exc)
        return None
    log.info("attention uses flash-attn")
    return fn


PEAK_CACHE_ENV = "MEGATRON_SP_CACHE_DIR"  # the directory of peak_flops.json (tests point it at a tmp dir)


def peak_cache_path() -> Path:
    """``peak_flops.json`` in ``$MEGATRON_SP_CACHE_DIR``, else ``$XDG_CACHE_HOME`` or ``~/.cache``/megatron_sp."""
    if os.environ.get(PEAK_CACHE_ENV):
        return Path(os.environ[PEAK_CACHE_ENV]) / "peak_flops.json"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "megatron_sp" / "peak_flops.json"


def host_cores() -> int:
    """The cores this process may run on (its CPU affinity), else every core of the host."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def load_average() -> float:
    """The host's 1-minute load average (runnable processes, ours included), 0 where the OS does not say."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def peak_cache_key(dtype: torch.dtype) -> str:
    """What a cached peak belongs to: host name, CPU model, cores, torch version and dtype."""
    return (f"{socket.gethostname()} | {_cpu_model()} | {host_cores()} cores | torch {torch.__version__} | "
            f"{str(dtype).removeprefix('torch.')}")


def _read_peak_cache(path: Path) -> dict[str, float]:
    """The cache's ``key → FLOP/s`` entries; empty when the file is missing, unreadable or malformed."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {k: float(v) for k, v in (data.items() if isinstance(data, dict) else ())
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0}


def record_peak_flops(dtype: torch.dtype, flops: float) -> float:
    """Keep and return ``max(cached, flops)`` for this host and ``dtype`` (atomic; an unusable cache is ignored)."""
    from .files import atomic_file

    path = peak_cache_path()
    entries = _read_peak_cache(path)
    key = peak_cache_key(dtype)
    best = max(flops, entries.get(key, 0.0))
    if best > entries.get(key, 0.0):
        entries[key] = best
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_file(path) as f:
                f.write((json.dumps(entries, indent=1, sort_keys=True) + "\n").encode())
        except OSError as exc:
            log.debug("peak FLOP/s cache %s not written: %s", path, exc)
    return best


@functools.cache
def measured_peak_flops(dtype: torch.dtype = torch.float32, n: int | None = None, seconds: float = 1.0,
                        window: float = 0.2) -> float:
    """Dense-matmul FLOP/s of this host's CPU cores for ``dtype`` (sizes ramp from 256 unless ``n``; the fastest
    ``window`` within ``seconds``: docs/metrics.md). Call it while no other rank of this host computes. Its matrices
    come from a generator of its own: how many sizes it draws depends on timing, and the default generator is
    dropout's stream (docs/metrics.md, "Randomness")."""
    gen = torch.Generator().manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(host_cores())
    deadline = time.perf_counter() + seconds
    try:
        def timed(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> float:
            t0 = time.perf_counter()
            torch.matmul(a, b, out=out)
            return time.perf_counter() - t0

        size, best = n or 256, 0.0
        while True:
            a, b = (torch.randn(size, size, generator=gen).to(dtype) for _ in range(2))
            out = torch.empty(size, size, dtype=dtype)
            timed(a, b, out)  # warm-up: threads, kernel choice, first touch of the pages
            last = timed(a, b, out)
            best = max(best, 2.0 * size**3 / last)
            if n is not None or size >= 4096 or 8 * last > 2.5 * window:
                break
            size *= 2
        while time.perf_counter() < deadline:
            reps, elapsed = 0, 0.0
            while elapsed < window:
                elapsed += timed(a, b, out)
                reps += 1
            best = max(best, 2.0 * size**3 * reps / elapsed)
    finally:
        torch.set_num_threads(threads)
    log.debug("measured %s matmul peak: %.1f GFLOP/s at n=%d", dtype, best / 1e9, size)
    return best


def cpu_peak_flops(dtype: torch.dtype) -> tuple[float, float]:
    """(best peak seen on this host for ``dtype``: the CPU MFU denominator, this run's measurement)."""
    measured = measured_peak_flops(dtype)
    return record_peak_flops(dtype, measured), measured
