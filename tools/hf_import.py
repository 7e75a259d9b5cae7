"""An HF ``config.json`` dict → our ``model`` section (``model_config_from_hf``), for ``tools/convert_checkpoint.py
--to megatron_sp``: the families of ``megatron_sp.model.hf_names`` (``HF_ARCHS``), their variants refused in one line."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megatron_sp.config.schema import ModelConfig
from megatron_sp.errors import DataError
from megatron_sp.model.hf_names import (DEEPSEEK_V3, HF_ARCHS, MIXTRAL, QWEN2_MOE, QWEN3_MOE, family_keys,
                                        hf_aux_loss_coef)


def _rope(raw: dict[str, Any], key: str, legacy: str, default: float) -> float:
    """A rotary setting from transformers >= 5's ``rope_parameters`` or the older top-level key."""
    params = raw.get("rope_parameters") or {}
    return float(params.get(key, raw.get(legacy, default)))


def qwen2_moe_keys(raw: dict[str, Any], num_layers: int, refuse: Callable[[str], DataError],
                   qwen3: bool = False) -> dict[str, Any]:
    """Our ``moe_*`` keys for a Qwen2MoeForCausalLM (or, ``qwen3``, Qwen3MoeForCausalLM: no shared expert) config
    (absent keys: the config class's defaults); ``norm_topk_prob`` is ``moe_renormalize``; refused: a shared width not a
    multiple of the experts', sparse layers not of the form ``is_moe_layer`` picks (every ``moe_layer_freq``-th from
    ``moe_first_dense_layers`` on)."""
    k, step = int(raw.get("num_experts_per_tok", 8 if qwen3 else 4)), int(raw.get("decoder_sparse_step", 1))
    ffn = int(raw.get("moe_intermediate_size", 768 if qwen3 else 1408))
    shared = 0 if qwen3 else int(raw.get("shared_expert_intermediate_size", 5632))
    if shared % ffn:
        raise refuse(f"shared_expert_intermediate_size {shared} (not a multiple of moe_intermediate_size {ffn})")
    sparse = [i for i in range(num_layers) if (i + 1) % step == 0 and i not in (raw.get("mlp_only_layers") or [])]
    first = sparse[0] if sparse else num_layers
    freq = sparse[1] - first if len(sparse) > 1 else max(num_layers - first, 1)
    if not sparse or sparse != list(range(first, num_layers, freq)):
        raise refuse(f"sparse layers {sparse} (ours: every moe_layer_freq-th layer from moe_first_dense_layers on)")
    experts = raw.get("num_experts", raw.get("num_local_experts", 128 if qwen3 else 60))  # transformers 5 writes the latter
    return {"num_experts": int(experts), "moe_top_k": k, "moe_ffn_hidden_size": ffn,
            "moe_renormalize": bool(raw.get("norm_topk_prob", False)),
            "moe_shared_experts": shared // ffn, "moe_first_dense_layers": first, "moe_layer_freq": freq,
            "moe_aux_loss_coeff": float(raw.get("router_aux_loss_coef", 0.001))}


_DEEPSEEK_V3 = {"kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                "v_head_dim": 128, "n_routed_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 2048,
                "n_shared_experts": 1, "first_k_dense_replace": 3, "n_group": 8, "topk_group": 4, "norm_topk_prob": True,
                "routed_scaling_factor": 2.5}  # DeepseekV3Config's defaults of the keys read


def deepseek_keys(raw: dict[str, Any], num_layers: int, refuse: Callable[[str], DataError]) -> dict[str, Any]:
    """Our latent-attention and MoE keys for a DeepseekV3ForCausalLM config (a MoE one: sigmoid router with groups,
    routed scaling, shared experts, ``first_k_dense_replace`` dense layers; ``moe_aux_loss_coeff`` 0 as transformers'
    class has no aux loss); ``q_lora_rank`` null is 0. Refused: a router other than ``scoring_func`` sigmoid with
    ``topk_method`` noaux_tc (transformers' class routes so whatever they say)."""
    for key, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if raw.get(key, want) != want:
            raise refuse(f"{key} {raw[key]!r} (DeepseekV3ForCausalLM routes as {want})")
    v = {key: raw.get(key, default) for key, default in _DEEPSEEK_V3.items()}
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    keys = {"kv_lora_rank": int(v["kv_lora_rank"]), "q_lora_rank": int(v["q_lora_rank"] or 0),
            "qk_nope_head_dim": int(v["qk_nope_head_dim"]), "qk_rope_head_dim": int(v["qk_rope_head_dim"]),
            "v_head_dim": int(v["v_head_dim"]), "rope_mscale_all_dim": float(rope.get("mscale_all_dim") or 0.0)}
    if int(v["first_k_dense_replace"]) >= num_layers:  # every layer dense
        return keys
    return {**keys, "num_experts": int(v["n_routed_experts"]), "moe_top_k": int(v["num_experts_per_tok"]),
            "moe_ffn_hidden_size": int(v["moe_intermediate_size"]), "moe_shared_experts": int(v["n_shared_experts"]),
            "moe_first_dense_layers": int(v["first_k_dense_replace"]), "moe_router_score": "sigmoid",
            "moe_renormalize": bool(v["norm_topk_prob"]), "moe_router_groups": int(v["n_group"] or 1),
            "moe_router_group_topk": int(v["topk_group"] or 1), "moe_routed_scaling": float(v["routed_scaling_factor"]),
            "moe_aux_loss_coeff": 0.0}


