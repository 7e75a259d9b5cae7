"""Pipeline schedules: tables of actions per rank, checked by simulation, run by one executor.

A schedule is a *table*: for every pipeline rank, the ordered list of its ``Action``s for one step
(``build_schedule``):

* ``F`` forward of (chunk, micro-batch); ``B`` its whole backward;
* ``I`` the input-gradient half of a backward and ``W`` the weight-gradient half (zero-bubble:
  ``I`` runs inside ``mpu.weight_grad.deferring``, ``W`` runs the queued weight gradients).

Virtual stage ``s = chunk · pp + rank`` (``S = pp · v`` of them) takes its input from stage ``s − 1``
and its output gradient from ``s + 1``. The schedules:

``none``         no pipelining: micro-batch after micro-batch through every stage, forward then
                 backward (gradient accumulation; at pp > 1 the stages take turns: a debugging
                 baseline, one micro-batch in flight).
``1f1b``         Megatron's one-forward-one-backward: stage r runs ``pp − r − 1`` warm-up forwards,
                 then alternates; at most ``pp − r`` micro-batches in flight. Bubble (p−1)/(m+p−1).
``interleaved``  Megatron's interleaved 1F1B over ``v`` model chunks per rank (micro-batches in
                 groups of pp, chunk by chunk); ``m % pp == 0``. Bubble (p−1)/(v·m) of the ideal time.
``zero_bubble``  ZB-H1 (Qi et al. 2023): backward split into I and W; the table comes from a greedy
                 list schedule on unit costs (I first, then F while fewer than pp micro-batches hold
                 activations, W to fill any wait), so each rank holds at most pp micro-batches —
                 1F1B's first-stage memory — and the bubble is about a third of 1F1B's.

``simulate`` runs a table on a cost model (F = I = W = 1, B = 2 by default): it checks that every
action appears exactly once on the right rank and that the table cannot deadlock (some rank can
always make progress), and gives each rank's idle fraction — the theory the bubble benchmark
compares against.

The executor (``forward_backward``)
-----------------------------------
Each rank walks its own list. An output goes out with a non-blocking ``isend`` as soon as it is
computed (waited for only at the end of the step); an input is received by an ``irecv`` posted
ahead of time and waited for right before the action that needs it. A rank therefore blocks only
on data it needs now, so any table that ``simulate`` accepts runs without deadlock, and transfers
overlap compute. Each directed link ``src → dst`` has its own two-rank process group
(``ParallelState.p2p_groups``) and carries its messages in the sender's order; the receiver posts
its receives in that same order (known from the sender's list), so first-in first-out matching
is exact on gloo and NCCL alike, and the two directions of a link never share a queue.

Activations have one fixed shape per run, ``[s, b, h]`` (``[s/t, b, h]`` under sequence
parallelism), and one dtype (checked on send), so receivers pre-allocate and no shape is ever
exchanged (the variable-shape deadlocks of Megatron #5100/#5240 cannot occur).

Why our own executor and not ``torch.distributed.pipelining``
-------------------------------------------------------------
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

Errors
------
A rank that raises stops talking; its neighbours block in a receive until the process group's
timeout (``parallel.timeout_s``) and then raise too, so an error surfaces on every rank after at
most that timeout, not a hang. Everything checkable before communicating (schedule name, counts,
the activation dtype) is checked identically on every rank, so such errors are raised everywhere
at once.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..model.gpt import GPTModel
from ..mpu import comm, weight_grad
from ..mpu.parallel_state import ParallelState
from .partition import PipelineConfigError, check_micro_batches

SCHEDULES = ("none", "1f1b", "interleaved", "zero_bubble")

MicroBatch = Mapping[str, torch.Tensor]
"""``tokens``, ``labels``, ``loss_mask``, ``position_ids`` and optionally ``token_index`` (context
parallelism) and ``document_ids`` (packed documents), each ``[b, s]``, as ``train_step`` slices them."""

LossFn = Callable[[torch.Tensor, MicroBatch], torch.Tensor]
"""``loss_fn(token_losses [b, s], micro_batch) -> scalar``: e.g. ``(t.float() * mask).sum() / global_tokens``."""

UNIT_COSTS = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


@dataclass(frozen=True)
class Action:
    """One entry of a rank's schedule: ``kind`` F | B | I | W of ``micro_batch`` through model ``chunk``."""

    kind: str
    chunk: int
    micro_batch: int


