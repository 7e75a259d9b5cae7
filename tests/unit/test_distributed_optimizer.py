"""DistributedOptimizer on one process (state None): AdamW arithmetic, accumulation, bf16 masters, clipping, NaN.

The oracle is torch itself: ``torch.optim.AdamW`` with the ``build_optimizer`` weight-decay split
(matrices only), ``torch.nn.utils.clip_grad_norm_`` and plain autograd gradients.
"""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from megatron_sp.config import TrainConfig
from megatron_sp.optim.distributed import DistributedOptimizer

RTOL = 1e-6  # fp32: max|Δ| / max|ref| per tensor
LRS = [1e-2, 2e-2, 1.5e-2, 5e-3, 1e-2]


def _cfg(**kw: float) -> TrainConfig:
    base = {"weight_decay": 0.1, "adam_beta1": 0.9, "adam_beta2": 0.95, "adam_eps": 1e-8, "clip_grad": 0.0}
    base.update(kw)
    return TrainConfig(**base)  # type: ignore[arg-type]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.LayerNorm(7), nn.Linear(7, 3))


def _batch(step: int, rows: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(rows, 5, generator=g), torch.randn(rows, 3, generator=g)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, count: int) -> torch.Tensor:
    return ((model(x) - y) ** 2).sum() / count


def _torch_adamw(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=1.0, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape
    scale = want.abs().max().item()
    return (got.double() - want.double()).abs().max().item() / (scale if scale > 0 else 1.0)


def _assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], tol: float = RTOL) -> None:
    assert got.keys() == want.keys()
    errs = {k: _rel(got[k], want[k]) for k in want}
    assert max(errs.values()) <= tol, errs


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("bucket_bytes", [64, 25 * 2**20])
def test_adamw_matches_torch(bucket_bytes: int) -> None:
    cfg = _cfg()
    ours, ref = _model(), _model()
    opt = DistributedOptimizer(list(ours.named_parameters()), cfg, None, zero=1, bucket_bytes=bucket_bytes)
    if bucket_bytes == 64:
        assert len(opt._buckets) > 2
    torch_opt = _torch_adamw(ref, cfg)
    for step, lr in enumerate(LRS):
        x, y = _batch(step)
        opt.zero_grad()
        _loss(ours, x, y, 6).backward()
        assert all(p.grad is None for p in ours.parameters())  # moved into main_grad
        norm, stepped = opt.step(lr, clip=0.0)
        assert stepped
        torch_opt.zero_grad()
        _loss(ref, x, y, 6).backward()
        want_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf")).item()
        assert abs(norm - want_norm) <= RTOL * want_norm
        for group in torch_opt.param_groups:
            group["lr"] = lr
        torch_opt.step()
        _assert_close(_params(ours), _params(ref))
    state = opt.state_dict_by_name()
    for name, p in ref.named_parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            assert _rel(state[name][key], torch_opt.state[p][key]) <= RTOL, (name, key)
        assert float(state[name]["step"]) == float(torch_opt.state[p]["step"]) == len(LRS)


def test_microbatch_accumulation_equals_one_shot() -> None:
    model, ref = _model(), _model()
    opt = DistributedOptimizer(list(model.named_parameters()), _cfg(), None, bucket_bytes=64)
    x, y = _batch(0, rows=6)
    opt.zero_grad()
    for i in range(3):
        mb = slice(2 * i, 2 * i + 2)
        opt.sync_grads = i == 2
        _loss(model, x[mb], y[mb], 6).backward()
    opt.finish_grad_sync()
    _loss(ref, x, y, 6).backward()
    _assert_close(opt.main_grads_by_name(), {n: p.grad for n, p in ref.named_parameters()})
    for n, p in model.named_parameters():  # main_grad is a view of the flat buffer
        assert p.main_grad.untyped_storage().data_ptr() == opt.grad_buffer.untyped_storage().data_ptr(), n
        assert p.untyped_storage().data_ptr() == opt.param_buffer.untyped_storage().data_ptr(), n

    # the no_sync() context manager gives the same; a second backward after finish without zero_grad is an error
    opt.zero_grad()
    for i in range(3):
        mb = slice(2 * i, 2 * i + 2)
        ctx = opt.no_sync() if i < 2 else torch.enable_grad()
        with ctx:
            _loss(model, x[mb], y[mb], 6).backward()
    assert opt.sync_grads
    _assert_close(opt.main_grads_by_name(), {n: p.grad for n, p in ref.named_parameters()})
    with pytest.raises(RuntimeError, match="zero_grad"):
        _loss(model, x, y, 6).backward()


def test_bf16_master_keeps_updates_below_bf16_resolution() -> None:
    w0 = torch.tensor([[1.0, 0.5], [-2.0, 0.25]])  # exactly representable in bf16
    w, b = nn.Parameter(w0.clone()), nn.Parameter(torch.tensor([0.123456789, 3.0]))
    b_fp32 = b.detach().clone()
    opt = DistributedOptimizer([("w", w), ("b", b)], _cfg(weight_decay=0.0), None, precision="bf16")
    assert w.dtype == b.dtype == torch.bfloat16
    assert torch.equal(opt.state_dict_by_name()["b"]["master_param"], b_fp32)  # master from the fp32 value
    c = torch.tensor([[1.0, -1.0], [1.0, 1.0]])  # constant grad: each Adam update is lr·sign(g) (to ~1e-8)
    lr = 1e-4
    for k in range(1, 26):
        opt.zero_grad()
        ((w.float() * c).sum() + b.float().sum()).backward()
        assert w.main_grad.dtype == torch.float32
        _, stepped = opt.step(lr, clip=0.0)
        assert stepped
        master = opt.state_dict_by_name()["w"]["master_param"]
        want = w0 - k * lr * torch.sign(c)
        assert (master - want).abs().max().item() <= k * 2**-22, k  # one fp32 ulp at |w| <= 2 per step
        assert torch.equal(w.detach(), master.to(torch.bfloat16))
        if k == 5:  # 5e-4 below the bf16 spacing near 1 (2^-8): the bf16 value has not moved, the master has
            assert w.detach()[0, 0].item() == 1.0 and master[0, 0].item() < 1.0
    assert w.detach()[0, 0].item() == 1.0 - 2**-8  # 25 steps of 1e-4 crossed half a bf16 spacing


