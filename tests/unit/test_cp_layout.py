"""Sequence layouts for context parallelism: shard/unshard round trips, zigzag indices, batch alignment, work balance."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_sp.data import collate
from megatron_sp.mpu.cp_layout import (
    LAYOUTS,
    document_shard_indices,
    required_divisor,
    sequence_layout,
    shard,
    shard_batch,
    shard_indices,
    unshard,
)

LAYOUT_NAMES = ("contiguous", "zigzag")


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("dim", [0, 1, 2, -1])
def test_shard_then_unshard_is_identity(layout: str, cp: int, dim: int) -> None:
    shape = [16, 16, 16]
    shape[dim] = 24  # divisible by 2·cp for every cp here, and distinct from the other dims
    t = torch.randn(shape)
    parts = [shard(t, cp, r, layout, dim=dim) for r in range(cp)]
    assert all(p.is_contiguous() and p.shape[dim] == 24 // cp for p in parts)
    assert torch.equal(unshard(parts, layout, dim=dim), t)


def test_zigzag_indices_exact() -> None:
    expected = [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    assert [shard_indices(16, 4, r, "zigzag").tolist() for r in range(4)] == expected
    assert [shard_indices(16, 4, r, "contiguous").tolist() for r in range(4)] == [
        [0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert shard_indices(16, 4, 0, "zigzag").dtype == torch.int64


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_union_of_shards_is_a_permutation(layout: str, cp: int) -> None:
    s = 48
    held = torch.cat([shard_indices(s, cp, r, layout) for r in range(cp)])
    assert held.numel() == s
    assert torch.equal(held.sort().values, torch.arange(s))


def test_cp1_is_identity_without_divisor() -> None:
    for layout in LAYOUT_NAMES:
        assert shard_indices(7, 1, 0, layout).tolist() == list(range(7))
    assert required_divisor("zigzag", 1) == 1


def _full_batch(b: int, s: int) -> dict[str, torch.Tensor]:
    """A batch as collate builds it, from samples of s + 1 distinct tokens (token value = 100·row + global index)."""
    samples = torch.arange(s + 1).unsqueeze(0) + 100 * torch.arange(b).unsqueeze(1)  # [b, s+1]
    tokens, labels = samples[:, :-1].contiguous(), samples[:, 1:].contiguous()
    position_ids = torch.arange(s).remainder(5).unsqueeze(0).repeat(b, 1)  # restarts, as with packed documents
    document_ids = torch.arange(s).div(5, rounding_mode="floor").unsqueeze(0).repeat(b, 1)
    loss_mask = (torch.arange(s) % 3 != 0).float().unsqueeze(0).repeat(b, 1)
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids,
            "document_ids": document_ids}


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_shard_batch_keeps_rows_aligned(layout: str, cp: int) -> None:
    b, s = 3, 16
    full = _full_batch(b, s)
    seen_targets: set[int] = set()
    for rank in range(cp):
        part = shard_batch(full, cp, rank, layout)
        assert set(part) == set(full) | {"token_index"}
        assert all(t.shape == (b, s // cp) and t.is_contiguous() for t in part.values())
        index = part["token_index"]
        assert index.dtype == torch.int64
        per_document = layout == "zigzag" and cp > 1  # documents of 5 tokens: each zigzagged on its own
        expected = (document_shard_indices(full["document_ids"], cp)[rank] if per_document
                    else shard_indices(s, cp, rank, layout).expand(b, -1))
        assert torch.equal(index, expected)
        for name, t in full.items():  # every tensor went through the same permutation
            assert torch.equal(part[name], torch.gather(t, 1, index)), name
        # the label of the token at global index i is token i + 1 of the full sample, also at chunk edges
        row = 100 * torch.arange(b).unsqueeze(1)
        assert torch.equal(part["tokens"], row + index)
        assert torch.equal(part["labels"], row + index + 1)
        seen_targets.update(part["labels"].flatten().tolist())
    # no target is lost: the shards together predict every one of tokens 1 … s of every sample
    assert seen_targets == {100 * r + i for r in range(b) for i in range(1, s + 1)}


def _documents(lengths: list[int]) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))


def test_document_layout_exact_and_one_document_is_zigzag() -> None:
    docs = _documents([5, 3, 8]).unsqueeze(0)
    # every document on its own (cp 2: 4 chunks): chunk sizes [2,1,1,1], then [0,1,1,1] (the one-token
    # remainders take chunks in turn: A's went to chunk 0, so B's go to 1, 2, 3), then [2,2,2,2]
    held = [part[0].tolist() for part in document_shard_indices(docs, 2, min_chunk=1)]
    assert held == [[0, 1, 8, 9, 4, 7, 14, 15], [2, 5, 10, 11, 3, 6, 12, 13]]
    # documents of >= 2·cp·min_chunk = 8 tokens on their own (C), the shorter ones (A, B) as one stream
    held = [part[0].tolist() for part in document_shard_indices(docs, 2, min_chunk=2)]
    assert held == [[0, 1, 8, 9, 6, 7, 14, 15], [2, 3, 10, 11, 4, 5, 12, 13]]
    # no document long enough: the plain zigzag layout
    plain = [shard_indices(16, 2, r, "zigzag").tolist() for r in range(2)]
    assert [part[0].tolist() for part in document_shard_indices(docs, 2)] == plain
    for cp in (1, 2, 4):
        for min_chunk in (1, 128):
            one = document_shard_indices(torch.zeros(2, 16, dtype=torch.int64), cp, min_chunk)
            assert all(torch.equal(one[r, i], shard_indices(16, cp, r, "zigzag")) for r in range(cp) for i in range(2))


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_document_layout_is_an_equal_split_of_every_document(cp: int) -> None:
    gen = torch.Generator().manual_seed(cp)
    s = 2 * cp * 40
    rows = []
    for _ in range(3):  # documents of 1 … s/3 tokens, the last cut to fit
        lengths: list[int] = []
        while sum(lengths) < s:
            lengths.append(int(torch.randint(1, s // 3, (1,), generator=gen)))
        lengths[-1] -= sum(lengths) - s
        rows.append(_documents(lengths))
    docs = torch.stack(rows)
    index = document_shard_indices(docs, cp, min_chunk=1)
    assert index.shape == (cp, 3, s // cp) and index.dtype == torch.int64
    for i in range(3):
        assert torch.equal(index[:, i].flatten().sort().values, torch.arange(s))  # a permutation of the row
        counts = torch.stack([torch.bincount(docs[i, index[r, i]], minlength=int(docs[i].max()) + 1) for r in range(cp)])
        assert int((counts.max(0).values - counts.min(0).values).max()) <= 2  # each rank ~d/cp of every document


def _causal_work(docs: torch.Tensor, index: torch.Tensor) -> list[float]:
    """Visible (query, key) pairs of each rank's queries: a query at offset o of its document sees o + 1 keys."""
    s = docs.shape[-1]
    starts = torch.ones(s, dtype=torch.bool)
    starts[1:] = docs[1:] != docs[:-1]
    first = starts.nonzero().flatten()
    cost = torch.arange(s) - first[torch.cumsum(starts.long(), 0) - 1] + 1
    return [float(cost[i].sum()) for i in index]


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_document_layout_balances_packed_work(cp: int) -> None:
    """Packed documents (exponential lengths, mean 2048, s 32768): zigzag by index leaves max/min work over the
    ranks well above 1; zigzagging every document keeps it within 2 %, every long one (the default) within 30 %."""
    gen = np.random.default_rng(cp)
    s = 32768
    lengths = np.maximum(1, gen.exponential(2048, 100).astype(int))
    lengths = lengths[np.cumsum(lengths) < s].tolist()
    docs = _documents(lengths + [s - sum(lengths)])
    balance = {}
    for name, min_chunk in (("every", 1), ("long", 128)):
        work = _causal_work(docs, document_shard_indices(docs.unsqueeze(0), cp, min_chunk)[:, 0])
        balance[name] = max(work) / min(work)
    by_index = _causal_work(docs, [shard_indices(s, cp, r, "zigzag") for r in range(cp)])
    balance["by_index"] = max(by_index) / min(by_index)
    assert balance["every"] <= 1.02 and balance["long"] <= 1.3 and balance["by_index"] >= 1.2, balance