# ----------------------------------------------------------------------------------------- tables


def build_schedule(name: str, pp: int, num_micro_batches: int, virtual_stages: int = 1,
                   costs: Mapping[str, float] | None = None) -> list[list[Action]]:
    """The schedule ``name`` as one ordered action list per pipeline rank (see the module doc).

    ``costs`` (seconds or any unit, per kind F/I/W): the zero-bubble table is list-scheduled on
    them (``agree_costs`` measures them); default unit costs. Other schedules ignore them.

    Raises ``PipelineConfigError`` (a ``ValueError``) for an unknown name, virtual stages with a
    schedule other than ``interleaved`` (or ``interleaved`` without them), or a micro-batch count
    the schedule cannot use.
    """
    m, v = num_micro_batches, virtual_stages
    if name not in SCHEDULES:
        raise PipelineConfigError(f"parallel.pp_schedule = {name!r}; supported: {', '.join(SCHEDULES)}")
    if m < 1 or pp < 1:
        raise PipelineConfigError(f"a pipeline step needs pp >= 1 and micro-batches >= 1 (got {pp}, {m})")
    if name == "interleaved":
        if v < 2 or pp < 2:
            raise PipelineConfigError(f"parallel.pp_schedule = interleaved needs parallel.pp >= 2 and "
                                      f"parallel.virtual_stages >= 2 (got {pp}, {v})")
    elif v != 1:
        raise PipelineConfigError(f"parallel.virtual_stages = {v} needs parallel.pp_schedule = interleaved")
    check_micro_batches(m, pp, name)
    if name == "none":
        return [[a for i in range(m) for a in (Action("F", 0, i), Action("B", 0, i))] for _ in range(pp)]
    if name == "1f1b":
        return [_one_f_one_b(pp, r, m) for r in range(pp)]
    if name == "interleaved":
        return [_interleaved(pp, r, m, v) for r in range(pp)]
    return _zero_bubble(pp, m, costs)


def _one_f_one_b(pp: int, rank: int, m: int) -> list[Action]:
    warmup = min(pp - rank - 1, m)
    actions = [Action("F", 0, i) for i in range(warmup)]
    for k in range(m - warmup):
        actions += [Action("F", 0, warmup + k), Action("B", 0, k)]
    return actions + [Action("B", 0, i) for i in range(m - warmup, m)]


def _interleaved(pp: int, rank: int, m: int, v: int) -> list[Action]:
    """Megatron's order: forwards in groups of pp micro-batches, chunk 0..v−1 per group; backwards
    likewise with the chunks reversed; ``(pp − r − 1)·2 + (v − 1)·pp`` warm-up forwards."""
    total = m * v

    def position(k: int, forward: bool) -> tuple[int, int]:
        group, within = divmod(k, pp * v)
        chunk = within // pp
        return (chunk if forward else v - 1 - chunk), group * pp + within % pp

    warmup = min((pp - rank - 1) * 2 + (v - 1) * pp, total)
    actions = [Action("F", *position(k, True)) for k in range(warmup)]
    for k in range(total - warmup):
        actions += [Action("F", *position(warmup + k, True)), Action("B", *position(k, False))]
    return actions + [Action("B", *position(k, False)) for k in range(total - warmup, total)]


