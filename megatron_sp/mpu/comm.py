"""The one layer every collective, point-to-point transfer and barrier goes through (``tests/unit/test_comm_rules.py``).

Each function takes its group explicitly (``None``: the default group) and is the identity for a group of one;
``count()`` records calls and bytes sent, ``observe(callback)`` sees each call. Table and byte formulas:
docs/communication.md.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any

import torch
import torch.distributed as dist

ReduceOp = dist.ReduceOp

_ACTIVE_COUNTERS: list[CommCounter] = []


@dataclass
class CommCounter:
    """Calls and bytes sent by this rank, per collective name (see the module docstring)."""

    calls: dict[str, int] = field(default_factory=dict)
    bytes: dict[str, float] = field(default_factory=dict)

    def record(self, op: str, nbytes: float) -> None:
        self.calls[op] = self.calls.get(op, 0) + 1
        self.bytes[op] = self.bytes.get(op, 0.0) + nbytes

    @property
    def total_bytes(self) -> float:
        return float(sum(self.bytes.values()))

    @property
    def total_calls(self) -> int:
        return sum(self.calls.values())

    def summary(self) -> dict[str, dict[str, float]]:
        """``{op: {"calls": n, "bytes": b}}`` (plain data, e.g. for JSON)."""
        return {op: {"calls": self.calls[op], "bytes": self.bytes[op]} for op in sorted(self.calls)}


@contextmanager
def count() -> Iterator[CommCounter]:
    """Count every collective issued inside the block (counters may nest; each sees all calls)."""
    counter = CommCounter()
    _ACTIVE_COUNTERS.append(counter)
    try:
        yield counter
    finally:
        _ACTIVE_COUNTERS.remove(counter)


@dataclass
class CommEvent:
    """One issued call as ``observe`` callbacks see it (``perf_counter`` times; ``work`` None if blocking)."""

    op: str
    nbytes: float
    group: Any
    tensor: Any
    called: float
    issued: float = 0.0
    work: Any = None
    wait_start: float | None = None
    wait_end: float | None = None


Observer = Callable[[CommEvent], None]
_OBSERVERS: list[Observer] = []


@contextmanager
def observe(callback: Observer) -> Iterator[None]:
    """Call ``callback(event)`` for every collective, send and receive issued inside the block (may nest)."""
    _OBSERVERS.append(callback)
    try:
        yield
    finally:
        _OBSERVERS.remove(callback)


def _issue(op: str, nbytes: float, group: Any, tensor: Any, call: Callable[[], Any],
           counted: bool = True) -> tuple[Any, CommEvent | None]:
    """Run the ``torch.distributed`` ``call()``, count ``nbytes`` under ``op``, tell the observers."""
    for counter in _ACTIVE_COUNTERS if counted else ():
        counter.record(op, nbytes)
    if not _OBSERVERS:
        return call(), None
    event = CommEvent(op, nbytes, group, tensor, called=perf_counter())
    event.work = call()
    event.issued = perf_counter()
    for callback in list(_OBSERVERS):
        callback(event)
    return event.work, event


LOCAL = "local"
"""A group of this process alone (``None`` is torch's default group): every collective over it is the identity."""


def group_size(group: Any) -> int:
    """Ranks in ``group`` (1 for ``LOCAL`` or when torch.distributed is not initialised)."""
    if group is LOCAL or not dist.is_available() or not dist.is_initialized():
        return 1
    size = dist.get_world_size(group)
    if size < 1:
        raise ValueError("this rank is not a member of the process group it communicates over")
    return size


def group_rank(group: Any) -> int:
    """This process's rank inside ``group`` (0 for ``LOCAL`` or when torch.distributed is not initialised)."""
    if group is LOCAL or not dist.is_available() or not dist.is_initialized():
        return 0
    return dist.get_rank(group)


def _dim(t: torch.Tensor, dim: int) -> int:
    if not -t.dim() <= dim < t.dim():
        raise IndexError(f"dim {dim} out of range for a tensor of shape {tuple(t.shape)}")
    return dim % t.dim()


def _ring_bytes(t: torch.Tensor, n: int, passes: float = 1.0) -> float:
    """Bytes this rank sends in ``passes`` ring passes over ``t`` (docs/communication.md)."""
    return passes * (n - 1) / n * t.numel() * t.element_size()


def _check_divisible(t: torch.Tensor, dim: int, n: int, op: str) -> None:
    if t.shape[dim] % n:
        raise ValueError(f"{op}: dim {dim} of shape {tuple(t.shape)} is not divisible by the group size {n}")


class Pending:
    """An issued asynchronous collective; ``wait()`` blocks until done and returns its result."""

    def __init__(self, work: Any, result: torch.Tensor, event: CommEvent | None = None) -> None:
        self._work = work
        self._result = result
        self._event = event

    def is_completed(self) -> bool:
        """Whether the transfer is done (never blocks)."""
        return self._work is None or self._work.is_completed()

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            if self._event is not None:
                self._event.wait_start = perf_counter()
            self._work.wait()
            self._work = None
            if self._event is not None:
                self._event.wait_end = perf_counter()
        return self._result


def all_reduce(t: torch.Tensor, group: Any, op: Any = ReduceOp.SUM) -> torch.Tensor:
    """Reduce ``t`` over ``group`` in place (``op``: SUM, MAX, ...) and return it."""
    n = group_size(group)
    if n == 1:
        return t
    buf = t if t.is_contiguous() else t.contiguous()
    _issue("all_reduce", _ring_bytes(t, n, 2.0), group, t, lambda: dist.all_reduce(buf, op=op, group=group))
    return t if buf is t else t.copy_(buf)


def all_reduce_async(t: torch.Tensor, group: Any) -> Pending:
    """Start a SUM all-reduce of the contiguous ``t`` in place; ``wait()`` returns ``t`` reduced."""
    n = group_size(group)
    if n == 1:
        return Pending(None, t)
    if not t.is_contiguous():
        raise ValueError("all_reduce_async needs a contiguous tensor (it reduces in place)")
    work, event = _issue("all_reduce", _ring_bytes(t, n, 2.0), group, t,
                         lambda: dist.all_reduce(t, op=ReduceOp.SUM, group=group, async_op=True))
    return Pending(work, t, event)


def _gather_dim0(t: torch.Tensor, group: Any, n: int, out: torch.Tensor | None,
                 async_op: bool) -> tuple[Any, torch.Tensor, CommEvent | None]:
    t = t.contiguous()
    shape = (n * t.shape[0], *t.shape[1:])
    if out is None:
        out = torch.empty(shape, dtype=t.dtype, device=t.device)
    elif tuple(out.shape) != shape or out.dtype != t.dtype or not out.is_contiguous():
        raise ValueError(f"all_gather: out buffer {tuple(out.shape)} {out.dtype} does not fit {shape} {t.dtype}")
    work, event = _issue("all_gather", _ring_bytes(out, n), group, t,
                         lambda: dist.all_gather_single(out, t, group=group, async_op=async_op))
    return work, out, event


def all_gather(t: torch.Tensor, group: Any, dim: int = 0, out: torch.Tensor | None = None) -> torch.Tensor:
    """The ``n`` ranks' ``t`` concatenated along ``dim``; ``out``: a dim-0 receive buffer."""
    n = group_size(group)
    if n == 1:
        return t
    dim = _dim(t, dim)
    if dim == 0:
        return _gather_dim0(t, group, n, out, async_op=False)[1]
    if out is not None:
        raise ValueError("all_gather: an out buffer is only supported for dim 0")
    stacked = _gather_dim0(t.unsqueeze(0), group, n, None, async_op=False)[1]  # [n, *t.shape]
    # [n, d0, .., d_dim, ..] -> [d0, .., n, d_dim, ..] -> merge (n, d_dim)
    moved = stacked.movedim(0, dim)
    return moved.reshape(*t.shape[:dim], n * t.shape[dim], *t.shape[dim + 1:])


def all_gather_async(t: torch.Tensor, group: Any, out: torch.Tensor | None = None) -> Pending:
    """Start gathering ``t`` along dim 0; ``wait()`` returns the gathered tensor."""
    n = group_size(group)
    if n == 1:
        return Pending(None, t)
    return Pending(*_gather_dim0(t, group, n, out, async_op=True))


def _chunks_to_dim0(t: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    """``t``'s ``n`` chunks along ``dim``, laid out one after another (contiguous; ``[n·chunk0, ..]`` for dim 0)."""
    if dim == 0:
        return t.contiguous()
    d = t.shape[dim]
    stacked = t.reshape(*t.shape[:dim], n, d // n, *t.shape[dim + 1:]).movedim(dim, 0)  # [n, *chunk]
    return stacked.contiguous().flatten(0, 1)  # [n·chunk0, ..]: gloo takes only the concatenated form


def _reduce_scatter(t: torch.Tensor, group: Any, n: int, dim: int,
                    async_op: bool) -> tuple[Any, torch.Tensor, CommEvent | None]:
    """On gloo, an all-to-all sends rank ``j`` its chunks and each rank sums what it receives: gloo's own
    reduce-scatter all-reduces the whole tensor (twice the bytes; 2.5x the time for 2^19 elements on 2 ranks) and its
    work has no future, so observers could not time it. The same bytes as a ring reduce-scatter; at n = 2 the same
    bits."""
    _check_divisible(t, dim, n, "reduce_scatter")
    inp = _chunks_to_dim0(t, dim, n)
    shape = list(t.shape)
    shape[dim] //= n
    out = torch.empty(shape, dtype=t.dtype, device=t.device)
    if dist.get_backend(group) != "gloo":
        work, event = _issue("reduce_scatter", _ring_bytes(t, n), group, t,
                             lambda: dist.reduce_scatter_single(out, inp, group=group, async_op=async_op))
        return work, out, event
    received = torch.empty_like(inp)  # [n·chunk0, ..]: block j is rank j's chunk for this rank
    work, event = _issue("reduce_scatter", _ring_bytes(t, n), group, t,
                         lambda: dist.all_to_all_single(received, inp, group=group, async_op=async_op))
    summed = _ThenSum(work, out, received.view(n, *shape))
    if async_op:
        return summed, out, event
    summed.wait()
    return None, out, event


def reduce_scatter(t: torch.Tensor, group: Any, dim: int = 0) -> torch.Tensor:
    """Sum ``t`` over the ranks and keep this rank's ``1/n`` chunk along ``dim``."""
    n = group_size(group)
    if n == 1:
        return t
    return _reduce_scatter(t, group, n, _dim(t, dim), async_op=False)[1]


def reduce_scatter_async(t: torch.Tensor, group: Any) -> Pending:
    """Start a dim-0 reduce-scatter of ``t``; ``wait()`` returns this rank's chunk (on gloo: the all-to-all's wait,
    then the sum of the received chunks)."""
    n = group_size(group)
    if n == 1:
        return Pending(None, t)
    return Pending(*_reduce_scatter(t, group, n, 0, async_op=True))


def split(t: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
    """This rank's ``1/n`` chunk of ``t`` along ``dim``, contiguous (no communication)."""
    n = group_size(group)
    if n == 1:
        return t
    dim = _dim(t, dim)
    _check_divisible(t, dim, n, "split")
    size = t.shape[dim] // n
    return t.narrow(dim, group_rank(group) * size, size).contiguous()


def all_to_all(t: torch.Tensor, group: Any, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Send chunk ``j`` of ``t`` along ``scatter_dim`` to rank ``j``; concatenate what arrives along ``gather_dim``."""
    n = group_size(group)
    if n == 1:
        return t
    scatter_dim, gather_dim = _dim(t, scatter_dim), _dim(t, gather_dim)
    _check_divisible(t, scatter_dim, n, "all_to_all")
    chunk = list(t.shape)
    chunk[scatter_dim] //= n
    inp = _chunks_to_dim0(t, scatter_dim, n)  # chunk j (for rank j) first
    out = torch.empty_like(inp)
    _issue("all_to_all", _ring_bytes(t, n), group, t, lambda: dist.all_to_all_single(out, inp, group=group))
    moved = out.view(n, *chunk).movedim(0, gather_dim)  # out[j] came from rank j: [.., n, chunk[gather_dim], ..]
    return moved.reshape(*chunk[:gather_dim], n * chunk[gather_dim], *chunk[gather_dim + 1:]).contiguous()


def all_to_all_uneven(t: torch.Tensor, group: Any, send_splits: list[int], recv_splits: list[int]) -> torch.Tensor:
    """Rows of ``t`` (dim 0) in consecutive blocks of ``send_splits[j]`` go to rank ``j``; returns the rows received,
    ``recv_splits[j]`` of them from rank ``j``, in rank order (the MoE dispatcher's exchange). Bytes: the rows sent
    to the other ranks."""
    n = group_size(group)
    if n == 1:
        return t
    t = t.contiguous()
    out = t.new_empty((sum(recv_splits), *t.shape[1:]))
    row_bytes = t.numel() // max(t.shape[0], 1) * t.element_size()
    nbytes = (sum(send_splits) - send_splits[group_rank(group)]) * row_bytes
    _issue("all_to_all", nbytes, group, t, lambda: dist.all_to_all_single(out, t, recv_splits, send_splits, group=group))
    return out


def broadcast(t: torch.Tensor, src: int, group: Any = None) -> torch.Tensor:
    """Overwrite ``t`` in place with global rank ``src``'s ``t`` (contiguous) and return it."""
    n = group_size(group)
    if n == 1:
        return t
    if not t.is_contiguous():
        raise ValueError("broadcast needs a contiguous tensor (it writes in place)")
    _issue("broadcast", _ring_bytes(t, n), group, t, lambda: dist.broadcast(t, src, group=group))
    return t


def barrier(group: Any = None) -> None:
    """Return when every rank of ``group`` has called it (counted as a call of 0 bytes)."""
    if group_size(group) == 1:
        return
    _issue("barrier", 0.0, group, None, lambda: dist.barrier(group=group))


def all_gather_object(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's picklable ``obj``, in the group's rank order (counted as a call of 0 bytes)."""
    n = group_size(group)
    if n == 1:
        return [obj]
    out: list[Any] = [None] * n
    _issue("all_gather_object", 0.0, group, None, lambda: dist.all_gather_object(out, obj, group=group))
    return out


def broadcast_object(obj: Any, src: int, group: Any = None) -> Any:
    """Global rank ``src``'s picklable ``obj`` on every rank (counted as a call of 0 bytes)."""
    if group_size(group) == 1:
        return obj
    box = [obj]
    _issue("broadcast_object", 0.0, group, None, lambda: dist.broadcast_object_list(box, src=src, group=group))
    return box[0]


def isend(t: torch.Tensor, dst: int, group: Any) -> Pending:
    """Start sending the contiguous ``t`` to global rank ``dst`` over ``group`` (counted as ``send``). Keep ``t``
    unchanged until the ``Pending`` is completed (its ``wait()`` returns ``t``)."""
    if not t.is_contiguous():
        raise ValueError("isend needs a contiguous tensor")
    work, event = _issue("send", t.numel() * t.element_size(), group, t, lambda: dist.isend(t, dst, group=group))
    return Pending(work, t, event)


def irecv(buf: torch.Tensor, src: int, group: Any) -> Pending:
    """Start receiving global rank ``src``'s tensor into ``buf``; ``wait()`` returns ``buf``. Not counted (the sender
    counts the bytes); observers see it as ``recv`` with 0 bytes."""
    work, event = _issue("recv", 0.0, group, buf, lambda: dist.irecv(buf, src, group=group), counted=False)
    return Pending(work, buf, event)


def ring_exchange_async(t: torch.Tensor, group: Any) -> Pending:
    """Send ``t`` to the next rank and receive the previous rank's tensor, posted together (``p2p``).
    ``batch_isend_irecv`` never deadlocks on NCCL, also when next == previous at n = 2."""
    n = group_size(group)
    if n == 1:
        return Pending(None, t)
    me = group_rank(group)
    t = t.contiguous()
    out = torch.empty_like(t)
    ranks = dist.get_process_group_ranks(group)
    ops = [dist.P2POp(dist.isend, t, ranks[(me + 1) % n], group),
           dist.P2POp(dist.irecv, out, ranks[(me - 1) % n], group)]
    work, event = _issue("p2p", t.numel() * t.element_size(), group, t,
                         lambda: _Works(dist.batch_isend_irecv(ops), keep=ops))
    return Pending(work, out, event)


class _ThenSum:
    """A work whose ``wait()`` waits for ``work`` (None: done) and then sums ``blocks`` ``[n, *dst.shape]`` into
    ``dst``."""

    def __init__(self, work: Any, dst: torch.Tensor, blocks: torch.Tensor) -> None:
        self.work, self.dst, self.blocks = work, dst, blocks

    def is_completed(self) -> bool:
        return self.work is None or self.work.is_completed()

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
        torch.sum(self.blocks, dim=0, out=self.dst)


class _Works:
    """Several works waited as one (``keep`` holds the send buffers alive until then)."""

    def __init__(self, works: list[Any], keep: Any = None) -> None:
        self.works, self.keep = works, keep

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.keep = None