def test_shifting_after_sharding_would_lose_targets() -> None:
    """Why collate shifts first: a shard shifted on its own has no target for its last token."""
    s, cp = 16, 4
    sample = torch.arange(s + 1).unsqueeze(0)
    full = {"tokens": sample[:, :-1], "labels": sample[:, 1:]}
    targets_right = {int(x) for r in range(cp) for x in shard_batch(full, cp, r, "zigzag")["labels"].flatten()}
    assert targets_right == set(range(1, s + 1))
    wrong = set()
    for r in range(cp):
        held = shard(sample[:, :-1], cp, r, "zigzag")
        wrong.update(int(x) for x in held[:, 1:].flatten())  # "labels" from shifting the shard itself
    assert len(wrong) < s  # targets lost (and some tokens paired with another chunk's token)


def test_shard_batch_rejects_bad_shapes_and_double_sharding() -> None:
    full = _full_batch(2, 8)
    with pytest.raises(ValueError, match="position_ids"):
        shard_batch({**full, "position_ids": torch.zeros(2, 4, dtype=torch.int64)}, 2, 0, "contiguous")
    part = shard_batch(full, 2, 0, "contiguous")
    with pytest.raises(ValueError, match="token_index"):
        shard_batch(part, 2, 0, "contiguous")


def test_divisibility_errors() -> None:
    with pytest.raises(ValueError, match="not divisible by 4"):
        shard_indices(18, 4, 0, "contiguous")
    with pytest.raises(ValueError, match="not divisible by 8"):
        shard_indices(20, 4, 0, "zigzag")  # 20 % 4 == 0 but zigzag needs 2·cp
    with pytest.raises(ValueError, match="not divisible"):
        shard(torch.zeros(2, 10), 4, 1, "zigzag")
    with pytest.raises(ValueError, match="out of range"):
        shard_indices(16, 4, 4, "zigzag")
    with pytest.raises(ValueError, match="layout"):
        shard_indices(16, 4, 0, "striped")
    with pytest.raises(ValueError, match="differ in size"):
        unshard([torch.zeros(1, 4), torch.zeros(1, 2)], "contiguous")


