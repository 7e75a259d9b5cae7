"""Every test file is collected by the README's test command (``python -m pytest tests``): none sits in a directory
that pytest does not enter (its default ``norecursedirs`` holds ``dist`` and ``build``: tests/dist once ran only when
named) or has a name that ``python_files`` does not match."""
from __future__ import annotations

import fnmatch
import re
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]


def test_every_file_with_tests_is_collected(pytestconfig: pytest.Config) -> None:
    skipped_dirs = pytestconfig.getini("norecursedirs")
    file_patterns = pytestconfig.getini("python_files")
    missed = []
    for path in sorted(TESTS.rglob("*.py")):
        if not re.search(r"^def test_", path.read_text(encoding="utf-8"), re.MULTILINE):
            continue
        parts = path.relative_to(TESTS).parts
        if any(fnmatch.fnmatch(d, pat) for d in parts[:-1] for pat in skipped_dirs) \
                or not any(fnmatch.fnmatch(path.name, pat) for pat in file_patterns):
            missed.append(str(path.relative_to(TESTS.parent)))
    assert not missed, f"pytest would not collect: {missed} (norecursedirs {skipped_dirs}, python_files {file_patterns})"
