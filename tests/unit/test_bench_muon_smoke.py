"""Smoke test of the Muon benchmark (tools/bench/muon.py) at a tiny size on tp2·dp2 ZeRO-1 gloo ranks: one JSON line
last, a row per optimizer, Muon's matrices each orthogonalised by one owner per TP pair (each data-parallel rank an
equal share: the FLOP balance is exact here), no Newton–Schulz time for AdamW. No timing is asserted beyond its fields."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "tools" / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))  # the run_distributed children import the script by module name

import muon  # noqa: E402

TINY = ["--layers", "2", "--hidden", "32", "--heads", "4", "--seq", "16", "--batch", "1", "--vocab", "64",
        "--warmup", "0", "--steps", "1"]


def test_muon_bench_tiny(capsys: pytest.CaptureFixture[str]) -> None:
    rows = muon.main(TINY)
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["bench"] == "muon" and [r["optimizer"] for r in report["rows"]] == ["adamw", "muon"] == [
        r["optimizer"] for r in rows]
    adamw, mu = report["rows"]
    assert adamw["matrices"] == 0 and adamw["rank_ns_ms"] == [0.0] * 4 and adamw["flop_spread"] is None
    assert mu["matrices"] == 2 * 4  # per layer: qkv, dense, fc1, fc2
    assert mu["rank_owned"] == [4] * 4 and mu["flop_spread"] == 1.0 and all(t > 0 for t in mu["rank_ns_ms"])
    for r in report["rows"]:
        assert r["step_ms"] > 0 and r["step_spread"] >= 1.0 and len(r["rank_step_ms"]) == 4
