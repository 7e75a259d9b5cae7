"""Muon on one rank against ``torch.optim.Muon`` (the same Newton–Schulz arithmetic in bf16, Moonlight's update scale
as its ``match_rms_adamw``): two steps of a GQA llama with MoE experts, each logical matrix (q, k and v of the fused
QKV — or each head with ``muon_split_heads`` —, every expert, the dense and shared MLP matrices) its own torch
parameter; the AdamW parameters (embedding, output layer, norms, router) as with ``train.optimizer=adamw``."""
from __future__ import annotations

import functools

import pytest
import torch

from megatron_sp import config
from megatron_sp.model import GPTModel
from megatron_sp.optim import DistributedOptimizer, named_trainable
from megatron_sp.optim import muon as muon_mod

OVR = ["data.paths=[x]", "tokenizer.type=byte", "model.arch=llama", "model.num_layers=2", "model.hidden_size=32",
       "model.num_heads=4", "model.num_kv_heads=2", "model.seq_length=16", "model.num_experts=2",
       "model.moe_shared_experts=1", "model.moe_ffn_hidden_size=48", "model.moe_first_dense_layers=1",
       "train.optimizer=muon", "train.weight_decay=0.1", "train.clip_grad=0"]
LR = 2e-2


def _logical(name: str, t: torch.Tensor, cfg, split_heads: bool) -> list[torch.Tensor]:
    """The logical matrices of a stored weight, in a fixed order (the reference's parameters)."""
    if t.ndim == 3:
        return [m for e in t for m in _logical(name, e, cfg, split_heads)]
    if name.endswith("qkv.weight"):
        g, r, d = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.hidden_size // cfg.num_heads
        x = t.view(g, r + 2, d, -1)
        if split_heads:
            return [x[i, j] for i in range(g) for j in range(r + 2)]
        return [x[:, :r].reshape(g * r * d, -1), x[:, r].reshape(g * d, -1), x[:, r + 1].reshape(g * d, -1)]
    return [t]


def _steps(cfg, model, opt, batches):
    for tokens in batches:
        opt.zero_grad()
        model(tokens[:, :-1], labels=tokens[:, 1:]).mean().backward()
        opt.finish_grad_sync()
        grads = {n: p.main_grad.clone() for n, p in named_trainable(model)}
        opt.step(LR)
        yield grads


