"""Multi-head latent attention (``model.kv_lora_rank``) against transformers' DeepseekV3 (dense layers, rope not
interleaved) with the same weights (named by ``hf_names``, the converter's mapping), fp64: loss and every parameter's
gradient; greedy decoding with the KV cache equals greedy decoding without it, and transformers' greedy tokens.
Layouts: tests/distributed/test_model_features_tp.py and the parity matrix; interleaved rope, MoE and the converter:
tests/unit/test_hf_families.py."""
from __future__ import annotations

import pytest
import torch

from megatron_sp.config.schema import ModelConfig
from megatron_sp.model import GPTModel
from megatron_sp.model.hf_names import hf_config_dict, to_hf_state_dict
from megatron_sp.model.inference import Sampling, generate_batch

transformers = pytest.importorskip("transformers")

S, B, V = 16, 2, 64

YARN = {"rope_scaling": "yarn", "rope_scaling_factor": 4.0, "rope_original_max_positions": 8,
        "rope_attention_factor": 1.0, "rope_mscale_all_dim": 1.0}  # DeepSeek-V3's yarn: mscale = mscale_all_dim
HF_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "mscale": 1.0,
           "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0, "rope_theta": 10000.0}


def _models(q_lora: int, yarn: bool = False) -> tuple[GPTModel, torch.nn.Module, ModelConfig]:
    cfg = ModelConfig(arch="llama", num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=4, head_dim=12,
                      ffn_hidden_size=48, rotary_pct=1.0, seq_length=S, vocab_size=V, padded_vocab_size=V,
                      kv_lora_rank=16, q_lora_rank=q_lora, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
                      init_std=0.2, norm_eps=1e-6, **(YARN if yarn else {}))
    ours = GPTModel(cfg, seed=3).double()
    hf_cfg = transformers.DeepseekV3Config(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=4, q_lora_rank=q_lora or None,
                                           kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
                                           first_k_dense_replace=2, rope_interleave=False, rms_norm_eps=1e-6,
                                           max_position_embeddings=S, tie_word_embeddings=False,
                                           **({"rope_parameters": HF_YARN} if yarn else {}))
    hf = transformers.DeepseekV3ForCausalLM(hf_cfg).double().eval()
    state = hf.state_dict()
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if "norm" in name:  # off 1, so that a misplaced norm shows
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
        for name, t in to_hf_state_dict(dict(ours.named_parameters()), cfg, rope_interleave=False).items():
            state[name].copy_(t)
    return ours, hf, cfg


@pytest.mark.parametrize("q_lora,yarn", [(24, False), (0, False), (24, True)])
def test_loss_and_grads_equal_transformers(q_lora: int, yarn: bool) -> None:
    """With and without a query latent; and DeepSeek-V3's yarn (its softmax scale × mscale(factor)²)."""
    ours, hf, cfg = _models(q_lora, yarn)
    tokens = torch.randint(0, V, (B, S + 1), generator=torch.Generator().manual_seed(5))
    loss = ours(tokens[:, :-1], labels=tokens[:, 1:]).mean()
    loss.backward()
    logits = hf(tokens[:, :-1]).logits
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, V), tokens[:, 1:].reshape(-1))
    want.backward()
    assert abs(loss.item() - want.item()) <= 1e-6 * want.item()  # transformers' rotary tables are fp32
    grads = to_hf_state_dict({n: p.grad for n, p in ours.named_parameters()}, cfg, rope_interleave=False)
    for name, p in hf.named_parameters():
        assert ((grads[name] - p.grad).abs().max() / p.grad.abs().max()).item() <= 1e-5, name