def _zero_bubble(pp: int, m: int, costs: Mapping[str, float] | None = None) -> list[list[Action]]:
    """ZB-H1 by greedy list scheduling on ``costs`` (default unit costs; deterministic for given costs).

    Whenever a rank is free it takes, among the actions that can start earliest: I (unblocks the
    previous stage), else F if fewer than pp micro-batches hold activations on it (F done, W not)
    and fewer than pp − r are between F and I (1F1B's limit), else W. On unit costs this is the
    paper's ZB-H1; with measured costs (W is cheaper than F and I on CPU) the same rule keeps the
    table below 1F1B's bubble, where the unit-cost table would idle more than 1F1B at large m.
    Every stage runs its I's and its W's in micro-batch order, so the gradients are accumulated in
    the same order whatever the costs: the numbers do not depend on the table.
    """
    free = [0.0] * pp
    done: dict[tuple[str, int, int], float] = {}
    n_f, n_i, n_w = [0] * pp, [0] * pp, [0] * pp
    table: list[list[Action]] = [[] for _ in range(pp)]
    for _ in range(3 * m * pp):
        best: tuple[float, int, int, str, int] | None = None
        for r in range(pp):
            options = []
            if n_i[r] < n_f[r]:
                ready = done.get(("I", r + 1, n_i[r])) if r < pp - 1 else done[("F", r, n_i[r])]
                if ready is not None:
                    options.append((max(free[r], ready), 0, r, "I", n_i[r]))
            if n_f[r] < m and n_f[r] - n_w[r] < pp and n_f[r] - n_i[r] < pp - r:
                ready = done.get(("F", r - 1, n_f[r])) if r > 0 else 0.0
                if ready is not None:
                    options.append((max(free[r], ready), 1, r, "F", n_f[r]))
            if n_w[r] < n_i[r]:
                options.append((free[r], 2, r, "W", n_w[r]))
            if options:
                option = min(options)
                if best is None or (option[0], option[2]) < (best[0], best[2]):
                    best = option
        assert best is not None, "zero-bubble table: no rank can make progress"
        start, _, r, kind, i = best
        free[r] = start + (1.0 if costs is None else costs[kind])
        done[(kind, r, i)] = free[r]
        table[r].append(Action(kind, 0, i))
        counter = {"F": n_f, "I": n_i, "W": n_w}[kind]
        counter[r] += 1
    return table


@dataclass
class Simulation:
    """``simulate``'s result: per rank the (start, end) of each action, the makespan and idle fractions."""

    times: list[list[tuple[float, float]]]
    makespan: float
    idle: list[float]
    peak_in_flight: list[int]


def _stage(action: Action, pp: int, rank: int) -> int:
    return action.chunk * pp + rank


