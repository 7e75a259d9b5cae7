"""Fixtures shared by the end-to-end tests: the dataset and cached 1-rank reference runs."""
from __future__ import annotations

from pathlib import Path

import pytest

from .runs import PARITY, make_byte_dataset, make_packed_dataset, train


@pytest.fixture(scope="session")
def byte_data(tmp_path_factory) -> str:
    return make_byte_dataset(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="session")
def packed_data(tmp_path_factory) -> str:
    return make_packed_dataset(tmp_path_factory.mktemp("packed"))


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory, byte_data):
    """reference_run(*overrides) → the log dir of the 1-rank parity run with those overrides (run once each)."""
    cache: dict[tuple[str, ...], Path] = {}
    root = tmp_path_factory.mktemp("ref")

    def get(*overrides: str, data: str | None = None) -> Path:
        key = (data or byte_data, *sorted(overrides))
        if key not in cache:
            run_dir = root / f"ref{len(cache)}"
            train(run_dir, data or byte_data, *PARITY, *overrides)
            cache[key] = run_dir / "log"
        return cache[key]

    return get
