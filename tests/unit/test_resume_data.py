"""Resuming with other data: another global batch size goes on from consumed_samples (the train set sized for what
remains); another model.seq_length or tokenizer is refused in one line unless checkpoint.allow_data_change."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest

from megatron_sp import training
from megatron_sp.config.schema import Config
from megatron_sp.data.tokenizer import ByteTokenizer
from megatron_sp.errors import ConfigError


def _cfg(**train: int) -> Config:
    cfg = Config()
    cfg.model.seq_length = 64
    cfg.train.iters, cfg.train.global_batch_size, cfg.train.eval_interval = 4, 2, 0
    for key, value in train.items():
        setattr(cfg.train, key, value)
    return cfg


def test_the_train_set_is_sized_for_what_remains() -> None:
    assert training.split_samples(_cfg())[0] == 8                                   # fresh: iters × gbs
    assert training.split_samples(_cfg(), 2, 8)[0] == 8 + 2 * 2                     # written at gbs 4: 4 → 2
    assert training.split_samples(_cfg(iters=3, global_batch_size=8), 2, 8)[0] == 16  # 4 → 8
    assert training.split_samples(_cfg(), 5, 20)[0] == 20                           # at or past the end


def test_another_seq_length_or_tokenizer_is_refused_unless_allowed(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    cfg, ckpt = _cfg(), tmp_path / "iter_0000002"
    sha = training.tokenizer_fingerprint(ByteTokenizer())
    meta = {"step": 2, "consumed_samples": 8, "tokenizer_sha256": sha,
            "config": {"model": {"seq_length": 64}, "tokenizer": {"type": "byte", "model": None}}}
    training.check_resume_data(cfg, meta, ckpt, sha)                                # the same data: accepted
    cfg.model.seq_length = 128
    training.check_resume_data(cfg, {**meta, "consumed_samples": 0}, ckpt, sha)      # nothing consumed yet
    with pytest.raises(ConfigError) as exc:
        training.check_resume_data(cfg, meta, ckpt, "f" * 64)
    line = str(exc.value)
    assert "\n" not in line and str(ckpt) in line and "model.seq_length 64 -> 128" in line
    assert "another tokenizer" in line and "checkpoint.allow_data_change=true" in line
    cfg.model.seq_length = 64
    with pytest.raises(ConfigError, match="another tokenizer"):
        training.check_resume_data(cfg, meta, ckpt, "f" * 64)
    no_record = {k: v for k, v in meta.items() if k != "tokenizer_sha256"}           # older checkpoints, imports
    training.check_resume_data(cfg, no_record, ckpt, "f" * 64)
    cfg.checkpoint.allow_data_change = True
    with caplog.at_level(logging.WARNING, logger="megatron_sp"):
        training.check_resume_data(cfg, meta, ckpt, "f" * 64)
    assert "going on from sample 8 of the new data order" in caplog.text


def test_the_tokenizer_fingerprint_is_the_file_not_its_name(tmp_path: Path) -> None:
    class Named:
        name, vocab_size, eod = "sentencepiece", 4, 3

        def __init__(self, path: Path) -> None:
            self.model_path = path

    a, b, c = tmp_path / "a.model", tmp_path / "b.model", tmp_path / "c.model"
    a.write_bytes(b"one")
    b.write_bytes(b"one")
    c.write_bytes(b"two")
    fingerprint = training.tokenizer_fingerprint
    assert fingerprint(Named(a)) == fingerprint(Named(b)) != fingerprint(Named(c))
    assert fingerprint(Named(a)) != fingerprint(ByteTokenizer())
