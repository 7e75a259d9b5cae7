"""Pre-packed samples the Hugging Face way (data.packing=position_ids): conversion, errors, batches, and
exactness against the same documents given EOD-delimited (reset_position_ids + reset_attention_mask)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_sp import config
from megatron_sp.config import TokenizerConfig
from megatron_sp.data import build_datasets, build_tokenizer, check_inputs, collate, convert_packed_jsonl
from megatron_sp.data.indexed import IndexedDataset, IndexedDatasetWriter, data_file_paths
from megatron_sp.data.packed import PackedDataset, collate_packed, side_prefixes
from megatron_sp.errors import ConfigError, DataError

ROOT = Path(__file__).resolve().parents[2]
VOCAB, PAD = 258, 257  # the byte tokenizer's ids and pad
EOD = 256


def _write(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _hf_row(documents: list[list[int]], labels: bool = False) -> dict:
    """What DataCollatorWithFlattening gives for these documents: positions restart at 0 per document, labels
    -100 on each document's first token."""
    row: dict = {"input_ids": [t for d in documents for t in d],
                 "position_ids": [p for d in documents for p in range(len(d))]}
    if labels:
        row["labels"] = [-100 if p == 0 else t for d in documents for p, t in enumerate(d)]
    return row


def _outputs(prefix: Path) -> list[Path]:
    base = f"{prefix}_packed"
    return [p for pre in (base, *side_prefixes(base)) for p in data_file_paths(pre)]


def test_convert_pads_and_reads_back(tmp_path):
    docs = [[[1, 2, 3], [4, 5]], [[6, 7, 8, 9, 10, 11, 12, 13, 14]]]
    src = _write(tmp_path / "p.jsonl", [_hf_row(docs[0], labels=True), "", _hf_row(docs[1])])
    stats = convert_packed_jsonl([src], tmp_path / "out", 8, VOCAB, PAD)
    assert stats["samples"] == 2 and stats["padded"] == 1 and stats["pad_tokens"] == 4
    tokens, positions, labels = (IndexedDataset(p) for p in (tmp_path / "out_packed",
                                                             *side_prefixes(tmp_path / "out_packed")))
    assert tokens[0].tolist() == [1, 2, 3, 4, 5, PAD, PAD, PAD, PAD]  # padded to seq_length + 1
    assert positions[0].tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3]  # the padding is a document of its own
    assert labels[0].tolist() == [-100, 2, 3, -100, 5, -100, -100, -100, -100]
    assert labels[1].tolist() == list(range(6, 15))  # no labels: the input ids
    ds = PackedDataset(tokens, np.arange(2), 8, 5, seed=1, name="train")
    assert ds[0].shape == (3, 9) and sorted(ds.sample_ids[:2].tolist()) == [0, 1]  # an epoch is a permutation


def test_collate_packed_masks_document_ends_and_ignored_labels():
    sample = np.array([[1, 2, 3, 4, 5, 6, 7, 8, 9],
                       [0, 1, 2, 3, 1, 2, 0, 0, 1],  # starts: 0, 4 (a decrease), 6, 7 (0 after 0)
                       [1, 2, -100, 4, 5, 6, 7, 8, -100]])
    b = collate_packed([sample])
    assert b["tokens"][0].tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert b["position_ids"][0].tolist() == [0, 1, 2, 3, 1, 2, 0, 0]
    assert b["document_ids"][0].tolist() == [0, 0, 0, 0, 1, 1, 2, 3]
    # target of token k is label k+1: -100 at 2 and 8, the next document's first token at 4, 6, 7: masked
    assert b["loss_mask"][0].tolist() == [1, 0, 1, 0, 1, 0, 0, 0]
    assert b["labels"][0].tolist()[:1] == [2] and b["labels"].min() >= 0  # masked labels stay valid ids
    assert collate([sample], eod=0, eod_mask_loss=True, reset_position_ids=True).keys() == b.keys()


