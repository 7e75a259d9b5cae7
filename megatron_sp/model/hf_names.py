"""Name and layout mapping between our GPTModel state dict and Hugging Face ``GPTNeoXForCausalLM`` (neox) /
``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``, ``Olmo2ForCausalLM`` (llama;
``FAMILIES``) / ``MixtralForCausalLM``, ``Qwen2MoeForCausalLM`` or ``Qwen3MoeForCausalLM`` (a MoE llama) /
``DeepseekV3ForCausalLM`` (latent attention, dense or MoE), with the Hub checkpoints' names (``embed_out.weight`` for
GPT-NeoX's output layer, transformers >= 5 loads it as ``lm_head.weight``; one tensor per expert, which transformers
>= 5 stacks on load and splits again on save; its stacked ``experts.gate_up_proj``/``down_proj`` are read too) and the
padded vocabulary. neox is a pure renaming; llama splits our fused QKV rows into ``q_proj``/``k_proj``/``v_proj``.
A tied output layer is not written. DeepSeek-V3's router bias ``e_score_correction_bias`` is our buffer
``mlp.router.expert_bias``; its interleaved rotary pairs (``rope_interleave``) are our rotary halves, rows permuted.
"""
from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
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
    "attention.q_norm": "self_attn.q_norm",
    "attention.k_norm": "self_attn.k_norm",
    "attention.mla.q_down": "self_attn.q_a_proj", "attention.mla.q_latent_norm": "self_attn.q_a_layernorm",
    "attention.mla.q_up": "self_attn.q_b_proj", "attention.mla.q_proj": "self_attn.q_proj",
    "attention.mla.kv_down": "self_attn.kv_a_proj_with_mqa", "attention.mla.kv_latent_norm": "self_attn.kv_a_layernorm",
    "attention.mla.kv_up": "self_attn.kv_b_proj",
}
_NORM_NAMES = {"pre": {},  # model.norm_placement → the HF names of our two layer norms (OLMo-2: after the sublayers)
               "post_sublayer": {"attn_norm": "post_attention_layernorm", "mlp_norm": "post_feedforward_layernorm"}}
_GLOBAL = {
    "neox": {"embedding": "gpt_neox.embed_in", "final_norm": "gpt_neox.final_layer_norm",
             "output_layer": "embed_out"},
    "llama": {"embedding": "model.embed_tokens", "final_norm": "model.norm", "output_layer": "lm_head"},
}
_LAYER_PREFIX = {"neox": "gpt_neox.layers", "llama": "model.layers"}
MIXTRAL, QWEN2_MOE, QWEN3_MOE = "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"
DEEPSEEK_V3 = "DeepseekV3ForCausalLM"


@dataclass(frozen=True)
class Family:
    """One dense transformers class as data: the ``model.*`` values every model of it has (the layers read those
    keys), its ``model_type`` and the ``config.json`` constants it is written with."""

    model_type: str
    keys: dict[str, Any]
    hf: dict[str, Any]


_PLAIN = {"arch": "llama", "qkv_bias": False, "qk_norm": False, "norm_placement": "pre"}
FAMILIES = {
    "GPTNeoXForCausalLM": Family("gpt_neox", {"arch": "neox", "qk_norm": False, "norm_placement": "pre"},
                                 {"use_parallel_residual": True}),
    "LlamaForCausalLM": Family("llama", _PLAIN, {"attention_bias": False, "mlp_bias": False}),
    "MistralForCausalLM": Family("mistral", _PLAIN, {"sliding_window": None}),
    "Qwen2ForCausalLM": Family("qwen2", {**_PLAIN, "qkv_bias": True}, {"use_sliding_window": False}),
    "Qwen3ForCausalLM": Family("qwen3", {**_PLAIN, "qk_norm": True, "qk_norm_scope": "head"},
                               {"attention_bias": False, "use_sliding_window": False}),
    "Olmo2ForCausalLM": Family("olmo2", {**_PLAIN, "qk_norm": True, "qk_norm_scope": "projection",
                                         "norm_placement": "post_sublayer"}, {"attention_bias": False}),
}
_MOE_ATTENTION = {QWEN3_MOE: "Qwen3ForCausalLM"}  # a MoE class whose attention is a dense family's (its keys)
HF_ARCHS = {**{name: f.keys["arch"] for name, f in FAMILIES.items()}, MIXTRAL: "llama", QWEN2_MOE: "llama",
            QWEN3_MOE: "llama", DEEPSEEK_V3: "llama"}
