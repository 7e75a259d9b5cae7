"""Cross-framework parity per open-model family: a tiny random model built from transformers' own config class
(Llama-3 rope llama3 / linear / yarn, Qwen2 q/k/v biases, Qwen3 QK-norm and head_dim ≠ hidden/heads, Mistral with a
sliding window of 5 (below the batch's 24 tokens and the 16 of generation), OLMo-2 post-sublayer norms and QK-norm
over the projection, Qwen3-MoE with its aux loss, DeepSeek-V3: latent attention with a query latent and interleaved
yarn rope, a dense layer then a MoE one with 2 expert groups, a shared expert, routed scaling and a routing bias),
saved as an HF
directory, imported with tools/convert_checkpoint.py; on one batch our 1-rank loss equals transformers' loss, every
parameter's gradient equals transformers' gradient of the same weight (max|Δ|/max|ref| ≤ 1e-5, fp32), greedy tokens
equal transformers'; export of the import gives back the same tensors bit for bit and a config transformers loads."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from megatron_sp.config.schema import ModelConfig
from megatron_sp.model import GPTModel, generate_batch
from megatron_sp.model.hf_names import from_hf_state_dict, hf_config_dict, to_hf_state_dict
from megatron_sp.model.moe import load_expert_bias
from tools import convert_checkpoint as convert

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")


V, S, B = 96, 24, 2
TINY = {"vocab_size": V, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 500.0,
        "attention_dropout": 0.0, "tie_word_embeddings": False, "initializer_range": 0.2}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
FAMILIES = {  # name: (config class, its keywords beyond TINY)
    "llama3": ("LlamaConfig", {"rope_scaling": LLAMA3}),
    "llama_linear_tied": ("LlamaConfig", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}, "tie_word_embeddings": True}),
    "llama_yarn": ("LlamaConfig", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", {"head_dim": 12, "rope_scaling": LLAMA3}),
    "mistral": ("MistralConfig", {"head_dim": 12, "sliding_window": 5}),  # a window below S and the generated length
    "olmo2": ("Olmo2Config", {}),
    # one MoE layer, top-2 not renormalised, the aux loss in transformers' loss (its coef ↔ ours: docs/moe.md)
    "qwen3_moe": ("Qwen3MoeConfig", {"head_dim": 12, "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": False,
                                     "moe_intermediate_size": 16, "mlp_only_layers": [0], "output_router_logits": True,
                                     "router_aux_loss_coef": 0.05}),
    "qwen3_moe_norm": ("Qwen3MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True,
                                          "moe_intermediate_size": 16, "router_aux_loss_coef": 0.0}),
    "deepseek_v3": ("DeepseekV3Config", {"num_key_value_heads": 4, "q_lora_rank": 24, "kv_lora_rank": 16,
                                         "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 6,
                                         "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
                                         "n_shared_experts": 1, "moe_intermediate_size": 16, "first_k_dense_replace": 1,
                                         "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "mscale": 1.0,
                                                          "original_max_position_embeddings": 16, "mscale_all_dim": 1.0}}),
}
TOL = 1e-5  # max|Δ| / max|ref|, fp32


def hf_model(family: str, **override: object) -> torch.nn.Module:
    """The family's tiny transformers model, its norms, biases and routing bias moved off their ones/zeros init."""
    config_class, extra = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**{**TINY, **extra, **override}, attn_implementation="eager")
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(0.2 * torch.randn(p.shape))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's: routes differently
                b.copy_(0.1 * torch.randn(b.shape))
    return model


def imported(hf: torch.nn.Module, tmp_path: Path) -> tuple[Path, ModelConfig, GPTModel]:
    """``hf`` saved and imported with ``convert_checkpoint.from_hf``: (checkpoint, its model config, our model)."""
    hf.save_pretrained(tmp_path / "hf")
    ckpt = convert.from_hf(tmp_path / "hf", tmp_path / "ours", None, None, [])
    _, meta, cfg, weights = convert.read_ours(ckpt, None)
    model = GPTModel(cfg.model, seed=0)
    load_expert_bias(model, meta.get("moe_expert_bias"))
    rows = weights["embedding.weight"].shape[0]
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.zero_()[:rows].copy_(weights[name]) if name in ("embedding.weight", "output_layer.weight") \
                else p.copy_(weights[name])
    return ckpt, cfg.model, model


