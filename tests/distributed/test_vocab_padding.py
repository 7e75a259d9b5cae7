"""Padded vocabulary rows are outside the softmax, so the loss and its gradients do not depend on padding."""
import pytest
import torch
import torch.nn.functional as F

from megatron_sp.mpu import comm, vocab_parallel_cross_entropy
from megatron_sp.testing import run_distributed

VOCAB = 37  # real vocabulary; padded to 40 (tp 1, 2, 4 all divide it) or 48


def _reference(padded: int):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 3, padded, generator=g, dtype=torch.float64) * 3
    target = torch.randint(0, VOCAB, (5, 3), generator=g)
    target[0, 0] = -100
    real = logits[..., :VOCAB].detach().requires_grad_(True)
    loss = F.cross_entropy(real.reshape(-1, VOCAB), target.reshape(-1), reduction="none", label_smoothing=0.1)
    loss.sum().backward()
    grad = torch.cat([real.grad, torch.zeros(5, 3, padded - VOCAB, dtype=torch.float64)], dim=-1)
    return logits, target, loss.view(5, 3).detach(), grad


def _check(rank, world, padded):
    logits, target, ref_loss, ref_grad = _reference(padded)
    part = padded // world
    local = logits[..., rank * part:(rank + 1) * part].clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(local, target, None, label_smoothing=0.1, vocab_size=VOCAB)
    loss.sum().backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(local.grad, ref_grad[..., rank * part:(rank + 1) * part], rtol=1e-12, atol=1e-12)
    return comm.group_size(None)


@pytest.mark.parametrize("world, padded", [(2, 40), (4, 40), (4, 48)])
def test_padded_rows_excluded_across_ranks(world, padded):
    # with padded=48 at world 4 the last rank's slice [36, 48) holds one real row, and 40→48 pads more
    assert run_distributed(_check, world, padded=padded) == [world] * world


def test_padding_excluded_single_process():
    logits, target, ref_loss, ref_grad = _reference(48)
    x = logits.clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(x, target, None, label_smoothing=0.1, vocab_size=VOCAB)
    loss.sum().backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad, ref_grad, rtol=1e-12, atol=1e-12)
