"""GPT dataset indices, their cache, the global-batch partition over DP, collate, and the data API."""
from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_sp import data
from megatron_sp.config.schema import Config
from megatron_sp.data import batch_indices, build_datasets, collate, ensure_demo_data
from megatron_sp.data.gpt_dataset import GPTDataset, split_documents
from megatron_sp.data.indexed import (
    IndexedDataset,
    IndexedDatasetWriter,
    data_file_paths,
)
from megatron_sp.data.tokenizer import ByteTokenizer
from megatron_sp.errors import ConfigError, DataError

EOD = 0


def _make_docs(n: int = 12, seed: int = 0) -> list[np.ndarray]:
    """Document d is ids d*1000+1, d*1000+2, … then EOD: every token tells where it came from."""
    rng = np.random.default_rng(seed)
    docs = []
    for d in range(n):
        length = int(rng.integers(1, 30))
        docs.append(np.concatenate([d * 1000 + 1 + np.arange(length), [EOD]]))
    return docs


@pytest.fixture
def indexed(tmp_path: Path) -> tuple[IndexedDataset, list[np.ndarray]]:
    docs = _make_docs()
    with IndexedDatasetWriter(tmp_path / "toy_text_document", np.int32) as writer:
        writer.add_documents(docs)
    return IndexedDataset(tmp_path / "toy_text_document"), docs


def test_samples_are_windows_of_the_shuffled_stream(indexed: tuple[IndexedDataset, list[np.ndarray]]) -> None:
    ds_idx, docs = indexed
    documents = np.arange(2, 10)
    seq_length, num_samples = 16, 40
    ds = GPTDataset(ds_idx, documents, seq_length, num_samples, seed=7, cache_dir=None, name="train")
    assert len(ds) == num_samples

    epochs = ds.doc_idx.reshape(-1, len(documents))
    for epoch in epochs:  # every epoch is a permutation of the split's documents
        assert sorted(epoch.tolist()) == documents.tolist()
    assert any(epoch.tolist() != documents.tolist() for epoch in epochs)  # and shuffled
    stream = np.concatenate([docs[d] for d in ds.doc_idx])
    assert len(stream) >= num_samples * seq_length + 1

    n_built = len(ds.shuffle_idx)
    assert n_built == (len(stream) - 1) // seq_length >= num_samples
    assert sorted(ds.shuffle_idx.tolist()) == list(range(n_built))
    assert ds.shuffle_idx.tolist() != list(range(n_built))
    for i in range(num_samples):
        j = int(ds.shuffle_idx[i])
        sample = ds[i]
        assert sample.dtype == np.int64 and sample.shape == (seq_length + 1,)
        np.testing.assert_array_equal(sample, stream[j * seq_length: j * seq_length + seq_length + 1])
    # consecutive samples (before shuffling) overlap by exactly one token
    where = {int(j): i for i, j in enumerate(ds.shuffle_idx[:num_samples])}
    pairs = [(where[j], where[j + 1]) for j in where if j + 1 in where]
    assert pairs
    for a, b in pairs:
        assert ds[a][-1] == ds[b][0]
    with pytest.raises(IndexError):
        ds[num_samples]


def test_seed_determinism(indexed: tuple[IndexedDataset, list[np.ndarray]]) -> None:
    ds_idx, _ = indexed
    documents = np.arange(12)
    a = GPTDataset(ds_idx, documents, 8, 30, seed=3, cache_dir=None, name="train")
    b = GPTDataset(ds_idx, documents, 8, 30, seed=3, cache_dir=None, name="train")
    c = GPTDataset(ds_idx, documents, 8, 30, seed=4, cache_dir=None, name="train")
    assert all(np.array_equal(a[i], b[i]) for i in range(30))
    assert not all(np.array_equal(a[i], c[i]) for i in range(30))


