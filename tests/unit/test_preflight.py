"""The pre-flight (tools/planner/preflight.py through train.py): a layout whose planned memory cannot fit this host
is refused in one line within seconds, naming the figure and a layout that fits, before any data is built or rank
started; the demo passes; ``train.preflight=false`` skips it. Also what a user meets next with configs/410M.yml:
the missing-tokenizer hint names the config's tokenizer, and ``data.build_demo`` never writes into its data paths.
"""
from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

import train as cli  # train.py: its main() is the command line
from megatron_sp import config as config_mod, device, launcher, training
from tools.planner import preflight

ROOT = Path(__file__).resolve().parents[2]
GiB = 2**30


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh directory holding the configs, on a 2-core host with 24 GiB available and no torchrun around."""
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    monkeypatch.chdir(tmp_path)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(device, "host_memory_available", lambda: 24 * GiB)
    monkeypatch.setattr(device, "host_cores", lambda: 2)
    monkeypatch.setattr(training.log, "handlers", [])  # main() points the logger at this test's stdout: undo after
    monkeypatch.setattr(launcher, "start_local", _must_not_start)
    return tmp_path


def _must_not_start(*_: object, **__: object) -> int:
    raise AssertionError("a rank was started")


def _one_error(capsys: pytest.CaptureFixture[str]) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def test_410m_is_refused_within_seconds_with_a_command_that_fits(host: Path, capsys: pytest.CaptureFixture[str],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(preflight, "host_peak", lambda cfg: (259e9, "this host's"))  # this 2-core host's fp32 peak
    t0 = time.perf_counter()
    assert cli.main(["--conf", "configs/410M.yml"]) == 2
    seconds = time.perf_counter() - t0
    line = _one_error(capsys)
    assert seconds < 30, seconds  # ~3 s here: the planner builds each candidate on the meta device
    for needle in ("this layout (tp2 pp1 cp1 dp4) needs ~", "per rank × 8 ranks", "24.00 GiB available",
                   "sized for 8 GPUs", "train.preflight=false"):
        assert needle in line, (needle, line)
    assert sorted(p.name for p in host.iterdir()) == ["configs"]  # no data, runs or checkpoints written
    # hours a step at any layout here: the suggestion is the CPU config, whose pre-flight passes
    assert "step under 10 min: try `python train.py --conf configs/125M_cpu.yml`" in line
    cfg = config_mod.load(["configs/125M_cpu.yml"], [])
    assert "per rank" in preflight.check(cfg, lambda extra: config_mod.load(["configs/125M_cpu.yml"], extra),
                                         cfg.parallel.world_size, training=True)


def test_the_demo_passes_and_the_note_names_the_plan(host: Path) -> None:
    cfg = config_mod.load(["configs/demo.yml"], [])
    note = preflight.check(cfg, lambda extra: config_mod.load(["configs/demo.yml"], extra), 2)
    assert note.startswith("planned ~") and "× 2 ranks" in note and "24.00 GiB available" in note
    assert cfg.model.vocab_size is None  # planned on a copy: the tokenizer sets the vocabulary later


def test_a_gpu_is_held_to_its_own_memory(host: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def build(extra: list[str]) -> config_mod.Config:
        return config_mod.load(["configs/410M.yml"], ["parallel.device=cuda", "parallel.backend=nccl", *extra])

    monkeypatch.setattr(device, "accelerator_memory_bytes", lambda local_rank=0: 80 * GiB)
    assert "80.00 GiB GPU" in preflight.check(build([]), build, 8)  # 8 ranks, each its own GPU: fits
    monkeypatch.setattr(device, "accelerator_memory_bytes", lambda local_rank=0: 4 * GiB)
    with pytest.raises(config_mod.loader.ConfigError, match=r"each GPU has 4.00 GiB .*; on these GPUs try `"):
        preflight.check(build([]), build, 8)


def test_preflight_false_goes_on_to_the_tokenizer_which_names_what_the_config_needs(
        host: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--conf", "configs/410M.yml", "train.preflight=false"]) != 0
    line = _one_error(capsys)
    assert "data/pile/tokenizer.model not found" in line and "sentencepiece tokenizer" in line
    assert "50277 tokens" in line and "--vocab-size 50277" in line and "data.build_demo=true" in line


def test_build_demo_never_writes_into_the_configs_data_paths(host: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--conf", "configs/410M.yml", "data.build_demo=true", "train.preflight=false"]) == 2
    line = _one_error(capsys)
    assert "writes only under data.demo_dir (data/demo)" in line and "data/pile/pile_text_document" in line
    assert ("`data.paths=[data/demo/demo_text_document] tokenizer.type=sentencepiece tokenizer.model=data/demo/tokenizer.model"
            " tokenizer.vocab_size=4096`") in line
    assert not (host / "data").exists()


def test_a_moe_layout_is_checked_like_a_dense_one(host: Path) -> None:
    def build(*extra: str) -> config_mod.Config:
        return config_mod.load(["configs/moe_demo.yml"], list(extra))

    cfg = build()
    note = preflight.check(cfg, lambda extra: build(*extra), 2)  # 8 experts over ep 2: 4 per rank
    assert note.startswith("planned ~") and "× 2 ranks" in note
    # 128 experts of width 8192 in 4 layers, 64 per rank under ep 2: 1.6 G parameters, 24 GiB with grads and Adam
    big = ("model.num_experts=128", "model.moe_ffn_hidden_size=8192")
    with pytest.raises(config_mod.loader.ConfigError, match=r"this layout \(tp1 pp1 cp1 dp2\) needs ~29\.3. GiB per rank × 2 ranks"):
        preflight.check(build(*big), lambda extra: build(*big, *extra), 2)