def simulate(table: Sequence[Sequence[Action]], num_micro_batches: int, virtual_stages: int = 1,
             costs: Mapping[str, float] | None = None) -> Simulation:
    """Check ``table`` and time it on ``costs`` (default ``UNIT_COSTS``), transfers taking no time.

    Raises ``ValueError`` when an action is missing, repeated or on the wrong rank, a W precedes its
    I, or the table deadlocks (no rank can run its next action). ``peak_in_flight``: per rank the
    most (chunk, micro-batch) pairs holding activations at once (F done, backward — B or W — not).
    """
    costs = dict(UNIT_COSTS if costs is None else costs)
    pp, m, v = len(table), num_micro_batches, virtual_stages
    last = pp * v - 1
    seen: set[tuple[str, int, int]] = set()
    for r, actions in enumerate(table):
        for a in actions:
            if not (0 <= a.chunk < v and 0 <= a.micro_batch < m and a.kind in costs):
                raise ValueError(f"rank {r}: invalid action {a}")
            key = (a.kind, _stage(a, pp, r), a.micro_batch)
            if key in seen:
                raise ValueError(f"rank {r}: {a} appears twice")
            seen.add(key)
    for s in range(pp * v):
        for i in range(m):
            split = ("I", s, i) in seen
            wanted = [("F", s, i), *((("I", s, i), ("W", s, i)) if split else (("B", s, i),))]
            if any(k not in seen for k in wanted) or (split and ("B", s, i) in seen):
                raise ValueError(f"stage {s} micro-batch {i}: needs F and B (or I and W) exactly once")
    end: dict[tuple[str, int, int], float] = {}
    times: list[list[tuple[float, float]]] = [[] for _ in range(pp)]
    free, pos = [0.0] * pp, [0] * pp
    while True:
        progressed = False
        for r in range(pp):
            while pos[r] < len(table[r]):
                a = table[r][pos[r]]
                s, i = _stage(a, pp, r), a.micro_batch
                deps: list[tuple[str, int, int]] = []
                if a.kind == "F" and s > 0:
                    deps.append(("F", s - 1, i))
                if a.kind in ("B", "I"):
                    deps.append(("F", s, i))
                    if s < last:
                        deps.append(("I" if ("I", s + 1, i) in seen else "B", s + 1, i))
                if a.kind == "W":
                    deps.append(("I", s, i))
                if any(d not in end for d in deps):
                    break
                start = max([free[r], *(end[d] for d in deps)])
                free[r] = start + costs[a.kind]
                end[(a.kind, s, i)] = free[r]
                times[r].append((start, free[r]))
                pos[r] += 1
                progressed = True
        if all(pos[r] == len(table[r]) for r in range(pp)):
            break
        if not progressed:
            stuck = {r: table[r][pos[r]] for r in range(pp) if pos[r] < len(table[r])}
            raise ValueError(f"the schedule deadlocks: each rank waits ({stuck})")
    makespan = max(free) if free else 0.0
    busy = [sum(e - b for b, e in ts) for ts in times]
    idle = [1.0 - b / makespan if makespan else 0.0 for b in busy]
    peaks = []
    for actions in table:
        live, peak = 0, 0
        for a in actions:
            live += 1 if a.kind == "F" else -1 if a.kind in ("B", "W") else 0
            peak = max(peak, live)
        peaks.append(peak)
    return Simulation(times, makespan, idle, peaks)


def theory_bubble(name: str, pp: int, m: int, v: int = 1) -> float:
    """The textbook idle fraction: 1F1B (p−1)/(m+p−1); interleaved (p−1)/(v·m+p−1) (i.e. (p−1)/(v·m)
    of the ideal time); zero-bubble H1 (p−1)/(3m+p−1) (F = I = W); none (p−1)/p."""
    if pp == 1:
        return 0.0
    return {"none": (pp - 1) / pp, "1f1b": (pp - 1) / (m + pp - 1), "interleaved": (pp - 1) / (v * m + pp - 1),
            "zero_bubble": (pp - 1) / (3 * m + pp - 1)}[name]


# -------------------------------------------------------------------------------------- executor


@dataclass
class ScheduleStats:
    """What one ``forward_backward`` did on this rank (for tests and benchmarks).

    ``events``: ``(kind, chunk, micro_batch)`` per action run (kind F | B | I | W), and ``("sync",)``
    when ``sync_grads_setter(True)`` was called; ``intervals``: ``(start, end)`` ``perf_counter``
    seconds of each action's compute, receive waits excluded; ``peak_in_flight``: the most
    (chunk, micro-batch) pairs whose activations were alive at once (forwarded, backward not done);
    ``deferred_weight_grads``: weight gradients computed by W actions (zero-bubble).
    """

    events: list[tuple[Any, ...]] = field(default_factory=list)
    intervals: list[tuple[float, float]] = field(default_factory=list)
    peak_in_flight: int = 0
    deferred_weight_grads: int = 0


StepObserver = Callable[[ScheduleStats], contextlib.AbstractContextManager]
_STEP_OBSERVERS: list[StepObserver] = []


@contextlib.contextmanager
def observe(around: StepObserver) -> Iterator[None]:
    """While the block runs, every ``forward_backward`` runs inside ``with around(stats):``.

    ``stats`` is the call's ``ScheduleStats`` (the caller's, or a fresh one), complete when the
    ``with`` exits. The supported way to measure around a step's schedule from the outside (the
    planner's ``--verify`` records the live saved-activation peak and ``peak_in_flight``) without
    replacing any function; with no observer the cost is one list truthiness test.
    """
    _STEP_OBSERVERS.append(around)
    try:
        yield
    finally:
        _STEP_OBSERVERS.remove(around)


