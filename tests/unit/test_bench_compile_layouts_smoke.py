"""Smoke test of the compile-per-layout benchmark at a tiny size (one layout, fp32): a train.py run of ``--method
processes``, and ``--method steps`` at dp2 whose JSON line carries both rates, their ratio and the ratio against the
first layout."""
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


def test_processes_method_runs_train_py(tmp_path: Path) -> None:
    """``--method processes``: one train.py run (eager here; the compiled run differs by ``train.compile`` alone and
    compiles in the test below) gives the rates of its steps after ``--skip``."""
    args = compile_layouts.parse_args(TINY)
    data = compile_layouts.byte_dataset(tmp_path / "data", 64, args.seq)
    rates = compile_layouts.run(args, "", "fp32", False, data, tmp_path / "run")
    assert len(rates) == args.iters - args.skip and all(math.isfinite(r) and r > 0 for r in rates), rates


def test_overrides_pad_the_vocabulary_per_tp_rank() -> None:
    """``make_vocab_size_divisible_by`` is multiplied by tp in the config: every layout gets ``--vocab`` rows."""
    args = compile_layouts.parse_args(["--vocab", "8192"])
    for layout, multiple in (("", 8192), ("parallel.tp=2 parallel.sequence_parallel=true", 4096)):
        items = compile_layouts.overrides(args, layout, "bf16", "/d/x", Path("/r"))
        assert f"model.make_vocab_size_divisible_by={multiple}" in items and "train.precision=bf16" in items
        assert items[len(items) - len(layout.split()):] == layout.split()  # the layout's own keys come last


def test_compile_layouts_steps_dp2(capsys: pytest.CaptureFixture[str]) -> None:
    """``--method steps`` on two gloo ranks (dp2): train.py's setup, the eager and the compiled model side by side,
    alternating steps; the rates after ``--skip`` of each, their ratio and the ratio against the first layout."""
    argv = [*TINY[:TINY.index("--layouts")], "--layouts", "dp2:parallel.dp=2", "--method", "steps"]
    compile_layouts.main(argv)
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    (row,) = report["results"]
    assert report["bench"] == "compile_layouts"
    assert (row["layout"], row["overrides"], row["method"], row["dtype"]) == ("dp2", "parallel.dp=2", "steps", "fp32")
    for key in ("eager_tokens_per_s", "compiled_tokens_per_s", "speedup", "speedup_median"):
        assert math.isfinite(row[key]) and row[key] > 0, (key, row[key])
    assert row["speedup"] == pytest.approx(row["compiled_tokens_per_s"] / row["eager_tokens_per_s"])
    assert row["speedup_vs_first_layout"] == pytest.approx(1.0)
