"""Tokenizers: byte tokenizer, SentencePiece training (exact round trip on code, determinism), errors."""
from __future__ import annotations

import json
import pickle
import re
import sysconfig
from pathlib import Path

import pytest

from megatron_sp.config.schema import TokenizerConfig
from megatron_sp.data.tokenizer import (
    MAX_LINE_BYTES,
    ByteTokenizer,
    SentencePieceTokenizer,
    build_tokenizer,
    train_sentencepiece,
    training_lines,
)
from megatron_sp.errors import ConfigError, DataError

CODE = (
    "import os\n"
    "\n"
    "class Foo(object):\n"
    "    \"\"\"Docstring with   three spaces.\"\"\"\n"
    "\n"
    "    def bar(self, x):\t# a tab before this comment\n"
    "\tif x  ==  1:\n"
    "\t\treturn   {'a': [1,2 ,3]}\n"
    "        return None    \n"
    "\n\n\n"
    "s = 'caf\u00e9 \u4e2d\u6587 \U0001f600 \u2581 literal lower-one-eighth block'\r\n"
    "  \x0c trailing\n"
)

STDLIB_FILES = ("argparse.py", "textwrap.py", "shlex.py")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A few hundred lines of standard-library source per document, one JSON object per line."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for name in STDLIB_FILES:
            text = "".join((stdlib / name).read_text(encoding="utf-8").splitlines(keepends=True)[:300])
            f.write(json.dumps({"text": text}) + "\n")
    return path


@pytest.fixture(scope="module")
def sp_model(corpus: Path) -> Path:
    return train_sentencepiece([corpus], corpus.parent / "tok", vocab_size=512)


def test_byte_tokenizer() -> None:
    tok = build_tokenizer(TokenizerConfig(type="byte"))
    assert isinstance(tok, ByteTokenizer) and tok.name == "byte"
    assert (tok.vocab_size, tok.eod, tok.pad) == (258, 256, 257)
    ids = tok.encode(CODE)
    assert ids == list(CODE.encode("utf-8")) and max(ids) < 256
    assert tok.decode(ids) == CODE
    assert tok.decode([*tok.encode("ab"), tok.eod, tok.pad]) == "ab"
    with pytest.raises(ValueError):
        tok.decode([300])


def test_sentencepiece_round_trip_on_code(sp_model: Path, corpus: Path) -> None:
    tok = build_tokenizer(TokenizerConfig(type="sentencepiece", model=str(sp_model)))
    assert isinstance(tok, SentencePieceTokenizer) and tok.name == "sentencepiece"
    assert tok.vocab_size == 512
    assert tok.id_to_piece(tok.eod) == "</s>" and tok.eod == 2
    assert tok.id_to_piece(tok.pad) == "<pad>"
    ids = tok.encode(CODE)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == CODE
    assert tok.decode([*tok.encode("x = 1\n"), tok.eod]) == "x = 1\n"
    for name in STDLIB_FILES:
        text = (Path(sysconfig.get_paths()["stdlib"]) / name).read_text(encoding="utf-8")
        assert tok.decode(tok.encode(text)) == text
    for line in corpus.read_text(encoding="utf-8").splitlines():
        text = json.loads(line)["text"]
        assert len(tok.encode(text)) < 0.75 * len(text.encode("utf-8"))  # it learned merges, not just bytes
    assert [tok.id_to_piece(i) for i in tok.encode("\n")] == ["<0x0A>"]  # newlines: byte fallback
    clone = pickle.loads(pickle.dumps(tok))
    assert clone.encode(CODE) == ids


def test_sentencepiece_training_is_deterministic(sp_model: Path, corpus: Path, tmp_path: Path) -> None:
    again = train_sentencepiece([corpus], tmp_path / "again", vocab_size=512)
    assert again.read_bytes() == sp_model.read_bytes()
    assert (tmp_path / "again.vocab").read_text(encoding="utf-8").count("\n") == 512
    assert not [p for p in tmp_path.iterdir() if ".tmp" in p.name]


def test_training_lines_keep_lines_not_documents() -> None:
    long_line = "x" * (MAX_LINE_BYTES + 1)
    lines, total, too_long = training_lines(["a = 1\n\n  b\r\n" + long_line + "\n", "last"])
    assert lines == ["a = 1", "  b", "last"]
    assert (total, too_long) == (3, 1)
    docs = ["\n".join(f"line {d}.{k}" for k in range(50)) for d in range(20)]
    sample, total, _ = training_lines(docs, max_lines=100, seed=5)
    assert total == 1000 and len(sample) == 100 and len(set(sample)) == 100
    assert sample == training_lines(docs, max_lines=100, seed=5)[0]  # deterministic
    assert sample != training_lines(docs, max_lines=100, seed=6)[0]
    everything = [line for doc in docs for line in doc.split("\n")]
    assert sample == sorted(sample, key=everything.index)  # kept in corpus order


def test_missing_model_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.model"
    with pytest.raises(DataError) as info:
        build_tokenizer(TokenizerConfig(type="sentencepiece", model=str(missing)))
    message = str(info.value)
    assert str(missing) in message
    assert "python tools/train_tokenizer.py --input" in message and f"--model-prefix {tmp_path / 'nope'}" in message


def test_bad_config() -> None:
    with pytest.raises(ConfigError, match=r"tokenizer\.model"):
        build_tokenizer(TokenizerConfig(type="sentencepiece", model=None))
    with pytest.raises(ConfigError, match="unknown tokenizer"):
        build_tokenizer(TokenizerConfig(type="gpt2"))


def test_invalid_model_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"not a protobuf")
    with pytest.raises(DataError, match=str(bad)):
        build_tokenizer(TokenizerConfig(type="sentencepiece", model=str(bad)))


def test_training_errors(corpus: Path, tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"vocab_size 100 is too small.*raise --vocab-size"):
        train_sentencepiece([corpus], tmp_path / "small", vocab_size=100)  # < 4 special + 256 bytes + chars
    with pytest.raises(DataError, match=re.escape(str(tmp_path / "missing.jsonl"))):
        train_sentencepiece([tmp_path / "missing.jsonl"], tmp_path / "m", vocab_size=512)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": broken\n', encoding="utf-8")
    with pytest.raises(DataError, match=re.escape(f"{bad}:2")):
        train_sentencepiece([bad], tmp_path / "b", vocab_size=512)
    assert not list(tmp_path.glob("*.model"))


def test_sentencepiece_special_tokens_and_batches(sp_model: Path) -> None:
    default = build_tokenizer(TokenizerConfig(type="sentencepiece", model=str(sp_model)))
    assert (default.eod, default.pad) == (2, 3)  # </s> and <pad> of train_sentencepiece
    explicit = build_tokenizer(TokenizerConfig(type="sentencepiece", model=str(sp_model), eod_token="<pad>",
                                               pad_token="<s>"))
    assert (explicit.eod, explicit.pad) == (3, 1)
    assert pickle.loads(pickle.dumps(explicit)).eod == 3
    with pytest.raises(ConfigError, match="tokenizer.pad_token: '<nope>' is not a piece"):
        build_tokenizer(TokenizerConfig(type="sentencepiece", model=str(sp_model), pad_token="<nope>"))
    texts = [CODE, "", "\n", "\n\nx\n", " a \n  b ", "plain text", "a \u2581 b\nc"]  # with and without "\u2581"
    assert default._newline_ids is not None  # protobuf is a dependency: batches are encoded line by line
    assert default.encode_batch(texts) == [default.encode(t) for t in texts]