ROPE_KEYS = {"factor": "rope_scaling_factor", "low_freq_factor": "rope_low_freq_factor",  # HF rope_parameters → ours
             "high_freq_factor": "rope_high_freq_factor", "original_max_position_embeddings": "rope_original_max_positions",
             "beta_fast": "rope_beta_fast", "beta_slow": "rope_beta_slow", "attention_factor": "rope_attention_factor"}
_ROPE_USES = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                                "original_max_position_embeddings"),
              "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor")}


def hf_dense_class(cfg: ModelConfig, prefer: str | None = None) -> str:
    """The dense transformers class whose ``Family.keys`` ``cfg`` has, ``prefer`` (an imported model's class: Mistral
    is Llama-shaped) first when it has them; a ConfigError naming the keys when none."""
    for name in sorted(FAMILIES, key=lambda n: n != prefer):
        family = FAMILIES[name]
        if all(getattr(cfg, key) == value for key, value in family.keys.items()) and \
                (family.keys["arch"] == "llama" or head_dim(cfg) == cfg.hidden_size // cfg.num_heads) and \
                (not cfg.sliding_window or {"sliding_window", "use_sliding_window"} & family.hf.keys()):
            return name
    raise ConfigError(f"no transformers class has model.arch={cfg.arch} with qkv_bias={cfg.qkv_bias}, qk_norm="
                      f"{cfg.qk_norm} ({cfg.qk_norm_scope}), norm_placement={cfg.norm_placement}, head_dim="
                      f"{head_dim(cfg)}, sliding_window={cfg.sliding_window} (Qwen2: qkv_bias; Qwen3: qk_norm head; OLMo-2: qk_norm "
                      "projection and post_sublayer norms; GPT-NeoX: none, head_dim = hidden/heads; a window: Mistral, "
                      "Qwen2, Qwen3)")


def window_config(cfg: ModelConfig, hf: dict[str, Any]) -> dict[str, Any]:
    """``model.sliding_window`` as the ``config.json`` keys of a class whose constants are ``hf``: Mistral's (Mixtral's)
    ``sliding_window``, or Qwen's with ``use_sliding_window`` and every layer windowed (``max_window_layers`` 0)."""
    if not cfg.sliding_window:
        return {}
    qwen = {"use_sliding_window": True, "max_window_layers": 0} if "use_sliding_window" in hf else {}
    return {"sliding_window": cfg.sliding_window, **qwen}


def renormalised(cfg: ModelConfig) -> bool:
    """Whether the MoE ``cfg`` renormalises its top-k weights (``model.moe_renormalize``, unset: k > 1)."""
    return cfg.moe_top_k > 1 if cfg.moe_renormalize is None else cfg.moe_renormalize


def rope_config(cfg: ModelConfig) -> dict[str, Any]:
    """``rope_theta`` and (when scaled) transformers' ``rope_scaling`` of ``cfg``."""
    if cfg.rope_scaling == "none":
        return {"rope_theta": cfg.rotary_base}
    params = {hf: getattr(cfg, ROPE_KEYS[hf]) for hf in _ROPE_USES[cfg.rope_scaling]}
    return {"rope_theta": cfg.rotary_base, "rope_scaling": {"rope_type": cfg.rope_scaling,
                                                            **{k: v for k, v in params.items() if v is not None}}}


def family_keys(raw: dict[str, Any], hf_class: str, refuse: Any) -> dict[str, Any]:
    """The ``model.*`` keys of an HF config dict of ``hf_class`` (the family's, head_dim, rope scaling); ``refuse(what)``
    makes the error of a variant ours lacks."""
    family = FAMILIES.get(_MOE_ATTENTION.get(hf_class, hf_class))
    keys = {k: v for k, v in family.keys.items() if k != "arch"} if family else {}
    if raw.get("head_dim") is not None and hf_class not in ("GPTNeoXForCausalLM", DEEPSEEK_V3):  # DeepSeek's: rope dims
        keys["head_dim"] = int(raw["head_dim"])
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", *_ROPE_USES):
        raise refuse(f"rope type {kind!r} (ours: default, {', '.join(_ROPE_USES)})")
    if kind == "yarn" and not rope.get("truncate", True):
        raise refuse("yarn with truncate=false")
    if kind == "yarn" and rope.get("attention_factor") is None and rope.get("mscale") and rope.get("mscale_all_dim"):
        f = rope.get("factor") or 1.0
        rope["attention_factor"] = (0.1 * rope["mscale"] * math.log(f) + 1) / (0.1 * rope["mscale_all_dim"] * math.log(f) + 1)
    if kind != "default":
        if kind == "yarn" and rope.get("factor") is None:
            rope["factor"] = int(raw["max_position_embeddings"]) / int(rope["original_max_position_embeddings"])
        keys["rope_scaling"] = kind
        keys.update({ROPE_KEYS[k]: rope[k] for k in _ROPE_USES[kind] if rope.get(k) is not None})
    return keys
# per HF MoE class: its sparse block's module, and our stacked expert matrices [E, out, in] ↔ {block}.experts.{e}.NAME
_MOE_BLOCK = {MIXTRAL: ("block_sparse_moe", {"gate": "w1", "down": "w2", "up": "w3"}),
              QWEN2_MOE: ("mlp", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}),
              QWEN3_MOE: ("mlp", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}),
              DEEPSEEK_V3: ("mlp", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"})}
_SHARED = {QWEN2_MOE: "shared_expert", DEEPSEEK_V3: "shared_experts"}  # the shared MLP's module (Qwen2-MoE: gated)
_HF_MOE_RE = re.compile(r"(?:block_sparse_moe|mlp)\.(?:(gate)|experts\.(\d+)\.(\w+)|shared_experts?\.(\w+)_proj|"
                        r"(shared_expert_gate))")
_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)\.(weight|bias|expert_bias)$")
_HF_LAYER_RE = re.compile(r"^(?:gpt_neox|model)\.layers\.(\d+)\.(.+)\.(weight|bias|e_score_correction_bias)$")
_STACKED_RE = re.compile(r"^(.+\.experts)\.(gate_up_proj|down_proj)$")  # transformers >= 5's in-memory experts


