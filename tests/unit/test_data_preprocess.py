"""Preprocessing at scale: chunked multi-worker output identical to one worker, sentence splitting,
pre-split sentence lists, Megatron's EOD rule for empty documents, dtype by vocabulary, progress lines."""
from __future__ import annotations

import gzip
import json
import logging
from pathlib import Path

import numpy as np
import pytest

from megatron_sp.data.indexed import IndexedDataset, IndexedDatasetWriter, data_file_paths
from megatron_sp.data.preprocess import preprocess_jsonl, split_sentences
from megatron_sp.data.tokenizer import ByteTokenizer, Tokenizer
from megatron_sp.errors import DataError

TEXTS = ["First sentence. Second one!  Third?\nNo end", "", "Para one.\n\nPara two", "x" * 300,
         "Dr. Who? \"Quoted.\" (Paren.) end"]


def _corpus(path: Path, n: int = 40) -> Path:
    lines = []
    for i in range(n):
        lines.append(json.dumps({"text": TEXTS[i % len(TEXTS)] + f" #{i}", "title": f"title {i}"}))
        if i % 7 == 3:
            lines.append("   ")  # blank lines are skipped (but counted for error line numbers)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_split_sentences() -> None:
    text = TEXTS[0]
    assert split_sentences(text) == ["First sentence. ", "Second one!  ", "Third?\n", "No end"]
    assert split_sentences("Para one.\n\nPara two") == ["Para one.\n\n", "Para two"]
    assert split_sentences("a\n\n  \nb") == ["a\n\n  \n", "b"]
    assert split_sentences('He said "stop." Then (it ended.) ok') == ['He said "stop." ', "Then (it ended.) ", "ok"]
    for t in TEXTS + ["", "   ", "no end at all", "3.14 is pi. "]:
        assert "".join(split_sentences(t)) == t


def test_workers_and_chunks_do_not_change_the_output(tmp_path: Path) -> None:
    corpus = _corpus(tmp_path / "c.jsonl")
    tok = ByteTokenizer()
    one = preprocess_jsonl([corpus], tmp_path / "one", tok, json_keys=("text", "title"), workers=1)
    two = preprocess_jsonl([corpus], tmp_path / "two", tok, json_keys=("text", "title"), workers=2, chunk_bytes=200)
    assert one["docs"] == two["docs"] == 40 and one["tokens"] == two["tokens"]
    for key in ("text", "title"):
        for a, b in zip(data_file_paths(tmp_path / f"one_{key}_document"),
                        data_file_paths(tmp_path / f"two_{key}_document"), strict=True):
            assert a.read_bytes() == b.read_bytes()
    ds = IndexedDataset(tmp_path / "one_text_document")
    texts = [json.loads(line)["text"] for line in corpus.read_text().splitlines() if line.strip()]
    assert ds.num_documents == len(texts) == 40 and len(ds) == 40  # one sequence per document
    for d, text in enumerate(texts):
        tokens = ds.get_document(d)
        assert int(tokens[-1]) == tok.eod and tok.decode(tokens[:-1].tolist()) == text


def test_split_sentences_and_sentence_lists(tmp_path: Path) -> None:
    corpus = tmp_path / "s.jsonl"
    corpus.write_text("\n".join(json.dumps(r) for r in [
        {"text": "One. Two! Three"},
        {"text": ""},  # no tokens: no sequence and no EOD, as in Megatron
        {"text": ["pre", "", "split"]},  # a list is the document's sentences; the empty one is left out
    ]) + "\n", encoding="utf-8")
    tok = ByteTokenizer()
    stats = preprocess_jsonl([corpus], tmp_path / "out", tok, split_sentences=True, workers=2, chunk_bytes=1)
    assert stats["outputs"] == [str(tmp_path / "out_text_sentence")]
    ds = IndexedDataset(tmp_path / "out_text_sentence")
    assert ds.document_indices.tolist() == [0, 3, 3, 5]
    sentences = [bytes(ds[i][ds[i] < 256].tolist()).decode() for i in range(len(ds))]
    assert sentences == ["One. ", "Two! ", "Three", "pre", "split"]
    assert [int(ds[i][-1]) == tok.eod for i in range(len(ds))] == [False, False, True, False, True]
    assert ds.document_sizes.tolist() == [16, 0, 9]


class _BigVocab(ByteTokenizer):
    """Byte ids with a vocabulary past Megatron's uint16 limit (65500): the dataset must be int32."""

    @property
    def vocab_size(self) -> int:
        return 70_000

    @property
    def eod(self) -> int:
        return 69_999

    def encode(self, text: str) -> list[int]:
        return [b + 65_000 for b in text.encode("utf-8")]


