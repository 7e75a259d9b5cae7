"""Name and layout mapping between our GPTModel state dict and Hugging Face ``GPTNeoXForCausalLM`` (neox) /
``LlamaForCausalLM`` (llama), with the Hub checkpoints' names (``embed_out.weight`` for GPT-NeoX's output layer;
transformers >= 5 loads it as ``lm_head.weight``) and the padded vocabulary. neox is a pure renaming; llama
splits our fused QKV rows into ``q_proj``/``k_proj``/``v_proj``. A tied output layer is not written.
"""
from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from megatron_sp.config.schema import ModelConfig
from megatron_sp.model.transformer import check_model_config, head_dim

_NEOX_LAYER = {
    "attn_norm": "input_layernorm",
    "mlp_norm": "post_attention_layernorm",
    "attention.qkv": "attention.query_key_value",
    "attention.out": "attention.dense",
    "mlp.fc1": "mlp.dense_h_to_4h",
    "mlp.fc2": "mlp.dense_4h_to_h",
}
_LLAMA_LAYER = {
    "attn_norm": "input_layernorm",
    "mlp_norm": "post_attention_layernorm",
    "attention.out": "self_attn.o_proj",
    "mlp.gate": "mlp.gate_proj",
    "mlp.up": "mlp.up_proj",
    "mlp.down": "mlp.down_proj",
}
_GLOBAL = {
    "neox": {"embedding": "gpt_neox.embed_in", "final_norm": "gpt_neox.final_layer_norm",
             "output_layer": "embed_out"},
    "llama": {"embedding": "model.embed_tokens", "final_norm": "model.norm", "output_layer": "lm_head"},
}
_LAYER_PREFIX = {"neox": "gpt_neox.layers", "llama": "model.layers"}
_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)\.(weight|bias)$")
_HF_LAYER_RE = re.compile(r"^(?:gpt_neox|model)\.layers\.(\d+)\.(.+)\.(weight|bias)$")


def _resolve_arch(cfg: ModelConfig, arch: str | None) -> str:
    check_model_config(cfg)
    arch = cfg.arch if arch is None else arch
    if arch != cfg.arch:
        raise ValueError(f"arch {arch!r} does not match model.arch {cfg.arch!r}")
    return arch


def hf_config_dict(cfg: ModelConfig, arch: str | None = None) -> dict[str, Any]:
    """Keyword arguments (and ``config.json`` content) of the matching HF config class."""
    arch = _resolve_arch(cfg, arch)
    common: dict[str, Any] = {
        "vocab_size": cfg.padded_vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "intermediate_size": cfg.ffn_hidden_size,
        "max_position_embeddings": cfg.seq_length,
        "attention_dropout": cfg.attention_dropout,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
    }
    if arch == "neox":
        return {**common, "architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox",
                "hidden_act": "gelu", "rotary_pct": cfg.rotary_pct, "rotary_emb_base": cfg.rotary_base,
                "layer_norm_eps": cfg.norm_eps, "use_parallel_residual": True, "attention_bias": True,
                "hidden_dropout": cfg.hidden_dropout}
    return {**common, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "num_key_value_heads": cfg.num_kv_heads, "hidden_act": "silu", "rope_theta": cfg.rotary_base,
            "rms_norm_eps": cfg.norm_eps, "attention_bias": False, "mlp_bias": False,
            "head_dim": head_dim(cfg)}


def _layer_items(sd: Mapping[str, torch.Tensor], layer_re: re.Pattern, top: dict[str, str], cfg: ModelConfig,
                 out: dict[str, torch.Tensor], error: str) -> Iterator[tuple[str, torch.Tensor, str, str, str]]:
    """Copy the names of ``sd`` outside the layers into ``out``, renamed through ``top`` (ours ↔ HF; a tied output
    layer dropped); yield ``(name, tensor, layer index, module, leaf)`` of the layer parameters."""
    for name, tensor in sd.items():
        match = layer_re.match(name)
        if match is not None:
            yield name, tensor, *match.groups()
            continue
        module, _, leaf = name.rpartition(".")
        if module not in top:
            raise KeyError(f"{error} {name!r}")
        if not ("output_layer" in (module, top[module]) and cfg.tie_embeddings):
            out[f"{top[module]}.{leaf}"] = tensor


