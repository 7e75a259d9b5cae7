"""Byte compatibility with megatron-core, both ways, and its blending algorithm (``pip install -e '.[compat]'``).

Skipped when megatron-core is not installed. Only ``megatron.core.datasets`` is used (its
``IndexedDataset``, ``IndexedDatasetBuilder``, ``DType``, the blending sizes and the compiled
``helpers_cpp`` when it loads); importing it costs a few seconds (megatron.core imports its model code).
"""
from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_sp.data import collate
from megatron_sp.data.blending import SURPLUS, build_blending_indices, normalize, samples_per_dataset
from megatron_sp.data.gpt_dataset import GPTDataset
from megatron_sp.data.indexed import IndexedDataset, IndexedDatasetWriter, best_dtype, data_file_paths
from megatron_sp.data.preprocess import preprocess_jsonl
from megatron_sp.data.tokenizer import ByteTokenizer

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # megatron.core warns that Transformer Engine and Apex are absent
    try:
        mc = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    except pytest.skip.Exception:
        raise
    except Exception as e:  # installed but not importable here: not our failure
        pytest.skip(f"megatron-core does not import: {e}", allow_module_level=True)

EOD = 256


def _documents(dtype: np.dtype, seed: int = 0) -> list[tuple[np.ndarray, list[int]]]:
    """Documents as (tokens, sequence lengths): one or several sequences each; an empty one."""
    rng = np.random.default_rng(seed)
    high = 65_000 if dtype == np.uint16 else 2**31 - 1
    docs = []
    for _ in range(12):
        lengths = [int(n) for n in rng.integers(1, 30, size=int(rng.integers(1, 4)))]
        docs.append((rng.integers(0, high, size=sum(lengths)), lengths))
    docs.append((np.zeros(0, dtype=np.int64), []))
    return docs


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_both_writers_write_the_same_bytes_and_read_each_other(tmp_path: Path, dtype: type) -> None:
    docs = _documents(np.dtype(dtype))
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    with IndexedDatasetWriter(ours, dtype) as writer:
        for tokens, lengths in docs:
            writer.add_document(tokens, lengths)
    builder = mc.IndexedDatasetBuilder(str(theirs) + ".bin", dtype=dtype)
    for tokens, lengths in docs[:6]:
        for start, length in zip(np.cumsum([0, *lengths[:-1]]), lengths, strict=True):
            builder.add_item(torch.from_numpy(tokens[start:start + length].astype(np.int64)))
        builder.end_document()
    for tokens, lengths in docs[6:]:
        builder.add_document(tokens, lengths)  # typed torch.Tensor; numpy.array() of a numpy array is the same
    builder.finalize(str(theirs) + ".idx")
    for a, b in zip(data_file_paths(ours), data_file_paths(theirs), strict=True):
        assert a.read_bytes() == b.read_bytes(), a.suffix

    theirs_read = mc.IndexedDataset(str(ours))  # megatron-core reads what we wrote
    ours_read = IndexedDataset(theirs)  # we read what megatron-core wrote
    assert len(theirs_read) == len(ours_read) == sum(len(lengths) for _, lengths in docs)
    np.testing.assert_array_equal(theirs_read.sequence_lengths, ours_read.sizes)
    np.testing.assert_array_equal(theirs_read.document_indices, ours_read.document_indices)
    for i in range(len(ours_read)):
        np.testing.assert_array_equal(theirs_read[i], ours_read[i])
        assert theirs_read[i].dtype == ours_read[i].dtype == np.dtype(dtype)
    np.testing.assert_array_equal(theirs_read.get(3, offset=1, length=2), ours_read.get(3, 1, 2))


def test_we_train_on_megatron_core_files(tmp_path: Path) -> None:
    """A dataset written by megatron-core's builder feeds our GPT dataset and batches."""
    docs = [np.concatenate([d * 10 + np.arange(1, 6 + d), [EOD]]) for d in range(8)]
    builder = mc.IndexedDatasetBuilder(str(tmp_path / "mc") + ".bin", dtype=mc.DType.optimal_dtype(258))
    for doc in docs:
        builder.add_document(doc, [len(doc)])
    builder.finalize(str(tmp_path / "mc") + ".idx")
    ds = GPTDataset(IndexedDataset(tmp_path / "mc"), np.arange(8), 8, 12, seed=1, cache_dir=None, name="train")
    stream = np.concatenate([docs[d] for d in ds.doc_idx])
    j = int(ds.shuffle_idx[0])
    np.testing.assert_array_equal(ds[0], stream[j * 8:j * 8 + 9])
    batch = collate([ds[i] for i in range(4)], EOD, eod_mask_loss=True, reset_position_ids=True,
                    reset_attention_mask=True)
    assert batch["tokens"].shape == (4, 8) and batch["document_ids"].shape == (4, 8)


