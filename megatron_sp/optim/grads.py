"""Gradient finalisation across tensor parallelism, and the global gradient norm.

``sync_tp_replicated_grads``: parameters replicated across the TP group whose gradient on each
rank is only a partial sum — every norm and row-parallel bias inside the sequence-parallel region
(each rank saw s/t of the tokens), and key/value projections replicated for grouped-query
attention when tp > num_kv_heads — carry ``sequence_parallel = True``. After backward, one
all-reduce over TP of all their gradients, flattened into one buffer, sums them. The tag is read
from the parameter, never inferred from a module's class name.

``global_grad_norm``: the L2 norm of the whole model's gradient, counting every parameter once:
TP-sharded parameters contribute their shard on every TP rank, TP-replicated ones only on TP
rank 0; the sum of squares is then all-reduced over the model-parallel (tp·pp) group. Data- and
context-parallel replicas hold identical reduced gradients and are not summed.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..mpu import ParallelState, comm


def sync_tp_replicated_grads(params: Sequence[nn.Parameter], tp_group: Any) -> int:
    """Sum the grads of ``sequence_parallel``-tagged params over TP in one all-reduce; returns how many."""
    grads = [p.grad for p in params if getattr(p, "sequence_parallel", False) and p.grad is not None]
    if not grads or comm.group_size(tp_group) == 1:
        return len(grads)
    flat = torch.cat([g.reshape(-1) for g in grads])
    comm.all_reduce(flat, tp_group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
    return len(grads)


def global_grad_norm(params: Sequence[nn.Parameter], state: ParallelState | None) -> torch.Tensor:
    """The L2 norm (fp32) of the full model's gradient, each parameter counted once."""
    tp_rank = state.tp_rank if state is not None else 0
    squares = [torch.linalg.vector_norm(p.grad, dtype=torch.float32) ** 2 for p in params
               if p.grad is not None and (getattr(p, "tensor_model_parallel", False) or tp_rank == 0)]
    dev = params[0].device if params else torch.device("cpu")
    total = torch.stack(squares).sum() if squares else torch.zeros((), device=dev)
    if state is not None and state.tp_size * state.pp_size > 1:
        comm.all_reduce(total, state.mp_group)
    return total.sqrt()


def clip_grads(params: Sequence[nn.Parameter], max_norm: float, state: ParallelState | None) -> torch.Tensor:
    """The global grad norm before clipping; scales every grad by max_norm/norm when that is below 1."""
    norm = global_grad_norm(params, state)
    if max_norm > 0:
        coeff = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        grads = [p.grad for p in params if p.grad is not None]
        torch._foreach_mul_(grads, coeff)
    return norm
