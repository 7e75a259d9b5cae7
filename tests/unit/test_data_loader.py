"""The read-ahead batch loader: worker processes never change which batch a step sees, resuming at
consumed_samples gives the same next batch (mid-epoch), and every DP layout reads the same global batch."""
from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from megatron_sp.data import batching
from megatron_sp.config.schema import Config
from megatron_sp.data import collate
from megatron_sp.data.gpt_dataset import GPTDataset
from megatron_sp.data.indexed import IndexedDataset, IndexedDatasetWriter
from megatron_sp.data.loader import BatchLoader, rank_collate

EOD = 0
GBS = 8


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> GPTDataset:
    """A GPT dataset of several epochs (40 samples of 9 tokens over ~110 tokens per epoch)."""
    rng = np.random.default_rng(0)
    docs = [np.concatenate([d * 100 + 1 + np.arange(int(rng.integers(3, 20))), [EOD]]) for d in range(10)]
    prefix = tmp_path_factory.mktemp("loader") / "toy"
    with IndexedDatasetWriter(prefix, np.int32) as writer:
        writer.add_documents(docs)
    ds = GPTDataset(IndexedDataset(prefix), np.arange(10), 8, 40, seed=3, cache_dir=None, name="train")
    assert ds.num_epochs() >= 3
    return ds


COLLATE = rank_collate(EOD, eod_mask_loss=True, reset_position_ids=True, reset_attention_mask=True)


def _expected(ds: GPTDataset, step: int, dp_rank: int = 0, dp_size: int = 1) -> dict[str, torch.Tensor]:
    per_rank = GBS // dp_size
    start = step * GBS + dp_rank * per_rank
    return collate([ds[i] for i in range(start, start + per_rank)], EOD, True, True, True)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_workers_do_not_change_the_batches(dataset: GPTDataset) -> None:
    """Nor do they, or the loader, draw from the default generator (dropout's stream; a resume rebuilds the loader)."""
    steps = len(dataset) // GBS
    for workers in (0, 2):
        rng = torch.get_rng_state()
        loader = BatchLoader(dataset, 0, GBS, 0, 1, COLLATE, num_workers=workers, prefetch_factor=2)
        batches = list(loader)
        assert torch.equal(torch.get_rng_state(), rng)
        assert len(batches) == steps and loader.next_sample == steps * GBS
        assert all(_same(batch, _expected(dataset, step)) for step, batch in enumerate(batches))
        loader.close()


def test_resume_mid_epoch_gives_the_same_next_batch(dataset: GPTDataset) -> None:
    samples_per_epoch = dataset.tokens_per_epoch // dataset.seq_length
    consumed = 2 * GBS  # 16 samples: inside the second epoch of ~12 samples
    assert consumed % samples_per_epoch
    loader = BatchLoader(dataset, consumed, GBS, 0, 1, COLLATE, num_workers=1, prefetch_factor=1)
    resumed = next(loader)
    assert loader.next_sample == consumed + GBS
    assert _same(resumed, _expected(dataset, 2))
    loader.close()


def test_another_global_batch_size_continues_from_consumed_samples(dataset: GPTDataset) -> None:
    """A resume at consumed_samples 12 with global batch 8 (written at 4 or 6): samples 12..19, 20..27, 28..35, then the
    dataset ends (40 samples: no partial batch)."""
    for dp in (1, 2):
        parts = [list(BatchLoader(dataset, 12, GBS, rank, dp, COLLATE, num_workers=0)) for rank in range(dp)]
        assert [len(p) for p in parts] == [3] * dp
        for k in range(3):
            joined = {key: torch.cat([p[k][key] for p in parts]) for key in parts[0][k]}
            want = collate([dataset[i] for i in range(12 + k * GBS, 20 + k * GBS)], EOD, True, True, True)
            assert _same(joined, want)
    with pytest.raises(ValueError, match="non-negative"):
        BatchLoader(dataset, -1, GBS, 0, 1, COLLATE)


def test_every_dp_layout_reads_the_same_global_batch(dataset: GPTDataset) -> None:
    for dp in (1, 2, 4):
        parts = [next(BatchLoader(dataset, GBS, GBS, rank, dp, COLLATE, num_workers=0)) for rank in range(dp)]
        joined = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
        assert _same(joined, _expected(dataset, 1))


def _runtime(dataset: GPTDataset, workers: int, dp_rank: int = 0, dp_size: int = 1) -> types.SimpleNamespace:
    """The parts of training.Runtime that batching.next_train_batch / rank_batch use (no process group)."""
    cfg = Config()
    cfg.train.global_batch_size = GBS
    cfg.data.num_workers = workers
    cfg.data.eod_mask_loss = cfg.data.reset_position_ids = cfg.data.reset_attention_mask = True
    state = types.SimpleNamespace(dp_rank=dp_rank, dp_size=dp_size, cp_size=1)
    return types.SimpleNamespace(cfg=cfg, state=state, device=torch.device("cpu"), train_ds=dataset,
                                 tokenizer=types.SimpleNamespace(eod=EOD), consumed_samples=0, train_loader=None)


def test_training_draws_rank_batch_through_the_loader(dataset: GPTDataset) -> None:
    rt = _runtime(dataset, workers=1, dp_rank=1, dp_size=2)
    for _ in range(3):  # what train_step does: one batch, then consumed_samples += gbs
        batch = batching.next_train_batch(rt)
        assert _same(batch, batching.rank_batch(rt, dataset, rt.consumed_samples))
        rt.consumed_samples += GBS
    first = rt.train_loader
    rt.consumed_samples = 1 * GBS  # a checkpoint of another step is loaded: the loader is rebuilt there
    batch = batching.next_train_batch(rt)
    assert rt.train_loader is not first and _same(batch, _expected(dataset, 1, 1, 2))
    rt.train_loader.close()
