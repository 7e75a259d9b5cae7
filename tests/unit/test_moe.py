"""The MoE layer on one rank against a naive per-token reference (fp64): routing, experts, shared experts, the
aux losses and their gradients, capacity drops, grouped GEMM against the loop, the dense model untouched."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F

from megatron_sp.config.schema import ModelConfig
from megatron_sp.model import GPTModel, count_parameters, flops_per_token
from megatron_sp.model import moe, transformer
from megatron_sp.model.gpt import OUTPUT_PROJECTIONS, init_full_tensor, init_kind, parameter_parts
from megatron_sp.model.transformer import EAGER, MLP, arch_spec

S, B, H, E, F_EXP = 6, 3, 16, 4, 12


def make_cfg(arch: str, **overrides: object) -> ModelConfig:
    base: dict[str, object] = {"arch": arch, "num_layers": 2, "hidden_size": H, "num_heads": 2, "seq_length": S,
                               "vocab_size": 50, "padded_vocab_size": 64, "num_kv_heads": 2, "ffn_hidden_size": 32,
                               "rotary_pct": 1.0, "num_experts": E, "moe_top_k": 2, "moe_ffn_hidden_size": F_EXP,
                               "moe_aux_loss_coeff": 0.0}
    base.update(overrides)
    return ModelConfig(**base)


def make_layer(cfg: ModelConfig, seed: int = 0) -> moe.MoE:
    """A MoE layer in fp64 with random parameters (biases too, so they are tested)."""
    shared = MLP(cfg, None, cfg.moe_shared_experts * cfg.moe_ffn_hidden_size) if cfg.moe_shared_experts else None
    layer = moe.MoE(cfg, arch_spec(cfg.arch), EAGER, shared).double()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.5)
    return layer


def naive_expert(layer: moe.MoE, e: int, x: torch.Tensor) -> torch.Tensor:
    """Expert ``e`` on one token ``x [h]``, written out."""
    ex = layer.experts

    def lin(m: moe.StackedLinear, v: torch.Tensor) -> torch.Tensor:
        return m.weight[e] @ v + (m.bias[e] if m.bias is not None else 0)

    if ex.swiglu:
        return lin(ex.down, F.silu(lin(ex.gate, x)) * lin(ex.up, x))
    return lin(ex.fc2, F.gelu(lin(ex.fc1, x)))


def naive_moe(layer: moe.MoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(output, aux loss, z-loss): every token through its top-k experts one at a time, weighted."""
    s, b, h = x.shape
    k, n = layer.top_k, layer.num_experts
    out, probs, chosen, lse = [], [], [], []
    for t in x.reshape(s * b, h):
        logits = layer.router.weight @ t
        scores = logits.softmax(-1) if layer.score == "softmax" else logits.sigmoid()
        top = sorted(range(n), key=lambda i: -float(scores[i].detach()))[:k]
        total = sum(scores[i] for i in top)
        y = sum((scores[i] / total if k > 1 else scores[i]) * naive_expert(layer, i, t) for i in top)
        out.append(y)
        probs.append(scores / scores.sum() if layer.score == "sigmoid" else scores)
        chosen += top
        lse.append(torch.log(torch.exp(logits).sum()))
    f = torch.tensor([chosen.count(i) / len(chosen) for i in range(n)], dtype=x.dtype)
    aux = n * (f * torch.stack(probs).mean(0)).sum()
    z = torch.stack(lse).square().mean()
    y = torch.stack(out).view(s, b, h)
    if layer.shared is not None:
        y = y + layer.shared(x)
    return y, aux, z


CASES = [("llama", "softmax", 2, 0), ("llama", "sigmoid", 1, 1), ("llama", "softmax", 1, 0), ("neox", "softmax", 2, 1),
         ("neox", "sigmoid", 2, 0), ("llama", "sigmoid", 3, 2)]


