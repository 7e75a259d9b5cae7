"""The data pipeline the training loop uses: tokenizer → indexed .bin/.idx → GPT dataset → batches.

- ``ensure_demo_data(cfg)`` builds the demo corpus, tokenizer and dataset when asked and absent
  (call it on one rank, then barrier);
- ``build_tokenizer(cfg.tokenizer)`` and ``build_datasets(cfg, tokenizer, n_train, n_valid)``;
- ``batch_indices(step, global_batch_size, dp_rank, dp_size)``: the sample ids one DP rank
  reads for one step. Global batch ``step`` is always samples ``step·gbs … (step+1)·gbs - 1`` in
  that order, whatever the layout; DP rank ``r`` takes the ``r``-th contiguous block of it;
- ``collate(samples, eod, eod_mask_loss, reset_position_ids, reset_attention_mask)``: tokens, shifted
  labels, loss mask, positions (and document ids for packed documents).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from megatron_sp.config.schema import Config
from megatron_sp.data.corpus import make_demo_corpus
from megatron_sp.data.gpt_dataset import GPTDataset, split_documents
from megatron_sp.data.indexed import (
    IndexedDataset,
    IndexedDatasetWriter,
    best_dtype,
    data_file_paths,
)
from megatron_sp.data.preprocess import preprocess_jsonl, tokenize_jsonl_to
from megatron_sp.data.tokenizer import Tokenizer, build_tokenizer, train_sentencepiece
from megatron_sp.errors import ConfigError, DataError

if TYPE_CHECKING:
    import torch

log = logging.getLogger("megatron_sp")

__all__ = [
    "GPTDataset", "IndexedDataset", "IndexedDatasetWriter", "Tokenizer", "batch_indices", "best_dtype",
    "build_datasets", "build_tokenizer", "collate", "ensure_demo_data", "make_demo_corpus", "preprocess_jsonl",
    "split_documents", "train_sentencepiece",
]

_TOKEN_CHECK_LIMIT = 1 << 22
"""Tokens of the dataset checked against the tokenizer's vocabulary at load time (a cheap guard
against data preprocessed with another tokenizer)."""


def ensure_demo_data(cfg: Config) -> None:
    """If ``cfg.data.build_demo`` and a needed file is missing, build the demo data under ``cfg.data.demo_dir``.

    Steps, each only when needed and each logging one line with its timing: ``corpus.jsonl`` from
    the standard library → the SentencePiece model at ``cfg.tokenizer.model`` (vocab
    ``cfg.tokenizer.vocab_size``) → the dataset at ``cfg.data.paths[0]``. A rebuilt tokenizer also
    rebuilds the dataset (its ids would not match). Run it on one rank only; the caller puts a
    barrier after it.
    """
    if not cfg.data.build_demo:
        return
    if len(cfg.data.paths) != 1:
        raise ConfigError("data.build_demo needs exactly one data.paths entry (the demo dataset prefix)")
    demo_dir = Path(cfg.data.demo_dir)
    prefix = str(cfg.data.paths[0])
    sentencepiece = cfg.tokenizer.type.lower() == "sentencepiece"
    if sentencepiece and not cfg.tokenizer.model:
        raise ConfigError("tokenizer.model is not set; give the path the demo tokenizer should be written to")
    model_path = Path(cfg.tokenizer.model) if sentencepiece else None
    need_tokenizer = model_path is not None and not model_path.is_file()
    if not need_tokenizer and all(p.is_file() for p in data_file_paths(prefix)):
        return
    corpus = demo_dir / "corpus.jsonl"
    if not corpus.is_file():
        make_demo_corpus(corpus)
    if model_path is not None and need_tokenizer:
        if model_path.suffix != ".model":
            raise ConfigError(f"tokenizer.model {model_path} must end in .model for build_demo to create it")
        train_sentencepiece([corpus], model_path.with_suffix(""), cfg.tokenizer.vocab_size)
    tokenize_jsonl_to([corpus], {"text": prefix}, build_tokenizer(cfg.tokenizer), append_eod=True)


def build_datasets(cfg: Config, tokenizer: Tokenizer, num_train_samples: int,
                   num_valid_samples: int) -> tuple[GPTDataset, GPTDataset | None]:
    """The train and validation GPT datasets of ``cfg.data.paths[0]``, split by ``cfg.data.split``.

    The validation dataset is ``None`` when ``num_valid_samples`` is 0 or the valid split is empty.
    """
    if len(cfg.data.paths) != 1:
        raise ConfigError(f"data.paths: {len(cfg.data.paths)} entries given; blending several datasets is not "
                          f"available yet, give exactly one prefix")
    prefix = Path(cfg.data.paths[0])
    indexed = IndexedDataset(prefix)
    _check_vocabulary(indexed, tokenizer)
    cache_dir = Path(cfg.data.cache_dir) if cfg.data.cache_dir else prefix.parent
    train_docs, valid_docs, _ = split_documents(indexed.num_documents, cfg.data.split)
    if train_docs.size == 0:
        raise DataError(f"the train split of {prefix} is empty ({indexed.num_documents} documents, "
                        f"data.split={cfg.data.split}); give the train split a larger share or use more data")
    seq_length, seed = cfg.model.seq_length, cfg.train.seed
    train = GPTDataset(indexed, train_docs, seq_length, num_train_samples, seed, cache_dir, "train")
    valid = None
    if num_valid_samples > 0:
        if valid_docs.size == 0:
            log.warning("the valid split of %s is empty (data.split=%s): no validation", prefix, cfg.data.split)
        else:
            valid = GPTDataset(indexed, valid_docs, seq_length, num_valid_samples, seed, cache_dir, "valid")
    return train, valid


def _check_vocabulary(indexed: IndexedDataset, tokenizer: Tokenizer) -> None:
    """Raise ``DataError`` when the first tokens of the dataset use ids the tokenizer does not have."""
    n = min(indexed.num_tokens, _TOKEN_CHECK_LIMIT)
    if n == 0 or len(indexed) == 0:
        return
    head = np.asarray(indexed.token_range(0, n))
    top = int(head.max())
    if top >= tokenizer.vocab_size or int(head.min()) < 0:
        raise DataError(f"{indexed.bin_path} holds token id {top} but the {tokenizer.name} tokenizer has only "
                        f"{tokenizer.vocab_size} ids; it was preprocessed with another tokenizer: rerun "
                        f"tools/preprocess_data.py with this one")


def batch_indices(step: int, global_batch_size: int, dp_rank: int, dp_size: int) -> range:
    """Sample ids data-parallel rank ``dp_rank`` reads at ``step``: its contiguous block of the global batch.

    Global batch ``step`` is samples ``step·gbs … (step+1)·gbs - 1``; rank ``r`` gets
    ``step·gbs + r·gbs/dp … step·gbs + (r+1)·gbs/dp - 1``. The union over ranks, in rank order, is
    the same global batch for every ``dp_size``.
    """
    if step < 0 or global_batch_size < 1:
        raise ValueError(f"need step >= 0 and global_batch_size >= 1, got {step}, {global_batch_size}")
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} out of range for dp_size {dp_size}")
    if global_batch_size % dp_size:
        raise ValueError(f"global_batch_size {global_batch_size} is not divisible by dp_size {dp_size}")
    per_rank = global_batch_size // dp_size
    start = step * global_batch_size + dp_rank * per_rank
    return range(start, start + per_rank)


def collate(samples: list[np.ndarray], eod: int, eod_mask_loss: bool, reset_position_ids: bool = False,
            reset_attention_mask: bool = False) -> dict[str, torch.Tensor]:
    """Stack samples of ``s + 1`` tokens into a batch of ``[b, s]`` tensors.

    ``tokens`` = sample[:-1], ``labels`` = sample[1:] (int64); ``loss_mask`` (float32) is 1.0,
    or 0.0 where the label is ``eod`` when ``eod_mask_loss``; ``position_ids`` = 0 … s-1 (int64).
    Labels are shifted here, on the full sequence, before any context-parallel sharding.

    A sample of the GPT dataset spans several documents, each ending with an ``eod`` token (Megatron's
    ``get_ltor_masks_and_position_ids``); the ``eod`` belongs to the document it ends:

    - ``reset_position_ids``: ``position_ids`` restart at 0 on the token after each ``eod`` of ``tokens``;
    - ``reset_attention_mask``: adds ``document_ids`` (int64 ``[b, s]``), the number of ``eod`` tokens
      strictly before each token; attention lets a token see only earlier tokens with the same id.
    """
    import torch  # here, not at the top: the data tools (tools/*.py) then start without importing torch

    if not samples:
        raise ValueError("collate needs at least one sample")
    batch = torch.from_numpy(np.stack([np.asarray(s, dtype=np.int64) for s in samples]))  # [b, s+1]
    tokens = batch[:, :-1].contiguous()  # [b, s]
    labels = batch[:, 1:].contiguous()  # [b, s]
    loss_mask = torch.ones(labels.shape, dtype=torch.float32)
    if eod_mask_loss:
        loss_mask[labels == eod] = 0.0
    b, s = tokens.shape
    arange = torch.arange(s, dtype=torch.int64).unsqueeze(0).expand(b, s)  # [b, s]
    is_eod = tokens == eod  # [b, s]
    if reset_position_ids:
        # index of the first token of each token's document: 1 + index of the last eod before it (else 0)
        starts_here = torch.zeros_like(is_eod)
        starts_here[:, 1:] = is_eod[:, :-1]
        doc_start = torch.where(starts_here, arange, torch.zeros_like(arange)).cummax(dim=1).values  # [b, s]
        position_ids = arange - doc_start
    else:
        position_ids = arange.contiguous()
    out = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids}
    if reset_attention_mask:
        eods = is_eod.to(torch.int64)
        out["document_ids"] = eods.cumsum(dim=1) - eods  # [b, s]: eod tokens strictly before
    return out
