"""Smoke test of the compile-per-layout benchmark at a tiny size (one layout, fp32, one run of each mode): train.py
runs eager and compiled, and the JSON line carries both rates, their ratio and the ratio against the first layout."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "tools" / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import compile_layouts  # noqa: E402

TINY = ["--layers", "1", "--hidden", "32", "--heads", "4", "--seq", "16", "--batch", "2", "--vocab", "256",
        "--global-batch", "4", "--iters", "3", "--skip", "1", "--rounds", "1", "--dtype", "fp32", "--layouts", "1:"]


def test_compile_layouts_tiny(capsys: pytest.CaptureFixture[str]) -> None:
    compile_layouts.main(TINY)
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["bench"] == "compile_layouts"
    (row,) = report["results"]
    assert (row["layout"], row["overrides"], row["dtype"]) == ("1", "", "fp32")
    for key in ("eager_tokens_per_s", "compiled_tokens_per_s", "speedup", "speedup_median"):
        assert math.isfinite(row[key]) and row[key] > 0, (key, row[key])
    assert row["speedup"] == pytest.approx(row["compiled_tokens_per_s"] / row["eager_tokens_per_s"])
    assert row["speedup_vs_first_layout"] == pytest.approx(1.0)


def test_overrides_pad_the_vocabulary_per_tp_rank() -> None:
    """``make_vocab_size_divisible_by`` is multiplied by tp in the config: every layout gets ``--vocab`` rows."""
    args = compile_layouts.parse_args(["--vocab", "8192"])
    for layout, multiple in (("", 8192), ("parallel.tp=2 parallel.sequence_parallel=true", 4096)):
        items = compile_layouts.overrides(args, layout, "bf16", "/d/x", Path("/r"))
        assert f"model.make_vocab_size_divisible_by={multiple}" in items and "train.precision=bf16" in items
        assert items[len(items) - len(layout.split()):] == layout.split()  # the layout's own keys come last


def test_compile_layouts_steps_dp2(capsys: pytest.CaptureFixture[str]) -> None:
    """``--method steps`` on two gloo ranks (dp2): train.py's setup, the eager and the compiled model side by side,
    alternating steps; the rates after ``--skip`` of each."""
    argv = [*TINY[:TINY.index("--layouts")], "--layouts", "dp2:parallel.dp=2", "--method", "steps"]
    compile_layouts.main(argv)
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    (row,) = report["results"]
    assert (row["layout"], row["method"], row["dtype"]) == ("dp2", "steps", "fp32")
    for key in ("eager_tokens_per_s", "compiled_tokens_per_s", "speedup", "speedup_median"):
        assert math.isfinite(row[key]) and row[key] > 0, (key, row[key])
