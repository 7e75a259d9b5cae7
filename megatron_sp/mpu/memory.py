"""Reusable buffers for all-gathered activations (sequence parallelism): docs/tensor_parallel.md."""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch


class GatherBuffer:
    """One reusable storage per ``(dtype, device)`` to all-gather activations into, grown to the largest shape asked
    for (``reuse=False``: a plain allocator, for debugging). **Single-use invariant**: a tensor from ``get`` is valid
    only until the next ``get`` of the same dtype and device; consume it at once, never keep or save it for backward.
    """

    def __init__(self, reuse: bool = True) -> None:
        self.reuse = reuse
        self._buffers: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}  # flat storages

    def get(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """A contiguous uninitialised tensor of ``shape``, in the shared storage while ``reuse``."""
        shape = tuple(int(n) for n in shape)
        device = torch.device(device)
        if not self.reuse:
            return torch.empty(shape, dtype=dtype, device=device)
        numel = math.prod(shape)
        key = (dtype, device)
        flat = self._buffers.get(key)
        if flat is None or flat.numel() < numel:
            self._buffers.pop(key, None)  # free the smaller storage before allocating the larger one
            flat = self._buffers[key] = torch.empty(numel, dtype=dtype, device=device)
        return flat[:numel].view(shape)

    def clear(self) -> None:
        """Free every buffer."""
        self._buffers.clear()

    @property
    def nbytes(self) -> int:
        """Bytes currently held."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


_DEFAULT_GATHER_BUFFER = GatherBuffer()


def default_gather_buffer() -> GatherBuffer:
    """The process-wide buffer shared by every sequence-parallel column-parallel linear."""
    return _DEFAULT_GATHER_BUFFER