def model_config_from_hf(raw: dict[str, Any], source: str) -> ModelConfig:
    """Our model section for an HF config dict of a class in ``HF_ARCHS`` (``FAMILIES``, MoE); unsupported variants are
    refused (Qwen2-MoE's q/k/v biases and shared-expert gate are checked to be zero with the weights)."""
    names = [a for a in raw.get("architectures") or [] if a in HF_ARCHS]
    if not names:
        raise DataError(f"{source}: architectures {raw.get('architectures')} is not one of {', '.join(HF_ARCHS)}")
    arch = HF_ARCHS[names[0]]
    hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])

    def refuse(what: str) -> DataError:
        return DataError(f"{source}: {what} is not supported by megatron_sp's {arch} model")
    if raw.get("quantization_config"):
        raise refuse(f"a quantized checkpoint ({raw['quantization_config'].get('quant_method', '?')}; dequantize it to "
                     "bf16 or fp32 and drop quantization_config first)")

    common = {**family_keys(raw, names[0], refuse), "arch": arch, "num_layers": int(raw["num_hidden_layers"]),
              "hidden_size": hidden, "num_heads": heads,
              "ffn_hidden_size": int(raw["intermediate_size"]), "seq_length": int(raw["max_position_embeddings"]),
              "attention_dropout": float(raw.get("attention_dropout", 0.0)),
              "tie_embeddings": bool(raw.get("tie_word_embeddings", arch == "llama" and names[0] != DEEPSEEK_V3)),
              "init_std": float(raw.get("initializer_range", 0.02)), "vocab_size": int(raw["vocab_size"])}
    if arch == "neox":
        if not raw.get("use_parallel_residual", True):
            raise refuse("use_parallel_residual=false")
        if raw.get("hidden_act", "gelu") != "gelu":
            raise refuse(f"hidden_act {raw.get('hidden_act')!r}")
        if not raw.get("attention_bias", True):
            raise refuse("attention_bias=false")
        if common["tie_embeddings"]:
            raise refuse("tie_word_embeddings=true")
        return ModelConfig(**common, num_kv_heads=heads, rotary_pct=_rope(raw, "partial_rotary_factor", "rotary_pct", 0.25),
                           rotary_base=_rope(raw, "rope_theta", "rotary_emb_base", 10000.0),
                           norm_eps=float(raw.get("layer_norm_eps", 1e-5)),
                           hidden_dropout=float(raw.get("hidden_dropout", 0.0)))
    if raw.get("hidden_act", "silu") != "silu":
        raise refuse(f"hidden_act {raw.get('hidden_act')!r}")
    if raw.get("attention_bias") or raw.get("mlp_bias"):
        raise refuse("attention_bias/mlp_bias=true")
    moe: dict[str, Any] = {}
    window = raw.get("sliding_window") if raw.get("use_sliding_window", names[0] in (MIXTRAL, "MistralForCausalLM")) else None
    window = int(window) if window and int(window) < common["seq_length"] else None  # one covering the context: none
    kinds = raw.get("layer_types") or ["sliding_attention" if i >= int(raw.get("max_window_layers", 0)) else "full"
                                       for i in range(common["num_layers"])]  # Qwen: windows from max_window_layers on
    if window and any(kind != "sliding_attention" for kind in kinds):
        raise refuse(f"a sliding window on some layers only (layer_types {kinds})")
    if names[0] in (QWEN2_MOE, QWEN3_MOE):
        moe = qwen2_moe_keys(raw, common["num_layers"], refuse, names[0] == QWEN3_MOE)
    if names[0] == DEEPSEEK_V3:
        moe = deepseek_keys(raw, common["num_layers"], refuse)
    if names[0] == MIXTRAL:  # llama with a MoE MLP in every layer
        moe = {"num_experts": int(raw["num_local_experts"]), "moe_top_k": int(raw.get("num_experts_per_tok", 2)),
               "moe_ffn_hidden_size": common["ffn_hidden_size"], "moe_renormalize": True,
               "moe_aux_loss_coeff": float(raw.get("router_aux_loss_coef", 0.01))}
    cfg = ModelConfig(**common, **moe, sliding_window=window, num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                      rotary_pct=1.0,
                      rotary_base=_rope(raw, "rope_theta", "rope_theta", 10000.0), norm_eps=float(raw.get("rms_norm_eps", 1e-6)))
    if moe:  # transformers' router_aux_loss_coef → our α (docs/moe.md)
        cfg.moe_aux_loss_coeff = hf_aux_loss_coef(cfg.moe_aux_loss_coeff, cfg, to_hf=False)
    return cfg
