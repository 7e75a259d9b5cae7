"""GPTModel: shapes, numerics against hand-written formulas and HF transformers, layout-free init."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from megatron_sp.config.schema import ModelConfig
from megatron_sp.model import (
    GPTModel,
    count_parameters,
    flops_per_token,
    generate_batch,
    init_full_tensor,
)
from megatron_sp.model.attention import kernels
from megatron_sp.model.gpt import name_seed
from megatron_sp.model.hf_names import (
    from_hf_state_dict,
    hf_config_dict,
    to_hf_state_dict,
)

VOCAB, PADDED = 100, 128


def make_cfg(arch: str, **overrides: object) -> ModelConfig:
    """A small finalized config: head dim 16 (neox: 4 rotary dims; llama: GQA 4 heads over 2 kv heads)."""
    base: dict[str, object] = {"arch": arch, "num_layers": 2, "hidden_size": 64, "num_heads": 4, "seq_length": 32,
                               "vocab_size": VOCAB, "padded_vocab_size": PADDED, "norm_eps": 1e-5}
    if arch == "neox":
        base.update(num_kv_heads=4, ffn_hidden_size=256, rotary_pct=0.25)
    else:
        base.update(num_kv_heads=2, ffn_hidden_size=96, rotary_pct=1.0)
    base.update(overrides)
    return ModelConfig(**base)


def tokens_for(b: int, s: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, s), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(params=["math", "sdpa"])
def attention_kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test once with the explicit-scores CPU kernel (forced for every dtype) and once with SDPA."""
    if request.param == "sdpa":
        monkeypatch.setattr(kernels, "MATH_ATTENTION_MAX_SCORES", 0)
    else:
        monkeypatch.setattr(kernels, "MATH_ATTENTION_DTYPES", (torch.float64, torch.float32, torch.bfloat16))
    return request.param


# --------------------------------------------------------------------------- shapes


@pytest.mark.parametrize("arch", ["neox", "llama"])
def test_shapes_and_parameter_tags(arch: str) -> None:
    cfg = make_cfg(arch)
    model = GPTModel(cfg, seed=1)
    tokens = tokens_for(3, 16)
    logits = model(tokens)
    assert logits.shape == (3, 16, PADDED)
    losses = model(tokens, labels=tokens)
    assert losses.shape == (3, 16) and losses.dtype == torch.float32
    qkv = model.layers["0"].attention.qkv.weight
    heads, kv = cfg.num_heads, cfg.num_kv_heads
    assert qkv.shape == ((heads + 2 * kv) * 16, 64)
    names = dict(model.named_parameters())
    assert names["embedding.weight"].shape == (PADDED, 64)
    assert names["output_layer.weight"].shape == (PADDED, 64)
    has_bias = any(n.endswith(".bias") for n in names)
    assert has_bias == (arch == "neox")
    def expected_split(name: str) -> int:  # the TP partition dim each parameter declares (even at tp=1)
        if "norm" in name or name.endswith(("attention.out.bias", "mlp.fc2.bias", "mlp.down.bias")):
            return -1
        return 1 if name.endswith(("attention.out.weight", "mlp.fc2.weight", "mlp.down.weight")) else 0
    for name, p in names.items():
        assert p.partition_dim == expected_split(name), name
        assert p.tensor_model_parallel is (expected_split(name) >= 0), name
        assert p.sequence_parallel is False and p.shared_embedding is False, name


def test_gqa_kv_heads_two_of_four() -> None:
    cfg = make_cfg("llama", num_kv_heads=2)
    model = GPTModel(cfg, seed=1)
    assert model.layers["1"].attention.qkv.weight.shape == ((4 + 2 * 2) * 16, 64)
    assert model(tokens_for(2, 8)).shape == (2, 8, PADDED)


def test_tied_embeddings_share_storage() -> None:
    cfg = make_cfg("llama", tie_embeddings=True)
    model = GPTModel(cfg, seed=1)
    assert model.output_layer.weight is None  # skip_weight: it multiplies by the embedding
    assert model.output_weight() is model.embedding.weight
    assert model.embedding.weight.shared_embedding is True
    assert "output_layer.weight" not in dict(model.named_parameters())
    model(tokens_for(2, 8), labels=tokens_for(2, 8, seed=1)).sum().backward()
    assert model.embedding.weight.grad is not None
    # a last stage without the embedding keeps a copy with the embedding's initial value
    last = GPTModel(cfg, seed=1, layer_range=range(1, 2), pre_process=False)
    assert last.output_layer.weight.shared_embedding is True
    assert torch.equal(last.output_layer.weight, model.embedding.weight)


