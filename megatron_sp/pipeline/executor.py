"""Runs a schedule table (``schedules.checked_schedule``) on this rank: ``forward_backward``, ``forward_only``.

Outputs go out by ``comm.isend`` at once, inputs arrive by a ``comm.irecv`` posted ahead in the sender's order;
activations have one shape and dtype per run. Invariants and errors: docs/pipeline.md, "The executor".
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..model.gpt import GPTModel
from ..mpu import comm, weight_grad
from ..mpu.parallel_state import ParallelState
from .schedules import UNIT_COSTS, Action, checked_schedule, virtual_stage

MicroBatch = Mapping[str, torch.Tensor]
"""``tokens``, ``labels``, ``loss_mask``, ``position_ids`` and optionally ``token_index`` (context
parallelism) and ``document_ids`` (packed documents), each ``[b, s]``, and ``mtp_tokens``/``mtp_labels`` (``[b, s, D]``,
multi-token prediction), as ``train_step`` slices them."""

LossFn = Callable[[torch.Tensor, MicroBatch], torch.Tensor]
"""``loss_fn(token_losses [b, s], micro_batch) -> scalar``: e.g. ``(t.float() * mask).sum() / global_tokens``."""


@dataclass
class ScheduleStats:
    """What one ``forward_backward`` did on this rank: ``events`` ``(kind, chunk, micro_batch)`` per action and
    ``("sync",)`` at ``sync_grads_setter(True)``; ``intervals`` each action's compute ``(start, end)`` (receive waits
    excluded); ``peak_in_flight`` the most activations alive at once; ``deferred_weight_grads`` W's gradients."""

    events: list[tuple[Any, ...]] = field(default_factory=list)
    intervals: list[tuple[float, float]] = field(default_factory=list)
    peak_in_flight: int = 0
    deferred_weight_grads: int = 0


StepObserver = Callable[[ScheduleStats], contextlib.AbstractContextManager]
_STEP_OBSERVERS: list[StepObserver] = []


@contextlib.contextmanager
def observe(around: StepObserver) -> Iterator[None]:
    """While the block runs, every ``forward_backward`` runs inside ``with around(stats):`` (``stats`` complete when
    the ``with`` exits): how to measure around a step's schedule without replacing any function."""
    _STEP_OBSERVERS.append(around)
    try:
        yield
    finally:
        _STEP_OBSERVERS.remove(around)


def agree_costs(stats: ScheduleStats) -> dict[str, float]:
    """Mean seconds per action kind (F, B, I, W) of this step over ALL ranks, bitwise identical on every rank (TP/CP
    peers must build the same zero-bubble table); kinds that did not run get the unit-cost ratio to F. Collective."""
    kinds = ("F", "B", "I", "W")
    sums = torch.zeros(2 * len(kinds), dtype=torch.float64)
    for event, (t0, t1) in zip((e for e in stats.events if e[0] in kinds), stats.intervals):
        k = kinds.index(event[0])
        sums[k] += t1 - t0
        sums[len(kinds) + k] += 1
    comm.all_reduce(sums, None)
    comm.broadcast(sums, 0, None)  # rank 0's sums: bitwise the same on every rank
    means = {k: float(sums[i] / sums[len(kinds) + i]) for i, k in enumerate(kinds) if sums[len(kinds) + i] > 0}
    f = means.get("F", 1.0)
    return {k: means.get(k, UNIT_COSTS[k] * f) for k in kinds}


def activation_shape(stage: GPTModel, micro_batch: MicroBatch) -> tuple[int, int, int]:
    """The ``[s, b, h]`` (``[s/t, b, h]`` under sequence parallelism) activation between stages."""
    b, s = micro_batch["tokens"].shape
    t = stage.parallel.tp_size
    if stage.parallel.sp:
        if s % t:
            raise ValueError(f"sequence length {s} is not divisible by tp = {t} (sequence parallelism)")
        s //= t
    return (s, b, stage.cfg.hidden_size)


def _messages(table: Sequence[Sequence[Action]], pp: int, v: int) -> dict[tuple[int, int], list[tuple[str, int, int]]]:
    """Per directed link (src pp rank, dst pp rank): its messages ``(kind, from_stage, mb)`` in send order."""
    links: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
    last = pp * v - 1
    for r, actions in enumerate(table):
        for a in actions:
            s = virtual_stage(a, pp, r)
            if a.kind == "F" and s < last:
                links.setdefault((r, (s + 1) % pp), []).append(("act", s, a.micro_batch))
            elif a.kind in ("B", "I") and s > 0:
                links.setdefault((r, (s - 1) % pp), []).append(("grad", s, a.micro_batch))
    return links


