"""The vocab-parallel cross entropy on one process: label smoothing and PaLM's z-loss against PyTorch.

The oracle is ``F.cross_entropy(real, t, reduction="none", label_smoothing=ε) + z·logsumexp(real)²``
on the real (unpadded) vocabulary columns, ignored targets at 0, differentiated by autograd; padded
columns must not change the loss and must get zero gradient. The custom backward is also checked
against finite differences (``gradcheck``, fp64). The chunked implementation: every chunking (one token,
a chunk size not dividing the tokens, one chunk) gives the reference; backward saves the logits plus
O(tokens) bytes, and under bf16 no fp32 tensor exceeds one chunk. Sharded (TP) parity lives in
``tests/distributed/test_tp_layers.py`` and ``tests/distributed/test_cross_entropy_tp.py``.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_sp.config.schema import ModelConfig
from megatron_sp.model import GPTModel
from megatron_sp.mpu import layers as ce
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


def _check_fp64(logits: torch.Tensor, target: torch.Tensor, eps: float, z: float, grad_seed: int) -> None:
    """Loss and logits grad equal the reference's to 1e-12; padded columns and ignored tokens get no gradient."""
    grad_out = torch.randn(S, B, generator=torch.Generator().manual_seed(grad_seed), dtype=F64)
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


CASES = [(0.0, 0.0), (0.1, 0.0), (0.0, 1e-2), (0.1, 1e-2), (0.3, 1e-4)]


@pytest.mark.parametrize("eps, z", CASES)
@pytest.mark.parametrize("padded", [VOCAB, PADDED])
def test_matches_pytorch_formula_fp64(eps: float, z: float, padded: int) -> None:
    logits, target = _inputs(padded)
    _check_fp64(logits, target, eps, z, grad_seed=1)


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


