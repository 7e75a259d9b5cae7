"""The data pipeline: tokenizer → indexed .bin/.idx → GPT dataset → batches (``loader.BatchLoader``, which
imports torch, reads them). See docs/data.md."""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from megatron_sp.config.schema import Config, TokenizerConfig
from megatron_sp.data.blending import SURPLUS, BlendedDataset, parse_blend, samples_per_dataset
from megatron_sp.data.corpus import make_demo_corpus
from megatron_sp.data.gpt_dataset import GPTDataset, split_documents
from megatron_sp.data.indexed import (
    IndexedDataset,
    IndexedDatasetWriter,
    best_dtype,
    data_file_paths,
)
from megatron_sp.data.packed import PackedDataset, check_dataset_kind, collate_packed, convert_packed_jsonl
from megatron_sp.data.preprocess import preprocess_jsonl, tokenize_jsonl_to
from megatron_sp.data.tokenizer import Tokenizer, build_tokenizer, train_sentencepiece
from megatron_sp.errors import ConfigError, DataError

if TYPE_CHECKING:
    import torch

log = logging.getLogger("megatron_sp")

Dataset = GPTDataset | PackedDataset | BlendedDataset
"""What ``build_datasets`` returns per split: ``len(ds)`` samples, ``ds[i]`` = ``seq_length + 1`` int64 tokens
(``data.packing=position_ids``: a ``[3, seq_length + 1]`` array of tokens, position_ids and labels)."""

__all__ = [
    "BlendedDataset", "GPTDataset", "IndexedDataset", "IndexedDatasetWriter", "PackedDataset", "Tokenizer",
    "batch_indices", "best_dtype", "build_datasets", "build_tokenizer", "check_inputs", "collate",
    "convert_packed_jsonl", "ensure_demo_data", "make_demo_corpus", "open_dataset", "parse_blend", "preprocess_jsonl",
    "split_documents", "train_sentencepiece", "whole_dataset",
]

_TOKEN_CHECK_LIMIT = 1 << 22
"""Tokens of a dataset checked against the tokenizer's vocabulary (data preprocessed with another one)."""


def ensure_demo_data(cfg: Config) -> None:
    """If ``cfg.data.build_demo``, build what is missing of the demo corpus, tokenizer and dataset (a rebuilt
    tokenizer rebuilds the dataset too). Run it on one rank only, then a barrier."""
    if not cfg.data.build_demo:
        return
    prefix = parse_blend(cfg.data.paths)[0][0]  # one prefix and, for sentencepiece, a model path: finalize checks
    demo_dir = Path(cfg.data.demo_dir)
    model_path = Path(cfg.tokenizer.model) if cfg.tokenizer.type == "sentencepiece" else None
    need_tokenizer = model_path is not None and not model_path.is_file()
    if not need_tokenizer and all(p.is_file() for p in data_file_paths(prefix)):
        return
    outside = [f"{key} {path}" for key, path, needed in (("data.paths", prefix, True), ("tokenizer.model", model_path,
               need_tokenizer)) if needed and not _inside(Path(path), demo_dir)]  # type: ignore[arg-type]
    if outside:  # the demo never lands where a config keeps its real data (a corpus named as if it were the Pile)
        raise ConfigError(f"data.build_demo writes only under data.demo_dir ({demo_dir}), but {' and '.join(outside)} "
                          f"{'is' if len(outside) == 1 else 'are'} outside it and missing: drop data.build_demo and "
                          f"give your own data, or train on the demo with `data.paths=[{demo_dir / 'demo_text_document'}] "
                          f"tokenizer.type=sentencepiece tokenizer.model={demo_dir / 'tokenizer.model'}"
                          f"{'' if cfg.tokenizer.vocab_size == DEMO_VOCAB else f' tokenizer.vocab_size={DEMO_VOCAB}'}`")
    log.info("data.build_demo: building what is missing of the demo corpus, tokenizer and dataset in %s", demo_dir)
    corpus = demo_dir / "corpus.jsonl"
    if not corpus.is_file():
        make_demo_corpus(corpus)
    if need_tokenizer:
        if model_path.suffix != ".model":
            raise ConfigError(f"tokenizer.model {model_path} must end in .model for build_demo to create it")
        train_sentencepiece([corpus], model_path.with_suffix(""), cfg.tokenizer.vocab_size)
    tokenize_jsonl_to([corpus], {"text": prefix}, build_tokenizer(cfg.tokenizer), append_eod=True)


DEMO_VOCAB = TokenizerConfig().vocab_size  # the demo tokenizer's vocabulary (4096)


def _inside(path: Path, directory: Path) -> bool:
    return path.resolve().is_relative_to(directory.resolve())


