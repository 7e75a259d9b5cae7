"""MFU and the numbers around it: model FLOPs per token (causal attention, counted by hand), the CPU
peak and its per-host cache, MFU never above 1, the ETA from recent steps, the parameter-count line.

Every test points the peak cache at a tmp dir (``MEGATRON_SP_CACHE_DIR``), never the user's home.
"""
from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron_sp import device, metrics
from megatron_sp.config.schema import ModelConfig
from megatron_sp.model import GPTModel, count_parameters, flops_per_token
from megatron_sp.mpu import ParallelContext
from megatron_sp.testing import run_distributed


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "cache"
    monkeypatch.setenv(device.PEAK_CACHE_ENV, str(path))
    return path


def tiny(arch: str = "neox", **overrides: object) -> ModelConfig:
    base: dict[str, object] = {"arch": arch, "num_layers": 2, "hidden_size": 8, "num_heads": 2, "num_kv_heads": 2,
                               "ffn_hidden_size": 32, "seq_length": 4, "vocab_size": 16, "padded_vocab_size": 16,
                               "norm_eps": 1e-5, "rotary_pct": 0.5 if arch == "neox" else 1.0}
    base.update(overrides)
    return ModelConfig(**base)


# ------------------------------------------------------------------------------------------ FLOPs


def test_flops_per_token_by_hand_counts_the_causal_half() -> None:
    cfg = tiny()
    # N without the input embedding, one layer: qkv 8·24 + 24, dense 8·8 + 8, two LayerNorms 2·16,
    # MLP 8·32 + 32 + 32·8 + 8  →  216 + 72 + 32 + 552 = 872; two layers, final LayerNorm 16,
    # output layer 16·8 = 128  →  N = 1888, 6N = 11328.
    assert count_parameters(cfg) == 1888
    # Attention, one layer, one token, forward: on average the query meets s/2 = 2 keys (causal);
    # q·kᵀ 2·2·8 = 32 FLOPs, p·v 32 more → 64; forward + backward ×3 → 192; two layers → 384 = 6·L·h·s.
    # PaLM's 12·L·h·s = 768 counts every key, twice what causal attention needs.
    assert flops_per_token(cfg) == 11328 + 384
    # GQA: fewer kv heads shrink N (the qkv projection) but not the attention matmuls (all query heads).
    gqa = tiny("llama", num_heads=4, num_kv_heads=1, tie_embeddings=True)
    assert flops_per_token(gqa) == 6 * count_parameters(gqa) + 6 * 2 * 8 * 4


def test_flops_per_token_counts_the_sliding_windows_band() -> None:
    """A window of W < s: a query meets (W·s − W²/2)/s keys on average (s = 4, W = 2: 1.5 instead of 2), so the
    attention term is 6·L·h·2·1.5 = 288 instead of 384; a window of s or more counts the causal half as without one."""
    cfg = tiny()
    windowed = tiny(sliding_window=2)
    assert flops_per_token(windowed) == flops_per_token(cfg) - 384 + 288
    assert flops_per_token(tiny(sliding_window=4)) == flops_per_token(tiny(sliding_window=64)) == flops_per_token(cfg)


# ------------------------------------------------------------------------------------------ peak cache


