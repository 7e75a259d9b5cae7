"""The vocab-parallel cross entropy on one process: label smoothing and PaLM's z-loss against PyTorch.

The oracle is ``F.cross_entropy(real, t, reduction="none", label_smoothing=ε) + z·logsumexp(real)²``
on the real (unpadded) vocabulary columns, ignored targets at 0, differentiated by autograd; padded
columns must not change the loss and must get zero gradient. The custom backward is also checked
against finite differences (``gradcheck``, fp64). Sharded (TP) parity lives in
``tests/dist/test_tp_layers.py``.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from megatron_sp.config.schema import ModelConfig
from megatron_sp.model import GPTModel
from megatron_sp.mpu import vocab_parallel_cross_entropy
from megatron_sp.pipeline.partition import build_stage

F64 = torch.float64
VOCAB, PADDED = 37, 48
S, B = 5, 3


def _inputs(padded: int = PADDED, scale: float = 3.0, offset: float = 0.0,
            seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(S, B, padded, generator=g, dtype=F64) * scale + offset
    target = torch.randint(0, VOCAB, (S, B), generator=g)
    target[0, 0], target[2, 1], target[4, 2] = -100, -1, VOCAB - 1  # ignored (any negative id), the last real row
    return logits, target


def reference(logits: torch.Tensor, target: torch.Tensor, eps: float, z: float, vocab: int = VOCAB) -> torch.Tensor:
    """Per-token loss from the real columns with PyTorch ops only (autograd gives the oracle gradient)."""
    real = logits[..., :vocab]
    ignored = target < 0
    ce = F.cross_entropy(real.flatten(0, -2), target.masked_fill(ignored, -100).flatten(), reduction="none",
                         label_smoothing=eps).view(target.shape)
    return (ce + z * torch.logsumexp(real, dim=-1).square()).masked_fill(ignored, 0.0)


CASES = [(0.0, 0.0), (0.1, 0.0), (0.0, 1e-2), (0.1, 1e-2), (0.3, 1e-4)]


@pytest.mark.parametrize("eps, z", CASES)
@pytest.mark.parametrize("padded", [VOCAB, PADDED])
def test_matches_pytorch_formula_fp64(eps: float, z: float, padded: int) -> None:
    logits, target = _inputs(padded)
    grad_out = torch.randn(S, B, generator=torch.Generator().manual_seed(1), dtype=F64)
    ref_in = logits.clone().requires_grad_(True)
    ref = reference(ref_in, target, eps, z)
    ref.backward(grad_out)
    x = logits.clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(x, target, None, label_smoothing=eps, vocab_size=VOCAB, z_loss=z)
    loss.backward(grad_out)
    torch.testing.assert_close(loss, ref.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(x.grad, ref_in.grad, rtol=0, atol=1e-12)
    assert torch.count_nonzero(x.grad[..., VOCAB:]) == 0  # padded columns: no gradient
    assert torch.count_nonzero(x.grad[target < 0]) == 0 and torch.count_nonzero(loss[target < 0]) == 0


def test_z_loss_is_the_squared_logsumexp_term() -> None:
    """The z-loss adds exactly z·log²Z (log Z over the real columns only) to the smoothed CE."""
    logits, target = _inputs(offset=4.0)  # log Z far from 0, so the term is large
    base = vocab_parallel_cross_entropy(logits, target, None, label_smoothing=0.1, vocab_size=VOCAB)
    with_z = vocab_parallel_cross_entropy(logits, target, None, label_smoothing=0.1, vocab_size=VOCAB, z_loss=1e-3)
    log_z = torch.logsumexp(logits[..., :VOCAB], dim=-1)
    torch.testing.assert_close(with_z - base, (1e-3 * log_z.square()).masked_fill(target < 0, 0.0), rtol=0, atol=1e-12)
    assert (with_z - base)[target >= 0].min() > 1e-2
    # padding columns with huge logits would dominate log Z if they were counted
    poisoned = logits.clone()
    poisoned[..., VOCAB:] = 1e4
    torch.testing.assert_close(vocab_parallel_cross_entropy(poisoned, target, None, label_smoothing=0.1,
                                                            vocab_size=VOCAB, z_loss=1e-3), with_z, rtol=0, atol=0)


@pytest.mark.parametrize("eps, z", [(0.1, 0.05), (0.0, 0.2)])
def test_gradcheck_fp64(eps: float, z: float) -> None:
    g = torch.Generator().manual_seed(2)
    vocab = 5
    logits = torch.randn(2, 3, 7, generator=g, dtype=F64).requires_grad_(True)  # 2 padded columns
    target = torch.tensor([[0, 4, -100], [2, 1, 3]])
    assert torch.autograd.gradcheck(
        lambda x: vocab_parallel_cross_entropy(x, target, None, label_smoothing=eps, vocab_size=vocab, z_loss=z),
        (logits,), eps=1e-6, atol=1e-8)


def test_fp32_and_bf16_logits() -> None:
    """Large fp32 logits (log Z ≈ 500) stay accurate: the z-loss uses the max-shifted sum plus the max."""
    logits, target = _inputs(scale=4.0, offset=500.0)
    grad_out = torch.randn(S, B, generator=torch.Generator().manual_seed(3), dtype=F64)
    for dtype, tol_loss, tol_grad in ((torch.float32, 1e-6, 1e-6), (torch.bfloat16, 1e-6, 2.0 ** -8)):
        rounded = logits.to(dtype)
        ref_in = rounded.double().requires_grad_(True)
        ref = reference(ref_in, target, 0.1, 1e-4)
        ref.backward(grad_out)
        x = rounded.clone().requires_grad_(True)
        loss = vocab_parallel_cross_entropy(x, target, None, label_smoothing=0.1, vocab_size=VOCAB, z_loss=1e-4)
        loss.backward(grad_out.to(loss.dtype))
        assert loss.dtype == torch.float32 and x.grad.dtype == dtype
        loss_err = ((loss.double() - ref) / ref.abs().clamp_min(1.0)).abs().max().item()
        grad_err = (x.grad.double() - ref_in.grad).abs().max().item() / ref_in.grad.abs().max().item()
        assert loss_err <= tol_loss, (dtype, loss_err)
        assert grad_err <= tol_grad, (dtype, grad_err)


def test_bad_arguments() -> None:
    logits, target = _inputs()
    for bad in (-1e-4, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="z_loss"):
            vocab_parallel_cross_entropy(logits, target, None, z_loss=bad)
    with pytest.raises(ValueError, match="label_smoothing"):
        vocab_parallel_cross_entropy(logits, target, None, label_smoothing=float("nan"))


def test_gpt_model_loss_options() -> None:
    """GPTModel(label_smoothing=ε, z_loss=z) returns the reference formula on its own logits; defaults are plain CE."""
    cfg = ModelConfig(arch="neox", num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=2, ffn_hidden_size=64,
                      rotary_pct=0.25, seq_length=8, vocab_size=VOCAB, padded_vocab_size=PADDED, norm_eps=1e-5)
    tokens = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(4))
    labels = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(5))
    labels[0, :2] = -100
    plain = GPTModel(cfg, seed=3).double()
    model = GPTModel(cfg, seed=3, label_smoothing=0.1, z_loss=1e-2).double()
    assert (plain.label_smoothing, plain.z_loss) == (0.0, 0.0)
    logits = model(tokens)  # [b, s, padded]
    torch.testing.assert_close(model(tokens, labels=labels), reference(logits, labels, 0.1, 1e-2), rtol=0, atol=1e-12)
    torch.testing.assert_close(plain(tokens, labels=labels), reference(logits, labels, 0.0, 0.0), rtol=0, atol=1e-12)


def test_build_stage_hands_the_options_to_the_last_stage() -> None:
    """training.setup passes train.label_smoothing / train.z_loss through build_stage."""
    cfg = ModelConfig(arch="neox", num_layers=2, hidden_size=32, num_heads=2, num_kv_heads=2, ffn_hidden_size=64,
                      rotary_pct=0.25, seq_length=8, vocab_size=VOCAB, padded_vocab_size=PADDED, norm_eps=1e-5)
    state = SimpleNamespace(pp_size=1, pp_rank=0, is_first_stage=True, is_last_stage=True)
    stage = build_stage(cfg, 3, state, label_smoothing=0.2, z_loss=1e-3)
    assert (stage.label_smoothing, stage.z_loss) == (0.2, 1e-3)
    default = build_stage(cfg, 3, state)
    assert (default.label_smoothing, default.z_loss) == (0.0, 0.0)