def _resolve_arch(cfg: ModelConfig, arch: str | None) -> str:
    check_model_config(cfg)
    arch = cfg.arch if arch is None else arch
    if arch != cfg.arch:
        raise ValueError(f"arch {arch!r} does not match model.arch {cfg.arch!r}")
    return arch


def _unmet(cfg: ModelConfig, hf_class: str) -> list[str]:
    """What a MoE ``cfg`` lacks to export exactly as ``hf_class``: all need llama experts, pre-norms and a softmax
    router; Mixtral renormalises the top-k, has no shared experts and a MoE MLP in every layer. Qwen2-MoE holds those
    (``norm_topk_prob``, ``mlp_only_layers``); Qwen3-MoE has per-head QK-norm and no shared experts."""
    qwen3 = hf_class == QWEN3_MOE
    needs = [("model.arch=llama", cfg.arch != "llama"), ("model.moe_router_score=softmax", cfg.moe_router_score != "softmax"),
             ("model.norm_placement=pre", cfg.norm_placement != "pre"),
             ("model.qk_norm=true (head)" if qwen3 else "model.qk_norm=false",
              (cfg.qk_norm, cfg.qk_norm_scope) != (True, "head") if qwen3 else cfg.qk_norm),
             ("model.qkv_bias=false", cfg.qkv_bias and hf_class != QWEN2_MOE),
             ("model.moe_shared_experts=0", cfg.moe_shared_experts > 0 and hf_class != QWEN2_MOE),
             ("model.moe_router_groups=1", cfg.moe_router_groups > 1), ("model.moe_routed_scaling=1",
                                                                        cfg.moe_routed_scaling != 1.0),
             ("model.kv_lora_rank=0 (no latent attention)", cfg.kv_lora_rank > 0)]
    if hf_class == MIXTRAL:
        needs += [("renormalised top-k weights (model.moe_top_k >= 2 or moe_renormalize=true)", not renormalised(cfg)),
                  ("every layer MoE (moe_layer_freq 1, moe_first_dense_layers 0)",
                   cfg.moe_layer_freq != 1 or cfg.moe_first_dense_layers > 0)]
    return [what for what, broken in needs if broken]


