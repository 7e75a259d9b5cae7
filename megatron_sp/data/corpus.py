"""JSONL corpora (one JSON object per line, plain or gzip) and the demo corpus: the Python standard
library's ``.py`` files, one per document, needing no download (same Python, same bytes)."""
from __future__ import annotations

import gzip
import hashlib
import json
import logging
import sysconfig
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from megatron_sp.files import atomic_file
from megatron_sp.errors import DataError, refuse_existing_outputs

log = logging.getLogger("megatron_sp")

SKIP_DIRS = frozenset({
    "site-packages", "dist-packages", "__pycache__",
    "test", "tests", "idle_test", "idlelib", "lib2to3", "test_data", "testdata",
})
"""Standard-library directories left out of the demo corpus: installed packages and test data."""

_MIN_LINE_BYTES = len(b'{"text": "x"}\n')


def demo_source_files(stdlib: Path | None = None) -> list[tuple[str, Path]]:
    """The stdlib ``.py`` files of the demo corpus as ``(relative posix path, path)``, ordered by the
    SHA-256 of the relative path: sorted paths would make the validation split ``encodings/cp*.py``."""
    root = Path(stdlib or sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise DataError(f"the Python standard library directory {root} does not exist; the demo corpus is "
                        f"built from it (give your own JSONL corpus instead)")
    files = []
    for path in root.rglob("*.py"):
        relative = path.relative_to(root)
        if SKIP_DIRS.intersection(relative.parts[:-1]) or not path.is_file():
            continue
        files.append((relative.as_posix(), path))
    files.sort(key=lambda item: hashlib.sha256(item[0].encode("utf-8")).hexdigest())
    return files


def make_demo_corpus(out_path: str | Path, max_bytes: int = 4_000_000, *, overwrite: bool = True) -> Path:
    """Write the demo JSONL corpus (``{"text": source}`` per line) of at most ``max_bytes`` bytes, atomically:
    files in ``demo_source_files`` order (empty, non-UTF-8 and overflowing ones skipped), written in a second
    fixed shuffle so the validation split is not biased towards small files. Unless ``overwrite``, an existing
    ``out_path`` is refused (before and just before the rename)."""
    out_path = Path(out_path)
    if max_bytes <= 0:
        raise DataError(f"max_bytes must be positive, got {max_bytes}")

    def refuse() -> None:
        if not overwrite:
            refuse_existing_outputs([out_path], "choose another --output")
    refuse()
    start = time.perf_counter()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    written = undecodable = 0
    chosen: list[tuple[str, bytes]] = []
    for relative, path in demo_source_files():
        if max_bytes - written < _MIN_LINE_BYTES:
            break
        try:
            text = path.read_bytes().decode("utf-8")
        except (UnicodeDecodeError, OSError):
            undecodable += 1
            continue
        if not text.strip():  # empty __init__.py files and the like
            continue
        line = (json.dumps({"text": text}, ensure_ascii=False) + "\n").encode("utf-8")
        if written + len(line) > max_bytes:
            continue
        chosen.append((relative, line))
        written += len(line)
    chosen.sort(key=lambda item: hashlib.sha256(b"order:" + item[0].encode("utf-8")).hexdigest())
    docs = len(chosen)
    if docs == 0:
        raise DataError(f"no standard-library file fits in {max_bytes} bytes for {out_path}; raise --max-bytes")
    refuse()  # created meanwhile: still never replaced
    with atomic_file(out_path) as f:
        for _, line in chosen:
            f.write(line)
    log.info("wrote demo corpus %s: %d documents, %.2f MB (%d undecodable files skipped) in %.1f s",
             out_path, docs, written / 1e6, undecodable, time.perf_counter() - start)
    return out_path


def check_input_files(paths: Sequence[str | Path], json_key: str = "text") -> None:
    """Raise ``DataError`` naming the first input file that does not exist."""
    if not paths:
        raise DataError("no input files given")
    for path in map(Path, paths):
        if not path.is_file():
            raise DataError(f"input file {path} not found; give a JSONL corpus ({{\"{json_key}\": ...}} per line), "
                            f"e.g. made by `python tools/make_demo_corpus.py --output {path}`")


def read_lines(path: Path) -> Iterator[bytes]:
    """Every raw line of a JSONL file (plain or ``.gz``)."""
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            yield from f
    except (gzip.BadGzipFile, EOFError) as e:
        raise DataError(f"{path}: not a readable gzip file ({e})") from None


def load_json_object(raw: bytes | str, where: str, example: str) -> dict[str, Any]:
    """One JSONL line as a dict; ``DataError`` naming ``where`` (file:line) and the ``example`` line otherwise."""
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
    except UnicodeDecodeError as e:
        raise DataError(f"{where}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: invalid JSON ({e.msg} at column {e.colno}); each line must be one JSON object "
                        f"like {example}") from None
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    return record


def parse_jsonl_line(raw: bytes | str, path: str | Path, line_no: int, json_keys: Sequence[str],
                     allow_lists: bool = False) -> list[Any]:
    """The strings under ``json_keys`` of one JSONL line; ``DataError`` naming file and line otherwise.
    ``allow_lists``: a value may also be a list of strings (a document already split into sentences)."""
    where = f"{path}:{line_no}"
    record = load_json_object(raw, where, '{"text": "..."}')
    values = []
    for key in json_keys:
        if key not in record:
            raise DataError(f"{where}: key '{key}' missing (keys present: {sorted(record)}); "
                            f"choose the key with --json-keys / --json-key")
        value = record[key]
        is_list = allow_lists and isinstance(value, list) and all(isinstance(v, str) for v in value)
        if not (is_list or isinstance(value, str)):
            expected = "a string or a list of strings" if allow_lists else "a string"
            raise DataError(f"{where}: key '{key}' holds {type(value).__name__}, expected {expected}")
        values.append(value)
    return values


def iter_jsonl_texts(paths: Sequence[str | Path], json_key: str = "text") -> Iterator[str]:
    """The ``json_key`` string of every non-blank line of JSONL files (plain or ``.gz``)."""
    check_input_files(paths, json_key)
    for path in map(Path, paths):
        for line_no, raw in enumerate(read_lines(path), start=1):
            if raw.strip():
                yield parse_jsonl_line(raw, path, line_no, (json_key,))[0]
