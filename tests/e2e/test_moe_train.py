"""End-to-end: train.py trains a tiny MoE llama on one rank (issue 33, the layer on one rank)."""
from __future__ import annotations

import math

from .runs import metrics, train

MOE = ["model.arch=llama", "model.ffn_multiple_of=64", "model.num_experts=4", "model.moe_top_k=2",
       "model.moe_ffn_hidden_size=64", "model.moe_shared_experts=1", "model.moe_first_dense_layers=1",
       "model.moe_z_loss_coeff=1e-3", "model.moe_capacity_factor=1.5"]


def test_moe_llama_trains_two_steps(tmp_path, byte_data):
    train(tmp_path, byte_data, "train.iters=2", "train.global_batch_size=4", *MOE)
    rows = metrics(tmp_path)
    assert sorted(rows) == [1, 2]
    assert all(math.isfinite(rows[s]["loss"]) and math.isfinite(rows[s]["grad_norm"]) for s in rows)