@pytest.mark.parametrize("arch,score,top_k,shared", CASES)
def test_layer_matches_naive_reference_values_and_gradients(arch: str, score: str, top_k: int, shared: int) -> None:
    """fp64, loop backend; the objective includes the aux and z losses (scale 0.3), so their gradients are checked
    together with those of the output (input, router, routed and shared experts)."""
    cfg = make_cfg(arch, moe_router_score=score, moe_top_k=top_k, moe_shared_experts=shared,
                   moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)
    layer = make_layer(cfg).train()
    layer.experts.backend = "loop"
    moe.set_aux_loss_scale(layer, 0.3)
    x = torch.randn(S, B, H, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    up = torch.randn(S, B, H, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    params = [x, *layer.parameters()]

    out = layer(x)
    got = torch.autograd.grad((out * up).sum(), params)
    ref_out, aux, z = naive_moe(layer, x)
    want = torch.autograd.grad((ref_out * up).sum() + 0.3 * (0.1 * aux + 0.01 * z), params)

    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(layer.aux_loss, aux.detach(), rtol=1e-12, atol=0)
    torch.testing.assert_close(layer.z_loss, z.detach(), rtol=1e-12, atol=0)
    names = ["x", *(n for n, _ in layer.named_parameters())]
    for name, g, w in zip(names, got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")
    assert int(layer.tokens_per_expert.sum()) == S * B * top_k and int(layer.dropped_tokens) == 0


def test_aux_and_z_loss_by_hand() -> None:
    """Two tokens, two experts, logits (0, ln 3) each: p = (1/4, 3/4), both routed to expert 1, so f = (0, 1),
    P = (1/4, 3/4): aux = 2·3/4 = 3/2; ∂aux/∂logits = ∂/∂z (E·f·p/T) = (−3/16, 3/16) per token. z = (ln 4)², its
    gradient 2·ln4·p/T = ln4·p."""
    logits = torch.tensor([[0.0, math.log(3)]] * 2, dtype=torch.float64, requires_grad=True)
    experts, weights, _, probs, _ = moe.route(logits, 1, "softmax")
    assert experts.tolist() == [[1], [1]]
    torch.testing.assert_close(weights, torch.tensor([[0.75], [0.75]], dtype=torch.float64))  # top-1: no renorm
    aux = moe.load_balancing_loss(probs, experts, 2)
    assert aux.item() == pytest.approx(1.5, rel=1e-14)
    (g,) = torch.autograd.grad(aux, logits)
    torch.testing.assert_close(g, torch.tensor([[-3 / 16, 3 / 16]] * 2, dtype=torch.float64))
    z = moe.router_z_loss(logits)
    assert z.item() == pytest.approx(math.log(4) ** 2, rel=1e-14)
    (g,) = torch.autograd.grad(z, logits)
    torch.testing.assert_close(g, math.log(4) * torch.tensor([[0.25, 0.75]] * 2, dtype=torch.float64))
    # sigmoid: P from the sigmoid scores normalised over the experts; balanced routing gives 1
    logits = torch.tensor([[1.0, -1.0], [-1.0, 1.0]], dtype=torch.float64)
    experts, weights, _, probs, _ = moe.route(logits, 1, "sigmoid")
    assert moe.load_balancing_loss(probs, experts, 2).item() == pytest.approx(1.0, rel=1e-14)
    torch.testing.assert_close(weights, torch.sigmoid(torch.ones(2, 1, dtype=torch.float64)))


def test_aux_gradient_scale_and_no_injection_outside_training() -> None:
    """With a zero upstream gradient the router's gradient is scale · ∇(coeff·aux + coeff·z), linear in the scale;
    no injection under no_grad or in eval mode."""
    cfg = make_cfg("llama", moe_aux_loss_coeff=0.5, moe_z_loss_coeff=0.25)
    layer = make_layer(cfg).train()
    x = torch.randn(S, B, H, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    grads = []
    for scale in (1.0, 0.25):
        moe.set_aux_loss_scale(layer, scale)
        out = layer(x)
        (g,) = torch.autograd.grad(out, layer.router.weight, grad_outputs=torch.zeros_like(out))
        grads.append(g)
    logits = x.reshape(-1, H) @ layer.router.weight.T
    experts, _, _, probs, _ = moe.route(logits, 2, "softmax")
    (want,) = torch.autograd.grad(0.5 * moe.load_balancing_loss(probs, experts, E) + 0.25 * moe.router_z_loss(logits),
                                  layer.router.weight)
    torch.testing.assert_close(grads[0], want, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grads[1], 0.25 * want, rtol=1e-12, atol=1e-14)
    layer.eval()
    assert layer(x.requires_grad_()).grad_fn.name() != "AuxLossGradBackward"


def test_router_logits_fp32_under_bf16_autocast() -> None:
    cfg = make_cfg("llama")
    layer = make_layer(cfg).float()
    x = torch.randn(S, B, H)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = layer.router(x.reshape(-1, H))
        out = layer(x)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, x.reshape(-1, H) @ layer.router.weight.T, rtol=1e-6, atol=1e-6)
    assert out.dtype == torch.bfloat16


def test_combine_stays_in_bf16_under_autocast() -> None:
    """bf16 parameters under bf16 autocast (tools/bench/moe.py's setting): the combine saves no fp32 copy of the
    [T, k, h] slots for backward (it ran in fp32 before issue 39: the bf16 block's main extra cost)."""
    layer = make_layer(make_cfg("llama", ffn_hidden_size=16, moe_ffn_hidden_size=16)).to(torch.bfloat16).train()
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(torch.randn(S, B, H).to(torch.bfloat16).requires_grad_())
    assert out.dtype == torch.bfloat16
    assert not [t.shape for t in saved if t.dtype == torch.float32 and t.numel() >= S * B * 2 * H]


def test_capacity_ranks_scores_a_few_ulps_apart_by_position() -> None:
    """Repeated tokens give scores a few fp32 ulps apart whose order is rounding noise (a tp2 run ranked them
    otherwise than 1 rank: fuzzer seed 338). Ranked on ``RANK_BITS`` significant bits they tie, and the earlier
    position stays whichever is the larger; scores further apart still rank by value."""
    a = torch.tensor(0.130601078, dtype=torch.float32)
    up = torch.nextafter(a, torch.tensor(1.0))
    experts = torch.zeros(3, 1, 1, dtype=torch.long)
    for scores in ((a, up, a * 0.5), (up, a, a * 0.5)):
        keep = moe.capacity_keep(experts, torch.stack(scores).view(3, 1, 1), 2, 1)
        assert keep.view(-1).tolist() == [True, False, False]
    keep = moe.capacity_keep(experts, torch.stack((a, a * (1 + 2.0 ** -moe.RANK_BITS * 2), a)).view(3, 1, 1), 2, 1)
    assert keep.view(-1).tolist() == [False, True, False]


def test_capacity_drops_the_lowest_scores_per_sequence() -> None:
    """Two experts, top-1, capacity factor 0.5 over 4 tokens: ceil(0.5·4·1/2) = 1 token per expert and sequence.
    Sequence 0 sends every token to expert 0 with scores ordered 1 = 3 > 2 > 0: only token 1 stays (the tie goes to
    the earlier position). Each sequence's drops do not depend on the other sequences of the batch."""
    cfg = make_cfg("llama", num_experts=2, moe_top_k=1, moe_capacity_factor=0.5, seq_length=4)
    layer = make_layer(cfg).train()
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[0, 0], layer.router.weight[1, 0] = 1.0, -1.0  # logits (a, −a): expert 0 iff a > 0
    a = torch.tensor([[0.5, -0.2], [2.0, -1.0], [1.0, 0.3], [2.0, -3.0]], dtype=torch.float64)  # [s, b]
    x = torch.zeros(4, 2, H, dtype=torch.float64)
    x[..., 0] = a
    x[..., 1:] = torch.randn(4, 2, H - 1, dtype=torch.float64, generator=torch.Generator().manual_seed(4)) * 0.1
    assert layer.capacity(4) == 1
    experts, _, scores, _, _ = moe.route(layer.router(x.reshape(-1, H)), 1, "softmax")
    keep = moe.capacity_keep(experts.view(4, 2, 1), scores.view(4, 2, 1), 2, 1)
    # sequence 1: tokens 1, 3 go to expert 1 (scores 1−σ(−2), 1−σ(−6): token 3 stays), tokens 0, 2 to expert 0
    # (a = −0.2 → expert 1 too): expert 1 has tokens 0, 1, 3 → keeps 3; expert 0 has token 2 → keeps it
    assert keep[..., 0].tolist() == [[False, False], [True, False], [False, True], [False, True]]
    out = layer(x)
    assert int(layer.dropped_tokens) == 5
    dense_out = layer.eval()(x)  # eval: dropless
    assert int(layer.dropped_tokens) == 0
    assert (out[:, 0][[0, 2, 3]] == 0).all() and out[1, 0].abs().sum() > 0
    torch.testing.assert_close(out[keep[..., 0]], dense_out[keep[..., 0]])
    alone = layer.train()(x[:, 1:])
    torch.testing.assert_close(alone[:, 0], out[:, 1])


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="no torch._grouped_mm")
@pytest.mark.parametrize("arch", ["llama", "neox"])
def test_grouped_gemm_equals_the_loop(arch: str) -> None:
    """fp32 on CPU, an expert with no tokens: values and gradients of the grouped GEMM and the per-expert loop."""
    torch.manual_seed(0)
    ex = moe.Experts(E, H, F_EXP, arch_spec(arch))
    for p in ex.parameters():
        torch.nn.init.normal_(p, std=0.3)
    counts = torch.tensor([5, 0, 9, 4])
    x = torch.randn(int(counts.sum()), H, requires_grad=True)
    assert moe.grouped_mm_usable(x, ex.down.weight if ex.swiglu else ex.fc2.weight)
    up = torch.randn(int(counts.sum()), H)
    results = []
    for backend in ("loop", "grouped"):
        ex.backend = backend
        out = ex(x, counts, EAGER)
        results.append((out, *torch.autograd.grad((out * up).sum(), [x, *ex.parameters()])))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert not moe.grouped_mm_usable(x.double(), ex.down.weight.double() if ex.swiglu else ex.fc2.weight.double())


def test_dense_model_unchanged() -> None:
    """num_experts 0: no MoE module is built (``MoE`` made unbuildable), the parameter names and init kinds are the
    pre-MoE ones, every parameter is its ``init_full_tensor`` draw, and the output equals the normal build's."""
    cfg = dataclasses.replace(make_cfg("neox", num_experts=0, moe_top_k=2, moe_ffn_hidden_size=None), num_kv_heads=2)
    torch.manual_seed(0)
    tokens = torch.randint(0, 50, (2, S))
    normal = GPTModel(cfg, seed=5)

    class Unbuildable:
        def __init__(self, *args: object, **kwargs: object) -> None:
            raise AssertionError("a dense model built a MoE layer")

    mp = pytest.MonkeyPatch()
    mp.setattr(transformer, "MoE", Unbuildable)
    try:
        untouched = GPTModel(cfg, seed=5)
    finally:
        mp.undo()
    old_projections = ("attention.out.weight", "mlp.fc2.weight", "mlp.down.weight")
    for (name, p), (name2, q) in zip(normal.named_parameters(), untouched.named_parameters(), strict=True):
        assert name == name2 and not any(w in name for w in ("router", "experts", "shared"))
        old_kind = "scaled_normal" if name.endswith(old_projections) else init_kind(name)
        assert init_kind(name) == old_kind
        rows = getattr(p, "vocab_rows", None)  # the embedding's padding rows are zero
        assert torch.equal(p[:rows], init_full_tensor(name, p.shape, old_kind, cfg, 5)[:rows]) and torch.equal(p, q)
    assert torch.equal(normal(tokens, labels=tokens), untouched(tokens, labels=tokens))
    assert set(OUTPUT_PROJECTIONS) >= set(old_projections)
    assert "moe_layer" not in parameter_parts(cfg)


def test_layer_selection_and_parameter_counts() -> None:
    cfg = make_cfg("llama", num_layers=5, moe_first_dense_layers=1, moe_layer_freq=2, moe_shared_experts=1, num_experts=8,
                   moe_top_k=2, tie_embeddings=True)
    assert [moe.is_moe_layer(cfg, i) for i in range(5)] == [False, True, False, True, False]
    model = GPTModel(cfg, seed=1)
    assert [isinstance(model.layers[str(i)].mlp, moe.MoE) for i in range(5)] == [False, True, False, True, False]
    assert model.num_parameters() == count_parameters(cfg, exclude_embeddings=False)
    parts = parameter_parts(cfg)
    expert = 3 * H * F_EXP
    assert parts["moe_layer"] - parts["moe_layer_active"] == (8 - 2) * expert
    assert count_parameters(cfg) - count_parameters(cfg, active=True) == 2 * 6 * expert
    n_active = count_parameters(cfg, active=True)
    assert flops_per_token(cfg) == 6.0 * n_active + 6.0 * 5 * H * S  # MFU counts the active parameters


def test_expert_bias_selects_but_does_not_weigh() -> None:
    """The bias changes which experts a token takes, never their weights: those are the unbiased scores."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]], dtype=torch.float64)
    scores = logits.sigmoid()
    experts, weights, top_scores, probs, balance = moe.route(logits, 2, "sigmoid", torch.tensor([0.0, 0.0, 0.5, 0.0]))
    assert experts.tolist() == [[2, 0]]  # sigmoid (0.88, 0.73, 0.5, 0.27) + bias: expert 2 (1.0) overtakes 0 and 1
    assert balance.tolist() == [[0, 1]]  # the aux loss's f counts the top-k without the bias
    torch.testing.assert_close(top_scores, scores[:, [2, 0]])
    torch.testing.assert_close(weights, scores[:, [2, 0]] / scores[:, [2, 0]].sum())
    torch.testing.assert_close(probs, scores / scores.sum())
    plain = moe.route(logits, 2, "sigmoid")
    zero = moe.route(logits, 2, "sigmoid", torch.zeros(4))
    assert all(torch.equal(a, b) for a, b in zip(plain, zero))  # a zero bias is no bias, bit for bit


def test_aux_loss_counts_the_top_k_without_the_bias() -> None:
    """Logits (3, 0, 0, 0) for every token, bias (0, 0, 0, 1), sigmoid, top-1: the bias routes every token to expert 3,
    but f counts expert 0 (DeepSeek-V3, megatron-core): aux = 4·σ(3)/(σ(3) + 3/2) = 1.5536 (0.8155 with the bias).
    A loaded non-zero bias routes even with moe_bias_update_rate 0 (where a zero bias is skipped)."""
    cfg = make_cfg("llama", moe_top_k=1, moe_router_score="sigmoid", moe_aux_loss_coeff=0.1)
    layer = make_layer(cfg).train()
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[0, 0] = 3.0
    assert not layer.router.bias_in_use
    moe.load_expert_bias(torch.nn.ModuleList([_Layer(layer, 0)]), {"0": [0.0, 0.0, 0.0, 1.0]})
    x = torch.zeros(S, B, H, dtype=torch.float64)
    x[..., 0] = 1.0
    layer(x)
    s3 = torch.sigmoid(torch.tensor(3.0, dtype=torch.float64)).item()
    assert layer.tokens_per_expert.tolist() == [0, 0, 0, S * B]  # the bias still routes (and moves the bias)
    assert layer.aux_loss.item() == pytest.approx(4 * s3 / (s3 + 1.5), rel=1e-12)


def test_capacity_is_exact_and_capped() -> None:
    """ceil(1.1·200·6/8) = ceil(165) = 165 (in floats 1.1·200·6/8 = 165.00000000000003 → 166); a factor so large
    that the product overflows a float caps at s (every token fits) and trains as dropless."""
    assert moe.expert_capacity(1.1, 200, 6, 8) == 165 and math.ceil(1.1 * 200 * 6 / 8) == 166
    assert moe.expert_capacity(0.3, 10, 1, 3) == 1 and moe.expert_capacity(1e-300, 10, 1, 3) == 1
    assert moe.expert_capacity(1e300, 200, 6, 8) == 200 and moe.expert_capacity(1.7e308, 2, 2, 4) == 2
    layer = make_layer(make_cfg("llama", moe_capacity_factor=1e300)).train()
    x = torch.randn(S, B, H, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    out = layer(x)
    assert int(layer.dropped_tokens) == 0 and torch.equal(out, layer.eval()(x))


def test_transformers_aux_loss_is_k_times_ours_pooled_and_the_export_converts() -> None:
    """transformers' Mixtral/Qwen2-MoE aux loss is k × ours on the layers' tokens pooled; ours sums the layers, so
    the export writes router_aux_loss_coef = α · L / k: with equal loads in every layer, the same objective."""
    load_balancing_loss_func = pytest.importorskip("transformers.models.mixtral.modeling_mixtral").load_balancing_loss_func
    from megatron_sp.model.hf_names import hf_aux_loss_coef, hf_config_dict
    gen = torch.Generator().manual_seed(9)
    layers = tuple(torch.randn(20, E, generator=gen) for _ in range(3))
    routed = [moe.route(logits, 2, "softmax") for logits in layers]
    pooled = moe.load_balancing_loss(torch.cat([r[3] for r in routed]), torch.cat([r[0] for r in routed]), E)
    assert load_balancing_loss_func(layers, E, 2).item() == pytest.approx(2 * pooled.item(), rel=1e-5)
    cfg = make_cfg("llama", num_layers=4, moe_first_dense_layers=1, moe_aux_loss_coeff=0.03)  # 3 MoE layers, k 2
    coef = hf_config_dict(cfg)["router_aux_loss_coef"]
    assert coef == pytest.approx(0.03 * 3 / 2) and hf_aux_loss_coef(coef, cfg, to_hf=False) == pytest.approx(0.03)
    ours = 0.03 * 3 * moe.load_balancing_loss(routed[0][3], routed[0][0], E)  # Σ over 3 layers with layer 0's loads
    assert coef * load_balancing_loss_func((layers[0],) * 3, E, 2).item() == pytest.approx(ours.item(), rel=1e-5)


def test_bias_update_rule_by_hand() -> None:
    """loads (5, 1, 2, 0): mean 2, so sign(mean − load) = (−1, +1, 0, +1); the bias moves by rate each, in fp32."""
    bias = torch.tensor([0.1, 0.0, 0.0, -0.2])
    moe.update_expert_bias(bias, torch.tensor([5.0, 1.0, 2.0, 0.0], dtype=torch.float64), 1e-3)
    want = torch.tensor([0.1, 0.0, 0.0, -0.2]) + torch.tensor([-1.0, 1.0, 0.0, 1.0]) * torch.tensor(1e-3)
    assert bias.dtype == torch.float32 and torch.equal(bias, want)


class _Layer(torch.nn.Module):
    def __init__(self, mlp: torch.nn.Module, layer_number: int) -> None:
        super().__init__()
        self.mlp, self.layer_number = mlp, layer_number


def test_end_step_sums_micro_batches_moves_the_bias_and_logs() -> None:
    """Two training micro-batches (plus an eval and a no-grad forward, not counted): ``end_step`` returns their
    summed loads and losses in the MoE layer's row, moves the bias by the rule and restarts; ``metrics_record`` and
    the meta.json form of the bias (round trip through JSON, exact) follow."""
    from types import SimpleNamespace

    from megatron_sp.mpu import comm
    cfg = make_cfg("llama", moe_first_dense_layers=1, moe_bias_update_rate=0.125, moe_capacity_factor=0.5)
    layer = make_layer(cfg)
    model = torch.nn.ModuleList([_Layer(layer, 1)])
    state = SimpleNamespace(dp_cp_group=comm.LOCAL, pp_group=comm.LOCAL)
    gen = torch.Generator().manual_seed(3)
    loads, aux, z, dropped = torch.zeros(E, dtype=torch.float64), 0.0, 0.0, 0
    for _ in range(2):
        layer(torch.randn(S, B, H, generator=gen, dtype=torch.float64)).sum().backward()
        loads += layer.tokens_per_expert
        aux, z, dropped = aux + layer.aux_loss.item(), z + layer.z_loss.item(), dropped + int(layer.dropped_tokens)
    with torch.no_grad():
        layer(torch.randn(S, B, H, generator=gen, dtype=torch.float64))
    layer.eval()(torch.randn(S, B, H, generator=gen, dtype=torch.float64)).sum().backward()
    stats = moe.end_step(model, cfg, state, stepped=True)
    assert stats.shape == (2, E + 4) and not stats[0].any() and layer.router.step_stats is None
    assert torch.equal(stats[1, :E], loads) and loads.sum() == 2 * S * B * 2 and dropped > 0
    assert stats[1, E:].tolist() == pytest.approx([aux, z, dropped, 2.0], rel=1e-12)
    want = torch.zeros(E, dtype=torch.float64)
    moe.update_expert_bias(want, loads, 0.125)
    assert torch.equal(layer.router.expert_bias.double(), want) and want.any()
    record = moe.metrics_record([stats, stats], cfg)
    assert record["moe_tokens_per_expert"] == [(2 * loads).long().tolist()]
    assert record["moe_aux_loss"] == pytest.approx(aux / 2) and record["moe_z_loss"] == pytest.approx(z / 2)
    assert record["moe_load_imbalance"] == pytest.approx(float(loads.max() / loads.mean()))
    assert record["moe_dropped_tokens"] == dropped
    saved = json.loads(json.dumps(moe.expert_bias_state(model, cfg, state)))
    assert list(saved) == ["1"]
    fresh = make_layer(cfg)
    moe.load_expert_bias(torch.nn.ModuleList([_Layer(fresh, 1)]), saved)
    assert torch.equal(fresh.router.expert_bias, layer.router.expert_bias)
    moe.end_step(model, cfg, state, stepped=False)  # a skipped step leaves the bias
    assert torch.equal(layer.router.expert_bias.double(), want)


def test_moe_configs_load() -> None:
    """configs/moe_demo.yml and configs/olmoe_1b7b.yml load; the OLMoE shape has its 6.9B/1.3B parameters."""
    from pathlib import Path

    from megatron_sp import config
    root = Path(__file__).resolve().parents[2] / "configs"
    demo = config.load([root / "moe_demo.yml"])
    assert demo.model.num_experts == 8 and demo.parallel.dp == 2 and demo.model.moe_bias_update_rate > 0
    olmoe = config.load([root / "olmoe_1b7b.yml"], world_size=32)
    config.set_vocab(olmoe, olmoe.tokenizer.vocab_size)
    assert olmoe.model.padded_vocab_size == 50304 and olmoe.train.grad_accum_steps == 8
    assert count_parameters(olmoe.model, exclude_embeddings=False) == pytest.approx(6.92e9, rel=1e-3)
    assert count_parameters(olmoe.model, active=True, exclude_embeddings=False) == pytest.approx(1.282e9, rel=1e-3)


def test_group_limited_routing_matches_transformers_deepseek_v3() -> None:
    """transformers' ``DeepseekV3TopkRouter`` (8 experts in 4 groups, top-2 groups, top-4, bias, norm_topk_prob,
    routed scaling 2.5) on the same tokens: the same experts and combine weights."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    cfg = transformers.DeepseekV3Config(hidden_size=16, n_routed_experts=8, num_experts_per_tok=4, n_group=4,
                                        topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)
    gen = torch.Generator().manual_seed(12)
    router = DeepseekV3TopkRouter(cfg)
    with torch.no_grad():
        router.weight.copy_(torch.randn(8, 16, generator=gen))
        router.e_score_correction_bias.copy_(torch.randn(8, generator=gen) * 0.2)
    x = torch.randn(40, 16, generator=gen)
    logits, want_w, want_e = router(x)
    experts, weights, _, _, _ = moe.route(logits, 4, "sigmoid", router.e_score_correction_bias, True, 4, 2, 2.5)
    order_want, order_got = want_e.sort(-1), experts.sort(-1)
    assert torch.equal(order_want.values, order_got.values)
    torch.testing.assert_close(weights.gather(-1, order_got.indices), want_w.gather(-1, order_want.indices))


@pytest.mark.parametrize("overrides,key", [(["model.moe_router_groups=3"], "model.moe_router_groups"),
                                           (["model.moe_router_groups=4"], "model.moe_router_groups"),
                                           (["model.moe_router_groups=2", "model.moe_router_group_topk=3"],
                                            "model.moe_router_group_topk"),
                                           (["model.moe_router_groups=2", "model.moe_top_k=3"],
                                            "model.moe_router_group_topk"),
                                           (["model.moe_routed_scaling=0"], "model.moe_routed_scaling")])
def test_group_routing_keys_are_checked(overrides: list[str], key: str) -> None:
    """Groups that do not divide the experts into pairs or more, more groups chosen than exist or too few experts
    in them for the top-k, a scaling <= 0: one line naming the key."""
    from megatron_sp import config
    from megatron_sp.errors import ConfigError
    with pytest.raises(ConfigError, match=key):
        config.load([], ["tokenizer.type=byte", "model.num_experts=4", "model.moe_top_k=2", *overrides])