def check_mixtral(cfg: ModelConfig) -> None:
    """ConfigError unless the MoE ``cfg`` exports exactly as ``MixtralForCausalLM``."""
    if bad := _unmet(cfg, MIXTRAL):
        raise ConfigError(f"this MoE model is not exactly a Mixtral: MixtralForCausalLM needs {', '.join(bad)}")


def check_deepseek(cfg: ModelConfig) -> None:
    """ConfigError unless the latent-attention ``cfg`` exports exactly as ``DeepseekV3ForCausalLM``: pre-norms, no
    window and, for a MoE, sigmoid scores with every layer MoE from ``moe_first_dense_layers`` on."""
    needs = [("model.norm_placement=pre", cfg.norm_placement != "pre"), ("no model.sliding_window", bool(cfg.sliding_window)),
             ("model.moe_router_score=sigmoid", cfg.num_experts > 0 and cfg.moe_router_score != "sigmoid"),
             ("model.moe_layer_freq=1", cfg.num_experts > 0 and cfg.moe_layer_freq != 1)]
    if bad := [what for what, broken in needs if broken]:
        raise ConfigError(f"this latent-attention model has no exact transformers class: DeepseekV3ForCausalLM needs "
                          f"{', '.join(bad)}")


def _layer_class(cfg: ModelConfig) -> str:
    """The transformers class whose layer names ``cfg`` maps to beyond a dense family's ('' for those)."""
    if cfg.kv_lora_rank:
        check_deepseek(cfg)
        return DEEPSEEK_V3
    return hf_moe_class(cfg) if cfg.num_experts else ""


def hf_moe_class(cfg: ModelConfig) -> str:
    """The transformers class a MoE ``cfg`` exports to exactly: Mixtral when it can, else Qwen2-MoE (shared experts,
    dense layers, top-1); a ConfigError naming what each lacks when neither can."""
    unmet = {hf_class: _unmet(cfg, hf_class) for hf_class in (MIXTRAL, QWEN2_MOE, QWEN3_MOE)}
    if exact := [hf_class for hf_class, bad in unmet.items() if not bad]:
        return exact[0]
    raise ConfigError("this MoE model has no exact transformers class: "
                      + "; ".join(f"{hf_class} needs {', '.join(bad)}" for hf_class, bad in unmet.items()))


def hf_aux_loss_coef(coeff: float, cfg: ModelConfig, to_hf: bool = True) -> float:
    """``moe_aux_loss_coeff`` α → transformers' ``router_aux_loss_coef`` (or back, ``to_hf=False``; ``cfg``'s top-k
    and MoE layers): its aux loss is k × ours with f and P pooled over the L MoE layers, where ours sums L per-layer
    losses, so ``coef = α · L / k`` pulls each router as α does (exactly when every layer has the same loads)."""
    ratio = sum(is_moe_layer(cfg, i) for i in range(cfg.num_layers)) / cfg.moe_top_k
    return coeff * ratio if to_hf else coeff / ratio


