"""Every config in configs/ loads; the open-model configs (Llama-3.1-8B, Qwen3-8B, Qwen3-30B-A3B) hold exactly the
model section tools/convert_checkpoint.py imports from the real model's config.json (so checkpoint.load of the import
matches), and their planned layout fits 80 GB per GPU by the planner's per-rank memory (meta device)."""
from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest

from megatron_sp import config

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("convert_checkpoint", ROOT / "tools" / "convert_checkpoint.py")
convert = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
_spec.loader.exec_module(convert)  # type: ignore[union-attr]

LLAMA = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
         "max_position_embeddings": 131072, "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
         "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": False, "vocab_size": 128256,
         "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 8192, "rope_type": "llama3"}}
QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "head_dim": 128, "hidden_size": 4096, "intermediate_size": 12288,
         "max_position_embeddings": 40960, "max_window_layers": 36, "num_attention_heads": 32, "num_hidden_layers": 36,
         "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
         "sliding_window": None, "tie_word_embeddings": False, "use_sliding_window": False, "vocab_size": 151936}
QWEN3_MOE = {**QWEN3, "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048, "intermediate_size": 6144,
             "num_hidden_layers": 48, "num_key_value_heads": 4, "max_window_layers": 48, "decoder_sparse_step": 1,
             "mlp_only_layers": [], "moe_intermediate_size": 768, "norm_topk_prob": True, "num_experts": 128,
             "num_experts_per_tok": 8, "router_aux_loss_coef": 0.001}
OPEN = {"llama3_8b": (LLAMA, 8, 8.03e9), "qwen3_8b": (QWEN3, 16, 8.19e9), "qwen3_30b_a3b": (QWEN3_MOE, 64, 30.53e9)}
NOT_THE_MODEL = {"seq_length", "vocab_size", "padded_vocab_size", "init_std"}  # the run's, the tokenizer's, unused


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yml")), ids=lambda p: p.name)
def test_every_config_loads(path: Path) -> None:
    config.load([path])


@pytest.mark.parametrize("name", OPEN)
def test_open_model_config_is_the_import_and_fits(name: str) -> None:
    from megatron_sp.model import count_parameters

    raw, devices, params = OPEN[name]
    cfg = config.load([ROOT / "configs" / f"{name}.yml"], ["parallel.device=cuda", "parallel.backend=nccl"])
    assert cfg.parallel.world_size == devices
    imported = convert.model_config_from_hf(raw, "config.json")
    differ = {f.name: (getattr(cfg.model, f.name), getattr(imported, f.name)) for f in dataclasses.fields(imported)
              if f.name not in NOT_THE_MODEL and getattr(imported, f.name) is not None  # None: derived, as ours
              and getattr(cfg.model, f.name) != getattr(imported, f.name)}
    assert not differ, differ
    config.set_vocab(cfg, raw["vocab_size"])
    assert count_parameters(cfg.model, exclude_embeddings=False) == pytest.approx(params, rel=2e-3)
    plan_spec = importlib.util.spec_from_file_location("plan_cli", ROOT / "tools" / "plan.py")
    plan_cli = importlib.util.module_from_spec(plan_spec)  # type: ignore[arg-type]
    plan_spec.loader.exec_module(plan_cli)  # type: ignore[union-attr]
    assert plan_cli.plan.plan_layout(cfg).peak_bytes <= 80e9  # plan.py --memory 80GB
