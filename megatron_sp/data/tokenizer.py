"""Tokenizers: SentencePiece (trained here for source code) and raw UTF-8 bytes.

Every tokenizer has ``name``, ``vocab_size`` (number of ids), ``eod`` (end-of-document id), ``pad``,
``encode(text) -> list[int]`` and ``decode(ids) -> str``, and ``decode(encode(text)) == text`` for
any text.

``train_sentencepiece`` trains a BPE model whose round trip is exact on source code:

- it trains on text *lines*: SentencePiece silently skips training "sentences" longer than
  ``max_sentence_length`` (4192 bytes), so one document per line would drop most files;
- ``normalization_rule_name=identity`` and ``remove_extra_whitespaces=False`` keep every
  character, tab and run of spaces; ``add_dummy_prefix=False`` adds no leading space;
- ``byte_fallback=True`` encodes anything outside the vocabulary as UTF-8 byte pieces. Newlines
  never occur inside training lines, so ``"\\n"`` always becomes the byte piece ``<0x0A>``;
- ``allow_whitespace_only_pieces=True`` and ``split_by_whitespace=False`` let BPE learn
  indentation runs and pieces like ``"▁▁▁▁return"`` (12% fewer tokens on the demo corpus than
  splitting at whitespace).

BPE escapes spaces as ``"▁"`` (U+2581), so a literal ``"▁"`` in the input would decode as a
space; ``SentencePieceTokenizer.encode`` therefore emits that character as its three byte pieces.
"""
from __future__ import annotations

import abc
import io
import logging
import os
import random
import re
import time
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import sentencepiece as spm

from megatron_sp.config.schema import TokenizerConfig
from megatron_sp.data.corpus import iter_jsonl_texts
from megatron_sp.errors import ConfigError, DataError

log = logging.getLogger("megatron_sp")

SPACE_SYMBOL = "\u2581"
"""SentencePiece's escaped space "▁"."""

MAX_LINE_BYTES = 4192
"""SentencePiece's default max_sentence_length: longer training lines are skipped (we count them)."""


class Tokenizer(abc.ABC):
    """The interface the data pipeline and the model rely on."""

    name: str

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Number of token ids (the embedding needs at least this many rows)."""

    @property
    @abc.abstractmethod
    def eod(self) -> int:
        """End-of-document id, appended after each document by preprocessing."""

    @property
    @abc.abstractmethod
    def pad(self) -> int:
        """Padding id."""

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no EOD appended)."""

    @abc.abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; special ids (EOD, pad) decode to nothing."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, vocab_size={self.vocab_size}, eod={self.eod})"


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255, EOD = 256, pad = 257: 258 ids, nothing to train."""

    name = "byte"

    @property
    def vocab_size(self) -> int:
        return 258

    @property
    def eod(self) -> int:
        return 256

    @property
    def pad(self) -> int:
        return 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"id {i} is outside the byte tokenizer's vocabulary 0..{self.vocab_size - 1}")
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model; EOD is its eos piece, pad its pad piece (or EOD when it has none)."""

    name = "sentencepiece"

    def __init__(self, model_path: str | Path) -> None:
        self.model_path = Path(model_path)
        if not self.model_path.is_file():
            raise DataError(f"tokenizer model {self.model_path} not found; create it with `python "
                            f"tools/train_tokenizer.py --input CORPUS.jsonl --model-prefix "
                            f"{_strip_model_suffix(self.model_path)} --vocab-size 4096` (or set data.build_demo=true)")
        self._load(self.model_path.read_bytes())

    def _load(self, proto: bytes) -> None:
        self._proto = proto
        try:
            self._sp = spm.SentencePieceProcessor(model_proto=proto)
        except RuntimeError as e:
            raise DataError(f"tokenizer model {self.model_path} is not a valid SentencePiece model ({e}); "
                            f"retrain it with tools/train_tokenizer.py") from None
        if self._sp.eos_id() < 0:
            raise DataError(f"tokenizer model {self.model_path} has no eos piece, which serves as end-of-document; "
                            f"retrain it with tools/train_tokenizer.py")
        self._space_bytes = [self._sp.piece_to_id(f"<0x{b:02X}>") for b in SPACE_SYMBOL.encode("utf-8")]
        self._has_bytes = all(self._sp.id_to_piece(i) == f"<0x{b:02X}>"
                              for i, b in zip(self._space_bytes, SPACE_SYMBOL.encode("utf-8"), strict=True))

    @property
    def vocab_size(self) -> int:
        return int(self._sp.get_piece_size())

    @property
    def eod(self) -> int:
        return int(self._sp.eos_id())

    @property
    def pad(self) -> int:
        pad = int(self._sp.pad_id())
        return pad if pad >= 0 else self.eod

    def encode(self, text: str) -> list[int]:
        if SPACE_SYMBOL not in text or not self._has_bytes:
            return self._sp.encode(text)
        ids: list[int] = []
        for k, part in enumerate(text.split(SPACE_SYMBOL)):
            if k:
                ids.extend(self._space_bytes)
            if part:
                ids.extend(self._sp.encode(part))
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def id_to_piece(self, i: int) -> str:
        """The piece (string) of one id, for inspection."""
        return self._sp.id_to_piece(int(i))

    def __getstate__(self) -> dict[str, Any]:
        return {"model_path": str(self.model_path), "proto": self._proto}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.model_path = Path(state["model_path"])
        self._load(state["proto"])


