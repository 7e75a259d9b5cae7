"""Pipeline schedules over the pp group: no pipelining (grad accumulation) and 1F1B.

Entry point: ``forward_backward(stage, micro_batches, state, loss_fn, schedule, sync_grads_setter)``.

Why our own point-to-point and not ``torch.distributed.pipelining``
------------------------------------------------------------------
Measured with torch 2.13 CPU/gloo (``PipelineStage`` + ``Schedule1F1B(scale_grads=False)``, a
4-layer neox at pp 2 and 4, 4 micro-batches): the gradients matched the unsharded model
(max|Δ|/max|ref| 6e-7), but only after bending our model to its interface, and three gaps remain:

1. A stage's forward receives only the previous stage's outputs; the per-micro-batch ``labels``,
   ``loss_mask`` and ``position_ids`` cannot reach the last stage's ``GPTModel.forward``. The last
   stage had to return logits and compute the cross entropy in ``loss_fn`` — outside the model,
   i.e. gathering ``[b, s, V]`` logits under TP instead of our vocab-parallel cross entropy.
2. No hook runs before the last micro-batch's backward (it only knows DDP/FSDP ``no_sync``), so our
   ``DistributedOptimizer`` cannot start its overlapped gradient reduction there.
3. The schedule's live activations are not observable for the 1F1B memory test.

So this module is a plain 1F1B over ``dist.batch_isend_irecv`` (Megatron's schedule), ~150 lines.

Communication and ordering (deadlock freedom)
---------------------------------------------
Activations have one fixed shape per run, ``[s, b, h]`` (``[s/t, b, h]`` under sequence
parallelism), and one dtype (the activation dtype, fp32 or bf16, checked on send), so receivers
pre-allocate and no shape is ever exchanged (the variable-shape deadlocks of Megatron #5100/#5240
cannot occur). Stage r talks only to r−1 and r+1. Every exchange posts all its sends and receives
at once (``batch_isend_irecv``) and then waits, and the two sides of each link issue matching
exchanges in the same order:

=================  ===================================  =====================================
phase (stage r)    with r−1                             with r+1
=================  ===================================  =====================================
warm-up (k times)  recv act                             send act
steady (each)      send grad ↔ recv next act            send act ↔ recv grad
cool-down          send grad                            recv grad
=================  ===================================  =====================================

with k = min(pp − r − 1, m) warm-up forwards. Messages in one direction of one link are sent and
received in the same (micro-batch) order, and gloo matches them first-in first-out.

Errors
------
A rank that raises stops talking; its neighbours block in a receive until the process group's
timeout (``parallel.timeout_s``, passed to ``mpu.initialize``) and then raise too, so an error
surfaces on every rank after at most that timeout, not a hang. Everything that can be checked
before communicating (schedule name, pp for "none", micro-batch count, the activation dtype) is
checked identically on every rank, so such errors are raised everywhere at once.

Memory (the 1F1B property)
--------------------------
Stage r holds at most min(pp − r, m) micro-batches' activations (forwarded, not yet backwarded):
the first stage at most pp, whatever m. ``ScheduleStats.peak_in_flight`` records the measured peak.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..model.gpt import GPTModel
from ..mpu.parallel_state import ParallelState

SCHEDULES = ("none", "1f1b")

MicroBatch = Mapping[str, torch.Tensor]
"""``tokens``, ``labels``, ``loss_mask``, ``position_ids`` (each ``[b, s]``), as ``train_step`` slices them."""

LossFn = Callable[[torch.Tensor, MicroBatch], torch.Tensor]
"""``loss_fn(token_losses [b, s], micro_batch) -> scalar``: e.g. ``(t.float() * mask).sum() / global_tokens``."""


@dataclass
class ScheduleStats:
    """What one ``forward_backward`` did on this rank (for tests and benchmarks).

    ``events``: ``("F", i)`` forward, ``("B", i)`` backward of micro-batch ``i``, ``("sync",)``
    when ``sync_grads_setter(True)`` was called; ``peak_in_flight``: the most micro-batches whose
    activations were alive at once (forwarded, backward not done).
    """

    events: list[tuple[Any, ...]] = field(default_factory=list)
    peak_in_flight: int = 0


def activation_shape(stage: GPTModel, micro_batch: MicroBatch) -> tuple[int, int, int]:
    """The ``[s, b, h]`` (``[s/t, b, h]`` under sequence parallelism) activation between stages."""
    b, s = micro_batch["tokens"].shape
    tp = stage.tp
    if tp.sequence_parallel and tp.size > 1:
        if s % tp.size:
            raise ValueError(f"sequence length {s} is not divisible by tp = {tp.size} (sequence parallelism)")
        s //= tp.size
    return (s, b, stage.cfg.hidden_size)


class _Link:
    """Point-to-point with the previous and next stage of the pp group (fixed shape and dtype)."""

    def __init__(self, state: ParallelState, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        ranks = state.group_ranks["pp"]
        r = state.pp_rank
        self.prev = ranks[r - 1] if r > 0 else None
        self.next = ranks[r + 1] if r < len(ranks) - 1 else None
        self.group = state.pp_group
        self.shape, self.dtype, self.device = shape, dtype, device

    def _check(self, t: torch.Tensor, what: str) -> torch.Tensor:
        if tuple(t.shape) != self.shape or t.dtype != self.dtype:
            raise RuntimeError(f"pipeline: {what} is {tuple(t.shape)} {t.dtype}, the run's activations are "
                               f"{self.shape} {self.dtype}")
        return t.contiguous()

    def exchange(self, send_next: torch.Tensor | None = None, send_prev: torch.Tensor | None = None,
                 recv_next: bool = False, recv_prev: bool = False) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Post the given sends and receives together, wait for all; return (from_prev, from_next)."""
        ops, from_prev, from_next = [], None, None
        if send_prev is not None:
            ops.append(dist.P2POp(dist.isend, self._check(send_prev, "an input gradient"), self.prev, self.group))
        if recv_prev:
            from_prev = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            ops.append(dist.P2POp(dist.irecv, from_prev, self.prev, self.group))
        if send_next is not None:
            ops.append(dist.P2POp(dist.isend, self._check(send_next, "an output activation"), self.next, self.group))
        if recv_next:
            from_next = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            ops.append(dist.P2POp(dist.irecv, from_next, self.next, self.group))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        return from_prev, from_next


