"""The chunked vocab-parallel cross entropy on gloo ranks against ``F.cross_entropy`` on the gathered logits.

Every rank builds the same full fp64 logits ``[s, b, V_padded]`` from a fixed seed and takes its
vocabulary slice; the oracle is ``F.cross_entropy(real, label_smoothing=ε) + z·logsumexp(real)²`` on
the real columns, ignored targets at 0, differentiated by autograd. Chunk sizes cross token
boundaries (1 row, a size not dividing the tokens, everything in one chunk); at world 4 with
``V_padded = 64`` the last rank holds only padding. Also checked: two all-reduces per forward (MAX,
then SUM), none in backward; fp32 and bf16 logits; the bytes saved for backward.
"""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from megatron_sp.mpu import comm
from megatron_sp.mpu import layers as ce
from megatron_sp.testing import run_distributed

F64 = torch.float64
S, B, VOCAB = 7, 3, 37  # 21 tokens: chunks of 4 rows do not divide them
CASES = [(0.0, 0.0), (0.1, 0.0), (0.0, 1e-2), (0.2, 1e-3)]


def _inputs(padded: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(21)
    logits = torch.randn(S, B, padded, generator=g, dtype=F64) * 3 + 1
    target = torch.randint(0, VOCAB, (S, B), generator=g)
    target[0, 0], target[3, 2], target[6, 1] = -100, -1, VOCAB - 1
    grad_out = torch.randn(S, B, generator=g, dtype=F64)
    return logits, target, grad_out


def _reference(logits: torch.Tensor, target: torch.Tensor, grad_out: torch.Tensor, eps: float,
               z: float) -> tuple[torch.Tensor, torch.Tensor]:
    x = logits.detach().double().requires_grad_(True)
    real = x[..., :VOCAB]
    ignored = target < 0
    loss = F.cross_entropy(real.flatten(0, 1), target.masked_fill(ignored, -100).flatten(), reduction="none",
                           label_smoothing=eps).view(S, B)
    loss = (loss + z * torch.logsumexp(real, -1).square()).masked_fill(ignored, 0.0)
    loss.backward(grad_out)
    return loss.detach(), x.grad


def _run(local: torch.Tensor, target: torch.Tensor, grad_out: torch.Tensor, eps: float,
         z: float) -> tuple[torch.Tensor, torch.Tensor, dict, dict]:
    x = local.clone().requires_grad_(True)
    with comm.count() as fwd:
        loss = ce.vocab_parallel_cross_entropy(x, target, None, label_smoothing=eps, vocab_size=VOCAB, z_loss=z)
    with comm.count() as bwd:
        loss.backward(grad_out.to(loss.dtype))
    return loss.detach(), x.grad, fwd.calls, bwd.calls


def _saved_storages(fn: Callable[[], object]) -> dict[int, int]:
    """``{storage pointer: bytes}`` of every tensor autograd saves while ``fn`` runs."""
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return saved


def _worker(rank: int, world: int, padded: int) -> dict[str, tuple[float, float]]:
    logits, target, grad_out = _inputs(padded)
    part = padded // world
    cols = slice(rank * part, (rank + 1) * part)
    out: dict[str, tuple[float, float]] = {}
    for rows in (1, 4, S * B):
        for eps, z in CASES:
            ref_loss, ref_grad = _reference(logits, target, grad_out, eps, z)
            with ce.chunk_size(rows * part):
                loss, grad, fwd, bwd = _run(logits[..., cols], target, grad_out, eps, z)
            name = f"fp64 rows {rows} eps {eps} z {z}"
            out[f"{name} loss"] = ((loss - ref_loss).abs().max().item(), 1e-12)
            out[f"{name} grad"] = ((grad - ref_grad[..., cols]).abs().max().item(), 1e-12)
            out[f"{name} ignored grad is 0"] = (grad[target < 0].abs().max().item(), 0.0)
            out[f"{name} forward collectives"] = (0.0 if fwd == {"all_reduce": 2} else 1.0, 0.0)
            out[f"{name} backward collectives"] = (0.0 if bwd == {} else 1.0, 0.0)
    for dtype, tol_loss, tol_grad in ((torch.float32, 1e-6, 1e-6), (torch.bfloat16, 1e-6, 2.0 ** -8)):
        rounded = logits.to(dtype)
        ref_loss, ref_grad = _reference(rounded, target, grad_out, 0.1, 1e-3)
        with ce.chunk_size(4 * part):
            loss, grad, _, _ = _run(rounded[..., cols], target, grad_out, 0.1, 1e-3)
        out[f"{dtype} loss dtype"] = (0.0 if loss.dtype == torch.float32 and grad.dtype == dtype else 1.0, 0.0)
        out[f"{dtype} loss"] = (((loss.double() - ref_loss) / ref_loss.abs().clamp_min(1.0)).abs().max().item(), tol_loss)
        out[f"{dtype} grad"] = ((grad.double() - ref_grad[..., cols]).abs().max().item()
                                / ref_grad.abs().max().item(), tol_grad)
        # saved for backward: this rank's logits (no copy) + O(tokens) bytes
        x = rounded[..., cols].clone().requires_grad_(True)
        saved = _saved_storages(lambda x=x: ce.vocab_parallel_cross_entropy(x, target, None, label_smoothing=0.1,
                                                                            vocab_size=VOCAB, z_loss=1e-3))
        logits_ptr = x.untyped_storage().data_ptr()
        other = sum(n for p, n in saved.items() if p != logits_ptr)
        out[f"{dtype} saved logits"] = (0.0 if logits_ptr in saved else 1.0, 0.0)
        out[f"{dtype} saved per-token bytes"] = (float(other), 32.0 * S * B)
    return out


@pytest.mark.parametrize("world, padded", [(2, 48), (4, 48), (4, 64)], ids=["w2", "w4", "w4-padded-rank"])
def test_chunked_vocab_parallel_cross_entropy(world: int, padded: int) -> None:
    for rank, errs in enumerate(run_distributed(_worker, world, padded=padded)):
        for key, (err, tol) in errs.items():
            assert err <= tol, f"world {world} rank {rank} {key}: {err:.3e} > {tol:.1e}"
