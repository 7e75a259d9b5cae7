"""The one place that knows about accelerators.

Everything else asks this module: which device and backend to use, whether flash-attn or NVIDIA
apex can be imported, the peak FLOP/s for MFU, memory in use, and how to synchronise. GPU-only
packages are imported lazily; when one is missing we fall back to plain PyTorch and say so once.
"""
from __future__ import annotations

import functools
import logging
import os
import resource
import time
from typing import Any
from collections.abc import Callable

import torch

log = logging.getLogger("megatron_sp")


def cuda_available() -> bool:
    """True when a CUDA device is visible to this process."""
    return torch.cuda.is_available()


def default_device_type() -> str:
    """'cuda' when a GPU is visible, else 'cpu'."""
    return "cuda" if cuda_available() else "cpu"


def default_backend(device_type: str) -> str:
    """The torch.distributed backend for a device type: nccl on CUDA, gloo on CPU."""
    return "nccl" if device_type == "cuda" else "gloo"


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


def memory_bytes(device: torch.device) -> int:
    """Memory in use for metrics: CUDA max allocated on GPU, peak resident set size on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


@functools.cache
def flash_attn_func() -> Callable[..., Any] | None:
    """flash-attn's ``flash_attn_func`` when the package imports and a GPU is present, else None.

    Logs one line the first time it is asked, either way.
    """
    if not cuda_available():
        return None
    try:
        from flash_attn import flash_attn_func as fn  # type: ignore[import-not-found]
    except Exception as exc:  # ImportError, or a broken CUDA build raising at import
        log.info("flash-attn not usable (%s); attention uses torch scaled_dot_product_attention", exc)
        return None
    log.info("attention uses flash-attn")
    return fn


@functools.cache
def apex_available() -> bool:
    """True when NVIDIA apex (built from source with its CUDA extensions) imports on a GPU machine."""
    if not cuda_available():
        return False
    try:
        import apex  # noqa: F401  # type: ignore[import-not-found]
        import fused_layer_norm_cuda  # noqa: F401  # type: ignore[import-not-found]
    except Exception as exc:
        log.info("NVIDIA apex not usable (%s); using torch fused kernels", exc)
        return False
    return True


@functools.cache
def measured_peak_flops(dtype: torch.dtype = torch.float32, n: int = 1024, seconds: float = 0.5,
                        window: float = 0.1) -> float:
    """Dense-matmul FLOP/s of this host's CPU cores for ``dtype``, measured once with every core.

    This is the MFU denominator on CPU. Call it while no other rank of this host computes (the
    training loop measures on local rank 0 between barriers). On GPUs a short matmul loop measures
    clocks, not the datasheet peak: there ``logging.peak_tflops`` must be given instead.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        a = torch.randn(n, n, dtype=dtype)
        b = torch.randn(n, n, dtype=dtype)
        a @ b  # warm-up
        # Other processes only ever slow a window down: the fastest of several short windows is the
        # best estimate of the peak on a shared machine.
        best, deadline = 0.0, time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            reps, t0 = 0, time.perf_counter()
            while True:
                a @ b
                reps += 1
                elapsed = time.perf_counter() - t0
                if elapsed >= window:
                    break
            best = max(best, 2.0 * n**3 * reps / elapsed)
    finally:
        torch.set_num_threads(threads)
    return best