# --------------------------------------------------------------------------- hand computation


def hand_rotary(x: torch.Tensor, positions: torch.Tensor, rot: int, base: float) -> torch.Tensor:
    """Rotate-half rotary on the first ``rot`` dims. x [s, b, heads, d]; positions [b, s]."""
    half = rot // 2
    inv_freq = torch.tensor([base ** (-2.0 * i / rot) for i in range(half)], dtype=torch.float64)
    angles = positions.t().to(torch.float64)[:, :, None] * inv_freq  # [s, b, half]
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1)[:, :, None, :]  # [s, b, 1, rot]
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1)[:, :, None, :]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    rotate_half = torch.cat([-x_rot[..., half:], x_rot[..., :half]], dim=-1)
    return torch.cat([x_rot * cos + rotate_half * sin, x_pass], dim=-1)


def hand_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q kᵀ/√d + causal mask) v per sample and head. q [s, b, n, d], k/v [s, b, g, d]."""
    s, b, n, d = q.shape
    group = n // k.shape[2]
    out = torch.empty_like(q)
    mask = torch.triu(torch.full((s, s), float("-inf"), dtype=q.dtype), diagonal=1)
    for bi in range(b):
        for head in range(n):
            qh, kh, vh = q[:, bi, head], k[:, bi, head // group], v[:, bi, head // group]  # [s, d]
            scores = qh @ kh.t() / math.sqrt(d) + mask
            out[:, bi, head] = torch.softmax(scores, dim=-1) @ vh
    return out


def hand_norm(x: torch.Tensor, norm: torch.nn.Module, eps: float) -> torch.Tensor:
    if isinstance(norm, torch.nn.LayerNorm):
        mean = x.mean(-1, keepdim=True)
        var = ((x - mean) ** 2).mean(-1, keepdim=True)
        return (x - mean) / torch.sqrt(var + eps) * norm.weight + norm.bias
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * norm.weight


def hand_layer(layer: torch.nn.Module, x: torch.Tensor, positions: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """One transformer layer with plain torch ops, following the GPT-NeoX / Llama papers' conventions."""
    s, b, h = x.shape
    n, g, d = cfg.num_heads, cfg.num_kv_heads, h // cfg.num_heads
    r = n // g
    rot = int(d * cfg.rotary_pct)
    att, mlp = layer.attention, layer.mlp

    def linear(module: torch.nn.Linear, inp: torch.Tensor) -> torch.Tensor:
        out = inp @ module.weight.t()
        return out if module.bias is None else out + module.bias

    def attention(inp: torch.Tensor) -> torch.Tensor:
        qkv = linear(att.qkv, inp).view(s, b, g, r + 2, d)  # per kv group: r query heads, key, value
        q = qkv[:, :, :, :r].reshape(s, b, n, d)
        k, v = qkv[:, :, :, r], qkv[:, :, :, r + 1]
        q, k = hand_rotary(q, positions, rot, cfg.rotary_base), hand_rotary(k, positions, rot, cfg.rotary_base)
        return linear(att.out, hand_attention(q, k, v).reshape(s, b, h))

    def feed_forward(inp: torch.Tensor) -> torch.Tensor:
        if cfg.arch == "neox":
            a = linear(mlp.fc1, inp)
            return linear(mlp.fc2, 0.5 * a * (1.0 + torch.erf(a / math.sqrt(2.0))))
        gate = linear(mlp.gate, inp)
        return linear(mlp.down, gate * torch.sigmoid(gate) * linear(mlp.up, inp))

    if cfg.arch == "neox":
        return x + attention(hand_norm(x, layer.attn_norm, cfg.norm_eps)) + feed_forward(
            hand_norm(x, layer.mlp_norm, cfg.norm_eps))
    y = x + attention(hand_norm(x, layer.attn_norm, cfg.norm_eps))
    return y + feed_forward(hand_norm(y, layer.mlp_norm, cfg.norm_eps))


