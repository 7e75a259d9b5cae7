"""tools/plan.py: bare ``key=value`` overrides (``--set`` kept as an alias), --memory defaulting to this host's, an
honest step-time estimate (ranks of one CPU host share its peak; MFU capped at the achievable share), and ZeRO,
recompute and micro-batch size searched per layout and shown in the ranking."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from megatron_sp import config, device

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("plan_cli_search", ROOT / "tools" / "plan.py")
assert _spec is not None and _spec.loader is not None
plan_cli = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plan_cli)
plan = plan_cli.plan
GiB = 2**30
TINY = ["data.paths=[unused]", "tokenizer.type=byte", "model.num_layers=2", "model.hidden_size=64", "model.num_heads=4",
        "model.seq_length=64", "model.make_vocab_size_divisible_by=32", "train.micro_batch_size=4",
        "train.global_batch_size=8", "parallel.device=cpu"]


@pytest.fixture
def conf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    path = tmp_path / "tiny.yml"
    path.write_text("model: {arch: neox}\n")
    monkeypatch.setattr(device, "host_memory_available", lambda: 8 * GiB)
    monkeypatch.setenv("MEGATRON_SP_CACHE_DIR", str(tmp_path / "peak_cache"))
    monkeypatch.setattr(device, "cpu_peak_flops", lambda dtype: (50e9, 50e9))  # no 1 s measurement
    return str(path)


def _report(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[str, dict]:
    assert plan_cli.main([*argv, "--json"]) == 0
    out = capsys.readouterr().out
    return out, json.loads(next(line for line in out.splitlines() if line.startswith("{")))


def test_bare_overrides_default_memory_and_an_honest_cpu_estimate(conf: str, capsys: pytest.CaptureFixture[str]) -> None:
    out, report = _report(capsys, "--conf", conf, "--devices", "2", *TINY)  # no --memory, no --set
    assert report["memory_bytes"] == 4 * GiB and "this host's available memory / 2 ranks" in out
    assert report["efficiency"] == plan.ACHIEVABLE_MFU["cpu"] == 0.75
    # the 2 ranks share this host's 50 GFLOP/s: 25 each, and no layout is estimated above 75 % MFU
    assert report["peak_tflops"] == pytest.approx(0.025) and "shared by the 2 ranks on this host" in report["peak_source"]
    assert max(r["mfu"] for r in report["layouts"]) == pytest.approx(0.75, rel=1e-3)
    assert "75 % of the peak, the achievable MFU" in out
    cfg = config.load(overrides=TINY)
    config.set_vocab(cfg, report["vocab"])
    tokens_per_s = cfg.train.global_batch_size * cfg.model.seq_length / min(r["step_s"] for r in report["layouts"])
    flops = plan.stage_flops(cfg, 0, "none") / (cfg.train.global_batch_size * cfg.model.seq_length)  # per token
    assert tokens_per_s * flops <= 0.75 * 50e9 * (1 + 1e-6)  # the host's tokens/s at most 75 % of its peak
    _, old = _report(capsys, "--conf", conf, "--devices", "2", "--memory", "1GiB", "--set", *TINY)  # the alias
    assert old["memory_bytes"] == GiB and old["memory_source"] == "--memory"


def test_zero_recompute_and_micro_batch_are_searched_and_shown(conf: str, capsys: pytest.CaptureFixture[str]) -> None:
    big = [*TINY, "model.seq_length=512", "model.hidden_size=256"]
    _, roomy = _report(capsys, "--conf", conf, "--devices", "2", "--memory", "8GiB", *big)
    first = {(r["tp"], r["pp"], r["cp"], r["dp"]): r for r in roomy["layouts"]}
    assert all((r["zero"], r["recompute"], r["micro_batch_size"]) == (0, "none", 4) for r in first.values())
    # between the dp 2 layout's leanest and its roomiest plan: it fits only with some of the knobs
    cfg = config.load(overrides=[*big, "parallel.dp=2", "model.recompute=full", "train.micro_batch_size=1",
                                 "parallel.zero=1"])
    config.set_vocab(cfg, roomy["vocab"])
    lean = plan.plan_layout(cfg).peak_bytes
    budget = (lean + first[(1, 1, 1, 2)]["peak_bytes"]) // 2
    out, tight = _report(capsys, "--conf", conf, "--devices", "2", "--memory", str(budget), *big)
    row = next(r for r in tight["layouts"] if (r["tp"], r["pp"], r["cp"], r["dp"]) == (1, 1, 1, 2))
    assert row["fits"] and row["peak_bytes"] <= budget
    assert (row["zero"], row["recompute"], row["micro_batch_size"]) != (0, "none", 4)
    assert row["step_s"] >= first[(1, 1, 1, 2)]["step_s"]  # a knob that saves memory never makes the step faster
    header = next(line for line in out.splitlines() if line.split()[:2] == ["#", "tp"])
    assert header.split()[-4:] == ["zero", "recompute", "mbs", "config"]