def test_compiled_sums_and_gradient() -> None:
    """``compiled=True`` (``train.compile``): the per-token sums and the gradient as two ``torch.compile`` kernels
    over the real columns give the reference loss and gradient in fp64 (smoothing, z-loss, padding, ignored tokens);
    bf16 logits get a bf16 gradient equal to the eager chunks' up to bf16 rounding."""
    logits, target = _inputs()
    grad_out = torch.randn(S, B, generator=torch.Generator().manual_seed(4), dtype=F64)
    ref_in = logits.clone().requires_grad_(True)
    ref = reference(ref_in, target, 0.1, 1e-2)
    ref.backward(grad_out)
    x = logits.clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(x, target, None, label_smoothing=0.1, vocab_size=VOCAB, z_loss=1e-2,
                                        compiled=True)
    loss.backward(grad_out)
    torch.testing.assert_close(loss, ref.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(x.grad, ref_in.grad, rtol=0, atol=1e-12)
    assert torch.count_nonzero(x.grad[..., VOCAB:]) == 0 and torch.count_nonzero(x.grad[target < 0]) == 0
    # mostly padding: the gradient of the real columns only, then padded (above: the whole width, padding masked)
    x = torch.cat([logits, logits], dim=-1).requires_grad_(True)  # 37 real of 96 columns
    loss = vocab_parallel_cross_entropy(x, target, None, label_smoothing=0.1, vocab_size=VOCAB, z_loss=1e-2,
                                        compiled=True)
    loss.backward(grad_out)
    torch.testing.assert_close(loss, ref.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(x.grad[..., :VOCAB], ref_in.grad[..., :VOCAB], rtol=0, atol=1e-12)
    assert torch.count_nonzero(x.grad[..., VOCAB:]) == 0

    grads = {}
    for compiled in (False, True):
        x = logits.to(torch.bfloat16).requires_grad_(True)
        loss = vocab_parallel_cross_entropy(x, target, None, label_smoothing=0.1, vocab_size=VOCAB, z_loss=1e-2,
                                            compiled=compiled)
        loss.backward(grad_out.float())
        assert loss.dtype == torch.float32 and x.grad.dtype == torch.bfloat16
        grads[compiled] = (loss.detach(), x.grad)
    torch.testing.assert_close(grads[True][0], grads[False][0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grads[True][1].float(), grads[False][1].float(), rtol=2.0 ** -7, atol=1e-6)


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


# ---------------------------------------------------------------------------------------------
# the chunked implementation: chunk boundaries, saved bytes, the one-chunk fp32 temporary


def _rows_per_chunk(monkeypatch: pytest.MonkeyPatch, rows: int, v_local: int) -> None:
    monkeypatch.setattr(ce, "CHUNK_ELEMENTS", rows * v_local)  # what ce.chunk_size does, undone by pytest


@pytest.mark.parametrize("rows", [1, 4, 5, S * B, S * B + 1])  # 4 does not divide the 15 tokens; 5 does
@pytest.mark.parametrize("eps, z", [(0.0, 0.0), (0.1, 1e-2)])
def test_chunk_boundaries_fp64(monkeypatch: pytest.MonkeyPatch, rows: int, eps: float, z: float) -> None:
    """Every chunking gives the reference loss and grad (padded vocabulary, ignored targets)."""
    _rows_per_chunk(monkeypatch, rows, PADDED)
    logits, target = _inputs(PADDED, seed=7)
    _check_fp64(logits, target, eps, z, grad_seed=8)


@pytest.mark.parametrize("shape", [(), (1,), (1, 1)])
def test_single_token(monkeypatch: pytest.MonkeyPatch, shape: tuple[int, ...]) -> None:
    _rows_per_chunk(monkeypatch, 1, PADDED)
    logits = torch.randn(*shape, PADDED, generator=torch.Generator().manual_seed(9), dtype=F64)
    target = torch.full(shape, 5)
    ref_in = logits.clone().requires_grad_(True)
    ref = reference(ref_in.reshape(1, 1, PADDED), target.reshape(1, 1), 0.1, 1e-3).reshape(shape)
    ref.sum().backward()
    x = logits.clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(x, target, None, label_smoothing=0.1, vocab_size=VOCAB, z_loss=1e-3)
    loss.sum().backward()
    assert loss.shape == shape
    torch.testing.assert_close(loss, ref.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(x.grad, ref_in.grad, rtol=0, atol=1e-12)


def test_non_contiguous_inputs_and_retain_graph() -> None:
    """Transposed logits/targets (the model passes ``labels.t()``) work; backward leaves the logits intact,
    so a second backward through a retained graph gives the same gradient."""
    logits, target = _inputs(PADDED, seed=10)
    x = logits.transpose(0, 1).contiguous().requires_grad_(True)  # [b, s, V]
    before = x.detach().clone()
    loss = vocab_parallel_cross_entropy(x.transpose(0, 1), target, None, label_smoothing=0.1, vocab_size=VOCAB,
                                        z_loss=1e-3)
    ref = reference(logits, target, 0.1, 1e-3)
    torch.testing.assert_close(loss, ref, rtol=0, atol=1e-12)
    loss.sum().backward(retain_graph=True)
    first = x.grad.clone()
    assert torch.equal(x.detach(), before)
    loss.sum().backward()
    torch.testing.assert_close(x.grad, 2 * first, rtol=0, atol=1e-12)


def _saved(fn: Any) -> list[torch.Tensor]:
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return saved


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("eps, z", [(0.0, 0.0), (0.1, 1e-3)])
def test_saved_bytes_are_the_logits_plus_per_token_vectors(dtype: torch.dtype, eps: float, z: float) -> None:
    """Backward keeps the logits themselves (no copy) and O(tokens) bytes; no fp32 [tokens, V/t] tensor."""
    s, b, v = 16, 4, 512
    x = torch.randn(s, b, v, generator=torch.Generator().manual_seed(11)).to(dtype).requires_grad_(True)
    target = torch.randint(0, v, (s, b), generator=torch.Generator().manual_seed(12))
    target[0] = -100
    saved = _saved(lambda: vocab_parallel_cross_entropy(x, target, None, label_smoothing=eps, vocab_size=v - 3,
                                                         z_loss=z))
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
    assert x.untyped_storage().data_ptr() in storages  # the logits, saved as they are
    others = sum(n for ptr, n in storages.items() if ptr != x.untyped_storage().data_ptr())
    assert others <= 32 * s * b, others  # per token: max, Σexp, log Z (fp32), target index (int64), 2 flags
    large = [t for t in saved if t.numel() >= s * b]
    assert all(t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for t in large if t.dim() > 1)
    if dtype == torch.bfloat16:
        assert not any(t.dtype == torch.float32 and t.numel() > s * b for t in saved)


class _LargestFloat(TorchDispatchMode):
    """The most elements of any ``dtype`` tensor an op returns while active."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype, self.largest = dtype, 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == self.dtype:
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("rows", [3, 16])
def test_one_fp32_chunk_at_a_time_under_bf16(monkeypatch: pytest.MonkeyPatch, rows: int) -> None:
    """With bf16 logits no op, forward or backward, makes an fp32 tensor larger than one chunk."""
    s, b, v = 16, 4, 256
    _rows_per_chunk(monkeypatch, rows, v)
    x = torch.randn(s, b, v, generator=torch.Generator().manual_seed(13)).bfloat16().requires_grad_(True)
    target = torch.randint(0, v, (s, b), generator=torch.Generator().manual_seed(14))
    mode = _LargestFloat(torch.float32)
    with mode:
        vocab_parallel_cross_entropy(x, target, None, label_smoothing=0.1, z_loss=1e-3).sum().backward()
    assert 0 < mode.largest <= rows * v, (mode.largest, rows * v)
    assert x.grad.dtype == torch.bfloat16


def test_chunk_size_context_restores_and_validates() -> None:
    default = ce.CHUNK_ELEMENTS
    with ce.chunk_size(7):
        assert ce.CHUNK_ELEMENTS == 7
    assert ce.CHUNK_ELEMENTS == default
    with pytest.raises(ValueError, match="chunk size"), ce.chunk_size(0):
        pass