@pytest.mark.parametrize("arch", ["neox", "llama"])
def test_layer_matches_hand_computation_fp64(arch: str, attention_kernel: str) -> None:
    cfg = make_cfg(arch, num_layers=1)
    model = GPTModel(cfg, seed=3).double()
    with torch.no_grad():  # non-trivial norm weights and biases, so their use is checked too
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(0.1 * torch.randn(p.shape, dtype=p.dtype, generator=torch.Generator().manual_seed(7)))
    layer = model.layers["0"]
    s, b = 12, 2
    x = torch.randn(s, b, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(5))  # [s, b, h]
    positions = torch.stack([torch.arange(s) + 3, torch.arange(s) * 2])  # [b, s], different per sample
    cos, sin = model.rotary(positions, s, x.device, torch.float64, torch.float64)
    with torch.no_grad():
        ours = layer(x, cos, sin)
        expected = hand_layer(layer, x, positions, cfg)
    torch.testing.assert_close(ours, expected, atol=1e-10, rtol=0)


@pytest.mark.parametrize("rows", [3, 4, 64])
@pytest.mark.parametrize("n,g", [(4, 4), (4, 2), (6, 1)])
def test_attention_kernels_agree_with_hand(n: int, g: int, rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """fp64: the CPU block kernel with blocks of 3 (uneven: 3+3+3+1), 4 and one block, with GQA (its forward's
    blocks are kept for backward even when ``CAUSAL_BLOCK_ROWS`` changes in between), then SDPA."""
    s, b, d = 10, 2, 8
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(s, b, n, d, dtype=torch.float64, generator=gen, requires_grad=True)
    k = torch.randn(s, b, g, d, dtype=torch.float64, generator=gen, requires_grad=True)
    v = torch.randn(s, b, g, d, dtype=torch.float64, generator=gen, requires_grad=True)
    upstream = torch.randn(s, b, n, d, dtype=torch.float64, generator=gen)
    expected = hand_attention(q, k, v)
    expected_grads = torch.autograd.grad(expected, (q, k, v), upstream)
    for kernel_dtypes, node in [((torch.float64,), "_BlockCausalAttentionBackward"), ((), "PermuteBackward0")]:
        monkeypatch.setattr(kernels, "MATH_ATTENTION_DTYPES", kernel_dtypes)
        monkeypatch.setattr(kernels, "CAUSAL_BLOCK_ROWS", rows)
        out = kernels.dot_product_attention(q, k, v)
        assert type(out.grad_fn).__name__ == node
        monkeypatch.setattr(kernels, "CAUSAL_BLOCK_ROWS", 5)
        torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)
        for grad, ref in zip(torch.autograd.grad(out, (q, k, v), upstream), expected_grads):
            torch.testing.assert_close(grad, ref, atol=1e-12, rtol=0)
    assert kernels.causal_block_scores(s, rows) == sum((e - a) * e for a, e in kernels.causal_blocks(s, rows))
    assert kernels.causal_block_scores(s, 3) == 3 * 3 + 3 * 6 + 3 * 9 + 1 * 10


def test_block_causal_attention_dropout() -> None:
    """With dropout the block kernel equals autograd through the same operations drawing the same random numbers
    (one ``F.dropout`` per block, in block order), in fp64."""
    s, b, n, g, d, p = 23, 2, 4, 2, 8, 0.3
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(s, b, heads, d, dtype=torch.float64, generator=gen, requires_grad=True)
               for heads in (n, g, g))
    upstream = torch.randn(s, b, n, d, dtype=torch.float64, generator=gen)

    def by_autograd() -> torch.Tensor:
        r = n // g
        q_rows = q.reshape(s, b, g, r, d).permute(1, 2, 0, 3, 4).reshape(b * g, s * r, d)
        k_rows, v_rows = (t.permute(1, 2, 0, 3).reshape(b * g, s, d) for t in (k, v))
        blocks = []
        for a, e in kernels.causal_blocks(s, 5):
            scores = q_rows[:, a * r:e * r] @ k_rows[:, :e].transpose(1, 2) / math.sqrt(d)
            position = torch.arange(a, e).repeat_interleave(r)
            scores = scores.masked_fill(torch.arange(e)[None, :] > position[:, None], float("-inf"))
            blocks.append(F.dropout(torch.softmax(scores, -1), p) @ v_rows[:, :e])
        return torch.cat(blocks, 1).view(b, g, s, r, d).permute(2, 0, 1, 3, 4).reshape(s, b, n, d)

    torch.manual_seed(7)
    out = kernels._BlockCausalAttention.apply(q, k, v, p, 5)
    grads = torch.autograd.grad(out, (q, k, v), upstream)
    torch.manual_seed(7)
    expected = by_autograd()
    expected_grads = torch.autograd.grad(expected, (q, k, v), upstream)
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)
    for grad, ref in zip(grads, expected_grads):
        torch.testing.assert_close(grad, ref, atol=1e-12, rtol=0)
    assert not torch.equal(out, hand_attention(q, k, v))  # dropout did drop


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_causal_kernel_choice(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32 and bf16 run the block kernel within ``MATH_ATTENTION_MAX_SCORES`` and SDPA beyond it; both agree with
    the fp64 hand computation to the dtype's rounding."""
    s, b, n, g, d = 70, 2, 4, 2, 16
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(s, b, heads, d, generator=gen, dtype=torch.float64) for heads in (n, g, g))
    expected = hand_attention(q, k, v)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    for bound, kernel in ((b * n * s * s, "_BlockCausalAttentionBackward"), (b * n * s * s - 1, "FlashAttention")):
        monkeypatch.setattr(kernels, "MATH_ATTENTION_MAX_SCORES", bound)
        leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        out = kernels.dot_product_attention(*leaves)
        node = out.grad_fn if kernel.startswith("_") else out.grad_fn.next_functions[0][0]  # SDPA: under a permute
        assert kernel in node.name(), node.name()
        assert out.dtype == dtype
        torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=0)


