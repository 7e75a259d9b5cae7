"""Smoke test of the context-parallel benchmark at a tiny size: cp = 1 and every algorithm at cp = 2 on
gloo ranks, then the longest-sequence search. It checks the JSON line and the numbers that are exact
by construction: the bytes sent equal the closed forms of our implementation (written out again here),
the attention work sums to the causal total and is balanced for zigzag and Ulysses, per-rank activations
about halve. No timing is asserted beyond being positive."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "tools" / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))  # the run_distributed children import the script by module name

import context_parallel  # noqa: E402

S, H, HEADS = 64, 32, 4
TINY = ["--seq", str(S), "--hidden", str(H), "--heads", str(HEADS), "--reps", "1", "--warmup", "0"]


def _report(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def _bytes(algo: str, n: int, g: int) -> tuple[int, int]:
    """(forward, backward) bytes per layer per rank, fp32, b = 1: the module docstring's table."""
    d = H // HEADS
    kv = 2 * S * g * d  # K and V elements of the whole sequence
    if algo in ("ring", "zigzag"):  # K,V blocks N−1 hops; backward also the fp32 dK,dV accumulators, N hops
        return (n - 1) * kv * 4 // n, (n - 1) * kv * 4 // n + kv * 4
    if algo == "llama3":  # all-gather; backward all-gather again + fp32 reduce-scatter
        return (n - 1) * kv * 4 // n, 2 * (n - 1) * kv * 4 // n
    g_sent = g if g % n == 0 else n
    each_way = (n - 1) * (2 * S * HEADS * d + 2 * S * g_sent * d) * 4 // n ** 2
    output_back = (n - 1) * S * HEADS * d * 4 // n ** 2  # backward moves the saved output back to [s, n/N]
    return each_way, each_way + output_back  # the lse is not sent (context_parallel_attention needs only out)


def test_context_parallel_tiny(capsys: pytest.CaptureFixture[str]) -> None:
    result = context_parallel.main([*TINY, "--cp", "1,2", "--algos", "ring,zigzag,llama3,ulysses,usp", "--long-cp", "1,2"])
    report = _report(capsys.readouterr().out)
    assert report["bench"] == "context_parallel" and report["skipped"] == []
    rows = {(r["cp"], r["algo"]): r for r in report["rows"]}
    assert list(rows) == [(1, "-"), (2, "ring"), (2, "zigzag"), (2, "llama3"), (2, "ulysses"), (2, "usp")]
    assert len(result["rows"]) == 6
    causal = HEADS * S * (S + 1) // 2
    for (n, algo), r in rows.items():
        assert r["work_total"] == r["work_causal"] == causal, r["work"]
        assert r["time_ms"]["wall"] > 0 and r["time_ms"]["thread_min"] > 0
        if n == 1:
            assert r["act_ratio"] == 1.0 and r["forward_bytes"] == r["backward_bytes"] == 0
            continue
        assert r["act_ratio"] < 0.6, (algo, r["act_ratio"])
        assert r["matches_expected"], (algo, r["comm"], r["expected"])
        assert (r["forward_bytes"], r["backward_bytes"]) == _bytes(algo, n, HEADS)
        assert r["meta_bytes"] == (n - 1) * S * 8 // n  # int64 token indices, once per micro-batch
        assert r["backward_work_equal"]
    assert rows[(2, "zigzag")]["balance"] <= 1.1 and rows[(2, "ulysses")]["balance"] == 1.0
    assert rows[(2, "ring")]["balance"] > 2  # contiguous causal: rank 1 does ~3x rank 0's pairs
    assert rows[(2, "ring")]["total_vs_table"] == pytest.approx(4 / 3)  # fp32 dK,dV make N hops, not N−1
    assert rows[(2, "llama3")]["total_vs_table"] == pytest.approx(1.0)
    long = report["long_context"]
    assert long["algo"] == "zigzag" and long["budget_bytes"] == rows[(1, "-")]["act_bytes"]
    by_cp = {f["cp"]: f for f in long["rows"]}
    assert by_cp[1]["longest"] == S and all(f["confirmed"] for f in by_cp.values())
    assert by_cp[2]["longest"] % 4 == 0 and by_cp[2]["longest"] >= 1.8 * S


def test_context_parallel_gqa(capsys: pytest.CaptureFixture[str]) -> None:
    """One kv head: Ulysses repeats it to cp heads before its all-to-all; llama3 gathers it once."""
    context_parallel.main([*TINY, "--arch", "llama", "--kv-heads", "1", "--cp", "2", "--algos", "ulysses,llama3",
                           "--long-algo", ""])
    report = _report(capsys.readouterr().out)
    assert report["long_context"] is None
    for r in report["rows"]:
        assert r["matches_expected"], (r["algo"], r["comm"], r["expected"])
        assert (r["forward_bytes"], r["backward_bytes"]) == _bytes(r["algo"], 2, 1)
        assert r["work_total"] == r["work_causal"] and r["act_ratio"] is None  # no cp = 1 row to compare with


def test_context_parallel_packed_documents(capsys: pytest.CaptureFixture[str]) -> None:
    """Packed documents: the work over ranks sums to the documents' causal pairs (no pair across a boundary),
    the bytes stay the closed forms, and the meta all-gather carries the document ids too."""
    context_parallel.main([*TINY, "--cp", "1,2", "--algos", "zigzag,ulysses", "--mean-doc", "8", "--long-algo", ""])
    report = _report(capsys.readouterr().out)
    rows = {(r["cp"], r["algo"]): r for r in report["rows"]}
    total = rows[(1, "-")]["work_causal"]
    assert total < HEADS * S * (S + 1) // 2  # several documents
    for (n, algo), r in rows.items():
        assert r["work_causal"] == total and r["work_total"] == total, (algo, r["work"])
        if n == 2:
            assert r["matches_expected"] and (r["forward_bytes"], r["backward_bytes"]) == _bytes(algo, n, HEADS)
            assert r["meta_bytes"] == r["meta_bytes_expected"] == 2 * (n - 1) * S * 8 // n
    assert rows[(2, "ulysses")]["balance"] == 1.0