def test_clipping_matches_clip_grad_norm() -> None:
    cfg = _cfg()
    ours, ref = _model(), _model()
    opt = DistributedOptimizer(list(ours.named_parameters()), cfg, None, bucket_bytes=64)
    torch_opt = _torch_adamw(ref, cfg)
    x, y = _batch(0)
    opt.zero_grad()
    _loss(ours, x, y, 6).backward()
    opt.finish_grad_sync()
    _loss(ref, x, y, 6).backward()
    full_norm = torch.linalg.vector_norm(torch.cat([p.grad.reshape(-1) for p in ref.parameters()])).item()
    clip = full_norm / 3  # clipping is active
    norm, stepped = opt.step(1e-2, clip=clip)
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip).item()
    assert stepped and abs(norm - want) <= RTOL * want
    _assert_close(opt.main_grads_by_name(), {n: p.grad for n, p in ref.named_parameters()})  # clipped in place
    for group in torch_opt.param_groups:
        group["lr"] = 1e-2
    torch_opt.step()
    _assert_close(_params(ours), _params(ref))


def test_nan_gradient_skips_the_step() -> None:
    model = _model()
    opt = DistributedOptimizer(list(model.named_parameters()), _cfg(), None, zero=1)
    x, y = _batch(0)
    opt.zero_grad()
    _loss(model, x, y, 6).backward()
    assert opt.step(1e-2)[1]
    before = _params(model)
    moments = opt.state_dict_by_name()
    opt.zero_grad()
    x[0, 0] = float("nan")
    _loss(model, x, y, 6).backward()
    norm, stepped = opt.step(1e-2, clip=1.0)
    assert not stepped and norm != norm  # NaN
    _assert_close(_params(model), before, tol=0.0)
    after = opt.state_dict_by_name()
    for name in moments:
        for key, value in moments[name].items():
            assert torch.equal(after[name][key], value), (name, key)
    opt.zero_grad()  # the next step is clean again
    _loss(model, *_batch(1), 6).backward()
    assert opt.step(1e-2)[1] and opt.step_count == 2


def test_no_parameters() -> None:
    opt = DistributedOptimizer([], _cfg(), None, zero=1)
    opt.zero_grad()
    assert opt.step(1e-3) == (0.0, True)
    assert opt.state_dict_by_name() == {} and opt.main_grads_by_name() == {}
    opt.load_state_dict_by_name({})


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_gpt_grads_with_recompute_and_tied_embedding(recompute: str) -> None:
    """The hooks also fire inside activation recomputation's inner backward; tied embeddings reduce once."""
    from megatron_sp.config import ModelConfig
    from megatron_sp.model import GPTModel
    from megatron_sp.optim import named_trainable

    cfg = ModelConfig(arch="llama", num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2, ffn_hidden_size=48,
                      seq_length=16, vocab_size=50, padded_vocab_size=64, norm_eps=1e-5, rotary_pct=1.0,
                      tie_embeddings=True, recompute=recompute)  # type: ignore[arg-type]
    model, ref = GPTModel(cfg, seed=3), GPTModel(cfg, seed=3)
    opt = DistributedOptimizer(named_trainable(model), _cfg(), None, zero=1, bucket_bytes=4096)
    tokens = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(0))
    opt.zero_grad()
    for i in range(2):
        with opt.no_sync() if i == 0 else torch.enable_grad():
            (model(tokens[i:i + 1], labels=tokens[i:i + 1]).sum() / 32).backward()
        (ref(tokens[i:i + 1], labels=tokens[i:i + 1]).sum() / 32).backward()
    _assert_close(opt.main_grads_by_name(), {n: p.grad for n, p in named_trainable(ref)})


def test_grad_norm_is_exact_on_ten_million_elements() -> None:
    """The norm is accumulated in fp64: torch's fp32 ``_foreach_norm`` is off by ~1e-4 here on CPU."""
    sizes = {"w1": (2048, 2048), "w2": (2000, 3001), "b": (777,)}  # ~10M elements, views not aligned to the chunks
    named = [(n, nn.Parameter(torch.zeros(s))) for n, s in sizes.items()]
    opt = DistributedOptimizer(named, _cfg(), None, zero=1)
    g = torch.Generator().manual_seed(0)
    for scale, (_, p) in zip((1e-3, 1.0, 10.0), named):
        p.main_grad.normal_(generator=g).mul_(scale)

    def fp64_norm() -> float:
        return math.sqrt(sum(p.main_grad.double().square().sum().item() for _, p in named))

    want = fp64_norm()
    assert abs(opt.grad_norm().item() - want) <= 1e-7 * want
    clip = want / 3
    norm, stepped = opt.step(0.0, clip=clip)
    assert stepped and abs(norm - want) <= 1e-7 * want
    want_clipped = want * clip / (want + 1e-6)  # the coefficient comes from the fp64 norm
    assert abs(fp64_norm() - want_clipped) <= 1e-7 * want_clipped
