"""Smoke test of the throughput benchmark at a tiny size (both archs, fp32 and bf16, one timed step each): the
JSON line's records, ours against HF on the same weights, ours through train.py's optimizer."""
from __future__ import annotations

import functools
import json
import math
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "tools" / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import throughput  # noqa: E402

TINY = ["--layers", "1", "--hidden", "32", "--heads", "4", "--seq", "16", "--batch", "2", "--vocab", "256",
        "--warmup", "1", "--steps", "1", "--rounds", "1", "--threads", "1"]


def test_throughput_tiny(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    # One peak measurement per dtype instead of the best of 5 (~0.3 s each): no timing is asserted here.
    monkeypatch.setattr(throughput, "best_peak_flops", functools.partial(throughput.best_peak_flops, tries=1))
    threads = torch.get_num_threads()
    try:
        throughput.main(TINY)
    finally:
        torch.set_num_threads(threads)
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["bench"] == "throughput"
    assert [(r["arch"], r["dtype"]) for r in report["results"]] == [
        ("neox", "fp32"), ("neox", "bf16"), ("llama", "fp32"), ("llama", "bf16")]
    for r in report["results"]:
        assert r["tokens_per_step"] == 32
        for key in ("ours_tokens_per_s", "hf_tokens_per_s", "ours_mfu", "ratio", "peak_flops"):
            assert math.isfinite(r[key]) and r[key] > 0, (key, r[key])
        assert r["ratio"] == pytest.approx(r["ours_tokens_per_s"] / r["hf_tokens_per_s"])
        assert r["ours_mfu"] <= 1.0


def test_ours_steps_like_train_py() -> None:
    """bf16: our parameters become the optimizer's bf16 buffer (fp32 masters inside); the loss falls on one batch
    for both models, which start from the same weights and loss."""
    args = throughput.parse_args(TINY)
    cfg, train = throughput.configs(args, "llama")
    ours = throughput.GPTModel(cfg, seed=args.seed)
    hf = throughput.build_hf_model(cfg, ours.state_dict())
    tokens = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    losses = {}
    for name, model in (("ours", ours), ("hf", hf)):
        step = throughput.make_step(model, throughput.loss_closure(model, x, y), torch.bfloat16, train)
        losses[name] = [step() for _ in range(3)]
    assert all(p.dtype == torch.bfloat16 for p in ours.parameters())
    assert all(p.dtype == torch.float32 for p in hf.parameters())
    assert losses["ours"][0] == pytest.approx(losses["hf"][0], rel=2e-2)
    assert losses["ours"][-1] < losses["ours"][0] and losses["hf"][-1] < losses["hf"][0]
