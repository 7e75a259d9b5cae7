"""Shared pytest set-up: the repo root on sys.path, markers, a private peak-FLOP/s cache, config helpers."""
import os
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def pytest_configure(config: pytest.Config) -> None:
    # Runs and benchmarks started by tests (in this process or as subprocesses) cache the CPU peak here,
    # never in the user's ~/.cache (megatron_sp.device.peak_cache_path).
    os.environ.setdefault("MEGATRON_SP_CACHE_DIR", tempfile.mkdtemp(prefix="megatron_sp_test_cache_"))
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped on CPU machines)")
    config.addinivalue_line("markers", "slow: long-running; kept in the default run while the suite stays under 15 min")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    from megatron_sp import device
    if device.cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return ROOT