def _deepseek_config(cfg: ModelConfig, common: dict[str, Any], rope_interleave: bool) -> dict[str, Any]:
    """``DeepseekV3Config`` keywords: a dense model has ``first_k_dense_replace`` = its layers; no MTP modules (ours
    are training-only); yarn's ``attention_factor`` 1 written as DeepSeek does, ``mscale`` = ``mscale_all_dim``."""
    check_deepseek(cfg)
    rope = dict(common.get("rope_scaling") or {})
    if cfg.rope_mscale_all_dim:
        rope["mscale_all_dim"] = cfg.rope_mscale_all_dim
        if rope.get("attention_factor") == 1.0:
            del rope["attention_factor"]
            rope["mscale"] = cfg.rope_mscale_all_dim
    moe = cfg.num_experts > 0
    return {**common, **({"rope_scaling": rope} if rope else {}), "architectures": [DEEPSEEK_V3],
            "model_type": "deepseek_v3", "num_key_value_heads": cfg.num_heads, "hidden_act": "silu",
            "rms_norm_eps": cfg.norm_eps, "attention_bias": False, "kv_lora_rank": cfg.kv_lora_rank,
            "q_lora_rank": cfg.q_lora_rank or None, "qk_nope_head_dim": cfg.qk_nope_head_dim,
            "qk_rope_head_dim": cfg.qk_rope_head_dim, "v_head_dim": cfg.v_head_dim, "rope_interleave": rope_interleave,
            "first_k_dense_replace": cfg.moe_first_dense_layers if moe else cfg.num_layers,
            "n_routed_experts": cfg.num_experts, "num_experts_per_tok": cfg.moe_top_k,
            "n_shared_experts": cfg.moe_shared_experts, "moe_intermediate_size": cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size,
            "n_group": cfg.moe_router_groups, "topk_group": cfg.moe_router_group_topk,
            "routed_scaling_factor": cfg.moe_routed_scaling, "norm_topk_prob": renormalised(cfg),
            "num_nextn_predict_layers": 0}