def test_sequence_layout_and_required_divisor() -> None:
    assert {algo: sequence_layout(algo) for algo in LAYOUTS} == LAYOUTS
    with pytest.raises(ValueError, match="parallel.cp_algo"):
        sequence_layout("stripe")
    assert required_divisor("ring", 4) == 4
    assert required_divisor("llama3", 4) == 4
    assert required_divisor("ulysses", 4) == 4
    assert required_divisor("zigzag", 4) == 8
    assert required_divisor("usp", 4) == 8
    assert required_divisor("zigzag", 2, tp=2, sequence_parallel=True) == 8
    assert required_divisor("ring", 2, tp=2, sequence_parallel=True) == 4
    assert required_divisor("ring", 2, tp=2, sequence_parallel=False) == 2
    for algo in LAYOUTS:
        for cp in (1, 2, 4):
            d = required_divisor(algo, cp)
            [shard_indices(3 * d, cp, r, sequence_layout(algo)) for r in range(cp)]  # accepted


def _visible_pairs(index: torch.Tensor) -> int:
    """Causal (query, key) pairs of the held queries, keys over the whole sequence: query i sees keys 0 … i."""
    return int((index + 1).sum())


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_zigzag_balances_causal_work(cp: int) -> None:
    s = 64
    zigzag = [_visible_pairs(shard_indices(s, cp, r, "zigzag")) for r in range(cp)]
    contiguous = [_visible_pairs(shard_indices(s, cp, r, "contiguous")) for r in range(cp)]
    assert len(set(zigzag)) == 1
    assert all(a < b for a, b in zip(contiguous, contiguous[1:]))
    assert sum(zigzag) == sum(contiguous) == s * (s + 1) // 2


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_packed_collate_batch_shards_with_its_documents(layout: str) -> None:
    """A packed batch from collate: document ids, rotary positions and labels follow the tokens through sharding."""
    eod, cp = 0, 4
    sample = np.array([3, 4, eod, 5, 6, 7, eod, 8, 9, 10, 11, 12, eod, 13, 14, 15, 16])  # s + 1 tokens
    full = collate([sample], eod=eod, eod_mask_loss=True, reset_position_ids=True, reset_attention_mask=True)
    for rank in range(cp):
        part = shard_batch(full, cp, rank, layout)
        index = part["token_index"][0]
        assert part["tokens"][0].tolist() == sample[index.numpy()].tolist()
        assert part["labels"][0].tolist() == sample[index.numpy() + 1].tolist()
        assert torch.equal(part["document_ids"][0], full["document_ids"][0, index])
        assert torch.equal(part["position_ids"][0], full["position_ids"][0, index])
        assert torch.equal(part["loss_mask"][0], full["loss_mask"][0, index])
