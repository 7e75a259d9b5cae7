"""Smoke tests of the activation-memory and communication-volume benchmarks at tiny sizes.

They check that the scripts run (in process and on gloo ranks), print one JSON line last, and
that the numbers that are exact by construction are: the full-recompute row saves exactly the
layer input and the rotary tables, every saved storage is attributed, and neox's collectives
match the Megatron theory call for call. No timing is asserted.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "tools" / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))  # the run_distributed children import the scripts by module name

import activation_memory  # noqa: E402
import comm_volume  # noqa: E402

TINY = ["--seq", "16", "--batch", "2", "--hidden", "32", "--heads", "4"]


def _json_line(out: str) -> dict:
    last = out.strip().splitlines()[-1]
    return json.loads(last)


def test_activation_memory_single_rank(capsys: pytest.CaptureFixture[str]) -> None:
    rows = activation_memory.main(["--tp", "1", *TINY])
    report = _json_line(capsys.readouterr().out)
    assert report["bench"] == "activation_memory" and len(report["rows"]) == len(rows) == 3
    by_recompute = {r["recompute"]: r for r in rows}
    s, b, h = 16, 2, 32
    full = by_recompute["full"]
    rotary = full["terms"]["rotary cos/sin"]["measured"]
    assert full["measured_bytes"] == s * b * h * 4 + rotary  # fp32 input + the cos/sin tables, nothing else
    for r in rows:
        categories = {st["category"] for st in r["storages"]}
        assert "other" not in categories, r["storages"]
    assert by_recompute["selective"]["measured_bytes"] <= by_recompute["none"]["measured_bytes"]


def test_activation_memory_sequence_parallel(capsys: pytest.CaptureFixture[str]) -> None:
    rows = activation_memory.main(["--tp", "2", "--dtype", "bf16", "--dropout", "0.1", *TINY])
    _json_line(capsys.readouterr().out)
    plain = {r["recompute"]: r for r in rows if not r["sp"]}
    sp = {r["recompute"]: r for r in rows if r["sp"]}
    assert sp["none"]["measured_bytes"] < plain["none"]["measured_bytes"]
    assert all(r["scores_stored"] == r["scores_expected"] for r in rows)


def test_comm_volume_matches_structure(capsys: pytest.CaptureFixture[str]) -> None:
    rows = comm_volume.main(["--tp", "2", *TINY])
    report = _json_line(capsys.readouterr().out)
    assert report["bench"] == "comm_volume" and len(rows) == 8
    for r in rows:
        assert r["unexplained"] == [], r
        if r["arch"] == "neox":
            assert r["total_bytes"] == r["theory_bytes"]