def test_exactness_against_eod_delimited_documents(tmp_path):
    """The same documents, (a) EOD-delimited through collate's reset flags and eod_mask_loss, (b) HF-packed
    (each document ends with its EOD, as preprocess --append-eod writes it) through the converter and
    PackedDataset: identical tokens, positions, document ids, loss mask, and labels wherever trained."""
    rng = np.random.default_rng(3)
    s = 32
    rows_a, rows_b = [], []
    for _ in range(12):
        docs, n = [], 0
        while n < s + 1:
            doc = [*rng.integers(0, EOD, int(rng.integers(1, 12))).tolist(), EOD]
            docs.append(doc)
            n += len(doc)
        stream = np.array([t for d in docs for t in d])[:s + 1]
        rows_a.append(stream)
        positions = np.concatenate([np.arange(len(d)) for d in docs])[:s + 1]
        rows_b.append({"input_ids": stream.tolist(), "position_ids": positions.tolist()})
    convert_packed_jsonl([_write(tmp_path / "b.jsonl", rows_b)], tmp_path / "b", s, VOCAB, PAD)
    ds = PackedDataset(IndexedDataset(tmp_path / "b_packed"), np.arange(12), s, 12, seed=0, name="train")
    order = ds.sample_ids.tolist()
    a = collate([rows_a[j] for j in order], eod=EOD, eod_mask_loss=True, reset_position_ids=True,
                reset_attention_mask=True)
    b = collate([ds[i] for i in range(12)], eod=EOD, eod_mask_loss=False)
    for key in ("tokens", "position_ids", "document_ids", "loss_mask"):
        assert torch.equal(a[key], b[key]), key
    trained = a["loss_mask"] > 0
    assert torch.equal(a["labels"][trained], b["labels"][trained])
    assert (~trained).any() and (a["document_ids"] > 0).any()  # boundaries occurred


@pytest.mark.parametrize("row, needle", [
    ('{"input_ids": [1, 2', "p.jsonl:2: invalid JSON"),
    ('[1, 2]', "p.jsonl:2: expected a JSON object"),
    ({"input_ids": [1, 2]}, "p.jsonl:2: key 'position_ids' missing"),
    ({"position_ids": [0, 1]}, "p.jsonl:2: key 'input_ids' missing"),
    ({"input_ids": [1, 2, 3], "position_ids": [0, 1]}, "p.jsonl:2: position_ids has 2 entries but input_ids has 3"),
    ({"input_ids": [1, 2], "position_ids": [0, 1], "labels": [1]}, "labels has 1 entries but input_ids has 2"),
    ({"input_ids": [1, 2], "position_ids": [1, 2]}, "p.jsonl:2: position_ids starts at 1, not 0"),
    ({"input_ids": [1, 2, 3], "position_ids": [0, 5, 6]}, r"position_ids\[1\] = 5 is negative or larger"),
    ({"input_ids": list(range(10)), "position_ids": list(range(10))},
     "p.jsonl:2: a sample of 10 tokens is longer than --seq-length \\+ 1 = 9; pass --seq-length 9"),
    ({"input_ids": [1, 999], "position_ids": [0, 1]}, r"input_ids\[1\] = 999 is outside the tokenizer's 258 ids"),
    ({"input_ids": [1, 2], "position_ids": [0, 1], "labels": [-1, 2]}, r"labels\[0\] = -1 is outside"),
    ({"input_ids": ["a"], "position_ids": [0]}, "'input_ids' must be a list of integers"),
    ({"input_ids": [], "position_ids": []}, "empty sample"),
])
def test_converter_errors_name_file_and_line_and_leave_nothing(tmp_path, row, needle):
    src = _write(tmp_path / "p.jsonl", [_hf_row([[1, 2, 3]]), row])
    with pytest.raises(DataError, match=needle):
        convert_packed_jsonl([src], tmp_path / "out", 8, VOCAB, PAD)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.jsonl"]  # no output, no temporary file