def forward_backward(stage: GPTModel, micro_batches: Sequence[MicroBatch], state: ParallelState, loss_fn: LossFn,
                     schedule: str = "1f1b", sync_grads_setter: Callable[[bool], None] | None = None, *,
                     dtype: torch.dtype | None = None, grad_scale: float = 1.0,
                     forward_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                     stats: ScheduleStats | None = None) -> torch.Tensor:
    """Run forward and backward of every micro-batch through the pipeline; gradients accumulate in ``.grad``.

    Args:
        stage: this rank's ``GPTModel`` stage (``build_stage``).
        micro_batches: the step's micro-batches, the same list on every stage of the pipeline.
        state: the parallel state (pp group, stage position).
        loss_fn: ``(token_losses [b, s], micro_batch) -> scalar`` on the last stage; normalise by the
            step's GLOBAL token count (the gradients are summed, never averaged, over micro-batches).
        schedule: ``"1f1b"`` (any pp; pp == 1 is plain accumulation) or ``"none"`` (requires pp == 1).
        sync_grads_setter: called with False first and with True just before the backward of the
            LAST micro-batch on this stage (e.g. ``lambda on: setattr(opt, "sync_grads", on)``).
        dtype: the activation dtype sent between stages (default: the stage parameters' dtype; with
            autocast pass the autocast dtype only if the layers' outputs have it).
        grad_scale: backward runs on ``loss · grad_scale`` (fp16 loss scaling); the returned sum is unscaled.
        forward_context: entered around each forward (e.g. autocast).
        stats: filled with the event trace and the peak number of in-flight micro-batches.

    Returns:
        fp64 scalar: the sum of ``loss_fn`` values on the last stage, 0 elsewhere (all-reduce it
        over the pp group, or take it from the last stage).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline schedule {schedule!r}; supported: {', '.join(SCHEDULES)}")
    pp, rank, m = state.pp_size, state.pp_rank, len(micro_batches)
    if schedule == "none" and pp != 1:
        raise ValueError(f"pipeline schedule 'none' (gradient accumulation) needs pp = 1, got pp = {pp}")
    if m < 1:
        raise ValueError("forward_backward needs at least one micro-batch")
    if stats is None:
        stats = ScheduleStats()
    set_sync = sync_grads_setter or (lambda on: None)
    first, last = state.is_first_stage, state.is_last_stage
    param = next(stage.parameters())
    link = _Link(state, activation_shape(stage, micro_batches[0]), dtype or param.dtype, param.device)

    loss_sum = torch.zeros((), dtype=torch.float64)
    in_flight: list[tuple[int, torch.Tensor | None, torch.Tensor]] = []  # (index, input, output or loss)
    next_forward, next_backward = 0, 0

    def forward(x: torch.Tensor | None) -> torch.Tensor:
        nonlocal next_forward, loss_sum
        i = next_forward
        mb = micro_batches[i]
        if x is not None:
            x.requires_grad_(True)
        with forward_context():
            out = stage(mb["tokens"] if first else None, position_ids=mb.get("position_ids"),
                        labels=mb["labels"] if last else None, hidden_states=x)
        if last:
            out = loss_fn(out, mb)
            loss_sum += out.detach().double().cpu()
        in_flight.append((i, x, out))
        stats.events.append(("F", i))
        stats.peak_in_flight = max(stats.peak_in_flight, len(in_flight))
        next_forward += 1
        return out

    def backward(grad_out: torch.Tensor | None) -> torch.Tensor | None:
        nonlocal next_backward
        i, x, out = in_flight.pop(0)
        assert i == next_backward, (i, next_backward)
        if i == m - 1:
            set_sync(True)
            stats.events.append(("sync",))
        if last:
            (out * grad_scale if grad_scale != 1.0 else out).backward()
        else:
            torch.autograd.backward(out, grad_tensors=grad_out)
        stats.events.append(("B", i))
        next_backward += 1
        return None if x is None else x.grad

    set_sync(False)
    warmup = min(pp - rank - 1, m)
    for _ in range(warmup):
        x, _ = link.exchange(recv_prev=not first)
        y = forward(x)
        link.exchange(send_next=None if last else y)
    steady = m - warmup
    x = link.exchange(recv_prev=not first)[0] if steady else None
    for k in range(steady):
        y = forward(x)
        _, grad_y = link.exchange(send_next=None if last else y, recv_next=not last)
        grad_x = backward(grad_y)
        more = k < steady - 1
        x, _ = link.exchange(send_prev=None if first else grad_x, recv_prev=more and not first)
    for _ in range(warmup):
        _, grad_y = link.exchange(recv_next=not last)
        grad_x = backward(grad_y)
        link.exchange(send_prev=None if first else grad_x)
    assert not in_flight and next_forward == next_backward == m
    return loss_sum


@torch.no_grad()
def forward_only(stage: GPTModel, micro_batches: Sequence[MicroBatch], state: ParallelState, loss_fn: LossFn, *,
                 dtype: torch.dtype | None = None,
                 forward_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
                 ) -> torch.Tensor:
    """Evaluation through the pipeline: each micro-batch goes stage to stage, no backward.

    Returns the fp64 sum of ``loss_fn`` values on the last stage, 0 elsewhere.
    """
    first, last = state.is_first_stage, state.is_last_stage
    param = next(stage.parameters())
    link = _Link(state, activation_shape(stage, micro_batches[0]), dtype or param.dtype, param.device)
    loss_sum = torch.zeros((), dtype=torch.float64)
    for mb in micro_batches:
        x, _ = link.exchange(recv_prev=not first)
        with forward_context():
            out = stage(mb["tokens"] if first else None, position_ids=mb.get("position_ids"),
                        labels=mb["labels"] if last else None, hidden_states=x)
        if last:
            loss_sum += loss_fn(out, mb).double().cpu()
        else:
            link.exchange(send_next=out)
    return loss_sum
