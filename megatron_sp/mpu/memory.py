"""Reusable buffers for all-gathered activations.

Under sequence parallelism every column-parallel linear all-gathers its ``[s/t, b, h]`` input to
``[s, b, h]``, multiplies, and is done with the gathered tensor. Allocating that ``t×`` larger
tensor afresh for every layer (and again in backward, when the gather is recomputed) churns the
allocator; a ``GatherBuffer`` hands out the same storage each time instead.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch


class GatherBuffer:
    """One reusable storage per ``(dtype, device)`` to all-gather activations into.

    ``get(shape, …)`` returns a contiguous view of the first ``prod(shape)`` elements of that
    storage, which grows (is replaced by a larger one) when a bigger shape is asked for. Memory is
    therefore the largest gather, whatever the mix of shapes: generation under SP, whose context
    grows by one token per step, holds one buffer of the longest context (keying by shape kept one
    per length: O(L²·h/t) after L tokens).

    **Single-use invariant.** A tensor returned by ``get`` is valid only until the next ``get`` of
    the same dtype and device, which may overwrite it. Whoever gathers into it must consume it
    immediately (the matmul right after the gather) and must never keep it: never return it, never
    save it for backward (``ctx.save_for_backward``), never let autograd save it. This is exactly
    why the sequence-parallel column-parallel linear saves only its *local shard* for backward and
    gathers again, into the buffer, in backward (nanotron #203): saving the gathered input would
    both cost ``t×`` the memory and be overwritten by the next layer's gather. (Autograd's version
    counter does catch a saved buffer, because the collective writes into it in place: backward
    then raises "modified by an inplace operation"; nothing catches other kept references.)
    Gathers never overlap: each is consumed before the next starts (single thread, one autograd
    engine on CPU; one stream on GPU).

    ``reuse=False`` turns the buffer into a plain allocator (``get`` always returns a new tensor):
    use it to rule the buffer out when debugging.
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
