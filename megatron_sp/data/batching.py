"""This rank's batch of a step: global batch → DP block (``batch_indices``) → CP part of every sample's
sequence (``mpu.cp_layout.shard_batch``, after the labels were shifted), on the device."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from megatron_sp.config.schema import Config
from megatron_sp.data.packed import IGNORE_INDEX


class Run(Protocol):
    """What batching reads of a run (``training.Runtime``); ``train_loader`` is its read-ahead loader."""

    cfg: Config
    state: Any  # mpu.ParallelState: dp_rank, dp_size, cp_rank, cp_size
    device: torch.device
    tokenizer: Any
    train_ds: Any
    train_loader: Any
    consumed_samples: int


def rank_batch(rt: Run, ds: Any, first_sample: int) -> dict[str, torch.Tensor]:
    """This rank's share of the global batch of ``ds`` starting at ``first_sample``."""
    cfg, st = rt.cfg, rt.state
    per_rank = cfg.train.global_batch_size // st.dp_size  # type: ignore[operator]
    start = first_sample + st.dp_rank * per_rank
    return place_batch(rt, _collate_fn(rt)([ds[i] for i in range(start, start + per_rank)]))


def next_train_batch(rt: Run) -> dict[str, torch.Tensor]:
    """``rank_batch(rt, rt.train_ds, rt.consumed_samples)``, from the read-ahead loader (rebuilt whenever it is
    not positioned at ``consumed_samples``: the first step, after a resume)."""
    from megatron_sp.data.loader import BatchLoader

    cfg, st = rt.cfg, rt.state
    loader = rt.train_loader
    if loader is None or loader.next_sample != rt.consumed_samples:
        if loader is not None:
            loader.close()
        loader = rt.train_loader = BatchLoader(
            rt.train_ds, rt.consumed_samples, cfg.train.global_batch_size, st.dp_rank, st.dp_size,  # type: ignore[arg-type]
            _collate_fn(rt), num_workers=cfg.data.num_workers, prefetch_factor=cfg.data.prefetch_factor,
            pin_memory=rt.device.type == "cuda")
    return place_batch(rt, next(loader))


def _collate_fn(rt: Run) -> Callable[[list[Any]], dict[str, torch.Tensor]]:
    """``data.collate`` with this run's EOD and packing flags bound."""
    from megatron_sp.data.loader import rank_collate

    d = rt.cfg.data
    return rank_collate(rt.tokenizer.eod, d.eod_mask_loss, d.reset_position_ids, d.reset_attention_mask)


def mtp_targets(batch: dict[str, torch.Tensor], depth: int) -> dict[str, torch.Tensor]:
    """Multi-token prediction's ``mtp_tokens`` and ``mtp_labels`` (``[b, s, depth]`` int64) of a whole-sequence batch:
    column k - 1 holds token i + k (module k's input at position i; 0 past the end) and label i + k (its target),
    ``IGNORE_INDEX`` (-100, no loss) where that label has no loss, lies past the end, or in another document than position i."""
    tokens, labels = batch["tokens"], batch["labels"]
    s, docs = tokens.shape[1], batch.get("document_ids")
    inputs, targets = torch.zeros(*tokens.shape, depth, dtype=torch.int64), torch.full((*tokens.shape, depth), IGNORE_INDEX)
    for k in range(1, min(depth, s - 1) + 1):
        valid = batch["loss_mask"][:, k:] > 0
        if docs is not None:
            valid &= docs[:, k:] == docs[:, :-k]
        inputs[:, :-k, k - 1] = tokens[:, k:]
        targets[:, :-k, k - 1] = torch.where(valid, labels[:, k:], IGNORE_INDEX)
    return {"mtp_tokens": inputs, "mtp_labels": targets}


def place_batch(rt: Run, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This CP rank's s/cp tokens of every sample (with multi-token prediction's targets, shifted on the whole
    sequence first), moved to the device."""
    st = rt.state
    if rt.cfg.model.mtp_layers:
        batch = {**batch, **mtp_targets(batch, rt.cfg.model.mtp_layers)}
    if st.cp_size > 1:
        from megatron_sp.mpu.cp_layout import sequence_layout, shard_batch
        par = rt.cfg.parallel
        batch = shard_batch(batch, st.cp_size, st.cp_rank, sequence_layout(par.cp_algo), par.cp_document_chunk)
    return {k: v.to(rt.device) for k, v in batch.items()}
