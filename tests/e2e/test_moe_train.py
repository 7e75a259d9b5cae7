"""End-to-end: train.py trains a tiny MoE llama on one rank; its MoE metrics, and the aux-loss-free bias of a dp2
run against the 1-rank run (issue 33)."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from .runs import metrics, train

MOE = ["model.arch=llama", "model.ffn_multiple_of=64", "model.num_experts=4", "model.moe_top_k=2",
       "model.moe_ffn_hidden_size=64", "model.moe_shared_experts=1", "model.moe_first_dense_layers=1",
       "model.moe_z_loss_coeff=1e-3", "model.moe_capacity_factor=1.5"]
MOE_KEYS = {"moe_aux_loss", "moe_z_loss", "moe_load_imbalance", "moe_dropped_tokens", "moe_tokens_per_expert"}


def test_moe_llama_trains_two_steps(tmp_path, byte_data):
    p = train(tmp_path, byte_data, "train.iters=2", "train.global_batch_size=4", *MOE)
    rows = metrics(tmp_path)
    assert sorted(rows) == [1, 2]
    assert all(math.isfinite(rows[s]["loss"]) and math.isfinite(rows[s]["grad_norm"]) for s in rows)
    for row in rows.values():  # one MoE layer (layer 0 is dense); 4 sequences × 64 tokens × top-2 per step
        assert MOE_KEYS <= set(row)
        (load,) = row["moe_tokens_per_expert"]
        assert len(load) == 4 and sum(load) == 4 * 64 * 2
        assert row["moe_load_imbalance"] == pytest.approx(max(load) / (sum(load) / 4))
        assert 1.0 <= row["moe_aux_loss"] < 4.0 and row["moe_z_loss"] > 0  # E·Σ f·P ≥ 1 when P ≈ f
        assert 0 <= row["moe_dropped_tokens"] < sum(load) and row["moe_dropped_tokens"] == int(row["moe_dropped_tokens"])
    assert "MoE aux" in p.stdout and "load max/mean" in p.stdout


RATE_FP32 = float(np.float32(0.01))  # the bias is fp32


def _biases(ckpt) -> dict[int, dict[str, list[float]]]:
    return {int(d.name[5:]): json.loads((d / "meta.json").read_text())["moe_expert_bias"] for d in ckpt.glob("iter_*")}


def test_expert_bias_equals_the_one_rank_run_and_resumes(tmp_path, byte_data):
    """Aux-loss-free balancing: the biases after each step, saved in meta.json, are the same under dp2 as on one
    rank (the loads of the whole global batch), move by ±rate, and a resumed run picks them up: a 1-rank run of 2
    steps resumed for a third matches the dp2 run's third step. The MoE metrics equal too (global-batch sums)."""
    args = [*MOE, "model.moe_layer_freq=1", "model.moe_first_dense_layers=0", "model.moe_router_score=sigmoid",
            "model.moe_bias_update_rate=0.01", "train.global_batch_size=4", "checkpoint.interval=1"]
    one, two = tmp_path / "one", tmp_path / "two"
    train(one, byte_data, "train.iters=2", f"checkpoint.save={one}/ckpt", *args)
    train(one, byte_data, "train.iters=3", f"checkpoint.save={one}/ckpt", "checkpoint.auto_resume=true", *args)
    train(two, byte_data, "train.iters=3", f"checkpoint.save={two}/ckpt", "parallel.dp=2", *args)
    b1, b2 = _biases(one / "ckpt"), _biases(two / "ckpt")
    assert sorted(b1) == sorted(b2) == [1, 2, 3]
    assert b1 == b2  # bit for bit, every step, both MoE layers
    assert sorted(b1[1]) == ["0", "1"] and all(abs(v) in (0.0, RATE_FP32) for v in b1[1]["0"]) and any(b1[1]["0"])
    assert b1[3] != b1[2]
    m1, m2 = metrics(one), metrics(two)
    for step in (1, 2, 3):
        assert m1[step]["moe_tokens_per_expert"] == m2[step]["moe_tokens_per_expert"]
        assert m1[step]["moe_dropped_tokens"] == m2[step]["moe_dropped_tokens"]
        for key in ("loss", "moe_aux_loss", "moe_z_loss", "moe_load_imbalance"):
            assert m1[step][key] == pytest.approx(m2[step][key], rel=1e-5, abs=1e-6), (step, key)
