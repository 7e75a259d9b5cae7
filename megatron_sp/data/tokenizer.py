"""Tokenizers behind the ``Tokenizer`` interface: SentencePiece (``train_sentencepiece`` trains one for source
code), a Hugging Face ``tokenizer.json``, and raw UTF-8 bytes. See docs/data.md, Tokenizers."""
from __future__ import annotations

import abc
import io
import logging
import random
import re
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import sentencepiece as spm

from megatron_sp.config.loader import check_tokenizer_keys
from megatron_sp.config.schema import TokenizerConfig
from megatron_sp.data.corpus import iter_jsonl_texts
from megatron_sp.files import atomic_file
from megatron_sp.errors import ConfigError, DataError, refuse_existing_outputs

log = logging.getLogger("megatron_sp")

SPACE_SYMBOL = "\u2581"
"""SentencePiece's escaped space "▁"."""

MAX_LINE_BYTES = 4192
"""SentencePiece's default max_sentence_length: longer training lines are skipped (we count them)."""


class Tokenizer(abc.ABC):
    """The interface the data pipeline and the model rely on: ``vocab_size`` ids (the embedding needs at least
    this many rows), the end-of-document id ``eod`` (appended after each document by preprocessing) and ``pad``
    (explicit tokenizer.eod_token / pad_token, or each tokenizer's defaults)."""

    name: str
    vocab_size: int
    eod: int
    pad: int

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no EOD appended)."""

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """``[encode(t) for t in texts]``; subclasses may do it in one native call."""
        return [self.encode(text) for text in texts]

    @abc.abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; special ids (EOD, pad) decode to nothing."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, vocab_size={self.vocab_size}, eod={self.eod})"


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255, EOD = 256, pad = 257: 258 ids, nothing to train."""

    name = "byte"
    vocab_size = 258
    eod = 256
    pad = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"id {i} is outside the byte tokenizer's vocabulary 0..{self.vocab_size - 1}")
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model; EOD is ``eod_token`` (default: its eos piece), pad is ``pad_token``
    (default: its pad piece, else EOD)."""

    name = "sentencepiece"

    def __init__(self, model_path: str | Path, eod_token: str | None = None, pad_token: str | None = None) -> None:
        self.model_path = Path(model_path)
        self.eod_token, self.pad_token = eod_token, pad_token
        if not self.model_path.is_file():
            prefix = self.model_path.with_suffix("") if self.model_path.suffix == ".model" else self.model_path
            raise DataError(f"tokenizer model {self.model_path} not found; create it with `python "
                            f"tools/train_tokenizer.py --input CORPUS.jsonl --model-prefix "
                            f"{prefix} --vocab-size 4096` (or set data.build_demo=true)")
        self._load(self.model_path.read_bytes())

    def _load(self, proto: bytes) -> None:
        self._proto = proto
        try:
            self._sp = spm.SentencePieceProcessor(model_proto=proto)
        except RuntimeError as e:
            raise DataError(f"tokenizer model {self.model_path} is not a valid SentencePiece model ({e}); "
                            f"retrain it with tools/train_tokenizer.py") from None
        self.vocab_size = int(self._sp.get_piece_size())
        self.eod = self._special(self.eod_token, "eod_token") if self.eod_token else int(self._sp.eos_id())
        if self.eod < 0:
            raise DataError(f"tokenizer model {self.model_path} has no eos piece, which serves as end-of-document; "
                            f"set tokenizer.eod_token to one of its pieces or retrain it with tools/train_tokenizer.py")
        default_pad = int(self._sp.pad_id())
        self.pad = (self._special(self.pad_token, "pad_token") if self.pad_token
                    else default_pad if default_pad >= 0 else self.eod)
        self._space_bytes = [self._sp.piece_to_id(f"<0x{b:02X}>") for b in SPACE_SYMBOL.encode("utf-8")]
        self._has_bytes = all(self._sp.id_to_piece(i) == f"<0x{b:02X}>"
                              for i, b in zip(self._space_bytes, SPACE_SYMBOL.encode("utf-8"), strict=True))
        self._newline_ids = self._newline_separable()

    def _newline_separable(self) -> list[int] | None:
        """The ids of "\\n" if encoding line by line and joining with them equals encoding the whole text, else None
        (docs/data.md, Tokenizers)."""
        try:
            from sentencepiece import sentencepiece_model_pb2
            model = sentencepiece_model_pb2.ModelProto.FromString(self._proto)
        except Exception:  # protobuf missing or too old for this proto: keep whole-text encoding
            return None
        spec = model.normalizer_spec
        if (spec.name != "identity" or spec.add_dummy_prefix or spec.remove_extra_whitespaces
                or any("\n" in p.piece and p.piece != "\n" for p in model.pieces)):
            return None
        ids = [int(i) for i in self._sp.encode("\n")]
        if not ids or self._sp.unk_id() in ids:
            return None
        return ids

    def _special(self, piece: str, key: str) -> int:
        i = int(self._sp.piece_to_id(piece))
        if self._sp.id_to_piece(i) != piece:  # an unknown piece maps to <unk>
            raise ConfigError(f"tokenizer.{key}: '{piece}' is not a piece of {self.model_path}; give one of its "
                              f"pieces, e.g. '{self._sp.id_to_piece(max(self._sp.eos_id(), 0))}'")
        return i

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

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """``[encode(t) for t in texts]``, one native single-threaded call for texts without a literal "▁"."""
        texts = list(texts)
        out: list[Any] = [self.encode(text) if SPACE_SYMBOL in text and self._has_bytes else None for text in texts]
        plain = [k for k, ids in enumerate(out) if ids is None]
        newline = self._newline_ids  # None: whole texts, not split into lines
        lines = [texts[k].split("\n") if newline is not None else [texts[k]] for k in plain]
        encoded = iter(self._sp.encode([line for parts in lines for line in parts], num_threads=1) if plain else [])
        for k, parts in zip(plain, lines, strict=True):
            out[k] = list(next(encoded))
            for _ in range(len(parts) - 1):
                out[k].extend(newline)
                out[k].extend(next(encoded))
        return out

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def id_to_piece(self, i: int) -> str:
        """The piece (string) of one id, for inspection."""
        return self._sp.id_to_piece(int(i))

    def __getstate__(self) -> dict[str, Any]:
        return {"model_path": str(self.model_path), "proto": self._proto, "eod_token": self.eod_token,
                "pad_token": self.pad_token}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.model_path = Path(state["model_path"])
        self.eod_token, self.pad_token = state.get("eod_token"), state.get("pad_token")
        self._load(state["proto"])


EOD_TOKENS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "[EOS]")
"""End-of-document candidates looked up, in order, in an HF tokenizer without ``tokenizer.eod_token``."""

PAD_TOKENS = ("<pad>", "<|padding|>", "[PAD]", "<|pad|>")
"""Padding candidates looked up, in order, without ``tokenizer.pad_token`` (none found: pad = EOD)."""


class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizers`` model from a ``tokenizer.json`` (or its directory); no download.
    Encodes without the tokenizer's own special tokens; ``vocab_size`` = largest id + 1 (added tokens too)."""

    name = "hf"

    def __init__(self, path: str | Path, eod_token: str | None = None, pad_token: str | None = None) -> None:
        try:
            import tokenizers  # noqa: F401
        except ImportError:
            raise ConfigError("tokenizer.type=hf needs the 'tokenizers' package: pip install -e '.[hf]'") from None
        given = Path(path)
        self.path = given / "tokenizer.json" if given.is_dir() else given
        if not self.path.is_file():
            raise DataError(f"tokenizer file {self.path} not found; give a Hugging Face tokenizer.json (or the "
                            f"directory holding it) as tokenizer.model")
        self.eod_token, self.pad_token = eod_token, pad_token
        self._load(self.path.read_text(encoding="utf-8"))

    def _load(self, json_text: str) -> None:
        from tokenizers import Tokenizer as RustTokenizer

        self._json = json_text
        try:
            self._tok = RustTokenizer.from_str(json_text)
        except Exception as e:  # the Rust side raises plain Exceptions for malformed files
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise DataError(f"{self.path} is not a valid Hugging Face tokenizer.json ({first})") from None
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1 if vocab else 0
        self.eod = self._find(self.eod_token, EOD_TOKENS, "eod_token", vocab)
        self.pad = self._find(self.pad_token, PAD_TOKENS, "pad_token", vocab, default=self.eod)

    def _find(self, token: str | None, candidates: tuple[str, ...], key: str, vocab: dict[str, int],
              default: int | None = None) -> int:
        if token is not None:
            if token not in vocab:
                raise ConfigError(f"tokenizer.{key}: '{token}' is not in the vocabulary of {self.path}; give one of "
                                  f"its tokens")
            return vocab[token]
        for candidate in candidates:
            if candidate in vocab:
                return vocab[candidate]
        if default is None:
            raise ConfigError(f"tokenizer.eod_token: {self.path} has none of {', '.join(candidates)}; set "
                              f"tokenizer.eod_token (or --eod-token) to its end-of-document token")
        return default

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def __getstate__(self) -> dict[str, Any]:
        return {"path": str(self.path), "json": self._json, "eod_token": self.eod_token, "pad_token": self.pad_token}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.path = Path(state["path"])
        self.eod_token, self.pad_token = state["eod_token"], state["pad_token"]
        self._load(state["json"])