@pytest.mark.parametrize("bound,kernel", [(None, "_BlockCausalAttention"), (2 * 4 * 70 * 70 - 1, "FlashAttention"),
                                          (0, "FlashAttention")])
def test_cpu_attention_max_scores_config(bound: int | None, kernel: str) -> None:
    """``model.cpu_attention_max_scores`` is the layer's bound: unset, the kernels' default (b·n·s² = 39200 is
    within it); below b·n·s², or 0, torch's flash kernel."""
    attention = GPTModel(make_cfg("llama", cpu_attention_max_scores=bound), seed=1).layers["0"].attention
    s, b, n, g, d = 70, 2, 4, 2, 16
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(s, b, heads, d, generator=gen, requires_grad=True) for heads in (n, g, g))
    out = attention.attention_fn(q, k, v, 0.0)
    node = out.grad_fn if kernel.startswith("_") else out.grad_fn.next_functions[0][0]  # SDPA: under a permute
    assert kernel in node.name(), node.name()
    torch.testing.assert_close(out.double(), hand_attention(q.double(), k.double(), v.double()), atol=1e-5, rtol=0)


# --------------------------------------------------------------------------- initialisation


@pytest.mark.parametrize("arch", ["neox", "llama"])
def test_init_is_layout_independent(arch: str) -> None:
    cfg = make_cfg(arch, num_layers=4)
    full = dict(GPTModel(cfg, seed=11).named_parameters())
    first = GPTModel(cfg, seed=11, layer_range=range(2), post_process=False)
    last = GPTModel(cfg, seed=11, layer_range=range(2, 4), pre_process=False)
    last_names = [n for n, _ in last.named_parameters()]
    assert last_names[0].startswith("layers.2.") and "embedding.weight" not in last_names
    assert "output_layer.weight" not in dict(first.named_parameters())
    for stage in (first, last):
        for name, p in stage.named_parameters():
            assert torch.equal(p, full[name]), name
    assert len(dict(first.named_parameters())) + len(last_names) == len(full)
    again = dict(GPTModel(cfg, seed=11).named_parameters())
    other = dict(GPTModel(cfg, seed=12).named_parameters())
    for name, p in full.items():
        assert torch.equal(p, again[name]), name
        if "norm" not in name and not name.endswith(".bias"):
            assert not torch.equal(p, other[name]), name


def test_pipeline_stages_compose_to_full_model() -> None:
    cfg = make_cfg("neox", num_layers=4)
    full = GPTModel(cfg, seed=2).double()
    first = GPTModel(cfg, seed=2, layer_range=range(1), post_process=False).double()
    middle = GPTModel(cfg, seed=2, layer_range=range(1, 3), pre_process=False, post_process=False).double()
    last = GPTModel(cfg, seed=2, layer_range=range(3, 4), pre_process=False).double()
    tokens = tokens_for(2, 8)
    with torch.no_grad():
        hidden = first(tokens)  # [s, b, h]
        assert hidden.shape == (8, 2, 64)
        logits = last(None, hidden_states=middle(None, hidden_states=hidden))
        torch.testing.assert_close(logits, full(tokens), atol=1e-12, rtol=0)


