"""The pre-flight of a training run (tools/planner/preflight.py, ``training=True``): the data index's memory and
disk, the step-time estimate, and a suggestion that is one command passing the same pre-flight here."""
from __future__ import annotations

import logging
import shlex
import shutil
from pathlib import Path

import pytest

from megatron_sp import config as config_mod, device
from megatron_sp.errors import ConfigError
from tools.planner import preflight

ROOT = Path(__file__).resolve().parents[2]
GiB = 2**30
THIS_HOST = 259e9  # this 2-core host's fp32 matmul peak, FLOP/s
DEMO = ["data.paths=[data/demo/demo_text_document]", "tokenizer.model=data/demo/tokenizer.model",
        "tokenizer.vocab_size=4096", "data.build_demo=true"]


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A fresh directory with the configs; ``host(memory GiB, peak FLOP/s)`` sets the 2-core host's model."""
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(device, "host_cores", lambda: 2)

    def model(memory_gib: float = 24, peak: float = THIS_HOST) -> None:
        monkeypatch.setattr(device, "host_memory_available", lambda: int(memory_gib * GiB))
        monkeypatch.setattr(preflight, "host_peak", lambda cfg: (peak, "the test's host"))
    return model


def _check(conf: str, *overrides: str) -> str:
    cfg = config_mod.load([conf], list(overrides))
    return preflight.check(cfg, lambda extra: config_mod.load([conf], [*overrides, *extra]), cfg.parallel.world_size,
                           training=True, command=f"python train.py --conf {conf} {' '.join(overrides)}".rstrip())


def _suggested(message: str) -> list[str]:
    return shlex.split(message.split("try `")[1].split("`")[0])


def _passes_its_own_preflight(line: list[str]) -> str:
    assert line[:2] == ["python", "train.py"] and line[2] == "--conf"
    return _check(line[3], *line[4:])


def test_410m_here_names_one_command_that_passes(host, caplog: pytest.LogCaptureFixture) -> None:
    host()  # this machine: 2 cores, 24 GiB, 259 GFLOP/s: 410M's step (1024 × 2048 tokens) takes hours at any layout
    with pytest.raises(ConfigError) as exc:
        _check("configs/410M.yml")
    line = _suggested(str(exc.value))
    assert line == ["python", "train.py", "--conf", "configs/125M_cpu.yml"] and "step under 10 min" in str(exc.value)
    with caplog.at_level(logging.INFO, logger="megatron_sp"):
        assert "per rank" in _passes_its_own_preflight(line)
    estimate = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("pre-flight: a step ~"))
    assert "s on this host" in estimate and "at 75 % of 0.259 TFLOP/s per host" in estimate  # ~52 s
    assert "planned as the demo corpus" in estimate
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_fast_host_gets_the_config_with_a_layout_and_the_demo_inputs(host) -> None:
    host(memory_gib=48, peak=1e15)
    with pytest.raises(ConfigError, match=r"this layout \(tp2 pp1 cp1 dp4\) needs") as exc:
        _check("configs/410M.yml", "train.iters=10")
    line = _suggested(str(exc.value))
    assert line[:5] == ["python", "train.py", "--conf", "configs/410M.yml", "train.iters=10"]
    assert all(o in line for o in DEMO) and any(o.startswith("parallel.") for o in line)  # no tokenizer, data: the demo's
    assert "per rank" in _passes_its_own_preflight(line)


def test_the_data_index_is_counted_in_memory_and_on_disk(host, monkeypatch: pytest.MonkeyPatch) -> None:
    one_rank = ["parallel.tp=1", "parallel.dp=1", "parallel.sequence_parallel=false", *DEMO]
    host(memory_gib=64, peak=1e15)  # the model fits; 146 M samples over the 1 M-token demo corpus do not
    assert "per rank" in _check("configs/410M.yml", *one_rank, "train.iters=10")
    host(memory_gib=16, peak=1e15)
    with pytest.raises(ConfigError, match=r"the data index of 14\d,\d+,\d+ samples \(train.iters 143000 × "
                       r"train.global_batch_size 1024, \+ validation; [\d,]+ epochs of the corpus\) needs ~\d+\.\d+ GiB of "
                       r"memory while rank 0 builds it"):
        _check("configs/410M.yml", *one_rank)
    plan = preflight.index_plan(config_mod.load(["configs/410M.yml"], one_rank))
    assert plan.memory > 9e9 and 3e9 < plan.disk < 5e9 and plan.epochs > 280_000  # the issue: ~4 GB of .npy
    host(memory_gib=64, peak=1e15)
    monkeypatch.setattr(preflight, "_free_disk", lambda path: 100 * 2**20)
    with pytest.raises(ConfigError, match=r"needs ~[\d.]+ MiB of disk in data/demo, which has 100.00 MiB free"):
        _check("configs/410M.yml", *one_rank, "train.iters=20000")


def test_a_step_past_ten_minutes_is_a_warning(host, caplog: pytest.LogCaptureFixture) -> None:
    host(memory_gib=64)
    with caplog.at_level(logging.INFO, logger="megatron_sp"):
        _check("configs/410M.yml", "parallel.tp=1", "parallel.dp=1", "parallel.sequence_parallel=false",
               "train.iters=10", *DEMO)
    warning = next(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert warning.startswith("a step would take ~") and "train.global_batch_size 1024 × 2048 tokens" in warning
    assert "configs/125M_cpu.yml" in warning and "train.iters 10 would take" in warning
