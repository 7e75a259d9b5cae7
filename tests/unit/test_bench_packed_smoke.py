"""Smoke test of the packed-vs-unpacked benchmark at a tiny size: cp = 1 and zigzag at cp = 2 on gloo ranks,
one timed step, transformers off. It checks the JSON line's records and that the documents are really
packed (several per sample); the ratios only have to be positive and finite, no goal is asserted."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "tools" / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))  # the run_distributed children import the script by module name

import packed  # noqa: E402

S = 256
TINY = ["--seqs", str(S), "--cp", "1,2", "--algos", "zigzag", "--layers", "1", "--hidden", "32", "--heads", "4",
        "--mean-doc", "32", "--reps", "1", "--warmup", "0", "--hf", "off"]
ROW_KEYS = {"seq", "cp", "algo", "packed_s", "unpacked_s", "packed_cpu_s", "unpacked_cpu_s", "packed_bytes",
            "unpacked_bytes", "packed_peak_bytes", "unpacked_peak_bytes", "time_ratio", "cpu_ratio", "mem_ratio",
            "peak_ratio", "time_ok", "mem_ok", "reps"}


def test_packed_tiny(capsys: pytest.CaptureFixture[str]) -> None:
    result = packed.main(TINY)
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["bench"] == "packed" and report["skipped"] == [] and report["hf"] == []
    assert report["documents"][str(S)]["count"] > 2  # mean 32 tokens: several documents in the sample
    rows = {(r["cp"], r["algo"]): r for r in report["rows"]}
    assert list(rows) == [(1, "-"), (2, "zigzag")] and len(result["rows"]) == 2
    for r in rows.values():
        assert ROW_KEYS <= set(r), ROW_KEYS - set(r)
        assert r["seq"] == S
        for key in ("time_ratio", "cpu_ratio", "mem_ratio", "peak_ratio"):
            assert math.isfinite(r[key]) and r[key] > 0, (key, r[key])
        assert r["packed_bytes"] > 0 and r["unpacked_peak_bytes"] > 0
    assert rows[(2, "zigzag")]["packed_bytes"] < rows[(1, "-")]["packed_bytes"]  # each rank holds half the tokens