def test_init_full_tensor_is_keyed_by_name_and_seed() -> None:
    cfg = make_cfg("neox")
    a = init_full_tensor("layers.0.attention.qkv.weight", (12, 4), "normal", cfg, seed=1)
    assert torch.equal(a, init_full_tensor("layers.0.attention.qkv.weight", (12, 4), "normal", cfg, seed=1))
    assert not torch.equal(a, init_full_tensor("layers.1.attention.qkv.weight", (12, 4), "normal", cfg, seed=1))
    assert not torch.equal(a, init_full_tensor("layers.0.attention.qkv.weight", (12, 4), "normal", cfg, seed=2))
    assert name_seed(1, "x") == name_seed(1, "x") and name_seed(1, "x") != name_seed(2, "x")
    assert torch.equal(init_full_tensor("b", (3,), "zeros", cfg, 1), torch.zeros(3))
    assert torch.equal(init_full_tensor("w", (3,), "ones", cfg, 1), torch.ones(3))
    with pytest.raises(ValueError):
        init_full_tensor("w", (3,), "uniform", cfg, 1)


@pytest.mark.parametrize("scaled", [True, False])
def test_init_statistics(scaled: bool) -> None:
    cfg = make_cfg("neox", num_layers=8, hidden_size=256, num_heads=8, num_kv_heads=8, ffn_hidden_size=1024,
                   init_std=0.02, scaled_init=scaled)
    params = dict(GPTModel(cfg, seed=5, layer_range=range(1), post_process=False).named_parameters())
    out_std = 0.02 / math.sqrt(2 * 8) if scaled else 0.02
    for name, std in [("layers.0.attention.qkv.weight", 0.02), ("layers.0.mlp.fc1.weight", 0.02),
                      ("embedding.weight", 0.02), ("layers.0.attention.out.weight", out_std),
                      ("layers.0.mlp.fc2.weight", out_std)]:
        w = params[name]
        if name == "embedding.weight":  # rows past the vocabulary are padding: zero, never used
            assert torch.count_nonzero(w[cfg.vocab_size:]) == 0
            w = w[:cfg.vocab_size]
        assert abs(w.std().item() / std - 1) < 0.02, name
        assert abs(w.mean().item()) < 5 * std / math.sqrt(w.numel()), name
    for name, p in params.items():
        if name.endswith(".bias"):
            assert torch.count_nonzero(p) == 0, name
        elif "norm" in name:
            assert torch.equal(p, torch.ones_like(p)), name


# --------------------------------------------------------------------------- positions, loss, precision


@pytest.mark.parametrize("arch", ["neox", "llama"])
def test_position_ids_are_honoured(arch: str) -> None:
    cfg = make_cfg(arch)
    model = GPTModel(cfg, seed=4).double().eval()
    tokens = tokens_for(1, 10).repeat(2, 1)  # two identical rows
    default = model(tokens)
    arange = torch.arange(10).repeat(2, 1)
    shifted = torch.stack([torch.arange(10) + 5, torch.arange(10) + 17])  # per-row offsets
    packed = torch.cat([torch.arange(5), torch.arange(5)]).repeat(2, 1)  # two documents of 5
    torch.testing.assert_close(model(tokens, position_ids=arange), default, atol=0, rtol=0)
    # rotary is relative: shifting every position of a row by the same amount changes nothing
    torch.testing.assert_close(model(tokens, position_ids=shifted), default, atol=1e-10, rtol=0)
    # positions come from position_ids, not from the sequence index
    assert (model(tokens, position_ids=packed) - default).abs().max() > 1e-4


def test_loss_equals_cross_entropy_on_logits() -> None:
    cfg = make_cfg("llama")
    model = GPTModel(cfg, seed=6)
    tokens, labels = tokens_for(2, 16), tokens_for(2, 16, seed=9)
    labels[0, :3] = -100
    losses = model(tokens, labels=labels)
    logits = model(tokens)
    # The padded vocab rows (ids >= vocab_size) are outside the softmax.
    real = logits.float()[..., :cfg.vocab_size]
    expected = F.cross_entropy(real.reshape(-1, cfg.vocab_size), labels.reshape(-1), reduction="none")
    torch.testing.assert_close(losses, expected.view(2, 16), atol=1e-6, rtol=1e-6)
    assert torch.count_nonzero(losses[0, :3]) == 0