def test_greedy_with_the_cache_equals_transformers() -> None:
    ours, hf, cfg = _models(24)
    ours.eval()
    kwargs = hf_config_dict(cfg)  # the export: a dense model's first_k_dense_replace = its layers, rope interleaved
    hf_class, model_type = kwargs.pop("architectures")[0], kwargs.pop("model_type")
    exported = getattr(transformers, hf_class)(transformers.AutoConfig.for_model(model_type, **kwargs)).double().eval()
    exported.load_state_dict(to_hf_state_dict(ours.state_dict(), cfg), strict=True)
    with torch.no_grad():
        torch.testing.assert_close(exported(torch.tensor([[5, 9, 2, 33]])).logits, hf(torch.tensor([[5, 9, 2, 33]])).logits,
                                   rtol=1e-12, atol=1e-12)
    prompts = [[5, 9, 2, 33], [7, 1]]
    cached = generate_batch(ours, prompts, 8, None, Sampling(greedy=True))
    uncached = generate_batch(ours, prompts, 8, None, Sampling(greedy=True), use_cache=False)
    for prompt, a, b in zip(prompts, cached, uncached):
        assert a.new_ids == b.new_ids and len(a.new_ids) == 8
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt):].tolist()
        assert a.new_ids == want


@pytest.mark.parametrize("overrides,key", [(["model.qk_nope_head_dim=8"], "model.qk_nope_head_dim"),
                                           (["model.kv_lora_rank=16", "model.arch=neox"], "model.arch"),
                                           (["model.kv_lora_rank=16", "model.arch=llama", "model.qk_norm=true"],
                                            "model.qk_norm"),
                                           (["model.kv_lora_rank=16", "model.arch=llama", "model.num_kv_heads=2"],
                                            "model.num_kv_heads"),
                                           (["model.kv_lora_rank=16", "model.arch=llama", "model.v_head_dim=200"],
                                            "model.v_head_dim"),
                                           (["model.kv_lora_rank=16", "model.arch=llama", "model.qk_rope_head_dim=5"],
                                            "model.qk_rope_head_dim")])
def test_mla_keys_are_checked(overrides: list[str], key: str) -> None:
    """MLA keys without ``kv_lora_rank``, or MLA with what it does not combine with: one line naming the key."""
    from megatron_sp import config
    from megatron_sp.errors import ConfigError
    with pytest.raises(ConfigError, match=key):
        config.load([], ["tokenizer.type=byte", *overrides])


def test_mla_config_derives_heads_and_counts_parameters() -> None:
    from megatron_sp import config
    from megatron_sp.model import count_parameters
    cfg = config.load([], ["tokenizer.type=byte", "data.build_demo=true", "model.arch=llama", "model.num_layers=2",
                           "model.hidden_size=32",
                           "model.num_heads=4", "model.kv_lora_rank=16", "model.q_lora_rank=24",
                           "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=4", "model.v_head_dim=6"])
    config.set_vocab(cfg, 64)
    assert (cfg.model.head_dim, cfg.model.num_kv_heads) == (12, 4)
    model = GPTModel(cfg.model, seed=1)
    assert count_parameters(cfg.model, exclude_embeddings=False) == sum(p.numel() for p in model.parameters())
    from megatron_sp.model import flops_per_token  # attention: 3·L·n·(qk + v)·s = 3·2·4·(12 + 6)·seq
    attention = flops_per_token(cfg.model) - 6 * count_parameters(cfg.model, exclude_embeddings=True, active=True)
    assert attention == 3 * 2 * 4 * (12 + 6) * cfg.model.seq_length


def test_the_cache_holds_the_latent_and_the_rotary_key() -> None:
    """Per token and layer the KV cache keeps ``kv_lora_rank`` + ``qk_rope_head_dim`` values (16 + 4 here, against
    2 · heads · (nope + rope) = 96 expanded), and the logits of a token decoded through it equal the full forward's."""
    from megatron_sp.model.inference import KVCache
    ours, _, _ = _models(24)
    ours.eval()
    tokens = torch.randint(0, V, (1, 10), generator=torch.Generator().manual_seed(6))
    cache = KVCache(16)
    with torch.no_grad():
        ours(tokens[:, :9], kv_cache=cache)
        step = ours(tokens[:, 9:], kv_cache=cache)
        full = ours(tokens)
    layer = cache.layer(0)
    assert (layer.k.shape[2:], layer.v.shape[2:]) == ((1, 16), (1, 4))
    torch.testing.assert_close(step[:, -1], full[:, -1], rtol=1e-12, atol=1e-12)