def test_cache_path_follows_the_environment(monkeypatch: pytest.MonkeyPatch, cache_dir: Path, tmp_path: Path) -> None:
    assert device.peak_cache_path() == cache_dir / "peak_flops.json"
    monkeypatch.delenv(device.PEAK_CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert device.peak_cache_path() == tmp_path / "xdg" / "megatron_sp" / "peak_flops.json"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert device.peak_cache_path() == tmp_path / "home" / ".cache" / "megatron_sp" / "peak_flops.json"


def test_cache_keeps_the_best_peak_per_host_and_dtype(cache_dir: Path) -> None:
    f32, bf16 = torch.float32, torch.bfloat16
    assert device.record_peak_flops(f32, 50e9) == 50e9
    assert device.record_peak_flops(f32, 30e9) == 50e9  # a noisy run does not lower it
    assert device.record_peak_flops(f32, 80e9) == 80e9
    assert device.record_peak_flops(bf16, 2e9) == 2e9  # its own entry
    entries = json.loads((cache_dir / "peak_flops.json").read_text())
    assert entries == {device.peak_cache_key(f32): 80e9, device.peak_cache_key(bf16): 2e9}
    key = device.peak_cache_key(f32)
    assert key.endswith("| float32") and f"{device.host_cores()} cores" in key and torch.__version__ in key
    assert [p.name for p in cache_dir.iterdir()] == ["peak_flops.json"]  # no temp file left behind


def test_each_run_measures_and_keeps_the_max(monkeypatch: pytest.MonkeyPatch) -> None:
    rates = iter([60e9, 20e9, 90e9])
    monkeypatch.setattr(device, "measured_peak_flops", lambda dtype: next(rates))
    assert device.cpu_peak_flops(torch.float32) == (60e9, 60e9)
    assert device.cpu_peak_flops(torch.float32) == (60e9, 20e9)  # (best, measured now)
    assert device.cpu_peak_flops(torch.float32) == (90e9, 90e9)


def test_cache_write_is_atomic(monkeypatch: pytest.MonkeyPatch, cache_dir: Path) -> None:
    device.record_peak_flops(torch.float32, 50e9)
    before = (cache_dir / "peak_flops.json").read_text()

    def crash(src: str, dst: str) -> None:  # dies between writing the temp file and the rename
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", crash)
    assert device.record_peak_flops(torch.float32, 70e9) == 70e9  # this run still uses its measurement
    assert (cache_dir / "peak_flops.json").read_text() == before  # the old file, whole
    assert [p.name for p in cache_dir.iterdir()] == ["peak_flops.json"]  # the temp file removed


def test_unusable_cache_is_ignored(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv(device.PEAK_CACHE_ENV, str(blocker / "sub"))  # cannot be created, even by root
    assert device.record_peak_flops(torch.float32, 40e9) == 40e9
    good = tmp_path / "good"
    good.mkdir()
    monkeypatch.setenv(device.PEAK_CACHE_ENV, str(good))
    for junk in ("{not json", "[1, 2]", '{"x": "fast"}'):  # corrupt or foreign: treated as empty, then replaced
        (good / "peak_flops.json").write_text(junk)
        assert device.record_peak_flops(torch.float32, 40e9) == 40e9
    assert json.loads((good / "peak_flops.json").read_text()) == {device.peak_cache_key(torch.float32): 40e9}


def test_measurement_uses_every_core_and_restores_threads() -> None:
    threads = torch.get_num_threads()
    seen: list[int] = []
    real = torch.matmul

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)  # type: ignore[arg-type]

    torch.matmul = spy  # type: ignore[assignment]
    try:
        rate = device.measured_peak_flops.__wrapped__(torch.float32, n=64, seconds=0.05, window=0.01)
    finally:
        torch.matmul = real  # type: ignore[assignment]
    assert rate > 0 and torch.get_num_threads() == threads
    assert seen and set(seen) == {device.host_cores()}


def test_peak_measurement_leaves_the_dropout_streams_alone() -> None:
    """However many sizes the measurement draws (timing decides: here forced to 64 or 128), the dropout masks drawn
    after it under the training's seeding are bitwise the same (it draws from a generator of its own)."""
    from megatron_sp.mpu.random import RNGTracker, init_rng

    def masks(n: int) -> list[torch.Tensor]:
        tracker = RNGTracker("cpu")
        init_rng(tracker, 21, 0, 0)
        device.measured_peak_flops.__wrapped__(torch.float32, n=n, seconds=0.0)
        drop = torch.nn.Dropout(0.1)
        with tracker.fork(tracker.names[0]):
            attention = drop(torch.ones(256))
        return [drop(torch.ones(256)), attention]

    a, b = masks(64), masks(128)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# ------------------------------------------------------------------------------------------ MFU ≤ 1


def test_measured_peak_below_the_achieved_rate_is_raised(caplog: pytest.LogCaptureFixture, cache_dir: Path) -> None:
    raised: list[float] = []
    peak = metrics.Peak(50e9, on_raise=raised.append)
    assert metrics.throughput(1000, 1.0, 25e6, peak)["mfu"] == pytest.approx(0.5)  # 25 GFLOP/s
    with caplog.at_level(logging.WARNING, logger="megatron_sp"):
        tp = metrics.throughput(1000, 1.0, 145e6, peak)  # 145 GFLOP/s: the demo's 266 % before
        assert tp["mfu"] == 1.0 and tp["tflops"] == pytest.approx(0.145)
        assert peak.flops == pytest.approx(145e9) and raised == [pytest.approx(145e9)]
        assert metrics.throughput(1000, 1.0, 150e6, peak)["mfu"] == 1.0  # raised again, no second warning
    assert peak.flops == pytest.approx(150e9) and len(raised) == 2
    assert len([r for r in caplog.records if "above the measured peak" in r.getMessage()]) == 1
    assert metrics.throughput(1000, 1.0, 75e6, peak)["mfu"] == pytest.approx(0.5)
    # what the training loop does with the new rate: the host's cache rises to it
    peak = metrics.Peak(50e9, on_raise=lambda flops: device.record_peak_flops(torch.float32, flops))
    peak.mfu(120e9)
    assert device.record_peak_flops(torch.float32, 0.0) == pytest.approx(120e9)


def test_bf16_on_a_cpu_without_native_bf16_warns_and_takes_the_fp32_peak(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """An AVX2-only CPU: bf16 matmuls at 1.3 GFLOP/s against 150 in fp32. One warning naming fp32; MFU against the
    fp32 peak, so a run at 5 GFLOP/s is 3.3 %, not 100 % of a peak raised to match it."""
    from megatron_sp import config as config_mod
    from megatron_sp.mpu import ParallelDims, ParallelState

    peaks = {torch.bfloat16: 1.3e9, torch.float32: 150e9}
    monkeypatch.setattr(device, "cpu_peak_flops", lambda dtype: (peaks[dtype], peaks[dtype]))
    st = ParallelState(ParallelDims(world_size=1), rank=0)
    cpu = ["parallel.device=cpu", "parallel.backend=gloo", "tokenizer.type=byte", "data.paths=[d]"]
    for precision, slow in (("bf16", True), ("fp32", False)):
        cfg = config_mod.load(None, [f"train.precision={precision}", *cpu])
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="megatron_sp"):
            peak = metrics.peak_flops_total(cfg, st, torch.device("cpu"))
        warnings = [r.getMessage() for r in caplog.records]
        assert peak.flops == 150e9
        assert len(warnings) == int(slow) and (not slow or "use train.precision=fp32" in warnings[0]), warnings
        assert metrics.throughput(1000, 1.0, 5e6, peak)["mfu"] == pytest.approx(5 / 150)
    peaks[torch.bfloat16] = 400e9  # native bf16: its own peak, no warning
    cfg = config_mod.load(None, ["train.precision=bf16", *cpu])
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="megatron_sp"):
        assert metrics.peak_flops_total(cfg, st, torch.device("cpu")).flops == 400e9
    assert not caplog.records