def test_cache_reused_and_invalidated(indexed: tuple[IndexedDataset, list[np.ndarray]], tmp_path: Path) -> None:
    ds_idx, docs = indexed
    cache = tmp_path / "cache"
    documents = np.arange(10)
    make = functools.partial(GPTDataset, ds_idx, cache_dir=cache, name="train")
    first = make(documents, 8, 20, 1)
    assert not first.loaded_from_cache
    paths = first.cache_paths()
    assert all(p.is_file() and first.hash in p.name for p in paths.values())
    mtimes = {k: p.stat().st_mtime_ns for k, p in paths.items()}

    again = make(documents, 8, 20, 1)
    assert again.loaded_from_cache and again.hash == first.hash
    assert {k: p.stat().st_mtime_ns for k, p in paths.items()} == mtimes  # not rewritten
    assert all(np.array_equal(first[i], again[i]) for i in range(20))

    variants = [make(documents, 9, 20, 1), make(documents, 8, 21, 1), make(documents, 8, 20, 2),
                make(np.arange(9), 8, 20, 1)]
    hashes = {first.hash} | {v.hash for v in variants}
    assert len(hashes) == 5
    assert not any(v.loaded_from_cache for v in variants)

    # Rewriting the dataset files (new size/mtime) invalidates the cache too.
    with IndexedDatasetWriter(ds_idx.prefix, np.int32) as writer:
        writer.add_documents([*docs, np.array([5, 6, 7, EOD])])
    rebuilt = GPTDataset(IndexedDataset(ds_idx.prefix), documents, 8, 20, 1, cache, "train")
    assert not rebuilt.loaded_from_cache and rebuilt.hash != first.hash
    assert not [p for p in cache.iterdir() if ".tmp" in p.name]


def test_empty_split_has_no_tokens(indexed: tuple[IndexedDataset, list[np.ndarray]]) -> None:
    ds_idx, _ = indexed
    with pytest.raises(DataError, match="no tokens"):
        GPTDataset(ds_idx, np.arange(0), 8, 4, 1, None, "valid")


def test_split_documents() -> None:
    train, valid, test = split_documents(1000, "98,2,0")
    assert (train[0], train[-1], len(train)) == (0, 979, 980)
    assert (valid[0], valid[-1], len(valid)) == (980, 999, 20)
    assert len(test) == 0
    parts = split_documents(10, "1,1,1")
    assert np.array_equal(np.concatenate(parts), np.arange(10)) and all(len(p) for p in parts)
    assert [len(p) for p in split_documents(7, "100")] == [7, 0, 0]
    assert [len(p) for p in split_documents(5, "0,1")] == [0, 5, 0]
    with pytest.raises(ConfigError):
        split_documents(10, "a,b")
    with pytest.raises(ConfigError):
        split_documents(10, "0,0,0")


@pytest.mark.parametrize("gbs", [8, 12])
def test_batch_indices_partition_the_global_batch(gbs: int) -> None:
    for step in range(3):
        expected = list(range(step * gbs, (step + 1) * gbs))
        for dp in (1, 2, 4):
            blocks = [batch_indices(step, gbs, rank, dp) for rank in range(dp)]
            assert all(len(b) == gbs // dp for b in blocks)
            assert [i for b in blocks for i in b] == expected  # same samples, same order, every layout
    with pytest.raises(ValueError):
        batch_indices(0, 6, 0, 4)
    with pytest.raises(ValueError):
        batch_indices(0, 8, 2, 2)


def test_collate_shifts_labels_and_masks_input_eod() -> None:
    samples = [np.array([5, 6, EOD, 7, 8]), np.array([1, 2, 3, 4, EOD])]
    batch = collate(samples, eod=EOD, eod_mask_loss=True)
    assert batch["tokens"].tolist() == [[5, 6, EOD, 7], [1, 2, 3, 4]]
    assert batch["labels"].tolist() == [[6, EOD, 7, 8], [2, 3, 4, EOD]]
    assert batch["loss_mask"].tolist() == [[1.0, 1.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]]  # Megatron: input EODs
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3], [0, 1, 2, 3]]
    assert batch["tokens"].dtype == batch["labels"].dtype == batch["position_ids"].dtype == torch.int64
    assert batch["loss_mask"].dtype == torch.float32
    assert all(t.shape == (2, 4) for t in batch.values())
    unmasked = collate(samples, eod=EOD, eod_mask_loss=False)
    assert bool((unmasked["loss_mask"] == 1.0).all())