@pytest.mark.parametrize("arch", ["neox", "llama"])
def test_bf16_autocast_is_close_to_fp32(arch: str) -> None:
    cfg = make_cfg(arch)
    model = GPTModel(cfg, seed=8)
    tokens, labels = tokens_for(2, 16), tokens_for(2, 16, seed=1)
    ref_logits, ref_loss = model(tokens), model(tokens, labels=labels)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(tokens)
        loss = model(tokens, labels=labels)
    assert logits.dtype == torch.bfloat16 and loss.dtype == torch.float32
    rel = (logits.float() - ref_logits).abs().max() / ref_logits.abs().max()
    assert rel < 0.03
    torch.testing.assert_close(loss, ref_loss, atol=0.02, rtol=0.01)
    loss.mean().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())


def test_inference_mode_first_then_training() -> None:
    """Cached rotary tables and causal masks made under inference mode must not break a later backward."""
    model = GPTModel(make_cfg("llama"), seed=1)
    tokens = tokens_for(2, 8)
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(tokens)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(tokens, labels=tokens).mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_dropout_only_in_training() -> None:
    cfg = make_cfg("neox", hidden_dropout=0.2, attention_dropout=0.2)
    model = GPTModel(cfg, seed=1)
    tokens = tokens_for(2, 8)
    model.eval()
    torch.testing.assert_close(model(tokens), model(tokens), atol=0, rtol=0)
    model.train()
    assert (model(tokens) - model(tokens)).abs().max() > 1e-4


# --------------------------------------------------------------------------- counting, generation


@pytest.mark.parametrize("arch,tied", [("neox", False), ("llama", False), ("llama", True)])
def test_parameter_count_and_flops(arch: str, tied: bool) -> None:
    cfg = make_cfg(arch, tie_embeddings=tied)
    model = GPTModel(cfg, seed=1)
    n_all = sum(p.numel() for p in model.parameters())
    assert model.num_parameters() == n_all
    embedding = PADDED * 64
    assert model.num_parameters(exclude_embeddings=True) == (n_all if tied else n_all - embedding)
    assert count_parameters(cfg) == model.num_parameters(exclude_embeddings=True)
    assert count_parameters(cfg, exclude_embeddings=False) == n_all
    expected = 6 * model.num_parameters(exclude_embeddings=True) + 6 * cfg.num_layers * 64 * cfg.seq_length
    assert flops_per_token(cfg) == pytest.approx(expected, rel=1e-12)


def test_generate_is_greedy_and_restores_mode() -> None:
    cfg = make_cfg("llama", seq_length=8)
    model = GPTModel(cfg, seed=1)
    model.train()
    prompt = [5, 6, 7, 8, 9]  # + 4 new tokens: the last one sampled after seq_length tokens
    out = prompt + generate_batch(model, [prompt], max_new_tokens=4, eod=None)[0].new_ids
    assert len(out) == len(prompt) + 4
    assert model.training and all(0 <= t < VOCAB for t in out)
    model.eval()
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(4):
            logits = model(torch.tensor([seq]))
            seq.append(int(logits[0, -1, :VOCAB].argmax()))
    assert out == seq
    assert generate_batch(model, [prompt], max_new_tokens=4, eod=out[len(prompt)])[0].new_ids == []
    assert not model.training


# --------------------------------------------------------------------------- HF transformers


def build_hf(cfg: ModelConfig) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    kwargs = hf_config_dict(cfg)
    kwargs.pop("architectures")
    kwargs.pop("model_type")
    if cfg.arch == "neox":
        return transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(**kwargs)).eval()
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**kwargs)).eval()


