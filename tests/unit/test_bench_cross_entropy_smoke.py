"""Smoke test of the cross-entropy benchmark at a tiny size: fp32 and bf16, two chunk sizes, one timed step.
It checks the JSON line's records and the memory facts that do not depend on timing: ours saves the
logits plus O(tokens) bytes, matches the torch loss, and peaks below torch's fp32 log-softmax + grad."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "tools" / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import cross_entropy  # noqa: E402

TINY = ["--seq", "16", "--batch", "2", "--vocab-local", "300", "--chunks", "1000,100000", "--reps", "1",
        "--warmup", "0", "--threads", "1"]
ROW_KEYS = {"dtype", "tokens", "v_local", "chunk_elements", "logits_bytes", "loss_max_abs_diff", "ours_saved_bytes",
            "ours_saved_beyond_logits_bytes", "ours_peak_bytes", "torch_saved_bytes",
            "torch_saved_beyond_logits_bytes", "torch_peak_bytes", "ours_s", "ours_cpu_s", "torch_s", "torch_cpu_s",
            "time_ratio", "cpu_ratio", "peak_ratio"}


def test_cross_entropy_tiny(capsys: pytest.CaptureFixture[str]) -> None:
    result = cross_entropy.main(TINY)
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["bench"] == "cross_entropy" and report["v_local"] == 300 and len(result["rows"]) == 4
    assert [(r["dtype"], r["chunk_elements"]) for r in report["rows"]] == [
        ("fp32", 1000), ("fp32", 100000), ("bf16", 1000), ("bf16", 100000)]
    for r in report["rows"]:
        assert ROW_KEYS <= set(r), ROW_KEYS - set(r)
        assert r["tokens"] == 32 and r["loss_max_abs_diff"] < 1e-4
        assert r["ours_saved_beyond_logits_bytes"] <= 32 * r["tokens"]
        assert r["ours_saved_bytes"] <= r["logits_bytes"] + 32 * r["tokens"]
        assert r["ours_peak_bytes"] < r["torch_peak_bytes"]
        for key in ("time_ratio", "cpu_ratio", "peak_ratio"):
            assert math.isfinite(r[key]) and r[key] > 0, (key, r[key])


def test_cross_entropy_padding(capsys: pytest.CaptureFixture[str]) -> None:
    """``--padding``: the loss still matches torch's on the real columns, and the one fp32 chunk temporary spans only
    the real columns (bf16: peak = the bf16 gradient + a [tokens, real] fp32 chunk)."""
    cross_entropy.main([*TINY[:-6], "--padding", "250", "--reps", "1", "--warmup", "0", "--threads", "1"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["padding"] == 250 and all(r["padding"] == 250 for r in report["rows"])
    for r in report["rows"]:
        assert r["loss_max_abs_diff"] < 1e-4
        if r["dtype"] == "bf16":
            assert r["ours_peak_bytes"] <= r["logits_bytes"] + 4 * r["tokens"] * 50 + 64 * r["tokens"]
