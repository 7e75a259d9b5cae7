"""Name and layout mapping between our GPTModel state dict and Hugging Face ``GPTNeoXForCausalLM`` (neox) /
``LlamaForCausalLM`` (llama) / ``MixtralForCausalLM`` or ``Qwen2MoeForCausalLM`` (a MoE llama), with the Hub
checkpoints' names (``embed_out.weight`` for GPT-NeoX's output layer, transformers >= 5 loads it as
``lm_head.weight``; one tensor per expert, which transformers >= 5 stacks on load and splits again on save) and the
padded vocabulary. neox is a pure renaming; llama splits our fused QKV rows into ``q_proj``/``k_proj``/``v_proj``.
A tied output layer is not written.
"""
from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from megatron_sp.config.schema import ModelConfig
from megatron_sp.errors import ConfigError
from megatron_sp.model.moe import is_moe_layer
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
MIXTRAL, QWEN2_MOE = "MixtralForCausalLM", "Qwen2MoeForCausalLM"
# per HF MoE class: its sparse block's module, and our stacked expert matrices [E, out, in] ↔ {block}.experts.{e}.NAME
_MOE_BLOCK = {MIXTRAL: ("block_sparse_moe", {"gate": "w1", "down": "w2", "up": "w3"}),
              QWEN2_MOE: ("mlp", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"})}
_HF_MOE_RE = re.compile(r"(?:block_sparse_moe|mlp)\.(?:(gate)|experts\.(\d+)\.(\w+)|shared_expert\.(\w+)_proj|(shared_expert_gate))")
_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)\.(weight|bias)$")
_HF_LAYER_RE = re.compile(r"^(?:gpt_neox|model)\.layers\.(\d+)\.(.+)\.(weight|bias)$")


def _resolve_arch(cfg: ModelConfig, arch: str | None) -> str:
    check_model_config(cfg)
    arch = cfg.arch if arch is None else arch
    if arch != cfg.arch:
        raise ValueError(f"arch {arch!r} does not match model.arch {cfg.arch!r}")
    return arch


def _unmet(cfg: ModelConfig, hf_class: str) -> list[str]:
    """What a MoE ``cfg`` lacks to export exactly as ``hf_class``: both need llama experts and a softmax router;
    Mixtral renormalises the top-k (so k ≥ 2: its top-1 weight is 1 where ours keeps the score), has no shared
    experts and a MoE MLP in every layer. Qwen2-MoE holds those (``norm_topk_prob = k > 1``, ``mlp_only_layers``)."""
    needs = [("model.arch=llama", cfg.arch != "llama"), ("model.moe_router_score=softmax", cfg.moe_router_score != "softmax")]
    if hf_class == MIXTRAL:
        needs += [("model.moe_top_k >= 2", cfg.moe_top_k < 2), ("model.moe_shared_experts=0", cfg.moe_shared_experts > 0),
                  ("every layer MoE (moe_layer_freq 1, moe_first_dense_layers 0)",
                   cfg.moe_layer_freq != 1 or cfg.moe_first_dense_layers > 0)]
    return [what for what, broken in needs if broken]


def check_mixtral(cfg: ModelConfig) -> None:
    """ConfigError unless the MoE ``cfg`` exports exactly as ``MixtralForCausalLM``."""
    if bad := _unmet(cfg, MIXTRAL):
        raise ConfigError(f"this MoE model is not exactly a Mixtral: MixtralForCausalLM needs {', '.join(bad)}")


def hf_moe_class(cfg: ModelConfig) -> str:
    """The transformers class a MoE ``cfg`` exports to exactly: Mixtral when it can, else Qwen2-MoE (shared experts,
    dense layers, top-1); a ConfigError naming what each lacks when neither can."""
    unmet = {hf_class: _unmet(cfg, hf_class) for hf_class in _MOE_BLOCK}
    if exact := [hf_class for hf_class, bad in unmet.items() if not bad]:
        return exact[0]
    raise ConfigError("this MoE model has no exact transformers class: "
                      + "; ".join(f"{hf_class} needs {', '.join(bad)}" for hf_class, bad in unmet.items()))


def hf_config_dict(cfg: ModelConfig, arch: str | None = None) -> dict[str, Any]:
    """Keyword arguments (and ``config.json`` content) of the matching HF config class (``hf_moe_class`` for MoE).
    Qwen2-MoE: ``decoder_sparse_step`` 1 with every dense layer in ``mlp_only_layers``; q/k/v biases on (written as
    zeros: transformers < 5 and other Qwen2-MoE readers always build them)."""
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
    llama = {**common, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
             "num_key_value_heads": cfg.num_kv_heads, "hidden_act": "silu", "rope_theta": cfg.rotary_base,
             "rms_norm_eps": cfg.norm_eps, "attention_bias": False, "mlp_bias": False,
             "head_dim": head_dim(cfg)}
    if not cfg.num_experts:
        return llama
    hf_class = hf_moe_class(cfg)
    moe = {"architectures": [hf_class], "num_experts_per_tok": cfg.moe_top_k, "output_router_logits": False,
           "router_aux_loss_coef": cfg.moe_aux_loss_coeff}  # transformers uses it only when training
    if hf_class == MIXTRAL:
        return {**llama, **moe, "model_type": "mixtral", "intermediate_size": cfg.moe_ffn_hidden_size,
                "num_local_experts": cfg.num_experts, "router_jitter_noise": 0.0, "sliding_window": None}
    llama = {k: v for k, v in llama.items() if k not in ("attention_bias", "mlp_bias")}
    return {**llama, **moe, "model_type": "qwen2_moe", "num_experts": cfg.num_experts,
            "moe_intermediate_size": cfg.moe_ffn_hidden_size, "norm_topk_prob": cfg.moe_top_k > 1,
            "shared_expert_intermediate_size": cfg.moe_shared_experts * cfg.moe_ffn_hidden_size,
            "decoder_sparse_step": 1, "mlp_only_layers": [i for i in range(cfg.num_layers) if not is_moe_layer(cfg, i)],
            "qkv_bias": True, "use_sliding_window": False}


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
    A tied ``output_layer.weight`` (the last stage's copy of the embedding) is dropped. Qwen2-MoE scales its shared
    expert by ``sigmoid(x · shared_expert_gate)``: written as a zero gate (sigmoid(0) = 0.5 exactly) and ``2·down``,
    bit for bit our ungated shared experts (a width-0 shared expert without them); its q/k/v biases as zeros."""
    arch = _resolve_arch(cfg, arch)
    top = _GLOBAL[arch]
    hf_class = hf_moe_class(cfg) if cfg.num_experts else ""
    block, expert_names = _MOE_BLOCK.get(hf_class, ("", {}))
    out: dict[str, torch.Tensor] = {}
    for name, tensor, index, module, leaf in _layer_items(our_sd, _LAYER_RE, top, cfg, out, "no HF name for"):
        prefix = f"{_LAYER_PREFIX[arch]}.{index}"
        if arch == "llama" and module == "attention.qkv":
            for proj, part in zip("qkv", _split_llama_qkv(tensor, cfg)):
                out[f"{prefix}.self_attn.{proj}_proj.{leaf}"] = part
                if hf_class == QWEN2_MOE:
                    out[f"{prefix}.self_attn.{proj}_proj.bias"] = part.new_zeros(part.shape[0])
            continue
        if module == "mlp.router":
            out[f"{prefix}.{block}.gate.{leaf}"] = tensor
            if hf_class == QWEN2_MOE:
                out[f"{prefix}.mlp.shared_expert_gate.{leaf}"] = tensor.new_zeros(1, cfg.hidden_size)
                h = cfg.hidden_size
                for proj, shape in (("gate", (0, h)), ("up", (0, h)), ("down", (h, 0))) if not cfg.moe_shared_experts else ():
                    out[f"{prefix}.mlp.shared_expert.{proj}_proj.{leaf}"] = tensor.new_zeros(shape)
            continue
        if module.startswith("mlp.experts.") and module[12:] in expert_names:  # [E, out, in]: one matrix per expert
            for e, matrix in enumerate(tensor.unbind(0)):
                out[f"{prefix}.{block}.experts.{e}.{expert_names[module[12:]]}.{leaf}"] = matrix
            continue
        if module.startswith("mlp.shared.") and hf_class == QWEN2_MOE:
            out[f"{prefix}.mlp.shared_expert.{module[11:]}_proj.{leaf}"] = tensor * 2 if module == "mlp.shared.down" else tensor
            continue
        table = _NEOX_LAYER if arch == "neox" else _LLAMA_LAYER
        if module not in table:
            raise KeyError(f"no HF name for {name!r}")
        out[f"{prefix}.{table[module]}.{leaf}"] = tensor
    return out


def from_hf_state_dict(hf_sd: Mapping[str, torch.Tensor], cfg: ModelConfig,
                       arch: str | None = None) -> dict[str, torch.Tensor]:
    """HF names and layouts → our full-model state dict (the inverse of ``to_hf_state_dict``). Accepts
    ``lm_head.weight`` or ``embed_out.weight`` for GPT-NeoX; drops the output layer when ``cfg.tie_embeddings``.
    llama: q/k/v biases and Qwen2-MoE's ``shared_expert_gate`` must be zero (ValueError naming the tensor), its
    shared expert's ``down_proj`` is halved (the inverse of the export), a width-0 shared expert dropped."""
    arch = _resolve_arch(cfg, arch)
    top_inverse = {hf: ours for ours, hf in _GLOBAL[arch].items()}
    if arch == "neox":
        top_inverse["lm_head"] = "output_layer"
    layer_inverse = {hf: ours for ours, hf in (_NEOX_LAYER if arch == "neox" else _LLAMA_LAYER).items()}
    out: dict[str, torch.Tensor] = {}
    pending_qkv: dict[str, dict[str, torch.Tensor]] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}  # our stacked name → expert index → matrix
    expert_of = {hf: ours for _, names in _MOE_BLOCK.values() for ours, hf in names.items()}
    for name, tensor, index, module, leaf in _layer_items(hf_sd, _HF_LAYER_RE, top_inverse, cfg, out,
                                                         "unexpected HF parameter"):
        moe = _HF_MOE_RE.fullmatch(module) if arch == "llama" else None
        if moe and moe.group(5) or arch == "llama" and leaf == "bias" and module.startswith("self_attn."):
            if tensor.any():  # ours has no place for it
                raise ValueError(f"{name} is not zero: megatron_sp's llama has no "
                                 + ("shared-expert gate" if moe else "attention biases"))
            continue
        if moe and moe.group(4) and not tensor.numel():  # a width-0 shared expert: none
            continue
        if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
            pending_qkv.setdefault(f"layers.{index}.attention.qkv.{leaf}", {})[module[-6]] = tensor
            continue
        if moe and moe.group(1):
            out[f"layers.{index}.mlp.router.{leaf}"] = tensor
            continue
        if moe and moe.group(3) in expert_of:
            experts.setdefault(f"layers.{index}.mlp.experts.{expert_of[moe.group(3)]}.{leaf}", {})[int(moe.group(2))] = tensor
            continue
        if moe and moe.group(4) in ("gate", "up", "down"):
            out[f"layers.{index}.mlp.shared.{moe.group(4)}.{leaf}"] = tensor / 2 if moe.group(4) == "down" else tensor
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
    for name, by_expert in experts.items():
        if sorted(by_expert) != list(range(cfg.num_experts)):
            raise KeyError(f"experts {sorted(by_expert)} of {name!r}, expected 0..{cfg.num_experts - 1}")
        out[name] = torch.stack([by_expert[e] for e in range(cfg.num_experts)])
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