TOKENIZER_TYPES = ("sentencepiece", "hf", "byte")
"""The values of ``tokenizer.type``."""

_ALIASES = {"sentencepiecetokenizer": "sentencepiece", "huggingfacetokenizer": "hf", "bytetokenizer": "byte"}


def _tokenizer_file(path: Path, kind: str) -> Path:
    return path / "tokenizer.json" if kind == "hf" and path.is_dir() else path


def _missing_tokenizer(cfg: TokenizerConfig, kind: str) -> str:
    """What a config whose tokenizer file is absent needs: its type and vocabulary, how to make one, the demo."""
    model = Path(cfg.model)  # type: ignore[arg-type]
    make = (f"train one: `python tools/train_tokenizer.py --input CORPUS.jsonl --model-prefix "
            f"{model.with_suffix('') if model.suffix == '.model' else model} --vocab-size {cfg.vocab_size}`"
            if kind == "sentencepiece" else "give the tokenizer.json (or its directory)")
    return (f"tokenizer.model {model} not found: this config needs the {kind} tokenizer of its data "
            f"({cfg.vocab_size} tokens); put it there or {make}; or try the config on the demo data: data.build_demo=true")


def build_tokenizer(cfg: TokenizerConfig) -> Tokenizer:
    """The tokenizer ``cfg`` describes: ``sentencepiece`` (loads ``cfg.model``), ``hf`` (a tokenizer.json) or ``byte``."""
    kind = _ALIASES.get(cfg.type.lower(), cfg.type.lower())
    if kind not in TOKENIZER_TYPES:
        raise ConfigError(f"tokenizer.type: unknown tokenizer '{cfg.type}'; choose one of {', '.join(TOKENIZER_TYPES)}")
    check_tokenizer_keys(cfg, kind)
    if kind in ("sentencepiece", "hf") and not _tokenizer_file(Path(cfg.model), kind).is_file():  # type: ignore[arg-type]
        raise DataError(_missing_tokenizer(cfg, kind))
    if kind == "sentencepiece":
        return SentencePieceTokenizer(cfg.model, cfg.eod_token, cfg.pad_token)  # type: ignore[arg-type]
    if kind == "hf":
        return HFTokenizer(cfg.model, cfg.eod_token, cfg.pad_token)  # type: ignore[arg-type]
    return ByteTokenizer()