class _P2P:
    """This rank's sends and receives for one step: isend at once, irecv posted in link order (the first of
    every incoming link at once, so data can arrive while we compute), waits on use."""

    def __init__(self, state: ParallelState, links: dict[tuple[int, int], list[tuple[str, int, int]]],
                 shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        self.ranks = state.group_ranks["pp"]
        self.me = state.pp_rank
        self.state, self.shape, self.dtype, self.device = state, shape, dtype, device
        self.incoming = {src: msgs for (src, dst), msgs in links.items() if dst == self.me}
        self.posted: dict[int, int] = dict.fromkeys(self.incoming, 0)
        self.pending: dict[tuple[str, int, int], tuple[torch.Tensor, Any]] = {}
        self.sends: list[tuple[Any, torch.Tensor]] = []
        for src in self.incoming:
            self._post_next(src)

    def _group(self, src: int, dst: int) -> Any:
        return self.state.p2p_groups[(self.ranks[src], self.ranks[dst])]

    def send(self, t: torch.Tensor, dst: int, what: str) -> None:
        if tuple(t.shape) != self.shape or t.dtype != self.dtype:
            raise RuntimeError(f"pipeline: {what} is {tuple(t.shape)} {t.dtype}, the run's activations are "
                               f"{self.shape} {self.dtype}")
        t = t.detach().contiguous()
        self.sends = [(work, buf) for work, buf in self.sends if not work.is_completed()]  # free delivered ones
        self.sends.append((comm.isend(t, self.ranks[dst], self._group(self.me, dst)), t))

    def _post_next(self, src: int) -> None:
        msgs, k = self.incoming[src], self.posted[src]
        if k < len(msgs):
            buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            self.pending[msgs[k]] = (buf, comm.irecv(buf, self.ranks[src], self._group(src, self.me)))
            self.posted[src] = k + 1

    def recv(self, key: tuple[str, int, int], src: int) -> torch.Tensor:
        """Wait for message ``key`` from pp rank ``src`` (posting the receives before it on that link first)."""
        msgs = self.incoming[src]
        while key not in self.pending:
            if self.posted[src] >= len(msgs):
                raise RuntimeError(f"pipeline: no message {key} from stage rank {src} in this schedule")
            self._post_next(src)
        buf, work = self.pending.pop(key)
        work.wait()
        self._post_next(src)  # one receive ahead on this link
        return buf

    def finish(self) -> None:
        for work, _ in self.sends:
            work.wait()
        self.sends.clear()
        if self.pending:
            raise RuntimeError(f"pipeline: messages received but never used: {sorted(self.pending)}")


def forward_backward(stage: GPTModel, micro_batches: Sequence[MicroBatch], state: ParallelState, loss_fn: LossFn,
                     schedule: str = "1f1b", sync_grads_setter: Callable[[bool], None] | None = None, *,
                     dtype: torch.dtype | None = None, grad_scale: float = 1.0,
                     forward_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                     stats: ScheduleStats | None = None, costs: Mapping[str, float] | None = None) -> torch.Tensor:
    """Forward and backward of every micro-batch (the same list on every stage) through this rank's ``stage``;
    gradients accumulate in ``.grad``. Returns the fp64 sum of ``loss_fn`` values on the last stage, 0 elsewhere.
    ``loss_fn`` normalises by the step's GLOBAL token count; ``sync_grads_setter(False)`` first, ``(True)`` before
    this rank's last gradient-producing action; ``dtype``: of the activations sent (default: the parameters');
    backward runs on ``loss · grad_scale`` (the sum returned is unscaled); ``costs``: ``agree_costs`` of the last step.
    """
    pp, m, v = state.pp_size, len(micro_batches), len(stage.layer_chunks)
    if m < 1:
        raise ValueError("forward_backward needs at least one micro-batch")
    if schedule in ("1f1b", "interleaved", "none") and pp == 1 and v == 1:
        schedule = "none"
    table = checked_schedule(schedule, pp, m, v, costs)  # validated, cached per layout; identical on every rank
    stats = stats if stats is not None else ScheduleStats()
    with contextlib.ExitStack() as observed:
        for around in list(_STEP_OBSERVERS):
            observed.enter_context(around(stats))
        return _execute(stage, micro_batches, state, table, loss_fn, sync_grads_setter, dtype=dtype,
                        grad_scale=grad_scale, forward_context=forward_context, stats=stats)


def _execute(stage: GPTModel, micro_batches: Sequence[MicroBatch], state: ParallelState,
             table: Sequence[Sequence[Action]], loss_fn: LossFn,
             sync_grads_setter: Callable[[bool], None] | None, *, dtype: torch.dtype | None, grad_scale: float,
             forward_context: Callable[[], contextlib.AbstractContextManager], stats: ScheduleStats) -> torch.Tensor:
    pp, rank, v = state.pp_size, state.pp_rank, len(stage.layer_chunks)
    last_stage = pp * v - 1
    set_sync = sync_grads_setter or (lambda on: None)
    param = next(stage.parameters())
    p2p = _P2P(state, _messages(table, pp, v), activation_shape(stage, micro_batches[0]), dtype or param.dtype,
               param.device)
    mine = table[rank]
    grad_kinds = [k for k, a in enumerate(mine) if a.kind in ("B", "I", "W")]
    sync_at = grad_kinds[-1] if grad_kinds else -1

    loss_sum = torch.zeros((), dtype=torch.float64)
    saved: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}  # (chunk, mb) -> (input, output)
    deferred: dict[tuple[int, int], list[weight_grad.WeightGrad]] = {}
    live = 0
    set_sync(False)
    for k, a in enumerate(mine):
        s, i, key = virtual_stage(a, pp, rank), a.micro_batch, (a.chunk, a.micro_batch)
        if k == sync_at:
            set_sync(True)
            stats.events.append(("sync",))
        if a.kind == "F":
            x = p2p.recv(("act", s - 1, i), (s - 1) % pp) if s > 0 else None
            t0 = time.perf_counter()
            if x is not None and torch.is_grad_enabled():
                x.requires_grad_(True)
            mb = micro_batches[i]
            with forward_context():
                out = stage(mb["tokens"] if s == 0 else None, position_ids=mb.get("position_ids"),
                            labels=mb["labels"] if s == last_stage else None, hidden_states=x, chunk=a.chunk,
                            token_index=mb.get("token_index"), document_ids=mb.get("document_ids"),
                            mtp=(mb["mtp_tokens"], mb["mtp_labels"]) if s == last_stage and "mtp_tokens" in mb else None)
            if s == last_stage:
                out = loss_fn(out, mb)
                loss_sum += out.detach().double().cpu()
            if torch.is_grad_enabled():
                saved[key] = (x, out)
                live += 1
                stats.peak_in_flight = max(stats.peak_in_flight, live)
            stats.intervals.append((t0, time.perf_counter()))
            if s < last_stage:
                p2p.send(out, (s + 1) % pp, "an output activation")
        elif a.kind in ("B", "I"):
            grad_out = p2p.recv(("grad", s + 1, i), (s + 1) % pp) if s < last_stage else None
            t0 = time.perf_counter()
            x, out = saved.pop(key)
            queue: list[weight_grad.WeightGrad] = []
            with weight_grad.deferring(queue) if a.kind == "I" else contextlib.nullcontext():
                if s == last_stage:
                    (out * grad_scale if grad_scale != 1.0 else out).backward()
                else:
                    torch.autograd.backward(out, grad_tensors=grad_out)
            if a.kind == "I":
                deferred[key] = queue
            else:
                live -= 1
            stats.intervals.append((t0, time.perf_counter()))
            if s > 0:
                assert x is not None and x.grad is not None
                p2p.send(x.grad, (s - 1) % pp, "an input gradient")
        else:  # W
            t0 = time.perf_counter()
            queue = deferred.pop(key)
            stats.deferred_weight_grads += len(queue)
            weight_grad.run(queue)
            live -= 1
            stats.intervals.append((t0, time.perf_counter()))
        stats.events.append((a.kind, a.chunk, i))
    p2p.finish()
    assert not saved and not deferred, "pipeline: activations left after the schedule"
    return loss_sum


@torch.no_grad()
def forward_only(stage: GPTModel, micro_batches: Sequence[MicroBatch], state: ParallelState, loss_fn: LossFn, *,
                 dtype: torch.dtype | None = None,
                 forward_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
                 ) -> torch.Tensor:
    """Evaluation through the pipeline (no backward): the fp64 sum of ``loss_fn`` on the last stage, 0 elsewhere."""
    pp, v = state.pp_size, len(stage.layer_chunks)
    table = [[Action("F", c, i) for i in range(len(micro_batches)) for c in range(v)] for _ in range(pp)]
    return _execute(stage, micro_batches, state, table, loss_fn, None, dtype=dtype, grad_scale=1.0,
                    forward_context=forward_context, stats=ScheduleStats())
