"""Smoke test of the ZeRO-3 benchmark (tools/bench/zero.py) at a tiny size on 2 gloo ranks: one JSON line last, every
row's persistent bytes within 5 % of the theory and equal to the planner's, the all-gather and reduce-scatter bytes of
a step equal to the planner's (tied: the head gathers the embedding again) and to the rule by hand. No timing is
asserted beyond its fields being there."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "tools" / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))  # the run_distributed children import the script by module name

import zero  # noqa: E402

TINY = ["--layers", "2", "--hidden", "32", "--heads", "4", "--seq", "16", "--batch", "1", "--vocab", "64",
        "--warmup", "0", "--steps", "1", "--tie"]


def test_zero_bench_tiny(capsys: pytest.CaptureFixture[str]) -> None:
    rows = zero.main(TINY)
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["bench"] == "zero" and len(report["rows"]) == len(rows) == 3
    assert [(r["zero"], r["prefetch"]) for r in report["rows"]] == [(1, 0), (3, 1), (3, 0)]
    for r in report["rows"]:
        assert set(r["bytes"]) == {"params", "grads", "state"} and r["memory_ok"] and not r["ranks_differ"]
        assert all(abs(v - 1) <= 0.05 for v in r["ratio"].values()), r["ratio"]
        assert r["total_bytes"] == r["planner_state_bytes"]
        for op in ("all_gather", "reduce_scatter"):
            assert r["comm_bytes"][op] == pytest.approx(r["planner_bytes"][op], rel=1e-12) and r["comm_bytes"][op] > 0
            assert r["comm_bytes"][op] == pytest.approx(r["rule_bytes"][op], rel=1e-12)
        assert r["comm_ok"] and r["comm_steady"]
        for key in ("step_ms", "vs_zero1", "all_gather_wait_ms", "all_gather_flight_ms", "reduce_scatter_wait_ms"):
            assert r[key] >= 0
    z1, z3 = report["rows"][0], report["rows"][1]
    assert z3["units"] == ["embedding", "head", "layers.0", "layers.1"]
    assert z3["bytes"]["params"] * 2 == z1["bytes"]["params"]  # bf16 weights sharded over dp 2 (no padding here)
