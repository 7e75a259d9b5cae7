"""Smoke test of the attention benchmark at a tiny size: fp32 and bf16, the flash kernel and two block sizes, one
timed step. It checks the JSON line's records and the facts that do not depend on timing: every kernel matches the
fp64 reference to its dtype's rounding, the block kernel computes Σ (e − a)·e scores per head, and it keeps more
bytes for backward than the flash kernel (the blocks' probabilities)."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "tools" / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import attention  # noqa: E402

TINY = ["--seq", "24", "--batch", "2", "--heads", "4", "--kv-heads", "2", "--head-dim", "8", "--rows", "5,24",
        "--reps", "1", "--warmup", "0", "--threads", "1"]
ROW_KEYS = {"dtype", "kernel", "block_rows", "scores_per_head", "saved_bytes", "max_rel_error", "s", "best_s", "cpu_s",
            "speedup_vs_flash", "best_speedup_vs_flash"}


def test_attention_tiny(capsys: pytest.CaptureFixture[str]) -> None:
    result = attention.main(TINY)
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["bench"] == "attention" and report["seq"] == 24 and len(result["rows"]) == 6
    assert [(r["dtype"], r["kernel"]) for r in report["rows"]] == [
        ("fp32", "flash"), ("fp32", "block 5"), ("fp32", "block 24"),
        ("bf16", "flash"), ("bf16", "block 5"), ("bf16", "block 24")]
    for r in report["rows"]:
        assert ROW_KEYS <= set(r), ROW_KEYS - set(r)
        assert r["max_rel_error"] < (1e-5 if r["dtype"] == "fp32" else 3e-2), r
        assert math.isfinite(r["speedup_vs_flash"]) and r["speedup_vs_flash"] > 0
    blocks = {(r["dtype"], r["block_rows"]): r for r in report["rows"] if r["block_rows"]}
    assert blocks["fp32", 5]["scores_per_head"] == 5 * 5 + 5 * 10 + 5 * 15 + 5 * 20 + 4 * 24
    assert blocks["fp32", 24]["scores_per_head"] == 24 * 24
    flash = {r["dtype"]: r for r in report["rows"] if r["kernel"] == "flash"}
    for (dtype, _), r in blocks.items():
        assert r["saved_bytes"] > flash[dtype]["saved_bytes"]
    assert blocks["fp32", 5]["saved_bytes"] < blocks["fp32", 24]["saved_bytes"]


def test_attention_bad_flags() -> None:
    with pytest.raises(SystemExit, match="--kv-heads must divide"):
        attention.parse_args(["--heads", "4", "--kv-heads", "3"])
