"""GatherBuffer: one growable storage per dtype and device, so its memory is the largest gather."""
from __future__ import annotations

import torch

from megatron_sp.mpu import GatherBuffer


def test_growing_context_holds_one_buffer_of_the_longest() -> None:
    """Generation under SP (t = 2) gathers [s, 1, h] for s = 2, 4, …, 256: the buffer holds one [256, 1, h]
    (keyed by shape, it kept all 128: 17 MB at h 256 instead of 0.26 MB)."""
    buffer, h = GatherBuffer(), 256
    for s in range(2, 257, 2):
        x = buffer.get((s, 1, h), torch.float32, "cpu")
        assert x.shape == (s, 1, h) and x.is_contiguous()
        x.fill_(float(s))  # usable as a whole
    assert buffer.nbytes == 256 * h * 4
    assert len(buffer._buffers) == 1


def test_shapes_share_the_storage_dtypes_do_not() -> None:
    buffer = GatherBuffer()
    a = buffer.get((8, 2, 4), torch.float32, "cpu")
    b = buffer.get((4, 2, 4), torch.float32, "cpu")  # smaller: a view of the same storage
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    c = buffer.get((8, 2, 4), torch.float64, "cpu")
    assert c.untyped_storage().data_ptr() != a.untyped_storage().data_ptr()
    assert buffer.nbytes == 64 * 4 + 64 * 8
    buffer.clear()
    assert buffer.nbytes == 0
    fresh = GatherBuffer(reuse=False)  # a plain allocator: holds nothing
    kept = [fresh.get((2, 2), torch.float32, "cpu") for _ in range(2)]
    assert kept[0].data_ptr() != kept[1].data_ptr() and fresh.nbytes == 0