def check_index_memory(num_samples: int, seq_length: int, indexed: IndexedDataset, documents: np.ndarray) -> None:
    """Refuse a sample count whose GPT dataset indices over ``documents`` (about 64 bytes per sample, 24 per
    document entry of every epoch, built up front) would not fit in this machine's memory."""
    tokens = int(indexed.document_sizes[documents].sum()) if documents.size else 0
    if not tokens:
        return  # an empty split: build_datasets says so
    epochs = -(-(num_samples * seq_length + 1) // tokens)
    needed = 64 * num_samples + 24 * epochs * documents.size
    try:
        memory = int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # the OS does not say
        return
    if 0 < memory < needed:
        raise DataError(f"train.iters × train.global_batch_size = {num_samples} samples of {indexed.prefix} need about "
                        f"{needed / 2**30:.3g} GiB of dataset indices ({epochs} epochs), more than this machine's "
                        f"{memory / 2**30:.3g} GiB; lower train.iters")


def check_inputs(cfg: Config) -> None:
    """Open every dataset of ``data.paths`` (a missing, malformed or empty .bin/.idx is one line) and check
    that the run's sample count is meaningful for it; cheap, so ``train.py`` runs it before any rank starts."""
    for prefix in parse_blend(cfg.data.paths)[0]:
        indexed = open_dataset(prefix)
        check_dataset_kind(prefix, cfg.data.packing, cfg.model.seq_length)
        check_index_memory(cfg.train.iters * cfg.train.global_batch_size, cfg.model.seq_length,  # type: ignore[operator]
                           indexed, split_documents(indexed.num_documents, cfg.data.split)[0])


def build_datasets(cfg: Config, tokenizer: Tokenizer, num_train_samples: int,
                   num_valid_samples: int) -> tuple[Dataset, Dataset | None]:
    """The train and validation datasets of ``cfg.data.paths``: a ``GPTDataset`` per split, or for several
    prefixes a ``BlendedDataset`` (weighted, or by tokens). Validation is ``None`` when 0 samples or empty.
    """
    prefixes, weights = parse_blend(cfg.data.paths)
    datasets = [open_dataset(prefix) for prefix in prefixes]
    for indexed in datasets:
        check_dataset_kind(indexed.prefix, cfg.data.packing, cfg.model.seq_length)
        _check_vocabulary(indexed, tokenizer)
    splits = [split_documents(indexed.num_documents, cfg.data.split) for indexed in datasets]
    seq_length, seed = cfg.model.seq_length, cfg.train.seed

    def cache_dir(indexed: IndexedDataset) -> Path:
        return Path(cfg.data.cache_dir) if cfg.data.cache_dir else indexed.prefix.parent

    def split_dataset(indexed: IndexedDataset, docs: np.ndarray, n: int, name: str) -> GPTDataset | PackedDataset:
        if cfg.data.packing == "position_ids":  # one document = one pre-packed sample
            return PackedDataset(indexed, docs, seq_length, n, seed, name)
        return GPTDataset(indexed, docs, seq_length, n, seed, cache_dir(indexed), name)

    for indexed, (train_docs, _, _) in zip(datasets, splits, strict=True):
        if train_docs.size == 0 or indexed.document_sizes[train_docs].sum() == 0:
            raise DataError(f"the train split of {indexed.prefix} is empty ({train_docs.size} of "
                            f"{indexed.num_documents} documents, data.split={cfg.data.split}); give the train split "
                            f"a larger share or use more data")
        check_index_memory(num_train_samples, seq_length, indexed, train_docs)
    if len(datasets) == 1:
        indexed, (train_docs, valid_docs, _) = datasets[0], splits[0]
        train: Dataset = split_dataset(indexed, train_docs, num_train_samples, "train")
        valid: Dataset | None = None
        if num_valid_samples > 0:
            if valid_docs.size == 0:
                log.warning("the valid split of %s is empty (data.split=%s): no validation", indexed.prefix,
                            cfg.data.split)
            else:
                valid = split_dataset(indexed, valid_docs, num_valid_samples, "valid")
        return train, valid

    def blend(split: int, name: str, num_samples: int) -> BlendedDataset | None:
        members = [(k, splits[k][split]) for k in range(len(datasets))
                   if splits[k][split].size and datasets[k].document_sizes[splits[k][split]].sum() > 0]
        if len(members) < len(datasets):
            empty = [str(datasets[k].prefix) for k in range(len(datasets)) if k not in dict(members)]
            if not members:
                log.warning("the %s split of every dataset is empty (data.split=%s): no validation", name,
                            cfg.data.split)
                return None
            log.warning("the %s split of %s is empty (data.split=%s): blending the others", name, ", ".join(empty),
                        cfg.data.split)
        if weights is not None:
            member_weights = [weights[k] for k, _ in members]
        else:  # no weights given: in proportion to the tokens of each dataset's split
            member_weights = [float(datasets[k].document_sizes[docs].sum()) for k, docs in members]
        targets = samples_per_dataset(member_weights, num_samples)
        built = samples_per_dataset(member_weights, num_samples, SURPLUS)
        parts = [split_dataset(datasets[k], docs, n, name) for (k, docs), n in zip(members, built, strict=True)]
        blended = BlendedDataset(parts, member_weights, sum(targets), cache_dir(datasets[0]), name)
        log.info("%s blend of %d samples: %s", name, len(blended), ", ".join(
            f"{w:.3f} {datasets[k].prefix} ({c} samples)"
            for w, (k, _), c in zip(blended.weights, members, blended.counts, strict=True)))
        return blended

    train_blend = blend(0, "train", num_train_samples)
    assert train_blend is not None  # every train split is non-empty (checked above)
    return train_blend, blend(1, "valid", num_valid_samples) if num_valid_samples > 0 else None


def whole_dataset(cfg: Config, tokenizer: Tokenizer, prefix: str | Path) -> Dataset:
    """Every document of ``prefix`` once (tools/evaluate.py): one epoch of samples in the order ``train.seed`` gives
    them — EOD-delimited, the ``(tokens - 1) // seq_length`` samples of ``seq_length + 1`` tokens the documents fill
    (built as ``build_datasets`` builds a split); pre-packed (``data.packing=position_ids``), each sample once."""
    indexed = open_dataset(prefix)
    check_dataset_kind(indexed.prefix, cfg.data.packing, cfg.model.seq_length)
    _check_vocabulary(indexed, tokenizer)
    documents = np.arange(indexed.num_documents, dtype=np.int64)
    seq_length, seed = cfg.model.seq_length, cfg.train.seed
    if cfg.data.packing == "position_ids":
        return PackedDataset(indexed, documents, seq_length, documents.size, seed, "eval")
    samples = (int(indexed.document_sizes.sum()) - 1) // seq_length
    if samples < 1:
        raise DataError(f"dataset {indexed.bin_path} holds {int(indexed.document_sizes.sum())} tokens, fewer than one "
                        f"sample of model.seq_length + 1 = {seq_length + 1}")
    return GPTDataset(indexed, documents, seq_length, samples, seed, None, "eval")  # one epoch: indices in memory


def open_dataset(prefix: str | Path) -> IndexedDataset:
    """``IndexedDataset(prefix)``, refusing an empty one (``DataError`` naming the file and the fix)."""
    indexed = IndexedDataset(prefix)
    if indexed.num_documents == 0 or indexed.num_tokens == 0:
        raise DataError(f"dataset {indexed.bin_path} is empty ({indexed.num_documents} documents, "
                        f"{indexed.num_tokens} tokens): preprocess a non-empty corpus into it with "
                        f"tools/preprocess_data.py, or drop it from data.paths")
    return indexed


def _check_vocabulary(indexed: IndexedDataset, tokenizer: Tokenizer) -> None:
    """Raise ``DataError`` when the first tokens of the (non-empty) dataset use ids the tokenizer does not have."""
    head = np.asarray(indexed.token_range(0, min(indexed.num_tokens, _TOKEN_CHECK_LIMIT)))
    top = int(head.max())
    if top >= tokenizer.vocab_size or int(head.min()) < 0:
        raise DataError(f"{indexed.bin_path} holds token id {top} but the {tokenizer.name} tokenizer has only "
                        f"{tokenizer.vocab_size} ids; it was preprocessed with another tokenizer: rerun "
                        f"tools/preprocess_data.py with this one")


def batch_indices(step: int, global_batch_size: int, dp_rank: int, dp_size: int) -> range:
    """Sample ids data-parallel rank ``dp_rank`` reads at ``step``: its contiguous block of global batch
    ``step`` (samples ``step·gbs … (step+1)·gbs - 1``, the same for every ``dp_size``)."""
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
    """Stack samples of ``s + 1`` tokens into ``[b, s]`` tensors: ``tokens``, ``labels`` (shifted by one),
    ``position_ids``, ``loss_mask`` and, with ``reset_attention_mask``, ``document_ids``; 2-D (packed) samples
    go to ``packed.collate_packed``, which ignores the EOD flags. Semantics: docs/data.md, "Batches"."""
    import torch  # here, not at the top: the data tools (tools/*.py) then start without importing torch

    if np.ndim(samples[0]) == 2:
        return collate_packed(samples)
    batch = torch.from_numpy(np.stack([np.asarray(s, dtype=np.int64) for s in samples]))  # [b, s+1]
    tokens = batch[:, :-1].contiguous()  # [b, s]
    labels = batch[:, 1:].contiguous()  # [b, s]
    b, s = tokens.shape
    arange = torch.arange(s, dtype=torch.int64).unsqueeze(0).expand(b, s)  # [b, s]
    is_eod = tokens == eod  # [b, s]
    loss_mask = torch.ones(labels.shape, dtype=torch.float32)
    if eod_mask_loss:
        loss_mask[is_eod] = 0.0
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