def training_lines(texts: Iterable[str], max_lines: int = 2_000_000, seed: int = 1234) -> tuple[list[str], int, int]:
    """(lines, total lines, too long): a uniform reservoir sample of at most ``max_lines`` non-blank lines
    no longer than ``MAX_LINE_BYTES`` (``random.Random(seed)``), in corpus order."""
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
                        character_coverage: float = 0.9999, overwrite: bool = True) -> Path:
    """Train a BPE SentencePiece model on the text lines of JSONL files; writes ``PREFIX.model`` / ``.vocab``
    atomically and returns the ``.model`` path. Deterministic (seeded, one thread). Ids: 0 ``<unk>``,
    1 ``<s>``, 2 ``</s>`` (EOD), 3 ``<pad>``, then 256 byte pieces and the merges. Unless ``overwrite``,
    existing outputs are refused (before training and again before the rename).
    """
    model_prefix = Path(model_prefix)
    model_path = Path(f"{model_prefix}.model")
    vocab_path = Path(f"{model_prefix}.vocab")

    def refuse() -> None:
        if not overwrite:
            refuse_existing_outputs([model_path, vocab_path], "choose another --model-prefix")
    refuse()
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
    sp = spm.SentencePieceProcessor(model_proto=proto)
    vocab_text = "".join(f"{sp.id_to_piece(i)}\t{sp.get_score(i):g}\n" for i in range(sp.get_piece_size()))
    model_path.parent.mkdir(parents=True, exist_ok=True)
    refuse()  # created meanwhile: still never replaced
    with atomic_file(vocab_path) as f:
        f.write(vocab_text.encode("utf-8"))
    with atomic_file(model_path) as f:
        f.write(proto)
    log.info("trained tokenizer %s: vocab %d on %d of %d lines in %.1f s", model_path, sp.get_piece_size(),
             len(lines), total_lines, time.perf_counter() - start)
    return model_path