def _config(prefix: Path, seq_length: int = 8) -> Config:
    cfg = Config()
    cfg.data.paths = [str(prefix)]
    cfg.data.split = "80,20,0"
    cfg.model.seq_length = seq_length
    cfg.train.seed = 11
    cfg.tokenizer.type = "byte"
    return cfg


def test_build_datasets(tmp_path: Path) -> None:
    docs = [np.concatenate([np.arange(1, 20) % 250 + 1, [256]]) for _ in range(10)]
    prefix = tmp_path / "bytes_text_document"
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        writer.add_documents(docs)
    cfg = _config(prefix)
    train, valid = build_datasets(cfg, ByteTokenizer(), num_train_samples=30, num_valid_samples=5)
    assert len(train) == 30 and valid is not None and len(valid) == 5
    assert set(train.doc_idx.tolist()) == set(range(8)) and set(valid.doc_idx.tolist()) == {8, 9}
    assert train[0].shape == (9,)
    assert train.cache_dir == tmp_path and any(tmp_path.glob("bytes_text_document_train_*_doc_idx.npy"))

    _, no_valid = build_datasets(cfg, ByteTokenizer(), 30, 0)
    assert no_valid is None
    cfg.data.cache_dir = str(tmp_path / "elsewhere")
    train2, _ = build_datasets(cfg, ByteTokenizer(), 30, 0)
    assert train2.cache_dir == tmp_path / "elsewhere" and not train2.loaded_from_cache

    cfg.data.paths = [str(prefix), str(prefix)]  # several prefixes without weights: blended by their tokens
    blend, _ = build_datasets(cfg, ByteTokenizer(), 30, 0)
    assert isinstance(blend, data.BlendedDataset) and len(blend) >= 30 and blend.weights == [0.5, 0.5]


def test_build_datasets_detects_tokenizer_mismatch(tmp_path: Path) -> None:
    prefix = tmp_path / "big_text_document"
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        writer.add_documents([np.array([1, 2, 3000, 4])] * 4)
    with pytest.raises(DataError, match="another tokenizer"):
        build_datasets(_config(prefix), ByteTokenizer(), 4, 0)


def test_ensure_demo_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(data, "make_demo_corpus", functools.partial(data.make_demo_corpus, max_bytes=60_000))
    cfg = Config()
    cfg.data.build_demo = True
    cfg.data.demo_dir = str(tmp_path / "demo")
    cfg.data.paths = [str(tmp_path / "demo" / "demo_text_document")]
    cfg.tokenizer.model = str(tmp_path / "demo" / "tokenizer.model")
    cfg.tokenizer.vocab_size = 512
    ensure_demo_data(cfg)
    bin_path, idx_path = data_file_paths(cfg.data.paths[0])
    for path in (tmp_path / "demo" / "corpus.jsonl", Path(cfg.tokenizer.model), bin_path, idx_path):
        assert path.is_file()
    tokenizer = data.build_tokenizer(cfg.tokenizer)
    ds = IndexedDataset(cfg.data.paths[0])
    assert ds.num_documents > 0 and int(ds[0][-1]) == tokenizer.eod
    def identity(p: Path) -> tuple[int, int]:
        return p.stat().st_ino, p.stat().st_mtime_ns

    before = {p: identity(p) for p in (Path(cfg.tokenizer.model), bin_path, idx_path)}
    ensure_demo_data(cfg)  # everything present: nothing rebuilt
    assert {p: identity(p) for p in before} == before

    Path(cfg.tokenizer.model).unlink()  # a new tokenizer means new ids: the dataset is rebuilt too
    ensure_demo_data(cfg)
    assert Path(cfg.tokenizer.model).is_file() and identity(idx_path) != before[idx_path]

    cfg.data.build_demo = False
    bin_path.unlink()
    ensure_demo_data(cfg)  # off: does nothing
    assert not bin_path.exists()