def test_converter_refuses_existing_outputs_unless_overwrite(tmp_path):
    src = _write(tmp_path / "p.jsonl", [_hf_row([[1, 2, 3]])])
    convert_packed_jsonl([src], tmp_path / "out", 8, VOCAB, PAD)
    before = [p.read_bytes() for p in _outputs(tmp_path / "out")]
    _write(src, [_hf_row([[4, 5]])])
    with pytest.raises(DataError, match="already exists.*--overwrite"):
        convert_packed_jsonl([src], tmp_path / "out", 8, VOCAB, PAD, overwrite=False)
    assert [p.read_bytes() for p in _outputs(tmp_path / "out")] == before
    convert_packed_jsonl([src], tmp_path / "out", 8, VOCAB, PAD, overwrite=True)
    assert IndexedDataset(tmp_path / "out_packed")[0].tolist()[:2] == [4, 5]


def test_command_line(tmp_path):
    src = _write(tmp_path / "p.jsonl", [_hf_row([[104, 105], [33]])])
    base = [sys.executable, "tools/preprocess_data.py", "--input", str(src), "--output-prefix", str(tmp_path / "o"),
            "--tokenizer-type", "byte"]
    ok = subprocess.run([*base, "--packed-samples", "--seq-length", "4"], cwd=ROOT, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert "samples 1 of 5 tokens (1 padded" in ok.stdout and all(p.is_file() for p in _outputs(tmp_path / "o"))
    again = subprocess.run([*base, "--packed-samples", "--seq-length", "4"], cwd=ROOT, capture_output=True, text=True)
    assert again.returncode != 0 and again.stderr.startswith("error: output") and "--overwrite" in again.stderr
    for extra, needle in ((["--packed-samples"], "needs --seq-length"), (["--seq-length", "4"], "only"),
                          (["--packed-samples", "--seq-length", "4", "--append-eod"], "--append-eod")):
        bad = subprocess.run([*base, *extra], cwd=ROOT, capture_output=True, text=True)
        assert bad.returncode != 0 and needle in bad.stderr, (extra, bad.stderr)


BASE = ["tokenizer.type=byte", "model.seq_length=8", "train.global_batch_size=2", "train.micro_batch_size=2",
        "train.iters=3"]


def test_config_checks_and_training_datasets(tmp_path):
    rows = [_hf_row([[1, 2, 3], [4, 5, 6, 7]]), _hf_row([[8, 9]]), _hf_row([[10] * 9])] * 4
    convert_packed_jsonl([_write(tmp_path / "p.jsonl", rows)], tmp_path / "hf", 8, VOCAB, PAD)
    data = f"data.paths=[{tmp_path}/hf_packed]"
    cfg = config.load(overrides=[*BASE, data, "data.packing=position_ids", "data.split=2,1,0"])
    check_inputs(cfg)
    train, valid = build_datasets(cfg, build_tokenizer(TokenizerConfig(type="byte")), 6, 2)
    assert isinstance(train, PackedDataset) and len(train) == 6 and valid is not None and len(valid) == 2
    batch = collate([train[i] for i in range(2)], eod=EOD, eod_mask_loss=False)
    assert batch["tokens"].shape == batch["document_ids"].shape == (2, 8)
    with pytest.raises(DataError, match="data.packing=eod would cut it.*set data.packing=position_ids"):
        check_inputs(config.load(overrides=[*BASE, data]))
    with pytest.raises(DataError, match="model.seq_length \\+ 1 = 17; train with model.seq_length=8"):
        check_inputs(config.load(overrides=[*BASE, data, "data.packing=position_ids", "model.seq_length=16"]))
    for extra, needle in ((["data.reset_attention_mask=true"], "set data.reset_attention_mask=false"),
                          (["data.eod_mask_loss=true"], "data.eod_mask_loss=false"),
                          (["model.attention_dropout=0.1"], "model.attention_dropout=0"),
                          (["data.packing=position_id"], "data.packing")):
        with pytest.raises(ConfigError, match=needle):
            config.load(overrides=[*BASE, data, "data.packing=position_ids", *extra])
    with IndexedDatasetWriter(tmp_path / "eod", np.uint16) as writer:
        writer.add_document([1, 2, EOD])
    with pytest.raises(DataError, match="eod_positions.bin/.idx not found.*--packed-samples"):
        check_inputs(config.load(overrides=[*BASE, f"data.paths=[{tmp_path}/eod]", "data.packing=position_ids"]))