def build_tokenizer(cfg: TokenizerConfig) -> Tokenizer:
    """The tokenizer ``cfg`` describes: ``sentencepiece`` (loads ``cfg.model``) or ``byte``."""
    kind = cfg.type.lower()
    if kind in ("sentencepiece", "sentencepiecetokenizer"):
        if not cfg.model:
            raise ConfigError("tokenizer.model is not set; give the SentencePiece .model path, or set "
                              "tokenizer.type=byte")
        return SentencePieceTokenizer(cfg.model)
    if kind in ("byte", "bytetokenizer"):
        return ByteTokenizer()
    raise ConfigError(f"tokenizer.type: unknown tokenizer '{cfg.type}'; choose sentencepiece or byte")


def _strip_model_suffix(path: Path) -> str:
    return str(path.with_suffix("")) if path.suffix == ".model" else str(path)


def training_lines(texts: Iterable[str], max_lines: int = 2_000_000, seed: int = 1234) -> tuple[list[str], int, int]:
    """The non-blank lines of documents that SentencePiece trains on, at most ``max_lines`` of them.

    Lines longer than ``MAX_LINE_BYTES`` are dropped (SentencePiece would skip them silently).
    Beyond ``max_lines`` a uniform sample is kept by reservoir sampling with ``random.Random(seed)``
    (memory bounded by ``max_lines``), returned in corpus order. Returns (lines, total lines, too long).
    """
    rng = random.Random(seed)
    reservoir: list[tuple[int, str]] = []
    total = too_long = 0
    for text in texts:
        for line in text.split("\n"):
            line = line.rstrip("\r")
            if not line.strip():
                continue
            if len(line.encode("utf-8")) > MAX_LINE_BYTES:
                too_long += 1
                continue
            if len(reservoir) < max_lines:
                reservoir.append((total, line))
            else:
                slot = rng.randrange(total + 1)
                if slot < max_lines:
                    reservoir[slot] = (total, line)
            total += 1
    reservoir.sort()
    return [line for _, line in reservoir], total, too_long


def train_sentencepiece(jsonl_paths: Sequence[str | Path], model_prefix: str | Path, vocab_size: int,
                        json_key: str = "text", *, max_lines: int = 2_000_000, seed: int = 1234,
                        character_coverage: float = 0.9999) -> Path:
    """Train a BPE SentencePiece model on the text lines of JSONL files; writes ``PREFIX.model`` / ``.vocab``.

    Deterministic: lines are sampled (when there are more than ``max_lines``) with
    ``random.Random(seed)``, SentencePiece's own generator is seeded and it runs on one thread
    (a vocabulary of 4096 on the 4 MB demo corpus trains in about 3 s).
    Ids: 0 ``<unk>``, 1 ``<s>``, 2 ``</s>`` (EOD), 3 ``<pad>``, then 256 byte pieces and the merges.
    Both files are written under temporary names and renamed. Returns the ``.model`` path.
    """
    model_prefix = Path(model_prefix)
    start = time.perf_counter()
    lines, total_lines, too_long = training_lines(iter_jsonl_texts(jsonl_paths, json_key), max_lines, seed)
    if not lines:
        raise DataError(f"no text to train on in {', '.join(map(str, jsonl_paths))} (key '{json_key}')")
    if too_long:
        log.warning("tokenizer training: skipped %d lines longer than %d bytes", too_long, MAX_LINE_BYTES)

    spm.set_random_generator_seed(seed)
    buffer = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines),
            model_writer=buffer,
            model_type="bpe",
            vocab_size=vocab_size,
            character_coverage=character_coverage,
            byte_fallback=True,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            split_by_whitespace=False,
            allow_whitespace_only_pieces=True,
            max_sentence_length=MAX_LINE_BYTES,
            input_sentence_size=0,
            shuffle_input_sentence=False,
            num_threads=1,
            unk_id=0,
            bos_id=1,
            eos_id=2,
            pad_id=3,
            minloglevel=2,
        )
    except RuntimeError as e:
        message = str(e).strip().splitlines()[-1] if str(e).strip() else repr(e)
        too_small = re.search(r"smaller than required_chars\. (\d+) vs (\d+)", message)
        if too_small:
            raise DataError(f"vocab_size {vocab_size} is too small for {model_prefix}.model: this corpus needs at "
                            f"least {too_small.group(2)} (4 special + 256 byte pieces + its characters at "
                            f"character_coverage {character_coverage}); raise --vocab-size") from None
        raise DataError(f"SentencePiece training for {model_prefix}.model failed: {message}") from None

    proto = buffer.getvalue()
    model_path = Path(f"{model_prefix}.model")
    vocab_path = Path(f"{model_prefix}.vocab")
    sp = spm.SentencePieceProcessor(model_proto=proto)
    vocab_text = "".join(f"{sp.id_to_piece(i)}\t{sp.get_score(i):g}\n" for i in range(sp.get_piece_size()))
    model_path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(vocab_path, vocab_text.encode("utf-8"))
    _atomic_write(model_path, proto)
    log.info("trained tokenizer %s: vocab %d on %d of %d lines in %.1f s", model_path, sp.get_piece_size(),
             len(lines), total_lines, time.perf_counter() - start)
    return model_path


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