@pytest.mark.parametrize("split_heads", [False, True])
def test_muon_matches_torch_muon(monkeypatch, split_heads):
    cfg = config.load(overrides=OVR + [f"train.muon_split_heads={str(split_heads).lower()}"])
    config.set_vocab(cfg, 258)
    monkeypatch.setattr(muon_mod, "newton_schulz", functools.partial(muon_mod.newton_schulz, dtype=torch.bfloat16))
    model = GPTModel(cfg.model, seed=3)
    start = {n: p.detach().clone() for n, p in named_trainable(model)}
    opt = DistributedOptimizer(named_trainable(model), cfg.train, None, model_cfg=cfg.model)
    assert {i.name for i in opt._muon} == {n for n in start if n.startswith("layers.") and start[n].ndim >= 2
                                          and not n.endswith("router.weight")}
    neox = config.load(overrides=OVR[:2] + ["model.num_experts=2", "model.num_layers=1"])
    config.set_vocab(neox, 258)
    assert [n for n, p in GPTModel(neox.model, seed=3).named_parameters() if muon_mod.is_muon_param(n, p)] == [
        "layers.0.attention.qkv.weight", "layers.0.attention.out.weight", "layers.0.mlp.experts.fc1.weight",
        "layers.0.mlp.experts.fc2.weight"]  # not the stacked experts' 2-D biases
    # one momentum buffer for Muon: exp_avg_sq holds AdamW's elements only (Muon's weights are buckets of their own)
    assert opt.exp_avg_sq.numel() == sum(v.numel() for n, v in start.items() if n not in {i.name for i in opt._muon})
    batches = [torch.randint(0, 258, (2, 17), generator=torch.Generator().manual_seed(s)) for s in range(2)]
    grads = list(_steps(cfg, model, opt, batches))

    # the reference: torch.optim.Muon on each logical matrix, torch.optim.AdamW (ours, adamw) on the rest
    ref_model = GPTModel(cfg.model, seed=3)
    adam_cfg = config.load(overrides=OVR + ["train.optimizer=adamw"]).train
    ref_opt = DistributedOptimizer(named_trainable(ref_model), adam_cfg, None)
    muon_names = [i.name for i in opt._muon]
    pieces = {n: [torch.nn.Parameter(m.clone()) for m in _logical(n, start[n], cfg.model, split_heads)]
              for n in muon_names}
    t = cfg.train
    torch_muon = torch.optim.Muon([q for n in muon_names for q in pieces[n]], lr=LR, weight_decay=t.weight_decay,
                                  momentum=t.muon_momentum, nesterov=t.muon_nesterov, ns_steps=t.muon_ns_steps,
                                  adjust_lr_fn="match_rms_adamw")
    for step_grads in grads:
        for n in muon_names:
            for q, g in zip(pieces[n], _logical(n, step_grads[n], cfg.model, split_heads)):
                q.grad = g.clone()
        torch_muon.step()
        ref_opt.zero_grad()
        for n, p in named_trainable(ref_model):
            p.main_grad.copy_(step_grads[n])
        ref_opt.finish_grad_sync()
        ref_opt.step(LR)
    got = dict(named_trainable(model))
    for n, p in named_trainable(ref_model):
        if n in pieces:  # bf16 Newton–Schulz on both sides; the update's scale applied in bf16 here, in fp32 there
            for mine, ref, first in zip(_logical(n, got[n].detach(), cfg.model, split_heads), pieces[n],
                                        _logical(n, start[n], cfg.model, split_heads)):
                delta, want = mine - first, ref.detach() - first
                assert (delta - want).abs().max() <= 1e-2 * want.abs().max(), n
        else:
            assert torch.equal(got[n], p), n


def test_resuming_another_optimizer_is_refused_unless_asked(tmp_path, caplog):
    from megatron_sp.errors import ConfigError
    from megatron_sp.training import check_resume_data

    meta = {"step": 3, "consumed_samples": 12, "config": {"train": {"optimizer": "adamw"}}}
    cfg = config.load(overrides=OVR)
    with pytest.raises(ConfigError, match="train.optimizer=adamw.*checkpoint.allow_optimizer_change=true"):
        check_resume_data(cfg, meta, tmp_path, "sha")
    cfg = config.load(overrides=OVR + ["checkpoint.allow_optimizer_change=true"])
    check_resume_data(cfg, meta, tmp_path, "sha")
    check_resume_data(config.load(overrides=OVR[:-3]), {"step": 3, "consumed_samples": 12}, tmp_path, "sha")  # adamw


def test_owners_balance_newton_schulz_flops():
    from types import SimpleNamespace as NS

    group = object()
    buckets = [NS(group=group, size=2), NS(group=group, size=2)]
    shapes = [(64, 32), (64, 32), (32, 32), (16, 16), (4, 64, 32)]  # the stacked experts: 4 matrices
    infos = [NS(index=k, bucket=k % 2, param=torch.empty(s)) for k, s in enumerate(shapes)]
    owners = muon_mod.muon_owners(infos, buckets, 1, 5)
    load = [sum(muon_mod.ns_flops(shapes[k], 5) for k, r in owners.items() if r == rank) for rank in (0, 1)]
    assert owners[4] == 0 and owners[0] == 1 and owners[1] == 1  # the experts alone outweigh the two largest
    assert max(load) / sum(load) < 0.6 and owners == muon_mod.muon_owners(infos[::-1], buckets, 1, 5)