@pytest.mark.parametrize("arch,tied", [("neox", False), ("llama", False), ("llama", True)])
def test_matches_hf_transformers(arch: str, tied: bool, attention_kernel: str) -> None:
    cfg = make_cfg(arch, tie_embeddings=tied, rotary_base=500.0, norm_eps=1e-6)
    hf = build_hf(cfg)
    model = GPTModel(cfg, seed=21).eval()
    with torch.no_grad():  # non-trivial norms and biases, so their mapping is checked too
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(3)))
    state = to_hf_state_dict(model.state_dict(), cfg)
    if "embed_out.weight" in state and not hasattr(hf, "embed_out"):
        state["lm_head.weight"] = state.pop("embed_out.weight")  # transformers >= 5 module name
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= ({"lm_head.weight"} if tied else set())
    tokens = tokens_for(2, 24)
    positions = torch.stack([torch.arange(24), torch.arange(24) + 9])
    with torch.no_grad():
        ours = model(tokens, position_ids=positions)
        theirs = hf(input_ids=tokens, position_ids=positions).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    assert ours.abs().max() > 0.1  # not trivially small


@pytest.mark.parametrize("arch,tied", [("neox", False), ("llama", True)])
def test_hf_state_dict_round_trip(arch: str, tied: bool) -> None:
    cfg = make_cfg(arch, tie_embeddings=tied)
    ours = GPTModel(cfg, seed=1).state_dict()
    back = from_hf_state_dict(to_hf_state_dict(ours, cfg), cfg)
    assert set(back) == set(ours)
    for name, tensor in ours.items():
        assert torch.equal(back[name], tensor), name
    with pytest.raises(ValueError):
        to_hf_state_dict(ours, cfg, arch="llama" if arch == "neox" else "neox")


def test_unfinalized_config_is_rejected() -> None:
    with pytest.raises(ValueError, match="not finalized"):
        GPTModel(dataclasses.replace(make_cfg("neox"), ffn_hidden_size=None), seed=1)


@pytest.mark.gpu
def test_cuda_flash_path_matches_sdpa() -> None:
    cfg = make_cfg("llama")
    model = GPTModel(cfg, seed=1).cuda().eval()
    tokens = tokens_for(2, 16).cuda()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        fast = model(tokens).float()
    with torch.no_grad():
        ref = model(tokens)
    assert (fast - ref).abs().max() / ref.abs().max() < 0.03


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rd", [8, 4], ids=["full_rotary", "partial_rotary"])
@pytest.mark.parametrize("r", [1, 3])
def test_eager_regions_equal_autograd_of_their_formulas_bit_for_bit(dtype: torch.dtype, rd: int, r: int) -> None:
    """``_RotaryQKV`` and ``_SwiGLU`` (hand-written backwards, no concatenation) give the very bits autograd
    gives for ``rotary_qkv`` and ``swiglu``, forward and backward."""
    from megatron_sp.model import transformer as T

    gen = torch.Generator().manual_seed(r + rd)
    s, b, g, d = 5, 2, 2, 8
    qkv = torch.randn(s, b, g * (r + 2) * d, generator=gen).to(dtype)
    angles = torch.randn(s, 1, rd // 2, generator=gen)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([-angles.sin(), angles.sin()], -1)
    douts = [torch.randn(s, b, g * r, d, generator=gen).to(dtype), *(torch.randn(s, b, g, d, generator=gen).to(dtype)
                                                                    for _ in range(2))]
    results = []
    for fn in (T.FORMULAS.rotary_qkv, T.EAGER.rotary_qkv):
        x = qkv.clone().requires_grad_(True)
        outs = fn(x, cos, sin, r, d)
        torch.autograd.backward(outs, douts)
        results.append((*outs, x.grad))
    for want, got in zip(*results):
        assert want.shape == got.shape and torch.equal(want, got)
    gate_up = torch.randn(s, b, 2 * 12, generator=gen).to(dtype)
    dout = torch.randn(s, b, 12, generator=gen).to(dtype)
    results = []
    for fn in (T.FORMULAS.swiglu, T.EAGER.swiglu):
        x = gate_up.clone().requires_grad_(True)
        out = fn(x)
        out.backward(dout)
        results.append((out, x.grad))
    for want, got in zip(*results):
        assert torch.equal(want, got)


def test_eager_swiglu_saves_only_its_input() -> None:
    """autograd of the formula saves ``silu(gate)`` too: ``f`` more values per token."""
    from megatron_sp.model import transformer as T

    def saved_bytes(fn) -> int:
        storages: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t
        x = torch.randn(64, 2, 2 * 32, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(x * 1.0)
        return sum(storages.values())
    assert saved_bytes(T.EAGER.swiglu) == 64 * 2 * 64 * 4
    assert saved_bytes(T.FORMULAS.swiglu) == 64 * 2 * 64 * 4 + 64 * 2 * 32 * 4