@pytest.mark.parametrize("seed", range(4))
def test_masks_and_positions_equal_megatron_core(seed: int) -> None:
    """loss_mask, position_ids and the document mask of ``collate`` equal megatron-core's
    ``_get_ltor_masks_and_position_ids`` on random token rows with EODs anywhere (first, last, runs)."""
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    rng = np.random.default_rng(seed)
    s = 24
    samples = [rng.integers(EOD - 3, EOD + 1, size=s + 1) for _ in range(6)]  # EOD one id in four
    samples[0][0] = samples[1][s - 1] = EOD  # at the first and at the last input position
    samples[2][:] = EOD  # nothing but EODs
    samples[3][:] = EOD - 1  # none
    for flags in [(False, False, True), (True, True, True), (True, False, False), (False, True, False)]:
        reset_pos, reset_attn, eod_mask = flags
        ours = collate(samples, EOD, eod_mask_loss=eod_mask, reset_position_ids=reset_pos,
                       reset_attention_mask=reset_attn)
        for row, sample in enumerate(samples):
            tokens = torch.from_numpy(sample[:-1].astype(np.int64))
            masked, loss_mask, position_ids = _get_ltor_masks_and_position_ids(
                tokens, EOD, reset_pos, reset_attn, eod_mask, create_attention_mask=True)
            assert torch.equal(ours["loss_mask"][row], loss_mask), (flags, row)
            assert torch.equal(ours["position_ids"][row], position_ids), (flags, row)
            if reset_attn:
                doc = ours["document_ids"][row]
                visible = (doc[:, None] == doc[None, :]) & torch.ones(s, s, dtype=torch.bool).tril()
                assert torch.equal(visible, ~masked[0]), (flags, row)


def test_megatron_core_reads_our_preprocessed_sentences(tmp_path: Path) -> None:
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "One. Two! Three"}\n{"text": "Four."}\n', encoding="utf-8")
    preprocess_jsonl([corpus], tmp_path / "p", ByteTokenizer(), split_sentences=True)
    theirs = mc.IndexedDataset(str(tmp_path / "p_text_sentence"))
    assert theirs.document_indices.tolist() == [0, 3, 4]
    assert bytes(theirs[2][:-1].tolist()) == b"Three" and int(theirs[2][-1]) == EOD


def test_dtype_choice_matches() -> None:
    for vocab in (258, 50_304, 65_499, 65_500, 128_256):
        assert best_dtype(vocab) == np.dtype(mc.DType.optimal_dtype(vocab))


def test_blending_matches_megatron_core() -> None:
    from megatron.core.datasets.blended_megatron_dataset_builder import _get_size_per_split_per_dataset

    for weights, sizes in (([0.3, 0.7], [1000, 17, 0]), ([1, 2, 3, 4], [12_345, 10, 1])):
        norm = normalize(weights)
        expected = _get_size_per_split_per_dataset(norm, sizes)
        expected_surplus = _get_size_per_split_per_dataset(norm, sizes, surplus=SURPLUS)
        for split, size in enumerate(sizes):
            assert samples_per_dataset(weights, size) == [row[split] for row in expected]
            assert samples_per_dataset(weights, size, SURPLUS) == [row[split] for row in expected_surplus]
    try:
        from megatron.core.datasets import helpers_cpp
    except ImportError:
        pytest.skip("megatron-core's compiled helpers are not built here")
    rng = np.random.default_rng(0)
    for n_datasets in (2, 3, 5, 9):
        weights = normalize(rng.random(n_datasets) + 0.01)
        size = 20_000
        index, sample = np.zeros(size, np.int16), np.zeros(size, np.int64)
        helpers_cpp.build_blending_indices(index, sample, np.asarray(weights), n_datasets, size, False)
        ours_index, ours_sample = build_blending_indices(weights, size)
        np.testing.assert_array_equal(ours_index, index)
        np.testing.assert_array_equal(ours_sample, sample)