def hf_config_dict(cfg: ModelConfig, arch: str | None = None, prefer: str | None = None,
                   rope_interleave: bool = True) -> dict[str, Any]:
    """Keyword arguments (and ``config.json`` content) of the matching HF config class (``hf_dense_class`` with
    ``prefer``, ``hf_moe_class`` for MoE, DeepSeek-V3 for latent attention with ``rope_interleave``).
    Qwen2-MoE: ``decoder_sparse_step`` 1 with every dense layer in ``mlp_only_layers``; q/k/v biases on (written as
    zeros: transformers < 5 and other Qwen2-MoE readers always build them)."""
    arch = _resolve_arch(cfg, arch)
    common: dict[str, Any] = {**rope_config(cfg),
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
    if cfg.kv_lora_rank:
        return _deepseek_config(cfg, common, rope_interleave)
    dense = hf_dense_class(cfg, prefer) if not cfg.num_experts else "LlamaForCausalLM"
    family = FAMILIES[dense]
    if arch == "neox":
        return {**common, **family.hf, "architectures": [dense], "model_type": family.model_type,
                "hidden_act": "gelu", "rotary_pct": cfg.rotary_pct, "rotary_emb_base": cfg.rotary_base,
                "layer_norm_eps": cfg.norm_eps, "attention_bias": True, "hidden_dropout": cfg.hidden_dropout}
    llama = {**common, **family.hf, "architectures": [dense], "model_type": family.model_type,
             "num_key_value_heads": cfg.num_kv_heads, "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps,
             "head_dim": head_dim(cfg), **window_config(cfg, family.hf)}
    if not cfg.num_experts:
        return llama
    hf_class = hf_moe_class(cfg)
    moe = {"architectures": [hf_class], "num_experts_per_tok": cfg.moe_top_k, "output_router_logits": False,
           "router_aux_loss_coef": hf_aux_loss_coef(cfg.moe_aux_loss_coeff, cfg)}  # transformers: training only
    if hf_class == MIXTRAL:
        return {**llama, **moe, "model_type": "mixtral", "intermediate_size": cfg.moe_ffn_hidden_size,
                "num_local_experts": cfg.num_experts, "router_jitter_noise": 0.0, "sliding_window": None,
                **window_config(cfg, {})}
    llama = {k: v for k, v in llama.items() if k not in ("attention_bias", "mlp_bias")}
    qwen = {**llama, **moe, "num_experts": cfg.num_experts, "moe_intermediate_size": cfg.moe_ffn_hidden_size,
            "norm_topk_prob": renormalised(cfg), "decoder_sparse_step": 1, "use_sliding_window": False,
            **window_config(cfg, {"use_sliding_window": False}),
            "mlp_only_layers": [i for i in range(cfg.num_layers) if not is_moe_layer(cfg, i)]}
    if hf_class == QWEN3_MOE:
        return {**qwen, "model_type": "qwen3_moe", "attention_bias": False}
    return {**qwen, "model_type": "qwen2_moe", "qkv_bias": True,
            "shared_expert_intermediate_size": cfg.moe_shared_experts * cfg.moe_ffn_hidden_size}


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


def _split_llama_qkv(t: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Our fused QKV weight ``[g·(r+2)·d, h]`` or bias ``[g·(r+2)·d]`` → q, k, v."""
    g, r, d = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, head_dim(cfg)
    grouped = t.view(g, r + 2, d, -1)  # [g, r+2, d, h | 1]
    rest = t.shape[1:]
    return (grouped[:, :r].reshape(g * r * d, *rest), grouped[:, r].reshape(g * d, *rest),
            grouped[:, r + 1].reshape(g * d, *rest))


def _rope_rows(t: torch.Tensor, cfg: ModelConfig, module: str, to_hf: bool) -> torch.Tensor:
    """DeepSeek's interleaved rotary pairs (``rope_interleave``: ``(x0, x1), (x2, x3), ...``) ↔ our rotary halves:
    the last ``qk_rope_head_dim`` rows of each head's query rows (``module`` q_up / q_proj) or of the shared key
    (kv_down) permuted, even ones first (exact: the same products, in the same order)."""
    r = cfg.qk_rope_head_dim
    rows = (cfg.kv_lora_rank if module.endswith("kv_down") else cfg.qk_nope_head_dim) + r
    perm = torch.cat([torch.arange(0, r, 2), torch.arange(1, r, 2)])
    grouped = t.reshape(-1, rows, *t.shape[1:])
    rope = grouped[:, rows - r:][:, perm.argsort() if to_hf else perm]
    return torch.cat([grouped[:, :rows - r], rope], dim=1).reshape(t.shape)


_ROPE_ROWS = ("attention.mla.q_up", "attention.mla.q_proj", "attention.mla.kv_down")


def to_hf_state_dict(our_sd: Mapping[str, torch.Tensor], cfg: ModelConfig,
                     arch: str | None = None, rope_interleave: bool = True) -> dict[str, torch.Tensor]:
    """Our full-model state dict → HF names and layouts (views or fresh copies); ``arch`` must equal ``cfg.arch``.
    A tied ``output_layer.weight`` (the last stage's copy of the embedding) is dropped. Qwen2-MoE scales its shared
    expert by ``sigmoid(x · shared_expert_gate)``: written as a zero gate (sigmoid(0) = 0.5 exactly) and ``2·down``,
    bit for bit our ungated shared experts (a width-0 shared expert without them); its q/k/v biases as zeros.
    ``mlp.router.expert_bias`` (a ``state_dict``'s buffer) is DeepSeek-V3's ``e_score_correction_bias``; elsewhere
    it must be zero (ValueError). Latent attention's rotary rows are interleaved as ``rope_interleave`` says."""
    arch = _resolve_arch(cfg, arch)
    top = _GLOBAL[arch]
    hf_class = _layer_class(cfg)
    block, expert_names = _MOE_BLOCK.get(hf_class, ("", {}))
    shared = _SHARED.get(hf_class)
    out: dict[str, torch.Tensor] = {}
    for name, tensor, index, module, leaf in _layer_items(our_sd, _LAYER_RE, top, cfg, out, "no HF name for"):
        prefix = f"{_LAYER_PREFIX[arch]}.{index}"
        if arch == "llama" and module == "attention.qkv":
            for proj, part in zip("qkv", _split_llama_qkv(tensor, cfg)):
                out[f"{prefix}.self_attn.{proj}_proj.{leaf}"] = part
                if hf_class == QWEN2_MOE and not cfg.qkv_bias:
                    out[f"{prefix}.self_attn.{proj}_proj.bias"] = part.new_zeros(part.shape[0])
            continue
        if module == "mlp.router" and leaf == "expert_bias":
            if hf_class == DEEPSEEK_V3:
                out[f"{prefix}.mlp.gate.e_score_correction_bias"] = tensor
            elif tensor.any():
                raise ValueError(f"{name} is not zero: {hf_class} has no routing bias")
            continue
        if module == "mlp.router":
            out[f"{prefix}.{block}.gate.{leaf}"] = tensor
            if hf_class == QWEN2_MOE:
                out[f"{prefix}.mlp.shared_expert_gate.{leaf}"] = tensor.new_zeros(1, cfg.hidden_size)
            h = cfg.hidden_size
            for proj, shape in (("gate", (0, h)), ("up", (0, h)), ("down", (h, 0))) if shared and not cfg.moe_shared_experts else ():
                out[f"{prefix}.mlp.{shared}.{proj}_proj.{leaf}"] = tensor.new_zeros(shape)
            continue
        if module.startswith("mlp.experts.") and module[12:] in expert_names:  # [E, out, in]: one matrix per expert
            for e, matrix in enumerate(tensor.unbind(0)):
                out[f"{prefix}.{block}.experts.{e}.{expert_names[module[12:]]}.{leaf}"] = matrix
            continue
        if module.startswith("mlp.shared.") and shared:
            gated = module == "mlp.shared.down" and hf_class == QWEN2_MOE
            out[f"{prefix}.mlp.{shared}.{module[11:]}_proj.{leaf}"] = tensor * 2 if gated else tensor
            continue
        table = _NEOX_LAYER if arch == "neox" else {**_LLAMA_LAYER, **_NORM_NAMES[cfg.norm_placement]}
        if module not in table:
            raise KeyError(f"no HF name for {name!r}")
        rope = module in _ROPE_ROWS and rope_interleave
        out[f"{prefix}.{table[module]}.{leaf}"] = _rope_rows(tensor, cfg, module, to_hf=True) if rope else tensor
    return out


def _unstacked(hf_sd: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """``hf_sd`` with transformers >= 5's stacked experts (``experts.gate_up_proj [E, 2f, h]``, ``experts.down_proj
    [E, h, f]``) as the Hub's one matrix per expert (``experts.{e}.gate_proj.weight``, ...)."""
    for name, tensor in hf_sd.items():
        match = _STACKED_RE.match(name)
        if match is None:
            yield name, tensor
            continue
        prefix, kind = match.groups()
        for e, matrix in enumerate(tensor):
            parts = zip(("gate_proj", "up_proj"), matrix.chunk(2)) if kind == "gate_up_proj" else [("down_proj", matrix)]
            yield from ((f"{prefix}.{e}.{proj}.weight", m) for proj, m in parts)


def from_hf_state_dict(hf_sd: Mapping[str, torch.Tensor], cfg: ModelConfig,
                       arch: str | None = None, rope_interleave: bool = True) -> dict[str, torch.Tensor]:
    """HF names and layouts → our full-model state dict (the inverse of ``to_hf_state_dict``). Accepts
    ``lm_head.weight`` or ``embed_out.weight`` for GPT-NeoX; drops the output layer when ``cfg.tie_embeddings``.
    llama: q/k/v biases and Qwen2-MoE's ``shared_expert_gate`` must be zero (ValueError naming the tensor), its
    shared expert's ``down_proj`` is halved (the inverse of the export), a width-0 shared expert dropped. Stacked
    experts are read too (``_unstacked``); DeepSeek-V3's ``e_score_correction_bias`` becomes ``mlp.router.expert_bias``."""
    arch = _resolve_arch(cfg, arch)
    top_inverse = {hf: ours for ours, hf in _GLOBAL[arch].items()}
    if arch == "neox":
        top_inverse["lm_head"] = "output_layer"
    table = _NEOX_LAYER if arch == "neox" else {**_LLAMA_LAYER, **_NORM_NAMES[cfg.norm_placement]}
    layer_inverse = {hf: ours for ours, hf in table.items()}
    out: dict[str, torch.Tensor] = {}
    pending_qkv: dict[str, dict[str, torch.Tensor]] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}  # our stacked name → expert index → matrix
    expert_of = {hf: ours for _, names in _MOE_BLOCK.values() for ours, hf in names.items()}
    for name, tensor, index, module, leaf in _layer_items(dict(_unstacked(hf_sd)), _HF_LAYER_RE, top_inverse, cfg, out,
                                                         "unexpected HF parameter"):
        moe = _HF_MOE_RE.fullmatch(module) if arch == "llama" else None
        qkv = module in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj") and not cfg.kv_lora_rank
        if moe and moe.group(5) or arch == "llama" and leaf == "bias" and module.startswith("self_attn.") \
                and not (qkv and cfg.qkv_bias):
            if tensor.any():  # ours has no place for it
                raise ValueError(f"{name} is not zero: megatron_sp's llama has no "
                                 + ("shared-expert gate" if moe else "attention biases"))
            continue
        if moe and moe.group(4) and not tensor.numel():  # a width-0 shared expert: none
            continue
        if arch == "llama" and qkv:
            pending_qkv.setdefault(f"layers.{index}.attention.qkv.{leaf}", {})[module[-6]] = tensor
            continue
        if moe and moe.group(1):
            out[f"layers.{index}.mlp.router.{'expert_bias' if leaf == 'e_score_correction_bias' else leaf}"] = tensor
            continue
        if moe and moe.group(3) in expert_of:
            experts.setdefault(f"layers.{index}.mlp.experts.{expert_of[moe.group(3)]}.{leaf}", {})[int(moe.group(2))] = tensor
            continue
        if moe and moe.group(4) in ("gate", "up", "down"):
            gated = moe.group(4) == "down" and "shared_experts." not in module  # Qwen2-MoE's, not DeepSeek's
            out[f"layers.{index}.mlp.shared.{moe.group(4)}.{leaf}"] = tensor / 2 if gated else tensor
            continue
        if module not in layer_inverse:
            raise KeyError(f"unexpected HF parameter {name!r}")
        ours = layer_inverse[module]
        rope = ours in _ROPE_ROWS and rope_interleave
        out[f"layers.{index}.{ours}.{leaf}"] = _rope_rows(tensor, cfg, ours, to_hf=False) if rope else tensor
    g, r, d = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, head_dim(cfg)
    for name, parts in pending_qkv.items():
        if set(parts) != {"q", "k", "v"}:
            raise KeyError(f"incomplete q/k/v projections for {name!r}")
        rest = parts["q"].shape[1:]  # (h,) of a weight, () of a bias
        grouped = torch.cat([parts["q"].reshape(g, r, d, -1), parts["k"].reshape(g, 1, d, -1),
                             parts["v"].reshape(g, 1, d, -1)], dim=1)  # [g, r+2, d, h | 1]
        out[name] = grouped.reshape(g * (r + 2) * d, *rest)
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
    hf_class = kwargs.pop("architectures")[0]
    hf = getattr(transformers, hf_class)(transformers.AutoConfig.for_model(kwargs.pop("model_type"), **kwargs))
    state = to_hf_state_dict(our_sd, cfg)
    if "embed_out.weight" in state and not hasattr(hf, "embed_out"):
        state["lm_head.weight"] = state.pop("embed_out.weight")  # transformers >= 5 module name
    missing, unexpected = hf.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"HF weight mapping mismatch: missing {missing}, unexpected {unexpected}")
    return hf.eval()
