"""Smoke test of tools/gpu_check.py's CPU dry mode (what a GPU runs at full size): the three parts run through the
same code (train.py runs read through their metrics.jsonl, the planner's figure, the CPU-vs-device loss parity,
generation against transformers), and the JSON line carries every number with sane values. No timing is asserted."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

TOP_KEYS = {"bench", "device", "device_type", "dry", "torch", "transformers", "cuda", "flash_attn", "peak_tflops",
            "peak_source", "budget_s", "parts", "train", "parity", "generate", "wall_s"}
RUN_KEYS = {"attention", "compiled", "wall_s", "tokens_per_s", "tflops", "mfu", "memory_bytes", "memory_kind",
            "planned_peak_bytes", "preflight_bytes", "memory_vs_plan", "loss_first", "loss_last", "flash_attn_ran"}


def load_gpu_check() -> Any:
    """tools/gpu_check.py as a module (its import puts the checkout and tools/bench first on sys.path, as run)."""
    sys.path.insert(0, str(ROOT / "tools"))
    import gpu_check

    return gpu_check


def test_gpu_check_dry(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """In this process (its train.py runs are processes of their own; it makes no process group here)."""
    code = load_gpu_check().main(["--dry", "--peak-tflops", "0.05", "--json", str(tmp_path / "check.json"), "--work",
                                  str(tmp_path / "work")])
    out = capsys.readouterr()
    assert code == 0, out.out[-2000:] + out.err[-2000:]
    rep = json.loads(out.out.strip().splitlines()[-1])  # the JSON line is last
    assert rep == json.loads((tmp_path / "check.json").read_text())
    assert TOP_KEYS <= set(rep), TOP_KEYS - set(rep)
    assert rep["bench"] == "gpu_check" and rep["dry"] and rep["device_type"] == "cpu" and rep["device"].startswith("CPU")
    assert rep["peak_tflops"] == 0.05 and rep["peak_source"] == "--peak-tflops" and 0 < rep["wall_s"] < rep["budget_s"]
    assert {name: (s["ran"], s["ok"]) for name, s in rep["parts"].items()} == {
        "train": (True, True), "parity": (True, True), "generate": (True, True)}

    train = rep["train"]
    assert train["shape"]["num_layers"] == 2 and not train["is_125M"]  # the dry shape; the full one overrides none
    eager, flash, compiled, flash_compiled = train["runs"]
    assert (eager["attention"], eager["compiled"]) == ("sdpa", False)
    assert RUN_KEYS <= set(eager), RUN_KEYS - set(eager)
    assert eager["tokens_per_s"] > 0 and eager["tflops"] > 0 and not eager["flash_attn_ran"]
    assert math.isclose(eager["mfu"], eager["tflops"] / 0.05)  # against the given peak, uncapped
    assert eager["memory_kind"] == "peak_rss" and eager["memory_bytes"] > 0
    assert 0 < eager["planned_peak_bytes"] < eager["preflight_bytes"]
    assert math.isclose(eager["memory_vs_plan"], eager["memory_bytes"] / eager["preflight_bytes"])
    assert 0 < eager["loss_last"] < eager["loss_first"] < 1.5 * math.log(512)  # Zipf tokens: learnable
    assert "CUDA" in flash["skipped"] and "CUDA" in flash_compiled["skipped"] and "--compile on" in compiled["skipped"]

    parity = rep["parity"]  # both runs on the CPU here: bitwise equal
    assert parity["steps"] == 3 and parity["loss_rel_diff"] == [0.0] * 3 and parity["within_rtol"]
    assert parity["grad_norm_rel_diff_step1"] == 0.0 and parity["loss_device"] == parity["loss_cpu"]
    assert parity["float32_matmul_precision"] == "highest"

    gen = rep["generate"]
    assert gen["tokens_equal"] and [(r["impl"], r["batch"]) for r in gen["rows"]] == [
        ("ours", 1), ("transformers", 1), ("ours", 2), ("transformers", 2)]
    for r in gen["rows"]:
        assert r["tokens_equal"] and r["prefill_tokens_per_s"] > 0
        assert r["decode_tokens_per_s"] is None or r["decode_tokens_per_s"] > 0  # (timing noise at this size)
    assert "\nparts: train ran; parity ran; generate ran\n" in out.out


def test_gpu_check_budget_and_peaks(capsys: pytest.CaptureFixture[str]) -> None:
    """A spent budget skips every part with its reason (exit 0); the datasheet peaks by device name."""
    gpu_check = load_gpu_check()
    assert gpu_check.main(["--dry", "--budget-s", "0"]) == 0
    rep = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert all(not s["ran"] and s["reason"].startswith("budget") for s in rep["parts"].values()), rep["parts"]
    assert [gpu_check.datasheet_peak(n) for n in ("NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H200",
                                                  "NVIDIA A100-SXM4-80GB", "NVIDIA GeForce RTX 4090")] == [
        989.0, 756.0, 989.0, 312.0, None]
