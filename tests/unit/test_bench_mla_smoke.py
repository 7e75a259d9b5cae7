"""Smoke test of the MLA benchmark at a tiny size (fp32 and bf16, one timed repetition): the JSON line's fields and the
facts that do not depend on timing. Our latent attention and transformers' DeepseekV3Attention (sdpa and eager) on the
same weights match fp64 (the bench refuses to time otherwise); the KV cache a real ``GPTModel`` prefill leaves holds
``kv_lora_rank + qk_rope_head_dim`` values per token per layer, so its ratio to the MHA twin's ``2 · heads · head_dim``
equals the formula exactly, as does the planner's figure. No timing is asserted."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "tools" / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import mla  # noqa: E402

pytest.importorskip("transformers")

TINY = ["--hidden", "64", "--heads", "4", "--kv-lora-rank", "16", "--q-lora-rank", "24", "--nope", "8", "--rope", "4",
        "--v-dim", "6", "--seq", "32", "--batch", "2", "--reps", "1", "--warmup", "0", "--threads", "1",
        "--cache-tokens", "5"]
ROW_KEYS = {"dtype", "impl", "errors", "max_rel_error", "s", "best_s", "cpu_s", "speedup_vs_hf_sdpa", "speedup_vs_hf_eager",
            "best_speedup_vs_hf_sdpa", "best_speedup_vs_hf_eager"}


def test_mla_bench_tiny(capsys: pytest.CaptureFixture[str]) -> None:
    mla.main(TINY)
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["bench"] == "mla"
    assert [(r["dtype"], r["impl"]) for r in report["attention"]] == [(d, i) for d in ("fp32", "bf16") for i in mla.VARIANTS]
    for r in report["attention"]:
        assert ROW_KEYS <= set(r), ROW_KEYS - set(r)
        assert r["max_rel_error"] <= mla.TOLERANCE[r["dtype"]], r
        assert math.isfinite(r["speedup_vs_hf_sdpa"]) and r["speedup_vs_hf_sdpa"] > 0
    assert report["checks"] == {"cache_ratio_equals_formula": True, "cache_equals_planner": True}
    for r, size in zip(report["cache"], (4, 2), strict=True):
        assert (r["mla"]["k_per_token"], r["mla"]["v_per_token"]) == ([1, 16], [1, 4])  # the latent, the rotary key
        assert r["mla"]["bytes_per_token_per_layer"] == (16 + 4) * size
        assert r["mha"]["bytes_per_token_per_layer"] == 2 * 4 * (8 + 4) * size
        assert r["ratio"] == r["formula_ratio"] == (16 + 4) / (2 * 4 * (8 + 4))
    assert {"fp32_vs_hf_sdpa", "bf16_vs_hf_eager_best", "fp32_cache_ratio"} <= set(report["goals"])


def test_mla_cuts_with_split_not_slices() -> None:
    """q and the keys/values are cut from the projections by ``split``: the only slice of a tensor wider than the rotary
    dims left in the sublayer's graph is the output's ``v_head_dim`` cut of the padded attention output (a slice's
    backward fills a zeroed full-width gradient; there were 7: 6-15 % of the sublayer's CPU time at the bench's size)."""
    import torch
    from common import build_layer, graph_nodes, rope
    from megatron_sp.mpu import ParallelContext

    cfg = mla.mla_config(mla.parse_args(TINY))
    attention = build_layer(cfg, ParallelContext(), 1).attention
    out = attention(torch.randn(32, 2, 64, requires_grad=True), *rope(cfg, 32))
    slices = [n._saved_self_sym_sizes for n in graph_nodes(out) if type(n).__name__ == "SliceBackward0"]
    assert [size for size in slices if size[-1] > 4] == [(32, 2, 4, 12)]  # [s, b, heads, nope + rope]


def test_mla_bench_bad_flags() -> None:
    with pytest.raises(SystemExit, match="--dtypes"):
        mla.parse_args(["--dtypes", "fp16"])
