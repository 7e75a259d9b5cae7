"""Every bad data input, through train.py's entry point: one ``error:`` line naming the file (or key) and
the fix, a non-zero exit code, no traceback — before any rank or process group starts."""
from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

import train as cli  # train.py: its main() is the command line
from megatron_sp import launcher, training
from megatron_sp.data.indexed import HEADER, IndexedDatasetWriter, data_file_paths

BASE = ["tokenizer.type=byte", "data.build_demo=false", "train.iters=1", "model.seq_length=8"]


def _dataset(prefix: Path, docs: list[list[int]] | None = None) -> tuple[Path, Path]:
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        writer.add_documents(docs if docs is not None else [[1, 2, 3, 256]] * 4)
    return data_file_paths(prefix)


@pytest.fixture(autouse=True)
def _entry_point(monkeypatch: pytest.MonkeyPatch) -> None:
    """main() as train.py runs it, but nothing may train or launch, and the logger is restored after."""
    def must_not_train(*_: object, **__: object) -> None:
        raise AssertionError("passed the data checks and would train")

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(training.log, "handlers", [])
    monkeypatch.setattr(training.log, "propagate", training.log.propagate)
    monkeypatch.setattr(training.log, "level", training.log.level)
    monkeypatch.setattr(training, "run", must_not_train)
    monkeypatch.setattr(launcher, "start_local", must_not_train)


def _error_line(capsys: pytest.CaptureFixture[str], tmp_path: Path, paths: str, *words: str) -> str:
    code = cli.main([*BASE, f"data.paths={paths}", f"logging.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code != 0 and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


def test_missing_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bin_path, idx_path = _dataset(tmp_path / "d")
    idx_path.unlink()
    _error_line(capsys, tmp_path, f"[{tmp_path / 'd'}]", str(idx_path), "not found", "tools/preprocess_data.py")
    _dataset(tmp_path / "d")
    bin_path.unlink()
    _error_line(capsys, tmp_path, f"[{tmp_path / 'd'}]", str(bin_path), "not found", "tools/preprocess_data.py")


def test_bin_and_idx_size_mismatch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bin_path, idx_path = _dataset(tmp_path / "d")
    with open(bin_path, "ab") as f:
        f.write(b"\0\0")
    _error_line(capsys, tmp_path, f"[{tmp_path / 'd'}]", str(bin_path), str(idx_path), "does not belong",
                "rebuild it")
    _dataset(tmp_path / "d")
    bin_path.write_bytes(bin_path.read_bytes()[:-2])  # cut short
    _error_line(capsys, tmp_path, f"[{tmp_path / 'd'}]", str(bin_path), "cut short")


def test_bad_header_and_version(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, idx_path = _dataset(tmp_path / "d")
    raw = bytearray(idx_path.read_bytes())
    idx_path.write_bytes(b"NOTANIDX!" + raw[9:])
    _error_line(capsys, tmp_path, f"[{tmp_path / 'd'}]", str(idx_path), "magic", "rebuild it")
    struct.pack_into("<Q", raw, 9, 2)  # version 2
    idx_path.write_bytes(raw)
    _error_line(capsys, tmp_path, f"[{tmp_path / 'd'}]", str(idx_path), "version 2", "rebuild it")
    idx_path.write_bytes(bytes(raw[:HEADER.size - 3]))
    _error_line(capsys, tmp_path, f"[{tmp_path / 'd'}]", str(idx_path), "truncated", "rebuild it")


def test_weight_list_of_odd_length(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _dataset(tmp_path / "a")
    line = _error_line(capsys, tmp_path, f"[0.3,{tmp_path / 'a'},0.7]", "data.paths", "odd number",
                       "[w1, PREFIX1, w2, PREFIX2, ...]")
    assert line.startswith("error: data.paths")
    _error_line(capsys, tmp_path, f"[0.3,{tmp_path / 'a'},-1,{tmp_path / 'a'}]", "data.paths", "positive")


def test_empty_dataset(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _dataset(tmp_path / "ok")
    bin_path, _ = _dataset(tmp_path / "empty", docs=[])
    _error_line(capsys, tmp_path, f"[0.5,{tmp_path / 'ok'},0.5,{tmp_path / 'empty'}]", str(bin_path), "is empty",
                "tools/preprocess_data.py", "drop it from data.paths")
    bin_path, _ = _dataset(tmp_path / "blank", docs=[[], []])  # documents without tokens
    _error_line(capsys, tmp_path, f"[{tmp_path / 'blank'}]", str(bin_path), "is empty")
