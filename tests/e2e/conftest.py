"""Fixtures shared by the end-to-end tests: the dataset and cached 1-rank reference runs."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from megatron_sp.parity import load_grads

from .runs import PARITY, make_byte_dataset, make_packed_dataset, metrics, train


@pytest.fixture(scope="session")
def byte_data(tmp_path_factory) -> str:
    return make_byte_dataset(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="session")
def packed_data(tmp_path_factory) -> str:
    return make_packed_dataset(tmp_path_factory.mktemp("packed"))


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory, byte_data):
    """reference_run(*overrides) → the log dir of the 1-rank parity run with those overrides (run once each).

    Each run's logged step-1 grad norm must be the fp64 norm of its dumped gradients (1e-7 relative).
    """
    cache: dict[tuple[str, ...], Path] = {}
    root = tmp_path_factory.mktemp("ref")

    def get(*overrides: str, data: str | None = None) -> Path:
        key = (data or byte_data, *sorted(overrides))
        if key not in cache:
            run_dir = root / f"ref{len(cache)}"
            train(run_dir, data or byte_data, *PARITY, *overrides)
            logged = metrics(run_dir)[1]["grad_norm"]
            grads = load_grads(run_dir / "log" / "grads_step1.pt")  # one entry per parameter (tied: once)
            want = math.sqrt(sum(g.double().square().sum().item() for g in grads.values()))
            assert abs(logged - want) <= 1e-7 * want, (overrides, logged, want)
            cache[key] = run_dir / "log"
        return cache[key]

    return get
