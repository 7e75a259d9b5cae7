"""Smoke test of the pipeline-bubble benchmark at a tiny size: it runs on 2 gloo ranks, prints one
JSON line last, and its rows carry the theory and per-stage idle fractions. No timing is asserted
beyond the fractions lying in [0, 1]."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "tools" / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))  # the run_distributed children import the script by module name

import pipeline_bubble  # noqa: E402

TINY = ["--pp", "2", "--micro", "2,4", "--layers", "2", "--hidden", "32", "--heads", "4", "--seq", "16",
        "--warmup", "1", "--steps", "1"]


def test_pipeline_bubble_tiny(capsys: pytest.CaptureFixture[str]) -> None:
    rows = pipeline_bubble.main(TINY)
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["bench"] == "pipeline_bubble"
    assert report["not_measured"] == ["interleaved", "zero_bubble"]
    assert [(r["pp"], r["m"]) for r in report["rows"]] == [(2, 2), (2, 4)] == [(r["pp"], r["m"]) for r in rows]
    for r in report["rows"]:
        assert r["theory"] == pytest.approx((r["pp"] - 1) / (r["m"] + r["pp"] - 1))
        assert len(r["stage_idle"]) == r["pp"] and all(0.0 <= x <= 1.0 for x in r["stage_idle"])
        assert r["ratio"] == pytest.approx(r["mean_idle"] / r["theory"])
        assert r["step_ms"] > 0 and len(r["stage_fwd_ms"]) == len(r["stage_bwd_ms"]) == r["pp"]