def test_dtype_follows_the_vocabulary(tmp_path: Path) -> None:
    corpus = _corpus(tmp_path / "c.jsonl", n=3)
    preprocess_jsonl([corpus], tmp_path / "small", ByteTokenizer())
    preprocess_jsonl([corpus], tmp_path / "big", _BigVocab())
    assert IndexedDataset(tmp_path / "small_text_document").dtype == np.uint16
    big = IndexedDataset(tmp_path / "big_text_document")
    assert big.dtype == np.int32 and int(big[0][-1]) == 69_999 and int(big[0][0]) >= 65_000


def test_progress_gzip_and_empty_input(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    corpus = _corpus(tmp_path / "c.jsonl")
    gz = tmp_path / "c.jsonl.gz"
    gz.write_bytes(gzip.compress(corpus.read_bytes()))
    with caplog.at_level(logging.INFO, logger="megatron_sp"):
        stats = preprocess_jsonl([gz], tmp_path / "gz", ByteTokenizer(), chunk_bytes=100, log_interval=10)
    progress = [r.getMessage() for r in caplog.records if r.getMessage().startswith("processed")]
    assert len(progress) == 4 and all("docs/s" in m and "MB/s" in m for m in progress)
    assert stats["bytes"] == corpus.stat().st_size
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n", encoding="utf-8")
    with pytest.raises(DataError, match=f"no documents in {empty}"):
        preprocess_jsonl([empty], tmp_path / "e", ByteTokenizer(), workers=2)
    assert not list(tmp_path.glob("e_*"))


def test_add_packed_equals_add_document(tmp_path: Path) -> None:
    docs = [[1, 2, 3], [], [4], [5, 6]]
    lengths = [[2, 1], [], [1], [1, 1]]
    with IndexedDatasetWriter(tmp_path / "a", np.uint16) as w:
        for doc, lens in zip(docs, lengths, strict=True):
            w.add_document(doc, lens)
    with IndexedDatasetWriter(tmp_path / "b", np.uint16) as w:
        w.add_packed(np.array([1, 2, 3]), np.array([2, 1]), np.array([2, 0]))
        w.add_item([4])  # single items and packed chunks mix
        w.end_document()
        w.add_packed(np.array([5, 6]), np.array([1, 1]), np.array([2]))
        with pytest.raises(ValueError, match="sequences"):
            w.add_packed(np.array([1]), np.array([1]), np.array([2]))
    for a, b in zip(data_file_paths(tmp_path / "a"), data_file_paths(tmp_path / "b"), strict=True):
        assert a.read_bytes() == b.read_bytes()


def test_tokenizer_encode_batch_default() -> None:
    class Plain(Tokenizer):
        name, vocab_size, eod, pad = "plain", 10, 9, 9

        def encode(self, text: str) -> list[int]:
            return [len(text)]

        def decode(self, ids: list[int]) -> str:
            return ""

    assert Plain().encode_batch(["ab", "", "abc"]) == [[2], [0], [3]]


def test_existing_outputs_are_never_replaced_unless_asked(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """tools/preprocess_data.py twice: the second run is one error line and the first run's files stay byte for
    byte; --overwrite replaces them; a failing run (even with --overwrite) leaves no partial files and the old
    ones untouched; --workers 0 is one line naming --workers."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("preprocess_data_tool",
                                                  Path(__file__).resolve().parents[2] / "tools" / "preprocess_data.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    big, small = _corpus(tmp_path / "big.jsonl", n=40), _corpus(tmp_path / "small.jsonl", n=1)
    out = tmp_path / "out"
    files = data_file_paths(tmp_path / "out_text_document")

    def run(corpus: Path, *extra: str) -> tuple[int, str]:
        try:
            code = tool.main(["--input", str(corpus), "--output-prefix", str(out), "--tokenizer-type", "byte", *extra])
        except SystemExit as exc:  # argparse errors
            code = exc.code
        return code, capsys.readouterr().err

    assert run(big)[0] == 0
    first = [p.read_bytes() for p in files]
    code, err = run(small)
    assert code == 1 and err.count("\n") == 1 and err.startswith(f"error: output '{files[0]}' already exists") \
        and "--overwrite" in err, err
    assert [p.read_bytes() for p in files] == first
    bad = tmp_path / "bad.jsonl"
    bad.write_text(big.read_text() + "{oops\n")
    assert run(bad, "--overwrite", "--workers", "2")[0] == 1
    assert [p.read_bytes() for p in files] == first
    assert sorted(p.name for p in tmp_path.glob("out*")) == ["out_text_document.bin", "out_text_document.idx"]
    assert run(small, "--overwrite")[0] == 0
    assert IndexedDataset(tmp_path / "out_text_document").num_documents == 1
    code, err = run(small, "--workers", "0")
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: --workers must be at least 1") \
        and "--workers 1" in err, err