def agree_costs(stats: ScheduleStats, state: ParallelState) -> dict[str, float]:
    """Mean seconds per action kind (F, B, I, W) of this step over ALL ranks, identical on every rank.

    Collective over the default group (every rank must call it): sums and counts are all-reduced
    and global rank 0's means are broadcast, so every rank holds bitwise the same costs and builds
    the same zero-bubble table. Agreeing only within a pp group would not do: TP and CP peers (other
    pp groups) would build different tables and issue their collectives in different orders.
    Kinds that did not run get the unit-cost ratio to F (B = 2F, I = W = F).
    """
    kinds = ("F", "B", "I", "W")
    sums = torch.zeros(2 * len(kinds), dtype=torch.float64)
    for event, (t0, t1) in zip((e for e in stats.events if e[0] in kinds), stats.intervals):
        k = kinds.index(event[0])
        sums[k] += t1 - t0
        sums[len(kinds) + k] += 1
    if dist.is_initialized() and dist.get_world_size() > 1:
        comm.all_reduce(sums, None)
        comm.broadcast(sums, 0, None)
    means = {k: float(sums[i] / sums[len(kinds) + i]) for i, k in enumerate(kinds) if sums[len(kinds) + i] > 0}
    f = means.get("F", 1.0)
    return {k: means.get(k, UNIT_COSTS[k] * f) for k in kinds}


def activation_shape(stage: GPTModel, micro_batch: MicroBatch) -> tuple[int, int, int]:
    """The ``[s, b, h]`` (``[s/t, b, h]`` under sequence parallelism) activation between stages."""
    b, s = micro_batch["tokens"].shape
    tp = stage.tp
    if tp.sequence_parallel and tp.size > 1:
        if s % tp.size:
            raise ValueError(f"sequence length {s} is not divisible by tp = {tp.size} (sequence parallelism)")
        s //= tp.size
    return (s, b, stage.cfg.hidden_size)


def _messages(table: Sequence[Sequence[Action]], pp: int, v: int) -> dict[tuple[int, int], list[tuple[str, int, int]]]:
    """Per directed link (src pp rank, dst pp rank): its messages ``(kind, from_stage, mb)`` in send order."""
    links: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
    last = pp * v - 1
    for r, actions in enumerate(table):
        for a in actions:
            s = _stage(a, pp, r)
            if a.kind == "F" and s < last:
                links.setdefault((r, (s + 1) % pp), []).append(("act", s, a.micro_batch))
            elif a.kind in ("B", "I") and s > 0:
                links.setdefault((r, (s - 1) % pp), []).append(("grad", s, a.micro_batch))
    return links


