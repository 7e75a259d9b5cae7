"""Our router, balancing losses, capacity and aux-loss-free bias step against megatron-core's own functions
(``megatron/core/transformer/moe/moe_utils.py``, 0.16.1 in the test extra) on the same inputs: values and gradients
to fp32 rounding, and the differences docs/moe.md names ("megatron-core and transformers").

Skipped when megatron-core is not installed."""
from __future__ import annotations

import warnings

import pytest
import torch

from megatron_sp.model import moe

T, E = 48, 8


def _megatron_moe_utils():
    """megatron-core's ``moe_utils`` module (its non-fused paths: no transformer-engine here)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron.core warns that Transformer Engine and Apex are absent
        return pytest.importorskip("megatron.core.transformer.moe.moe_utils")


mc = pytest.fixture(scope="module")(lambda: _megatron_moe_utils())


def _logits(seed: int = 0, t: int = T) -> torch.Tensor:
    return (torch.randn(t, E, generator=torch.Generator().manual_seed(seed)) * 2).requires_grad_(True)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("score,top_k,bias", [("softmax", 1, False), ("softmax", 2, False), ("softmax", 3, False),
                                              ("sigmoid", 1, False), ("sigmoid", 2, False), ("sigmoid", 2, True),
                                              ("sigmoid", 1, True)])
def test_router_matches_megatron(mc, score: str, top_k: int, bias: bool) -> None:
    """The chosen experts and combine weights ``[T, E]``, and their gradient. Ours is megatron-core's softmax with
    ``moe_router_pre_softmax`` at k = 1 (the top-1 weight is its score) and without it at k > 1 (the softmax of the
    top-k logits = the renormalised top-k softmax); sigmoid (with the expert bias) as theirs."""
    logits = _logits(1)
    b = torch.randn(E, generator=torch.Generator().manual_seed(2)) * 0.3 if bias else None
    probs, routing_map = mc.topk_routing_with_score_function(logits, top_k, use_pre_softmax=top_k == 1,
                                                             score_function=score, expert_bias=b)
    experts, weights, _, _, _ = moe.route(logits, top_k, score, b)
    ours = torch.zeros(T, E).scatter(1, experts, weights)
    assert torch.equal(ours != 0, routing_map)
    _close(ours, probs)
    dout = torch.randn(T, E, generator=torch.Generator().manual_seed(3))
    (want,) = torch.autograd.grad(probs, logits, dout)
    (got,) = torch.autograd.grad(ours, logits, dout)
    _close(got, want)


def test_megatron_softmax_ignores_the_bias(mc) -> None:
    """megatron-core's softmax path drops ``expert_bias`` (its config refuses the pair); ours routes on p + b."""
    logits, b = _logits(4), torch.zeros(E).index_fill_(0, torch.tensor([5]), 2.0)
    with_bias = mc.topk_routing_with_score_function(logits, 2, score_function="softmax", expert_bias=b)[1]
    assert torch.equal(with_bias, mc.topk_routing_with_score_function(logits, 2, score_function="softmax")[1])
    assert (moe.route(logits, 2, "softmax", b)[0][:, 0] == 5).all()


@pytest.mark.parametrize("score,top_k,bias", [("softmax", 2, False), ("sigmoid", 1, False), ("sigmoid", 2, True)])
def test_aux_and_z_loss_match_megatron(mc, score: str, top_k: int, bias: bool) -> None:
    """``switch_load_balancing_loss_func`` on ``compute_routing_scores_for_aux_loss`` (f from the top-k without the
    bias) and ``z_loss_func``: values and gradients; and this rank's share under SP/CP (counts and T of the whole
    micro-batch, probabilities of its own tokens) sums to the whole as theirs does."""
    logits = _logits(5)
    b = torch.randn(E, generator=torch.Generator().manual_seed(6)) * 0.5 if bias else None
    routing_map, scores = mc.compute_routing_scores_for_aux_loss(logits, top_k, score)
    want = mc.switch_load_balancing_loss_func(scores, routing_map.sum(0), T, top_k, E, moe_aux_loss_coeff=1.0)
    _, _, _, probs, balance = moe.route(logits, top_k, score, b)
    got = moe.load_balancing_loss(probs, balance, E)
    _close(got, want)
    _close(*(torch.autograd.grad(v, logits, retain_graph=True)[0] for v in (got, want)))
    counts = torch.bincount(balance.reshape(-1), minlength=E)
    shares = sum(moe.load_balancing_loss(probs[i::2], balance[i::2], E, counts, T) for i in range(2))
    _close(shares, want)
    _close(moe.router_z_loss(logits), mc.z_loss_func(logits, 1.0))
    _close(*(torch.autograd.grad(v, logits)[0] for v in (moe.router_z_loss(logits), mc.z_loss_func(logits, 1.0))))