def test_given_peak_is_kept_and_mfu_capped(caplog: pytest.LogCaptureFixture) -> None:
    peak = metrics.Peak(0.1e12, given=True)  # logging.peak_tflops=0.1
    with caplog.at_level(logging.WARNING, logger="megatron_sp"):
        assert peak.mfu(0.05e12) == pytest.approx(0.5)
        assert peak.mfu(0.3e12) == 1.0 and peak.mfu(0.2e12) == 1.0
    assert peak.flops == 0.1e12  # the user's number stays
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "logging.peak_tflops" in warnings[0]
    quiet = metrics.Peak(0.1e12, given=True, warn=False)  # ranks other than 0
    with caplog.at_level(logging.WARNING, logger="megatron_sp"):
        assert quiet.mfu(1e12) == 1.0
    assert len(caplog.records) == 1
    assert metrics.Peak(0.0).mfu(1e12) == 0.0  # unknown peak (GPU without logging.peak_tflops)


# ------------------------------------------------------------------------------------------ ETA


def test_eta_comes_from_recent_steps_not_start_up() -> None:
    # 10 steps logged, the first slow (warm-up: 5 s), then 0.5 s each; 140 steps to go.
    steps = [5.0] + [0.5] * 9
    old = 140 * sum(steps) / len(steps)  # the mean since the start: 133 s, nearly twice the truth
    assert metrics.eta_seconds(steps, 140) == pytest.approx(70.0) and old > 1.8 * 70
    assert metrics.eta_seconds([0.5, 0.6, 9.0, 0.5, 0.6], 10) == pytest.approx(6.0)  # an odd slow step ignored
    assert metrics.eta_seconds([1.0] * 10 + [2.0] * 11, 10) == pytest.approx(20.0)  # follows a slowdown
    assert metrics.eta_seconds([], 10) == float("inf") and metrics.format_eta(float("inf")) == "?"
    assert metrics.eta_seconds([], 0) == 0.0 and metrics.format_eta(70.0) == "1:10"