def _split_llama_qkv(weight: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g, r, d = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, head_dim(cfg)
    grouped = weight.view(g, r + 2, d, weight.shape[-1])  # [g, r+2, d, h]
    q = grouped[:, :r].reshape(g * r * d, -1)
    k = grouped[:, r].reshape(g * d, -1)
    v = grouped[:, r + 1].reshape(g * d, -1)
    return q, k, v


def to_hf_state_dict(our_sd: Mapping[str, torch.Tensor], cfg: ModelConfig,
                     arch: str | None = None) -> dict[str, torch.Tensor]:
    """Our full-model state dict → HF names and layouts (views or fresh copies); ``arch`` must equal ``cfg.arch``.
    A tied ``output_layer.weight`` (the last stage's copy of the embedding) is dropped."""
    arch = _resolve_arch(cfg, arch)
    top = _GLOBAL[arch]
    out: dict[str, torch.Tensor] = {}
    for name, tensor, index, module, leaf in _layer_items(our_sd, _LAYER_RE, top, cfg, out, "no HF name for"):
        prefix = f"{_LAYER_PREFIX[arch]}.{index}"
        if arch == "llama" and module == "attention.qkv":
            for proj, part in zip("qkv", _split_llama_qkv(tensor, cfg)):
                out[f"{prefix}.self_attn.{proj}_proj.{leaf}"] = part
            continue
        table = _NEOX_LAYER if arch == "neox" else _LLAMA_LAYER
        if module not in table:
            raise KeyError(f"no HF name for {name!r}")
        out[f"{prefix}.{table[module]}.{leaf}"] = tensor
    return out


def from_hf_state_dict(hf_sd: Mapping[str, torch.Tensor], cfg: ModelConfig,
                       arch: str | None = None) -> dict[str, torch.Tensor]:
    """HF names and layouts → our full-model state dict (the inverse of ``to_hf_state_dict``). Accepts
    ``lm_head.weight`` or ``embed_out.weight`` for GPT-NeoX; drops the output layer when ``cfg.tie_embeddings``."""
    arch = _resolve_arch(cfg, arch)
    top_inverse = {hf: ours for ours, hf in _GLOBAL[arch].items()}
    if arch == "neox":
        top_inverse["lm_head"] = "output_layer"
    layer_inverse = {hf: ours for ours, hf in (_NEOX_LAYER if arch == "neox" else _LLAMA_LAYER).items()}
    out: dict[str, torch.Tensor] = {}
    pending_qkv: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor, index, module, leaf in _layer_items(hf_sd, _HF_LAYER_RE, top_inverse, cfg, out,
                                                         "unexpected HF parameter"):
        if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
            pending_qkv.setdefault(f"layers.{index}.attention.qkv.{leaf}", {})[module[-6]] = tensor
            continue
        if module not in layer_inverse:
            raise KeyError(f"unexpected HF parameter {name!r}")
        out[f"layers.{index}.{layer_inverse[module]}.{leaf}"] = tensor
    g, r, d = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, head_dim(cfg)
    for name, parts in pending_qkv.items():
        if set(parts) != {"q", "k", "v"}:
            raise KeyError(f"incomplete q/k/v projections for {name!r}")
        h = parts["q"].shape[-1]
        grouped = torch.cat([parts["q"].reshape(g, r, d, h), parts["k"].reshape(g, 1, d, h),
                             parts["v"].reshape(g, 1, d, h)], dim=1)  # [g, r+2, d, h]
        out[name] = grouped.reshape(g * (r + 2) * d, h)
    return out


def build_hf_model(cfg: ModelConfig, our_sd: Mapping[str, torch.Tensor]) -> Any:
    """The transformers model of ``cfg.arch`` holding our weights (transformers imported lazily: the ``test``
    extra). Raises ``RuntimeError`` when the mapped weights do not cover it (a tied ``lm_head.weight`` may be absent)."""
    import transformers

    kwargs = hf_config_dict(cfg)
    kwargs.pop("architectures")
    kwargs.pop("model_type")
    if cfg.arch == "neox":
        hf = transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(**kwargs))
    else:
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kwargs))
    state = to_hf_state_dict(our_sd, cfg)
    if "embed_out.weight" in state and not hasattr(hf, "embed_out"):
        state["lm_head.weight"] = state.pop("embed_out.weight")  # transformers >= 5 module name
    missing, unexpected = hf.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"HF weight mapping mismatch: missing {missing}, unexpected {unexpected}")
    return hf.eval()
