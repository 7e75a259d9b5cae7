"""The data tools end to end as subprocesses: corpus → tokenizer → .bin/.idx, and one-line user errors."""
from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_sp.config.schema import TokenizerConfig
from megatron_sp.data.indexed import IndexedDataset
from megatron_sp.data.tokenizer import build_tokenizer

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ("make_demo_corpus.py", "train_tokenizer.py", "preprocess_data.py")


def run_tool(name: str, *args: str | Path) -> subprocess.CompletedProcess[str]:
    """Run ``python tools/<name> args`` from the repo root, as a user would (package not installed)."""
    return subprocess.run([sys.executable, f"tools/{name}", *map(str, args)], cwd=ROOT, check=False,
                          capture_output=True, text=True, timeout=120)


def assert_one_line_error(result: subprocess.CompletedProcess[str], *words: str) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for word in words:
        assert word in lines[0]


def test_pipeline_end_to_end(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.jsonl"
    result = run_tool("make_demo_corpus.py", "--output", corpus, "--max-bytes", 80_000)
    assert result.returncode == 0, result.stderr
    assert 0 < corpus.stat().st_size <= 80_000
    texts = [json.loads(line)["text"] for line in corpus.read_text(encoding="utf-8").splitlines()]
    assert len(texts) > 1 and all(texts)

    result = run_tool("train_tokenizer.py", "--input", corpus, "--model-prefix", tmp_path / "tok",
                      "--vocab-size", 512)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "tok.model").is_file() and (tmp_path / "tok.vocab").is_file()

    result = run_tool("preprocess_data.py", "--input", corpus, "--output-prefix", tmp_path / "demo",
                      "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", tmp_path / "tok.model",
                      "--json-keys", "text", "--append-eod", "--workers", 2)
    assert result.returncode == 0, result.stderr
    for word in ("docs", "tokens", "docs/s", "MB/s"):
        assert word in result.stdout
    assert f"docs {len(texts)}," in result.stdout

    tokenizer = build_tokenizer(TokenizerConfig(type="sentencepiece", model=str(tmp_path / "tok.model")))
    ds = IndexedDataset(tmp_path / "demo_text_document")
    assert ds.num_documents == len(ds) == len(texts)
    assert ds.dtype.name == "uint16"
    for i, text in enumerate(texts):
        tokens = ds[i].tolist()
        assert tokens[-1] == tokenizer.eod
        assert tokenizer.decode(tokens[:-1]) == text
    assert f"tokens {ds.num_tokens}," in result.stdout

    # Workers do not change the output; the byte tokenizer and .gz input work too.
    gz = tmp_path / "corpus.jsonl.gz"
    gz.write_bytes(gzip.compress(corpus.read_bytes()))
    result = run_tool("preprocess_data.py", "--input", gz, "--output-prefix", tmp_path / "one",
                      "--tokenizer-type", "sentencepiece", "--tokenizer-model", tmp_path / "tok.model",
                      "--append-eod")
    assert result.returncode == 0, result.stderr
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"one_text_document{suffix}").read_bytes() == \
            (tmp_path / f"demo_text_document{suffix}").read_bytes()
    result = run_tool("preprocess_data.py", "--input", corpus, "--output-prefix", tmp_path / "bytes",
                      "--tokenizer-type", "byte")
    assert result.returncode == 0, result.stderr
    raw = IndexedDataset(tmp_path / "bytes_text_document")
    assert bytes(raw[0].tolist()).decode("utf-8") == texts[0]  # no --append-eod: no EOD


@pytest.mark.parametrize("tool", TOOLS)
def test_help_documents_every_flag(tool: str) -> None:
    result = run_tool(tool, "--help")
    assert result.returncode == 0
    flags = {
        "make_demo_corpus.py": ["--output", "--max-bytes", "--overwrite"],
        "train_tokenizer.py": ["--input", "--model-prefix", "--vocab-size", "--json-key", "--overwrite"],
        "preprocess_data.py": ["--input", "--output-prefix", "--tokenizer-type", "--tokenizer-model",
                               "--json-keys", "--append-eod", "--workers"],
    }[tool]
    for flag in flags:
        assert flag in result.stdout