def per_expert(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' stacked expert grads (``experts.gate_up_proj [E, 2f, h]``, ``experts.down_proj``) by the names
    of its checkpoints (one matrix per expert), which ours maps to."""
    out = {}
    for name, grad in grads.items():
        prefix, _, leaf = name.rpartition(".")
        for e, matrix in enumerate(grad if prefix.endswith(".experts") else ()):
            parts = dict(zip(("gate_proj", "up_proj"), matrix.chunk(2))) if leaf == "gate_up_proj" else {leaf: matrix}
            out.update({f"{prefix}.{e}.{proj}.weight": m for proj, m in parts.items()})
        if not prefix.endswith(".experts"):
            out[name] = grad
    return out


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(1))
    labels = torch.cat([tokens[:, 1:], torch.full((B, 1), -100)], dim=1)
    return tokens, labels


@pytest.mark.parametrize("family", FAMILIES)
def test_loss_grads_and_greedy_equal_transformers(family: str, tmp_path: Path) -> None:
    hf = hf_model(family)
    _, cfg, ours = imported(hf, tmp_path)
    tokens, labels = batch()
    hf.train()
    out = hf(input_ids=tokens, labels=tokens)
    out.loss.backward()  # with the aux loss when output_router_logits: ours adds only its gradient
    hf_loss = out.loss - hf.config.router_aux_loss_coef * out.aux_loss if out.get("aux_loss") is not None else out.loss
    ours.train()
    losses = ours(tokens, labels=labels)
    mask = (labels >= 0).float()
    loss = (losses * mask).sum() / mask.sum()
    loss.backward()
    assert abs(loss.item() - hf_loss.item()) <= TOL * hf_loss.item(), (loss.item(), hf_loss.item())
    grads = to_hf_state_dict({n: p.grad for n, p in ours.named_parameters()}, cfg)
    hf_grads = per_expert({n: p.grad for n, p in hf.named_parameters()})
    assert set(grads) == set(hf_grads), set(grads) ^ set(hf_grads)
    worst = 0.0
    for name, ref in hf_grads.items():
        got = grads[name][: ref.shape[0]]  # our vocab rows are padded
        err = ((got - ref).abs().max() / ref.abs().max()).item()
        worst = max(worst, err)
        assert err <= TOL, (name, err)
    print(f"{family}: loss rel {abs(loss.item() - hf_loss.item()) / hf_loss.item():.1e}, worst grad {worst:.1e}")
    # greedy decoding with our KV cache against transformers' generate
    ours.eval()
    hf.eval()
    hf.generation_config.eos_token_id = None  # ours is given no EOD either
    prompts = tokens[:, :6]
    done = generate_batch(ours, prompts.tolist(), max_new_tokens=10, eod=None)
    with torch.no_grad():
        theirs = hf.generate(prompts, max_new_tokens=10, do_sample=False, pad_token_id=0)[:, 6:]
    assert [c.new_ids for c in done] == theirs.tolist()


@pytest.mark.parametrize("family", ["llama3", "qwen2", "qwen3", "mistral", "olmo2", "qwen3_moe", "deepseek_v3"])
def test_export_of_import_is_bit_identical_and_loads(family: str, tmp_path: Path) -> None:
    hf = hf_model(family)
    ckpt, cfg, _ = imported(hf, tmp_path)
    out = convert.to_hf(ckpt, tmp_path / "back", None)
    original = safetensors_torch.load_file(str(tmp_path / "hf" / "model.safetensors"))
    back = safetensors_torch.load_file(str(out / "model.safetensors"))
    assert set(back) == set(original)
    for name, tensor in original.items():
        assert torch.equal(back[name], tensor), name
    loaded = transformers.AutoConfig.from_pretrained(out)
    assert type(loaded) is type(hf.config)
    for key in ("head_dim", "num_key_value_heads", "tie_word_embeddings", "rms_norm_eps", "norm_topk_prob",
                "mlp_only_layers", "num_experts", "router_aux_loss_coef", "q_lora_rank", "kv_lora_rank", "v_head_dim",
                "n_group", "topk_group", "routed_scaling_factor", "n_shared_experts", "first_k_dense_replace",
                "moe_intermediate_size", "rope_interleave"):  # (Qwen2: no head_dim)
        assert getattr(loaded, key, 8) == getattr(hf.config, key, 8), key
    yarn = {"beta_fast": 32.0, "beta_slow": 1.0} if hf.config.rope_parameters["rope_type"] == "yarn" else {}
    assert loaded.rope_parameters == {**yarn, **hf.config.rope_parameters}  # (yarn's defaults written out)
    assert json.loads((out / "config.json").read_text())["architectures"] == hf.config.architectures


def test_deepseek_v3_hub_forms(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """DeepSeek-V3 read with its experts stacked (as transformers >= 5 holds them) and its MTP layer
    (``model.layers.{num_hidden_layers}.*``, ignored), rope not interleaved, queries without a latent: the export is
    transformers' own save bit for bit, with the same config; our MTP tensors are not exported; what the class does
    not hold is refused in one line."""
    hf = hf_model("deepseek_v3", rope_interleave=False, q_lora_rank=None)
    hf.save_pretrained(tmp_path / "hub")  # one matrix per expert
    stacked = {n: t.contiguous() for n, t in hf.state_dict().items()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in stacked
    stacked["model.layers.2.eh_proj.weight"] = torch.ones(32, 64)  # DeepSeek-V3's MTP layer 61
    (tmp_path / "hf").mkdir()
    safetensors_torch.save_file(stacked, str(tmp_path / "hf" / "model.safetensors"))
    (tmp_path / "hf" / "config.json").write_text((tmp_path / "hub" / "config.json").read_text())
    caplog.set_level("INFO", logger="megatron_sp")
    ckpt = convert.from_hf(tmp_path / "hf", tmp_path / "ours", None, None, [])
    assert "ignored the 1 tensors of the multi-token prediction layers (model.layers.2 and on)" in caplog.text
    read_ours = convert.read_ours

    def with_mtp(*args: object) -> tuple:  # a checkpoint holding our MTP module too
        path, meta, cfg, weights = read_ours(*args)
        return path, meta, cfg, {**weights, "mtp.0.enorm.weight": weights["final_norm.weight"]}
    monkeypatch.setattr(convert, "read_ours", with_mtp)
    out = convert.to_hf(ckpt, tmp_path / "back", None)
    assert "dropped the 1 multi-token prediction tensors (mtp.*): MTP modules are training-only" in caplog.text
    original = safetensors_torch.load_file(str(tmp_path / "hub" / "model.safetensors"))
    back = safetensors_torch.load_file(str(out / "model.safetensors"))
    assert set(back) == set(original) and all(torch.equal(back[n], t) for n, t in original.items())
    loaded = transformers.AutoConfig.from_pretrained(out)
    assert (loaded.rope_interleave, loaded.q_lora_rank, loaded.num_nextn_predict_layers) == (False, None, 0)
    raw = json.loads((tmp_path / "hub" / "config.json").read_text())
    for bad, what in (({"attention_bias": True}, "attention_bias"), ({"scoring_func": "softmax"}, "scoring_func"),
                      ({"quantization_config": {"quant_method": "fp8"}}, "a quantized checkpoint \\(fp8")):
        with pytest.raises(convert.DataError, match=what):
            convert.model_config_from_hf({**raw, **bad}, "config.json")


def test_family_keys_refused_and_resolved() -> None:
    raw = {"architectures": ["LlamaForCausalLM"], **TINY, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}
    with pytest.raises(convert.DataError, match="rope type 'dynamic'"):
        convert.model_config_from_hf(raw, "config.json")
    raw["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "truncate": False}
    with pytest.raises(convert.DataError, match="truncate=false"):
        convert.model_config_from_hf(raw, "config.json")
    with pytest.raises(convert.DataError, match="attention_bias"):  # Qwen3's attention_bias biases o_proj too
        convert.model_config_from_hf({**raw, "architectures": ["Qwen3ForCausalLM"], "rope_scaling": None,
                                      "attention_bias": True}, "config.json")
    mixtral = {**TINY, "architectures": ["MixtralForCausalLM"], "num_local_experts": 4, "num_experts_per_tok": 1}
    assert convert.model_config_from_hf(mixtral, "config.json").moe_renormalize  # its top-1 weight is 1
    bare = convert.Config()
    bare.model.qk_norm_scope = "projection"
    with pytest.raises(convert.ConfigError, match="qk_norm_scope=projection needs model.qk_norm=true"):
        convert.finalize(bare)
    qwen_window = {**TINY, "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True, "sliding_window": 16}
    with pytest.raises(convert.DataError, match="a sliding window on some layers only"):
        convert.model_config_from_hf({**qwen_window, "max_window_layers": 1}, "config.json")
    windowed = convert.model_config_from_hf({**qwen_window, "max_window_layers": 0}, "config.json")
    assert windowed.sliding_window == 16
    windowed = dataclasses.replace(windowed, num_kv_heads=2, ffn_hidden_size=48, rotary_pct=1.0, padded_vocab_size=128)
    assert hf_config_dict(windowed)["architectures"] == ["Qwen2ForCausalLM"]  # Llama has no window
    assert hf_config_dict(windowed)["max_window_layers"] == 0
    assert convert.model_config_from_hf({**TINY, "architectures": ["MistralForCausalLM"], "sliding_window": 64},
                                        "config.json").sliding_window is None  # a window covering the context: none
    cfg = convert.model_config_from_hf({**TINY, "architectures": ["Qwen3ForCausalLM"], "head_dim": 12}, "config.json")
    post = dataclasses.replace(cfg, qk_norm=False, norm_placement="post_sublayer", num_kv_heads=2, ffn_hidden_size=48,
                               rotary_pct=1.0, padded_vocab_size=128)  # OLMo-2's norms without its QK-norm
    with pytest.raises(convert.ConfigError, match="norm_placement=post_sublayer"):
        hf_config_dict(post)
    moe = dataclasses.replace(post, qk_norm=True, norm_placement="pre", num_experts=4, moe_shared_experts=1,
                              moe_ffn_hidden_size=16)
    with pytest.raises(convert.ConfigError, match="Qwen3MoeForCausalLM needs model.moe_shared_experts=0"):
        hf_config_dict(moe)
    both = dataclasses.replace(cfg, qkv_bias=True, num_kv_heads=2, ffn_hidden_size=48, rotary_pct=1.0,
                               padded_vocab_size=128)
    with pytest.raises(convert.ConfigError, match="no transformers class"):
        hf_config_dict(both)
    state = GPTModel(both, seed=0).state_dict()  # ours holds both: its mapping still round-trips
    back = from_hf_state_dict(to_hf_state_dict(state, both), both)
    assert all(torch.equal(back[n], t) for n, t in state.items()) and set(back) == set(state)


def test_model_vocab_larger_than_tokenizer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen's embedding has more rows (151936) than its tokenizer.json has ids (151669): the checkpoint's rows win as
    generate.py and train.py load it; loss and greedy tokens equal transformers' (the extra rows are in its softmax
    too), export gives them back; a tokenizer larger than the model is one line."""
    from megatron_sp import checkpointing, training
    from tests.distributed.test_hf_families_layouts import tokenizer_json
    from tools.inference_setup import checkpoint_config, load_tokenizer

    hf = hf_model("qwen3")
    tokenizer_json(tmp_path / "hf", 80)  # ids 0..79 of the model's V = 96
    ckpt, _, _ = imported(hf, tmp_path)
    meta = checkpointing.read_meta(ckpt)
    cfg = checkpoint_config(meta, ckpt, [], 1, batches=False)  # tools/generate.py's config, no data path
    assert load_tokenizer(cfg).vocab_size == 80 and (cfg.model.vocab_size, cfg.model.padded_vocab_size) == (V, 128)
    ours = GPTModel(cfg.model, seed=0)
    checkpointing.load_model_state(ours, ckpt, None)
    tokens = torch.randint(0, 80, (B, S), generator=torch.Generator().manual_seed(1))
    labels = torch.cat([tokens[:, 1:], torch.full((B, 1), -100)], dim=1)
    with torch.no_grad():
        loss = ours(tokens, labels=labels)[labels >= 0].mean()
        hf_loss = hf(input_ids=tokens, labels=tokens).loss
    assert abs(loss.item() - hf_loss.item()) <= TOL * hf_loss.item(), (loss.item(), hf_loss.item())
    ours.eval()
    hf.eval().generation_config.eos_token_id = None
    done = generate_batch(ours, tokens[:, :6].tolist(), max_new_tokens=10, eod=None)
    with torch.no_grad():
        theirs = hf.generate(tokens[:, :6], max_new_tokens=10, do_sample=False, pad_token_id=0)[:, 6:]
    assert [c.new_ids for c in done] == theirs.tolist()
    back = safetensors_torch.load_file(str(convert.to_hf(ckpt, tmp_path / "back", None) / "model.safetensors"))
    original = safetensors_torch.load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert set(back) == set(original) and all(torch.equal(back[n], t) for n, t in original.items())
    train = checkpoint_config(meta, ckpt, [f"checkpoint.load={ckpt}"], 1)
    train.model.vocab_size = None  # as configs/qwen3_8b.yml: the import's model section without its vocabulary
    monkeypatch.setattr(training, "check_inputs", lambda cfg: None)  # (no data)
    training.prepare_inputs(train)  # train.py's
    assert (train.model.vocab_size, train.model.padded_vocab_size) == (V, 128)
    tokenizer_json(tmp_path / "big", 120)
    cfg = checkpoint_config(meta, ckpt, [f"tokenizer.model={tmp_path / 'big'}"], 1, batches=False)
    with pytest.raises(convert.ConfigError, match=f"model.vocab_size {V} is smaller than the tokenizer's 120 ids"):
        load_tokenizer(cfg)
