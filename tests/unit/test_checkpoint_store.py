"""The layout-free tensor store: flat ranges as contiguous boxes, any box read back from any writers."""
import math
import random

import pytest
import torch

from megatron_sp.checkpointing import store
from megatron_sp.errors import DataError


def test_flat_boxes_are_contiguous_and_cover_the_range_exactly():
    rng = random.Random(0)
    for _ in range(500):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 4)))
        n = math.prod(shape)
        a = rng.randint(0, n)
        b = rng.randint(a, n)
        t = torch.arange(n).view(shape)
        seen = []
        boxes = store.flat_boxes(a, b, shape)
        assert len(boxes) <= 2 * len(shape) - 1
        for flat, offsets, lengths in boxes:
            part = t[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))].reshape(-1)
            assert part.tolist() == list(range(flat, flat + math.prod(lengths))), (shape, a, b)
            seen += part.tolist()
        assert seen == list(range(a, b))


def test_shards_of_any_split_read_back_as_any_box(tmp_path):
    """A [10, 6] tensor written as two TP column shards, each split into flat chunks by two 'dp ranks',
    with the padded rows 10..11 of a vocabulary-like layout clipped, reads back whole and by any box."""
    full = torch.randn(10, 6, dtype=torch.float64)
    padded = torch.cat([full, torch.zeros(2, 6, dtype=torch.float64)])  # [12, 6]: padding rows
    entries, files = [], []
    for tp_rank in range(2):
        local = padded[:, 3 * tp_rank:3 * tp_rank + 3].contiguous()  # [12, 3]
        flat = local.reshape(-1)
        for dp_rank, (lo, hi) in enumerate(((0, 17), (17, 36))):
            boxes = store.boxes_of_flat("w", flat[lo:hi], lo, local.shape, (0, 3 * tp_rank), (10, 6))
            file = store.rank_file(2 * tp_rank + dp_rank)
            store.write_file(tmp_path / file, boxes, {"rng/x": torch.tensor([dp_rank])})
            entries += store.entries_of(boxes, file)
            files.append(file)
    index = store.build_index(entries, {"w": ((10, 6), "float64")}, files)
    store.finish_index(index, tmp_path)
    reader = store.Reader(tmp_path)
    assert torch.equal(reader.read("w"), full)
    for _ in range(50):
        o = [random.randint(0, 9), random.randint(0, 5)]
        n = [random.randint(1, 10 - o[0]), random.randint(1, 6 - o[1])]
        assert torch.equal(reader.read("w", o, n), full[o[0]:o[0] + n[0], o[1]:o[1] + n[1]])
    assert reader.read_extra(store.rank_file(1), "rng/") == {"x": torch.tensor([1])}
    with pytest.raises(DataError, match="holds no tensor 'v'"):
        reader.read("v")


def test_writers_that_miss_elements_are_caught_when_indexing():
    box = store.Box("w", (0, 0), torch.zeros(2, 3))
    with pytest.raises(RuntimeError, match="stored 6 of 12 elements of 'w'"):
        store.build_index(store.entries_of([box], "f"), {"w": ((4, 3), "float32")})


def test_shard_files_get_the_umask_mode_not_safetensors_0600(tmp_path):
    import os

    umask = os.umask(0o027)  # a group-readable umask: 0640 expected
    try:
        flat = torch.arange(12.0)
        store.write_file(tmp_path / "rank_00000.safetensors", store.boxes_of_flat("w", flat, 0, (4, 3), (0, 0), (4, 3)))
    finally:
        os.umask(umask)
    assert (tmp_path / "rank_00000.safetensors").stat().st_mode & 0o777 == 0o640