class _P2P:
    """This rank's sends and receives for one step: isend at once, irecv posted in link order, waits on use."""

    def __init__(self, state: ParallelState, links: dict[tuple[int, int], list[tuple[str, int, int]]],
                 shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        self.ranks = state.group_ranks["pp"]
        self.me = state.pp_rank
        self.state, self.shape, self.dtype, self.device = state, shape, dtype, device
        self.incoming = {src: msgs for (src, dst), msgs in links.items() if dst == self.me}
        self.posted: dict[int, int] = dict.fromkeys(self.incoming, 0)
        self.pending: dict[tuple[str, int, int], tuple[torch.Tensor, Any]] = {}
        self.sends: list[tuple[Any, torch.Tensor]] = []

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

    def prefetch(self) -> None:
        """Post the first receive of every incoming link (so data can arrive while we compute)."""
        for src in self.incoming:
            self._post_next(src)

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
    """Run forward and backward of every micro-batch through the pipeline; gradients accumulate in ``.grad``.

    Args:
        stage: this rank's ``GPTModel`` stage (``build_stage``), with its ``layer_chunks``.
        micro_batches: the step's micro-batches, the same list on every stage of the pipeline.
        state: the parallel state (pp group, stage position, ``p2p_groups``).
        loss_fn: ``(token_losses [b, s], micro_batch) -> scalar`` on the last stage; normalise by the
            step's GLOBAL token count (the gradients are summed, never averaged, over micro-batches).
        schedule: one of ``SCHEDULES`` (see the module doc); at pp == 1 every schedule but
            ``zero_bubble`` is plain gradient accumulation.
        sync_grads_setter: called with False first and with True just before this rank's LAST
            gradient-producing action (e.g. ``lambda on: setattr(opt, "sync_grads", on)``).
        dtype: the activation dtype sent between stages (default: the stage parameters' dtype; with
            autocast pass the autocast dtype only if the layers' outputs have it).
        grad_scale: backward runs on ``loss · grad_scale`` (fp16 loss scaling); the returned sum is unscaled.
        forward_context: entered around each forward (e.g. autocast).
        stats: filled with the event trace, compute intervals and the peak in-flight count.
        costs: per-kind action costs for the zero-bubble table, the same on every rank: pass
            ``agree_costs(stats, state)`` of the previous step (default unit costs).

    Returns:
        fp64 scalar: the sum of ``loss_fn`` values on the last stage, 0 elsewhere (all-reduce it
        over the pp group, or take it from the last stage).
    """
    pp, m, v = state.pp_size, len(micro_batches), len(stage.layer_chunks)
    if m < 1:
        raise ValueError("forward_backward needs at least one micro-batch")
    if schedule in ("1f1b", "interleaved", "none") and pp == 1 and v == 1:
        schedule = "none"
    table = build_schedule(schedule, pp, m, v, costs)
    simulate(table, m, v)  # validates the table (cheap); identical on every rank
    if not _STEP_OBSERVERS:
        return _execute(stage, micro_batches, state, table, loss_fn, sync_grads_setter, dtype=dtype,
                        grad_scale=grad_scale, forward_context=forward_context, stats=stats)
    stats = stats if stats is not None else ScheduleStats()
    with contextlib.ExitStack() as observed:
        for around in list(_STEP_OBSERVERS):
            observed.enter_context(around(stats))
        return _execute(stage, micro_batches, state, table, loss_fn, sync_grads_setter, dtype=dtype,
                        grad_scale=grad_scale, forward_context=forward_context, stats=stats)


def _execute(stage: GPTModel, micro_batches: Sequence[MicroBatch], state: ParallelState,
             table: Sequence[Sequence[Action]], loss_fn: LossFn | None,
             sync_grads_setter: Callable[[bool], None] | None, *, dtype: torch.dtype | None, grad_scale: float,
             forward_context: Callable[[], contextlib.AbstractContextManager],
             stats: ScheduleStats | None) -> torch.Tensor:
    pp, rank, v = state.pp_size, state.pp_rank, len(stage.layer_chunks)
    last_stage = pp * v - 1
    stats = stats if stats is not None else ScheduleStats()
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
    p2p.prefetch()
    for k, a in enumerate(mine):
        s, i, key = _stage(a, pp, rank), a.micro_batch, (a.chunk, a.micro_batch)
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
                            token_index=mb.get("token_index"), document_ids=mb.get("document_ids"))
            if s == last_stage and loss_fn is not None:
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
    """Evaluation through the pipeline: each micro-batch through every (virtual) stage, no backward.

    Returns the fp64 sum of ``loss_fn`` values on the last stage, 0 elsewhere.
    """
    pp, v = state.pp_size, len(stage.layer_chunks)
    table = [[Action("F", c, i) for i in range(len(micro_batches)) for c in range(v)] for _ in range(pp)]
    return _execute(stage, micro_batches, state, table, loss_fn, None, dtype=dtype, grad_scale=1.0,
                    forward_context=forward_context, stats=None)
