"""Full (unsharded) tensors ↔ this rank's shards, from the parameter attributes alone.

A ``tensor_model_parallel`` parameter is split into ``t`` chunks along ``partition_dim`` over TP; one
with ``vocab_rows`` is stored without its (layout-dependent, never used) padding rows, zero-filled when
sliced back in. An ``expert_parallel`` parameter (MoE experts ``[E/ep, ...]``) is rank ``ep_rank``'s slice of dim 0
of ``ep_size`` slices. Checkpoints and the parity witness use these functions, so they are layout-free.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from . import comm
from .layers import shard
from .parallel_state import ParallelState


def is_sharded(param: nn.Parameter) -> bool:
    return bool(getattr(param, "tensor_model_parallel", False)) and getattr(param, "partition_dim", -1) >= 0


def gather_full(named: Iterable[tuple[str, nn.Parameter]], state: ParallelState | None,
                tensor_of: Callable[[nn.Parameter], torch.Tensor | None] = lambda p: p.data) -> dict[str, torch.Tensor]:
    """{name: full tensor on CPU} for the whole model: TP shards concatenated, expert slices concatenated over ep, PP
    stages merged. Collective over the TP, ep and PP groups. ``tensor_of(param)`` picks what to gather (value, grad, moment; None skips
    it); a tensor not shaped like the parameter's shard (Adam's scalar ``step``) is taken as it is."""
    out: dict[str, torch.Tensor] = {}
    for name, p in named:
        if is_tied_copy(name, p):
            continue  # the last stage's copy of the tied embedding: stored once, as embedding.weight
        local = tensor_of(p)
        if local is None:
            continue
        local = local.detach()
        if local.shape != p.shape:  # not shaped like the parameter: the same on every TP rank
            out[name] = local.cpu()
            continue
        if state is not None and state.tp_size > 1 and is_sharded(p):
            local = comm.all_gather(local.contiguous(), state.tp_group, dim=p.partition_dim)
        if ep_size(p) > 1 and state is not None:
            local = comm.all_gather(local.contiguous(), state.ep_group, dim=0)
        rows = getattr(p, "vocab_rows", None)
        out[name] = (local[:rows] if rows is not None else local).cpu()
    if state is not None and state.pp_size > 1:
        stages: list[dict[str, torch.Tensor] | None] = comm.all_gather_object(out, state.pp_group)
        out = {k: v for stage in stages for k, v in (stage or {}).items()}
    return out


EMBEDDING = "embedding.weight"


def is_tied_copy(name: str, param: nn.Parameter) -> bool:
    """True for a pipeline's last-stage copy of a tied input/output embedding (kept in sync with
    ``embedding.weight`` through the embedding group, so it is never stored separately)."""
    return name != EMBEDDING and bool(getattr(param, "shared_embedding", False))


def stored_name(name: str, param: nn.Parameter) -> str:
    """The name under which a parameter's full tensor is stored (a tied copy reads the embedding's)."""
    return EMBEDDING if is_tied_copy(name, param) else name


def ep_size(param: nn.Parameter) -> int:
    """The number of expert-parallel slices of ``param`` along dim 0 (1: not expert-parallel)."""
    return getattr(param, "ep_size", 1) if getattr(param, "expert_parallel", False) else 1


def full_shape(param: nn.Parameter, tp_size: int) -> tuple[int, ...]:
    """The unsharded shape of a (possibly TP-sharded or expert-parallel) parameter."""
    shape = list(param.shape)
    if is_sharded(param):
        shape[param.partition_dim] *= tp_size
    shape[0] *= ep_size(param)
    return tuple(shape)


def stored_shape(param: nn.Parameter, tp_size: int) -> tuple[int, ...]:
    """The shape a parameter has in checkpoints and gathered gradients: full, without vocab padding."""
    shape = list(full_shape(param, tp_size))
    rows = getattr(param, "vocab_rows", None)
    if rows is not None:
        shape[0] = rows
    return tuple(shape)


def local_shard_of(full: torch.Tensor, param: nn.Parameter, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This rank's part of ``full`` (of ``stored_shape``) for ``param``, a copy; zero-filled padding rows.
    A tensor not of the parameter's stored shape (a scalar like Adam's step) is copied whole."""
    if tuple(full.shape) != stored_shape(param, tp_size):
        return full.detach().clone()
    target = full_shape(param, tp_size)
    if tuple(full.shape) != target:  # re-add the vocab padding this layout needs (not torch.cat: on the meta device,
        padded = full.new_zeros(target)  # as the planner builds the model, it imports torch._dynamo: 1.1 s a process)
        padded[:full.shape[0]].copy_(full)
        full = padded
    if ep_size(param) > 1:
        full = shard(full, 0, param.ep_rank, param.ep_size)
    if not is_sharded(param):
        return full.detach().clone()
    return shard(full, param.partition_dim, tp_rank, tp_size)