def test_aux_loss_example_of_the_issue(mc) -> None:
    """Logits (3, 0, 0, 0) twice, bias (0, 0, 0, 1), sigmoid, top-1: 1.5536 in both (0.8155 counting the bias)."""
    logits = torch.tensor([[3.0, 0.0, 0.0, 0.0]] * 2)
    routing_map, scores = mc.compute_routing_scores_for_aux_loss(logits, 1, "sigmoid")
    want = mc.switch_load_balancing_loss_func(scores, routing_map.sum(0), 2, 1, 4, moe_aux_loss_coeff=1.0)
    _, _, _, probs, balance = moe.route(logits, 1, "sigmoid", torch.tensor([0.0, 0.0, 0.0, 1.0]))
    assert moe.load_balancing_loss(probs, balance, 4).item() == pytest.approx(want.item(), rel=1e-6)
    assert want.item() == pytest.approx(1.5536, abs=1e-4)


def test_capacity_matches_megatron(mc) -> None:
    """``get_capacity(s·k, E, factor)`` (no drop when it exceeds the tokens) = ours where the float product is exact;
    at cf 1.1, s 200, k 6, E 8 both give the documented 165. With one sequence and top-1 (the weight is the score)
    ``apply_router_token_dropping`` keeps the same assignments as ``capacity_keep``."""
    for factor in (0.25, 0.5, 1.0, 1.25, 2.0, 64.0):
        for s, k, n in ((16, 1, 4), (12, 2, 8), (10, 3, 4)):
            assert moe.expert_capacity(factor, s, k, n) == min(s, mc.get_capacity(s * k, n, factor))
    assert moe.expert_capacity(1.1, 200, 6, 8) == mc.get_capacity(200 * 6, 8, 1.1) == 165
    logits = _logits(7, t=32).detach()
    probs, routing_map = mc.topk_routing_with_score_function(logits, 1, use_pre_softmax=True)
    _, final_map = mc.apply_router_token_dropping(probs, routing_map, 1, capacity_factor=1.0)
    experts, _, top_scores, _, _ = moe.route(logits, 1, "softmax")
    keep = moe.capacity_keep(experts.view(32, 1, 1), top_scores.view(32, 1, 1), E, moe.expert_capacity(1.0, 32, 1, E))
    assert 0 < int((~keep).sum()) and torch.equal(torch.zeros(32, E, dtype=torch.bool).scatter(1, experts, keep.view(32, 1)),
                                                  final_map)


def test_bias_update_matches_megatron(mc, monkeypatch) -> None:
    """``get_updated_expert_bias`` (its all-reduce over the data ranks made the identity: one rank) = ours, bit for
    bit, including an expert at exactly the mean load."""
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda tensor, group=None: None)
    monkeypatch.setattr(mc.parallel_state, "get_tensor_and_data_parallel_group", lambda **_: None)
    loads = torch.tensor([5.0, 1.0, 2.0, 0.0, 3.0, 2.0, 1.0, 2.0])  # mean 2
    bias = torch.randn(E, generator=torch.Generator().manual_seed(8)) * 1e-2
    want = mc.get_updated_expert_bias(loads.clone(), bias.clone(), 1e-3)
    got = bias.clone()
    moe.update_expert_bias(got, loads.double(), 1e-3)
    assert torch.equal(got, want) and got[2] == bias[2]


@pytest.mark.parametrize("score,top_k,groups,group_top_k,bias", [("sigmoid", 4, 4, 2, True), ("sigmoid", 2, 2, 1, False),
                                                                 ("softmax", 4, 4, 2, False), ("sigmoid", 6, 4, 3, True)])
def test_group_limited_routing_matches_megatron(mc, score: str, top_k: int, groups: int, group_top_k: int,
                                                bias: bool) -> None:
    """DeepSeek-V3's group-limited top-k with routed scaling 2.5 (``num_groups``, ``group_topk``,
    ``scaling_factor``): the same experts and weights, and their gradient. megatron-core scores a group by its top
    ``k / group_topk`` selection scores, DeepSeek-V3 and transformers (and ours) by its top 2: the cases give both 2.
    Softmax: megatron-core's ``use_pre_softmax`` (groups scored on probabilities, weights not renormalised)."""
    logits = _logits(9)
    b = torch.randn(E, generator=torch.Generator().manual_seed(10)) * 0.3 if bias else None
    probs, routing_map = mc.topk_routing_with_score_function(logits, top_k, use_pre_softmax=score == "softmax",
                                                             num_groups=groups, group_topk=group_top_k,
                                                             scaling_factor=2.5, score_function=score, expert_bias=b)
    renormalize = False if score == "softmax" else None
    experts, weights, _, _, _ = moe.route(logits, top_k, score, b, renormalize, groups, group_top_k, 2.5)
    ours = torch.zeros(T, E).scatter(1, experts, weights)
    assert torch.equal(ours != 0, routing_map)
    assert (routing_map.view(T, groups, -1).any(-1).sum(-1) <= group_top_k).all()
    _close(ours, probs)
    dout = torch.randn(T, E, generator=torch.Generator().manual_seed(11))
    _close(torch.autograd.grad(ours, logits, dout)[0], torch.autograd.grad(probs, logits, dout)[0])
