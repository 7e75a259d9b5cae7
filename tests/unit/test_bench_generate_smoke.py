"""Smoke test of the generation benchmark in its --quick mode (a tiny llama, one round, batches 1 and 8, 1 rank and
tp2·pp2: the other layouts run the same code with fewer ranks): the JSON line's fields and the facts that do not
depend on timing. Greedy tokens equal transformers' ``generate`` on the exported model and the 1-rank tokens under
every layout (every rank), and do not depend on the batch; each rank's memory holds its shard of the weights and its
KV cache. No timing is asserted."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "tools" / "bench"
sys.path.insert(0, str(BENCH))  # ahead of tools/ (common.py puts it first): `generate` is the bench, not tools/generate.py

import generate  # noqa: E402

pytest.importorskip("transformers")

ROW_KEYS = {"impl", "layout", "tp", "pp", "world", "batch", "threads_per_rank", "prefill_s", "prefill_best_s", "full_s",
            "decode_s", "decode_best_s", "prefill_tokens_per_s", "decode_tokens_per_s", "decode_best_tokens_per_s",
            "decode_step_ms", "prefill_cpu_s", "decode_cpu_s", "decode_step_cpu_ms", "memory", "max_prefill_peak_bytes",
            "max_decode_peak_bytes", "max_weights_bytes",
            "tokens_equal", "decode_vs_transformers", "decode_best_vs_transformers", "prefill_vs_transformers",
            "decode_vs_1rank", "decode_best_vs_1rank", "prefill_vs_1rank"}
MEMORY_KEYS = {"weights_bytes", "prefill_peak_bytes", "decode_peak_bytes", "kv_cache_bytes"}


def test_generate_bench_quick(capsys: pytest.CaptureFixture[str]) -> None:
    assert Path(generate.__file__).resolve().parent == BENCH
    threads = torch.get_num_threads()
    result = generate.main(["--quick", "--layouts", "tp2pp2"])
    assert torch.get_num_threads() == threads
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["bench"] == "generate"
    assert report["checks"] == {"tokens_equal_transformers": True, "tokens_equal_across_layouts": True,
                                "batch_independent": True}
    rows = report["rows"]
    assert len(result["rows"]) == len(rows) == 2 * 3  # per batch: transformers, ours at 1 rank, tp2·pp2
    assert [(r["impl"], r["layout"], r["batch"]) for r in rows[:3]] == [
        ("transformers", "1", 1), ("ours", "1", 1), ("ours", "tp2pp2", 1)]
    assert {r["batch"] for r in rows} == {1, 8}
    for r in rows:
        assert ROW_KEYS <= set(r), ROW_KEYS - set(r)
        assert r["tokens_equal"], r
        assert len(r["memory"]) == r["world"] == r["tp"] * r["pp"]
        for m in r["memory"]:
            assert MEMORY_KEYS <= set(m), MEMORY_KEYS - set(m)
            assert 0 < m["weights_bytes"] < m["prefill_peak_bytes"] and m["weights_bytes"] < m["decode_peak_bytes"]
            if r["impl"] == "ours":  # each rank's cache: its layers, its kv heads, the model's seq_length rows
                assert m["kv_cache_bytes"] > 0 and m["kv_cache_bytes"] % (r["batch"] * 32 * 4) == 0
            if r["world"] > 1:
                assert m["rss_peak_bytes"] > m["decode_peak_bytes"]
    by = {(r["layout"], r["batch"], r["impl"]): r for r in rows}
    for b in (1, 8):
        one = by["1", b, "ours"]
        assert one["decode_vs_1rank"] == 1.0 and by["1", b, "transformers"]["decode_vs_transformers"] == 1.0
        for name in ("tp2pp2",):
            shards = [m["weights_bytes"] for m in by[name, b, "ours"]["memory"]]
            assert max(shards) < one["max_weights_bytes"]  # no rank holds the whole model
            kv = [m["kv_cache_bytes"] for m in by[name, b, "ours"]["memory"]]
            assert sum(kv) == one["memory"][0]["kv_cache_bytes"]  # split over the ranks (tp 2 <= 2 kv heads: no copies)
    assert set(report["goals"]) == {f"b{b}_{k}_vs_transformers" for b in (1, 8) for k in ("decode", "decode_best", "prefill")}
    assert report["config"]["quick"] and report["config"]["transformers"]


def test_generate_bench_bad_flags() -> None:
    with pytest.raises(SystemExit, match="not tpXppY"):
        generate.parse_args(["--layouts", "dp2"])
    with pytest.raises(SystemExit, match="exceed --seq"):
        generate.parse_args(["--seq", "64", "--prompt-len", "60", "--new-tokens", "8"])
    assert generate.layout_dims("tp2pp2") == (2, 2) and generate.layout_dims("pp4") == (1, 4)
