"""Hugging Face ``tokenizers`` JSON tokenizers, explicit special tokens, and the config checks around them."""
from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from megatron_sp import config
from megatron_sp.config.schema import TokenizerConfig
from megatron_sp.data.indexed import IndexedDataset
from megatron_sp.data.tokenizer import HFTokenizer, build_tokenizer
from megatron_sp.errors import ConfigError, DataError

tokenizers = pytest.importorskip("tokenizers")

TEXT = "def  bar(y):\n\treturn y*2  # ünïcode 😀 ▁ 中文\n"


def _train(path: Path, special: list[str]) -> Path:
    """A byte-level BPE (GPT-2/NeoX style) of at most 300 ids trained on a few lines, saved as tokenizer.json."""
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["def foo(x):\n    return x + 1\n"] * 20, trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    return path / "tokenizer.json"


@pytest.fixture(scope="module")
def hf_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _train(tmp_path_factory.mktemp("hf"), ["<|endoftext|>", "<|padding|>"])


def test_hf_tokenizer(hf_json: Path) -> None:
    tok = build_tokenizer(TokenizerConfig(type="hf", model=str(hf_json)))
    assert isinstance(tok, HFTokenizer)
    size = tokenizers.Tokenizer.from_file(str(hf_json)).get_vocab_size(with_added_tokens=True)
    assert (tok.vocab_size, tok.eod, tok.pad) == (size, 0, 1) and size > 256
    ids = tok.encode(TEXT)
    assert tok.eod not in ids and tok.decode(ids) == TEXT  # byte-level: exact round trip
    assert tok.decode([*ids, tok.eod, tok.pad]) == TEXT  # special ids decode to nothing
    assert tok.encode_batch([TEXT, "", "x"]) == [ids, [], tok.encode("x")]
    again = pickle.loads(pickle.dumps(tok))  # preprocessing workers receive it pickled
    assert again.encode(TEXT) == ids and (again.eod, again.pad) == (0, 1)
    from_dir = build_tokenizer(TokenizerConfig(type="hf", model=str(hf_json.parent)))  # a directory works too
    assert from_dir.encode(TEXT) == ids


def test_hf_special_tokens_are_explicit(hf_json: Path, tmp_path: Path) -> None:
    tok = build_tokenizer(TokenizerConfig(type="hf", model=str(hf_json), eod_token="<|padding|>",
                                          pad_token="<|endoftext|>"))
    assert (tok.eod, tok.pad) == (1, 0)
    with pytest.raises(ConfigError, match="tokenizer.eod_token: '<nope>'"):
        build_tokenizer(TokenizerConfig(type="hf", model=str(hf_json), eod_token="<nope>"))
    bare = _train(tmp_path / "bare", ["<unk>"])  # no end-of-document token among the usual names
    with pytest.raises(ConfigError, match="set tokenizer.eod_token"):
        build_tokenizer(TokenizerConfig(type="hf", model=str(bare)))
    tok = build_tokenizer(TokenizerConfig(type="hf", model=str(bare), eod_token="<unk>"))
    assert tok.eod == tok.pad == 0  # no pad token: pad is EOD


def test_hf_file_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="tokenizer.json"):
        build_tokenizer(TokenizerConfig(type="hf", model=str(tmp_path / "missing.json")))
    broken = tmp_path / "tokenizer.json"
    broken.write_text("{not json", encoding="utf-8")
    with pytest.raises(DataError, match=f"{broken} is not a valid"):
        build_tokenizer(TokenizerConfig(type="hf", model=str(broken)))


def test_config_checks_tokenizer_keys() -> None:
    base = ["data.paths=[d/x]"]
    assert config.load(overrides=[*base, "tokenizer.type=hf", "tokenizer.model=t.json"]).tokenizer.type == "hf"
    with pytest.raises(ConfigError, match="tokenizer.model is not set"):
        config.load(overrides=[*base, "tokenizer.type=hf"])
    with pytest.raises(ConfigError, match="byte tokenizer's special ids are fixed"):
        config.load(overrides=[*base, "tokenizer.type=byte", "tokenizer.eod_token=x"])
    with pytest.raises(ConfigError, match="tokenizer.type"):
        config.load(overrides=[*base, "tokenizer.type=gpt2"])


def test_preprocess_tool_with_hf_tokenizer(hf_json: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("preprocess_tool", Path(__file__).parents[2] / "tools" /
                                                  "preprocess_data.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "def foo(x): return 1"}\n{"text": "ünï 😀"}\n', encoding="utf-8")
    code = tool.main(["--input", str(corpus), "--output-prefix", str(tmp_path / "hf"), "--tokenizer-type",
                      "HuggingFaceTokenizer", "--tokenizer-model", str(hf_json), "--append-eod", "--workers", "2"])
    assert code == 0 and "docs/s" in capsys.readouterr().out
    tok = build_tokenizer(TokenizerConfig(type="hf", model=str(hf_json)))
    ds = IndexedDataset(tmp_path / "hf_text_document")
    assert [tok.decode(ds[i].tolist()) for i in range(2)] == ["def foo(x): return 1", "ünï 😀"]
    assert all(int(ds[i][-1]) == tok.eod for i in range(2))
    assert tool.main(["--input", str(corpus), "--output-prefix", str(tmp_path / "x"), "--tokenizer-type", "hf",
                      "--tokenizer-model", str(hf_json), "--eod-token", "<nope>"]) != 0
    assert capsys.readouterr().err.startswith("error: tokenizer.eod_token: '<nope>'")
