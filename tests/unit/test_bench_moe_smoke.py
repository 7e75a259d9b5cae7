"""Smoke test of the MoE benchmark in its --quick mode (tiny sizes, one repetition): the JSON line's fields and the
facts that do not depend on timing. Every block variant (ours grouped and loop, transformers' Mixtral eager and
grouped_mm, holding our exported weights) matches the fp64 reference; ep2's first loss equals ep1's; the rows passed
to the all-to-alls average to the planner's figure over the ep group. No timing is asserted."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "tools" / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))  # the run_distributed children import the script by module name

import moe  # noqa: E402

pytest.importorskip("transformers")

BLOCK_KEYS = {"experts", "top_k", "moe_ffn", "dtype", "impl", "routing_agreement", "errors", "max_rel_error", "correct",
              "s", "best_s", "cpu_s", "speedup_vs_hf_eager", "speedup_vs_hf_grouped_mm", "speedup_vs_ours_loop"}
STEP_KEYS = {"dtype", "moe_active_params", "dense_active_params", "moe_fwd_bwd_s", "dense_fwd_bwd_s", "moe_step_s",
             "dense_step_s", "fwd_bwd_ratio", "step_ratio", "step_cpu_ratio"}
EP_KEYS = {"dtype", "ep1_step_s", "ep2_step_s", "ep2_over_ep1", "first_loss", "loss_matches", "a2a_bytes_per_rank",
           "a2a_bytes_mean", "a2a_element_bytes", "planner_bytes", "a2a_matches_planner"}


def test_moe_bench_quick(capsys: pytest.CaptureFixture[str]) -> None:
    threads = torch.get_num_threads()
    result = moe.main(["--quick"])
    assert torch.get_num_threads() == threads
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["bench"] == "moe"
    assert report["checks"] == {"block_matches_fp64": True, "ep_loss_matches_ep1": True, "a2a_matches_planner": True}
    assert len(result["block"]) == len(report["block"]) == 2 * 2 * len(moe.BLOCK_VARIANTS)  # 2 cases × 2 dtypes
    for r in report["block"]:
        assert BLOCK_KEYS <= set(r), BLOCK_KEYS - set(r)
        assert r["correct"], r
        if r["impl"].startswith("ours") or r["dtype"] == "fp32":  # our router runs in fp32: no token routes otherwise
            assert r["routing_agreement"] == 1.0, r
    assert {r["experts"] for r in report["block"]} == {8, 64}
    for r in report["step"]:
        assert STEP_KEYS <= set(r), STEP_KEYS - set(r)
        assert math.isfinite(r["step_ratio"]) and r["step_ratio"] > 0
        # the dense twin has the active parameters of the MoE model but for the router
        assert 0 < r["moe_active_params"] - r["dense_active_params"] <= r["moe_active_params"] // 50
    assert [r["dtype"] for r in report["ep"]] == ["fp32", "bf16"]
    for r in report["ep"]:
        assert EP_KEYS <= set(r), EP_KEYS - set(r)
        assert r["first_loss"]["ep1"] == pytest.approx(r["first_loss"]["ep2"], rel=1e-5)
        assert r["a2a_element_bytes"] == {"fp32": 4, "bf16": 2}[r["dtype"]]
        assert sum(r["a2a_bytes_per_rank"]) == 2 * r["planner_bytes"] > 0
    assert set(report["goals"]) >= {"E8_fp32_vs_hf_eager", "E64_bf16_grouped_vs_loop", "fp32_moe_step_over_dense", "bf16_ep2_over_ep1"}


def test_moe_bench_bad_flags() -> None:
    with pytest.raises(SystemExit, match="--block-cases"):
        moe.parse_args(["--block-cases", "2x4x16"])