def test_user_errors_are_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "missing.jsonl"
    assert_one_line_error(run_tool("preprocess_data.py", "--input", missing, "--output-prefix", tmp_path / "x",
                                   "--tokenizer-type", "byte"), str(missing), "make_demo_corpus.py")
    assert_one_line_error(run_tool("train_tokenizer.py", "--input", missing, "--model-prefix", tmp_path / "t"),
                          str(missing))

    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "a"}\n{"body": "b"}\n', encoding="utf-8")
    no_model = tmp_path / "none.model"
    assert_one_line_error(run_tool("preprocess_data.py", "--input", corpus, "--output-prefix", tmp_path / "x",
                                   "--tokenizer-type", "sentencepiece", "--tokenizer-model", no_model),
                          str(no_model), "tools/train_tokenizer.py")
    assert_one_line_error(run_tool("preprocess_data.py", "--input", corpus, "--output-prefix", tmp_path / "x",
                                   "--tokenizer-type", "byte"), f"{corpus}:2", "'text'")
    corpus.write_text('{"text": "a"}\n\n{"text": oops}\n', encoding="utf-8")
    assert_one_line_error(run_tool("preprocess_data.py", "--input", corpus, "--output-prefix", tmp_path / "x",
                                   "--tokenizer-type", "byte", "--workers", 2), f"{corpus}:3", "invalid JSON")
    assert not list(tmp_path.glob("x*"))  # a failed run leaves no (partial) outputs


def load_tool(name: str):
    """``tools/<name>`` as a module, to call its ``main(argv)`` in this process."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"{Path(name).stem}_tool", ROOT / "tools" / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_existing_outputs_are_kept_unless_overwrite(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """make_demo_corpus.py and train_tokenizer.py refuse an existing output in one line naming it and
    --overwrite, before any work and leaving it byte for byte; --overwrite replaces it, no temporary left."""
    make_corpus, train_tok = load_tool("make_demo_corpus.py"), load_tool("train_tokenizer.py")
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("old\n")
    assert make_corpus.main(["--output", str(corpus), "--max-bytes", "30000"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: output '{corpus}' already exists (4 bytes)")
    assert "pass --overwrite" in err and "--output" in err and corpus.read_text() == "old\n"
    assert make_corpus.main(["--output", str(corpus), "--max-bytes", "30000", "--overwrite"]) == 0
    assert corpus.read_text().startswith('{"text": ')

    vocab = tmp_path / "tok.vocab"  # only one of the two outputs exists: still refused, and nothing trained
    vocab.write_text("mine\n")
    args = ["--input", str(corpus), "--model-prefix", str(tmp_path / "tok"), "--vocab-size", "400"]
    assert train_tok.main(args) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"'{vocab}' already exists" in err and "--overwrite" in err
    assert vocab.read_text() == "mine\n" and not (tmp_path / "tok.model").exists()
    assert train_tok.main([*args, "--overwrite"]) == 0
    assert (tmp_path / "tok.model").stat().st_size > 0 and vocab.read_text() != "mine\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.jsonl", "tok.model", "tok.vocab"]


def test_demo_corpus_is_a_fixed_shuffle_so_its_validation_tail_is_like_the_rest(tmp_path: Path) -> None:
    """Sorted paths made the demo's validation split (the last 5 % of documents) all encodings/cp*.py
    code tables: validation loss 1.6 nats below training loss. The tail now mixes packages and sizes."""
    from megatron_sp.data.corpus import demo_source_files, make_demo_corpus

    files = [relative for relative, _ in demo_source_files()]
    assert files != sorted(files)
    a = make_demo_corpus(tmp_path / "a.jsonl")  # the demo's size (4 MB)
    b = make_demo_corpus(tmp_path / "b.jsonl")
    assert a.read_bytes() == b.read_bytes()  # deterministic
    texts = [json.loads(line)["text"] for line in a.read_text(encoding="utf-8").splitlines()]
    tail = texts[-max(8, len(texts) // 10):]
    assert sum("codecs.charmap_build" in t for t in tail) <= len(tail) // 2  # not a run of code tables
    mean = sum(map(len, texts)) / len(texts)
    assert sum(map(len, tail)) / len(tail) > 0.25 * mean  # not only the small files that filled the budget
