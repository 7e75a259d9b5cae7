"""The layout planner and the MFU count with multi-token prediction (``model.mtp_layers``, docs/mtp.md "Cost"): the
modules' parameters on the last stage (with the embedding's copy under PP), their FLOPs in ``stage_flops`` as in
``flops_per_token``, their saved activations against the tensors autograd saves."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from megatron_sp import config
from megatron_sp.model.gpt import GPTModel, count_parameters, flops_per_token, parameter_parts

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("plan_cli_mtp", ROOT / "tools" / "plan.py")
assert _spec is not None and _spec.loader is not None
plan_cli = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plan_cli)  # puts tools/ on sys.path: the planner package is importable from here on
plan = plan_cli.plan

BASE = ["data.paths=[unused]", "tokenizer.type=byte", "model.arch=llama", "model.num_layers=2", "model.hidden_size=64",
        "model.num_heads=4", "model.seq_length=32", "train.micro_batch_size=2", "train.global_batch_size=4",
        "model.mtp_layers=2"]
MOE = ["model.num_experts=4", "model.moe_ffn_hidden_size=32", "model.moe_first_dense_layers=1"]


def make_config(*overrides: str):
    cfg = config.load(overrides=[*BASE, *overrides])
    config.set_vocab(cfg, 250)
    return cfg


@pytest.mark.parametrize("tied", [False, True])
def test_parameters_and_flops_count_the_modules(tied: bool) -> None:
    cfg = make_config(*MOE, f"model.tie_embeddings={tied}", "parallel.pp=2", "parallel.world_size=2")
    assert GPTModel(cfg.model, 1).num_parameters() == count_parameters(cfg.model, exclude_embeddings=tied)
    last = dict(plan.stage_parameters(cfg, 1))
    assert {n for n in last if n.startswith("mtp.")} and ("mtp_embedding.weight" in last) != tied
    assert not any(n.startswith("mtp") for n, _ in plan.stage_parameters(cfg, 0))
    tokens = cfg.train.global_batch_size * cfg.model.seq_length
    assert sum(plan.stage_flops(cfg, r) for r in range(2)) == pytest.approx(tokens * flops_per_token(cfg.model))
    without = make_config(*MOE, f"model.tie_embeddings={tied}", "model.mtp_layers=0")
    parts, m = parameter_parts(cfg.model), cfg.model  # two MoE modules, each one more pass through the output layer
    assert parts["mtp_active"] == 2 * (parts["moe_layer_active"] + 3 * 64 + 2 * 64 * 64)
    attention = 3 * 2 * m.num_heads * 2 * m.head_dim * m.seq_length
    assert flops_per_token(m) - flops_per_token(without.model) == 6 * (parts["mtp_active"] + 2 * 256 * 64) + attention


@pytest.mark.parametrize("overrides", [(), ("model.arch=neox", "model.recompute=full", "model.mtp_layers=1"),
                                       (*MOE, "train.precision=bf16")])
def test_mtp_activations_match_saved_tensors(overrides: tuple[str, ...]) -> None:
    """Measured / predicted 0.95-1.00: the planner counts the module's hnorm input, which is the state the main
    model's final norm (or the previous module's) already saved."""
    cfg = make_config(*overrides)
    chunk = plan.chunk_activations(cfg, 0, 0)
    assert chunk.extra["multi-token prediction"] > 0
    predicted = chunk.per_micro_batch + sum(chunk.shared.values())
    assert 0.94 <= plan.micro_batch_saved_bytes(cfg) / predicted <= 1.01
