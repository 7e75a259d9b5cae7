"""Pipeline schedule tables (per pipeline rank, its ordered ``Action``s for one step) and their simulator: pure
Python (no torch), usable by config checks and the planner. Theory and bubbles: docs/pipeline.md.
"""
from __future__ import annotations

import functools
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .partition import PipelineConfigError, check_micro_batches, check_schedule
UNIT_COSTS = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


@dataclass(frozen=True)
class Action:
    """One entry of a rank's schedule: ``kind`` F | B | I | W of ``micro_batch`` through model ``chunk``."""

    kind: str
    chunk: int
    micro_batch: int


def build_schedule(name: str, pp: int, num_micro_batches: int, virtual_stages: int = 1,
                   costs: Mapping[str, float] | None = None) -> list[list[Action]]:
    """The schedule ``name`` as one ordered action list per pipeline rank, or a ``PipelineConfigError``.
    ``costs`` (per kind F/I/W, ``agree_costs``): what the zero-bubble table is list-scheduled on."""
    m, v = num_micro_batches, virtual_stages
    check_schedule(name, pp, v)
    if m < 1 or pp < 1:
        raise PipelineConfigError(f"a pipeline step needs pp >= 1 and micro-batches >= 1 (got {pp}, {m})")
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
    """Megatron's interleaved order (docs/pipeline.md)."""
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
    """ZB-H1 by greedy list scheduling on ``costs`` (default unit costs; deterministic): the rule is in
    docs/pipeline.md. I's and W's run in micro-batch order, so the gradient sums do not depend on the costs."""
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


def virtual_stage(action: Action, pp: int, rank: int) -> int:
    """The virtual stage ``chunk · pp + rank`` that ``action`` of pipeline rank ``rank`` runs."""
    return action.chunk * pp + rank


def simulate(table: Sequence[Sequence[Action]], num_micro_batches: int, virtual_stages: int = 1,
             costs: Mapping[str, float] | None = None) -> Simulation:
    """Check ``table`` and time it on ``costs`` (default ``UNIT_COSTS``), transfers taking no time; a
    ``ValueError`` when an action is missing, repeated or on the wrong rank, a W precedes its I, or the
    table deadlocks. ``peak_in_flight``: per rank the most (chunk, micro-batch) activations held at once."""
    costs = dict(UNIT_COSTS if costs is None else costs)
    pp, m, v = len(table), num_micro_batches, virtual_stages
    last = pp * v - 1
    seen: set[tuple[str, int, int]] = set()
    for r, actions in enumerate(table):
        for a in actions:
            if not (0 <= a.chunk < v and 0 <= a.micro_batch < m and a.kind in costs):
                raise ValueError(f"rank {r}: invalid action {a}")
            key = (a.kind, virtual_stage(a, pp, r), a.micro_batch)
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
                s, i = virtual_stage(a, pp, r), a.micro_batch
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
    live = {"F": 1, "B": -1, "I": 0, "W": -1}  # activations held: from F until B (or W)
    peaks = [max([0, *itertools.accumulate(live[a.kind] for a in actions)]) for actions in table]
    return Simulation(times, makespan, idle, peaks)


def theory_bubble(name: str, pp: int, m: int, v: int = 1) -> float:
    """The textbook idle fraction: 1F1B (p−1)/(m+p−1); interleaved (p−1)/(v·m+p−1) (i.e. (p−1)/(v·m)
    of the ideal time); zero-bubble H1 (p−1)/(3m+p−1) (F = I = W); none (p−1)/p."""
    if pp == 1:
        return 0.0
    return {"none": (pp - 1) / pp, "1f1b": (pp - 1) / (m + pp - 1), "interleaved": (pp - 1) / (v * m + pp - 1),
            "zero_bubble": (pp - 1) / (3 * m + pp - 1)}[name]


def checked_schedule(name: str, pp: int, num_micro_batches: int, virtual_stages: int = 1,
                     costs: Mapping[str, float] | None = None) -> tuple[tuple[Action, ...], ...]:
    """``build_schedule``'s table, validated by ``simulate`` (identically on every rank): a unit-cost table
    is built and simulated once per run, a zero-bubble table on measured ``costs`` each time they change."""
    m, v = num_micro_batches, virtual_stages
    if name == "zero_bubble" and costs is not None:
        return _validated(tuple(map(tuple, build_schedule(name, pp, m, v, costs))), m, v)
    return _unit_cost_table(name, pp, m, v)


@functools.lru_cache(maxsize=32)
def _unit_cost_table(name: str, pp: int, m: int, v: int) -> tuple[tuple[Action, ...], ...]:
    return _validated(tuple(map(tuple, build_schedule(name, pp, m, v))), m, v)


@functools.lru_cache(maxsize=32)
def _validated(table: tuple[tuple[Action, ...], ...], m: int, v: int) -> tuple[tuple[Action, ...], ...]:
    simulate(table, m, v)  # raises on a missing or repeated action or a deadlock
    return table
