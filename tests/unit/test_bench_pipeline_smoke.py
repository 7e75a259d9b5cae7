"""Smoke test of the pipeline-bubble benchmark at a tiny size: it runs every schedule on 2 gloo
ranks, prints one JSON line last, and its rows carry the theory, the simulated idle and per-stage
idle fractions. No timing is asserted beyond the fractions lying in [0, 1]."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "tools" / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))  # the run_distributed children import the script by module name

import pipeline_bubble  # noqa: E402

from megatron_sp.pipeline.schedules import theory_bubble  # noqa: E402

SCHEDULES = ["none", "1f1b", "interleaved", "zero_bubble"]
TINY = ["--pp", "2", "--micro", "2,3", "--schedules", ",".join(SCHEDULES), "--virtual", "2", "--layers", "4",
        "--hidden", "32", "--heads", "4", "--seq", "16", "--warmup", "1", "--steps", "1"]


def test_pipeline_bubble_tiny(capsys: pytest.CaptureFixture[str]) -> None:
    rows = pipeline_bubble.main(TINY)
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["bench"] == "pipeline_bubble"
    # m = 3 is not a multiple of pp = 2: interleaved is skipped there, the others run.
    want = [(s, 2, 2) for s in SCHEDULES] + [(s, 2, 3) for s in SCHEDULES if s != "interleaved"]
    assert [(r["schedule"], r["pp"], r["m"]) for r in report["rows"]] == want
    assert [(r["schedule"], r["pp"], r["m"]) for r in rows] == want
    assert len(report["skipped"]) == 1 and report["skipped"][0].startswith("interleaved pp=2 m=3")
    for r in report["rows"]:
        assert r["v"] == (2 if r["schedule"] == "interleaved" else 1)
        assert r["theory"] == pytest.approx(theory_bubble(r["schedule"], r["pp"], r["m"], r["v"]))
        assert 0.0 <= r["sim"] < 1.0 and len(r["sim_stage_idle"]) == r["pp"]
        assert len(r["stage_idle"]) == r["pp"] and all(0.0 <= x <= 1.0 for x in r["stage_idle"])
        assert r["mean_idle"] == pytest.approx(sum(r["stage_idle"]) / r["pp"])
        assert r["ratio_theory"] == pytest.approx(r["mean_idle"] / r["theory"])
        assert r["ratio_sim"] == pytest.approx(r["mean_idle"] / r["sim"])
        assert r["step_ms"] > 0 and r["sim_step_ms"] > 0 and r["cpu_over_wall"] > 0
        kinds = {"F", "I", "W"} if r["schedule"] == "zero_bubble" else {"F", "B"}
        assert set(r["action_ms"]) == kinds and all(ms > 0 for ms in r["action_ms"].values())
    gains = {(g["schedule"], g["m"]): g for g in report["gains"]}
    assert set(gains) == {(s, m) for s, _, m in want if s != "1f1b"}
    assert all(g["step_vs_1f1b"] > 0 and g["sim_step_vs_1f1b"] > 0 for g in gains.values())