def test_a_long_step_logs_its_progress(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Past STEP_PROGRESS_AFTER_S a step logs micro-batches done and an ETA, at most every STEP_PROGRESS_EVERY_S;
    off rank 0, and before the threshold, nothing."""
    def lines(after: float, every: float, enabled: bool = True) -> list[str]:
        monkeypatch.setattr(metrics, "STEP_PROGRESS_AFTER_S", after)
        monkeypatch.setattr(metrics, "STEP_PROGRESS_EVERY_S", every)
        caplog.clear()
        progress = metrics.StepProgress(7, 4, enabled=enabled)
        with caplog.at_level(logging.INFO, logger="megatron_sp"):
            for _ in range(4):
                progress.tick()
        return [r.getMessage() for r in caplog.records]

    every = lines(0.0, 0.0)
    assert [line.split(" done")[0] for line in every] == [f"step 7 in progress: {k}/4 micro-batches" for k in (1, 2, 3)]
    assert all(re.fullmatch(r".* done in \d+:\d\d, ETA \d+:\d\d", line) for line in every), every
    assert len(lines(0.0, 3600.0)) == 1                 # at most every STEP_PROGRESS_EVERY_S
    assert lines(3600.0, 0.0) == lines(0.0, 0.0, enabled=False) == []


def test_start_up_logs_threads_and_load_and_warns_when_oversubscribed(caplog: pytest.LogCaptureFixture) -> None:
    def logged(*args: object) -> list[tuple[int, str]]:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="megatron_sp"):
            metrics.log_host_load(*args)  # type: ignore[arg-type]
        return [(r.levelno, r.getMessage()) for r in caplog.records]

    assert logged(1, 2, 2, 0.5, True) == [(logging.INFO, "host: 2 local ranks × 1 torch threads on 2 cores, "
                                                         "load average 0.50")]
    (_, info), (level, warning) = logged(2, 2, 2, 3.25, True)
    assert level == logging.WARNING and warning.startswith(
        "host oversubscribed: 2 ranks × 2 threads = 4 > 2 cores; load average 3.25 > 2 cores before training; ")
    assert len(logged(2, 2, 2, 3.25, False)) == 1  # a GPU run: the line, no warning
    assert 0.0 <= device.load_average()


# ------------------------------------------------------------------------------------------ parameter line


def test_parameter_summary_line() -> None:
    assert metrics.parameter_summary(5_120_000, 5_120_000, 1, 1, 4096, 4096) == "5.12M parameters"
    assert (metrics.parameter_summary(5_120_000, 2_630_000, 2, 1, 4096, 4096)
            == "5.12M parameters (2.63M on this rank: tp2 pp1)")
    assert (metrics.parameter_summary(6_900_000_000, 1_720_000_000, 2, 2, 50277, 50304)
            == "6.90B parameters (1.72B on this rank: tp2 pp2), incl. vocab padding 50277→50304")


def _tp_counts(rank: int, world: int) -> dict[str, int]:
    cfg = tiny("neox", hidden_size=16, num_heads=4, num_kv_heads=4, vocab_size=30, padded_vocab_size=32)
    model = GPTModel(cfg, seed=1, parallel=ParallelContext(tp_group=dist.group.WORLD))
    sharded = sum(p.numel() for p in model.parameters() if getattr(p, "tensor_model_parallel", False))
    return {"on_rank": model.num_parameters(), "sharded": sharded, "replicated": model.num_parameters() - sharded,
            "total": count_parameters(cfg, exclude_embeddings=False)}


def test_total_parameters_under_tp2_are_the_whole_model() -> None:
    ranks = run_distributed(_tp_counts, 2, timeout_s=120)
    total = ranks[0]["total"]
    # every TP shard once, replicated tensors (norms, row-parallel biases) once: the config's count
    assert sum(r["sharded"] for r in ranks) + ranks[0]["replicated"] == total
    assert ranks[0]["replicated"] == ranks[1]["replicated"] and ranks[0]["on_rank"] < 0.6 * total
    # the old line summed TP rank 0 over the model-parallel group: one shard's worth, not the model
    assert ranks[0]["on_rank"] != total
    line = metrics.parameter_summary(total, ranks[0]["on_rank"], 2, 1, 30, 32)
    assert line.startswith(f"{total / 1e6:.2f}M parameters (") and "on this rank: tp2 pp1" in line
    assert line.endswith("incl. vocab padding 30→32")
