"""Gradient reduction and ZeRO-1/2 sharding on flat buffers: the ``GradReducer`` base of ``DistributedOptimizer``.
Buffer layout and the invariants of the asynchronous handles: docs/optimizer.md.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..config.registry import check, choice
from ..config.schema import Config
from ..errors import ConfigError
from ..mpu import ParallelState, comm
from ..mpu.comm import Pending
from ..mpu.zero3 import ParamUnits

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
ZERO2_INFLIGHT = 2  # ZeRO-2: launched bucket reductions (with their staging buffers) left in flight after a launch


def check_optimizer_options(zero: int, precision: str, prefetch: int = 1) -> None:
    """``parallel.zero`` (0 to 3), ``parallel.zero3_prefetch`` (>= 0) and ``train.precision`` (a key of
    ``PRECISIONS``), or a config error."""
    if zero not in (0, 1, 2, 3):
        raise ConfigError(f"parallel.zero: {zero} must be 0, 1, 2 or 3")
    if prefetch < 0:
        raise ConfigError(f"parallel.zero3_prefetch: {prefetch} must be >= 0 (0: no prefetch)")
    choice("train.precision", precision, tuple(PRECISIONS))


@check
def check_optimizer_config(cfg: Config) -> None:
    """The optimizer's config keys."""
    check_optimizer_options(cfg.parallel.zero, cfg.train.precision, cfg.parallel.zero3_prefetch)


@dataclass
class _Param:
    """One parameter's place in the flat buffers and the tags the optimizer reads."""

    index: int
    name: str
    param: nn.Parameter
    start: int  # offset in the flat (global) buffers
    numel: int
    bucket: int
    decay: bool  # weight decay applies (ndim >= 2)
    in_norm: bool  # counted in the global grad norm on this rank
    expert: bool  # an expert-parallel parameter (ep > 1): reduced and sharded over edp, not dp_cp
    own_start: int = 0  # the owned interval [own_start, own_end) in global offsets (may be empty)
    own_end: int = 0
    fresh: bool = True  # main_grad still holds zero_grad's zeros: the first gradient is copied, not added

    @property
    def end(self) -> int:
        return self.start + self.numel


@dataclass
class _Bucket:
    """A contiguous region of the flat buffers reduced by one collective; ``numel`` includes padding."""

    index: int
    start: int
    numel: int
    params: list[int] = field(default_factory=list)
    expert: bool = False  # holds expert parameters only: reduced over ``group`` = edp (else dp_cp)
    unit: str = ""  # ZeRO-3: the unit (``unit_of`` of its parameters' names) gathered with it
    kind: Any = None  # ``_bucket_kind`` of its parameters (a subclass's: Muon's buckets apart from AdamW's)
    group: Any = None
    size: int = 1  # the group's size and this rank's place in it
    rank: int = 0
    sharded: bool = False  # ZeRO-1/2 over ``group``: this rank owns chunk ``rank`` of ``size``
    shard_start: int = 0  # global offset of this rank's owned chunk
    shard_numel: int = 0
    local_start: int = 0  # offset of that chunk in this rank's local shard tensors
    ready: set[int] = field(default_factory=set)  # ZeRO-2: the parameters with a gradient in ``staged``
    staged: torch.Tensor | None = None  # ZeRO-2: the bucket's gradients not yet launched (fp32, ``numel``)
    reduce: Pending | None = None
    launched: bool = False
    full: torch.Tensor | None = None  # ZeRO-3: the gathered parameters (param dtype, ``numel``; storage freed between uses)


class GradReducer:
    """Flat fp32 main grads reduced over dp_cp in overlapping buckets of about ``bucket_bytes``, optional ZeRO-1
    (``zero=1``) shards of the masters, ZeRO-2 (``zero=2``) also of the grads, ZeRO-3 (``zero=3``) also of the
    parameters, gathered per unit (``unit_of(name)``; ``units``, ``prefetch``). ``named_params``: every trainable
    (name, parameter), names keying checkpoints; ``state`` None: one process; ``precision`` bf16/fp16: 16-bit params,
    fp32 masters kept here."""

    def __init__(self, named_params: Sequence[tuple[str, nn.Parameter]], state: ParallelState | None,
                 zero: int = 0, precision: str = "fp32", bucket_bytes: int = 25 * 2**20,
                 unit_of: Callable[[str], str] | None = None, prefetch: int = 1) -> None:
        check_optimizer_options(zero, precision, prefetch)
        named = list(named_params)
        if len({id(p) for _, p in named}) != len(named) or not all(p.requires_grad for _, p in named):
            raise ValueError("GradReducer needs distinct trainable parameters (optim.named_trainable gives them)")
        devices = {p.device for _, p in named}
        if len(devices) > 1:
            raise ValueError(f"parameters are on several devices {sorted(map(str, devices))}")
        self.device = devices.pop() if devices else torch.device("cpu")

        self.state = state
        self.zero = zero
        self.precision = precision
        self.param_dtype = PRECISIONS[precision]
        self.bucket_bytes = bucket_bytes
        self.sync_grads = True
        self._dp_group = state.dp_cp_group if state is not None else None
        self.dp_size = state.dp_cp_size if state is not None else 1
        self.dp_rank = state.dp_cp_rank if state is not None else 0
        # expert-parallel parameters (ep > 1) live in buckets of their own, reduced and ZeRO-sharded over edp
        self._ep = getattr(state, "ep_size", 1)  # (the planner's stand-in state has no ep yet)
        self._bucket_groups = {False: (self._dp_group, self.dp_size, self.dp_rank)}
        if self._ep > 1:
            edp = state.edp_group  # type: ignore[union-attr]
            self._bucket_groups[True] = (edp, comm.group_size(edp), comm.group_rank(edp))
        # some bucket is reduced: over dp_cp, or (experts folded over tp under SP) over an edp group while dp_cp is 1
        self._reduces = max(size for _, size, _ in self._bucket_groups.values()) > 1
        self._sharded = zero >= 1 and self._reduces  # some bucket is sharded
        self._zero2 = zero >= 2 and self._reduces  # grad_buffer is this rank's shard; buckets staged per micro-batch
        self._zero3 = zero == 3 and self._reduces  # param_buffer too; the parameters gathered per unit
        self._unit_of = unit_of if unit_of is not None else (lambda name: name.rpartition(".")[0])
        self._inflight: list[tuple[_Bucket, Pending]] = []  # ZeRO-2's launched reductions, oldest first
        self._synced = False
        self._next_launch = 0
        self._align_cache: dict[tuple[int, tuple[int, ...]], bool] = {}

        self._params: list[_Param] = []
        self._buckets: list[_Bucket] = []
        self._layout(named)
        self._by_id = {id(info.param): info for info in self._params}
        self.numel = sum(b.numel for b in self._buckets)  # padded, divisible by dp_size
        self.shard_numel = sum(b.shard_numel for b in self._buckets)
        self._build_buffers()
        self.units: ParamUnits | None = None  # ZeRO-3's gatherer (the model's ``param_units``)
        if self._zero3:
            by_unit: dict[str, list[_Bucket]] = {}
            for b in self._buckets:
                if b.sharded:
                    by_unit.setdefault(b.unit, []).append(b)
            self.units = ParamUnits(by_unit, lambda b: self.param_buffer[b.local_start:b.local_start + b.shard_numel],
                                    prefetch)
            self.units.free_all()
        self._hooks = [info.param.register_post_accumulate_grad_hook(lambda _, i=info.index: self._on_grad(i))
                       for info in self._params]

    def _layout(self, named: list[tuple[str, nn.Parameter]]) -> None:
        """Assign offsets (reverse order), close buckets at ``bucket_bytes``, pad each to a multiple of dp."""
        tp_rank = self.state.tp_rank if self.state is not None else 0
        skip_shared = self.state is not None and self.state.pp_size > 1 and not self.state.is_first_stage
        offset = 0
        current: _Bucket | None = None
        for name, p in reversed(named):
            expert = self._ep > 1 and bool(getattr(p, "expert_parallel", False))
            if expert and getattr(p, "ep_size", 1) != self._ep:
                raise ValueError(f"'{name}' is split over {getattr(p, 'ep_size', 1)} expert-parallel ranks, the layout "
                                 f"over {self._ep}: build the model with ParallelContext.from_state")
            unit, kind = self._unit_of(name) if self.zero == 3 else "", self._bucket_kind(name, p)
            if current is not None and (current.expert != expert or current.unit != unit or current.kind != kind):
                offset += self._close(current)
                current = None
            if current is None:
                group, size, rank = self._bucket_groups[expert]
                current = _Bucket(index=len(self._buckets), start=offset, numel=0, unit=unit, kind=kind, expert=expert,
                                  group=group, size=size, rank=rank, sharded=self.zero >= 1 and size > 1)
            info = _Param(index=len(self._params), name=name, param=p, start=offset, numel=p.numel(),
                          bucket=current.index, decay=p.ndim >= 2,
                          in_norm=(bool(getattr(p, "tensor_model_parallel", False)) or tp_rank == 0 or getattr(p, "ep_tp", False))
                          and not (skip_shared and getattr(p, "shared_embedding", False)), expert=expert)
            self._params.append(info)
            current.params.append(info.index)
            current.numel += info.numel
            offset += info.numel
            if current.numel * 4 >= self.bucket_bytes:
                offset += self._close(current)
                current = None
        if current is not None:
            self._close(current)

        local = 0
        for b in self._buckets:
            chunk = b.numel // b.size if b.sharded else b.numel
            b.shard_start = b.start + (b.rank * chunk if b.sharded else 0)
            b.shard_numel = chunk
            b.local_start = local
            local += chunk
            for i in b.params:
                info = self._params[i]
                info.own_start = min(max(info.start, b.shard_start), b.shard_start + chunk)
                info.own_end = max(min(info.end, b.shard_start + chunk), info.own_start)

    def _bucket_kind(self, name: str, param: nn.Parameter) -> Any:
        """Parameters of different kinds never share a bucket (None here)."""
        return None

    def _close(self, bucket: _Bucket) -> int:
        pad = -bucket.numel % bucket.size
        bucket.numel += pad
        self._buckets.append(bucket)
        return pad

    def _build_buffers(self) -> None:
        dev, n, n_local = self.device, self.numel, self.shard_numel
        self.grad_buffer = torch.zeros(n_local if self._zero2 else n, dtype=torch.float32, device=dev)
        self.param_buffer = torch.zeros(n_local if self._zero3 else n, dtype=self.param_dtype, device=dev)
        self._master_local: torch.Tensor | None = None
        if self.precision != "fp32":
            self._master_local = torch.zeros(n_local, dtype=torch.float32, device=dev)
        with torch.no_grad():
            for info in self._params:
                p = info.param
                if self._master_local is not None:  # the master keeps the fp32 value before the cast to bf16
                    lo, hi = self._to_local(info.own_start, info.own_end)
                    own = p.detach().reshape(-1)[info.own_start - info.start:info.own_end - info.start]
                    self._master_local[lo:hi].copy_(own)
                b = self._buckets[info.bucket]
                if self._zero3 and b.sharded:  # a view of the bucket's gathered storage; this rank's chunk kept below
                    if b.full is None:
                        b.full = torch.zeros(b.numel, dtype=self.param_dtype, device=dev)
                    view = b.full[info.start - b.start:info.end - b.start].view_as(p)
                else:
                    view = self._param(info.start, info.end).view_as(p)
                view.copy_(p.detach())
                p.data = view
                if not (self._zero2 and self._buckets[info.bucket].sharded):  # (ZeRO-2: staged, see _on_grad)
                    p.main_grad = self._grad(info.start, info.end).view_as(p)
                p.grad = None

            for b in self._buckets:
                if b.full is not None:
                    self._keep_own(b)
        self._grad_pieces = [self._grad(b.shard_start, b.shard_start + b.shard_numel) for b in self._buckets]  # owned
        self._sp_params = [i.param for i in self._params if getattr(i.param, "sequence_parallel", False)]

    def _runs(self, keep: Callable[[_Param], bool]) -> list[tuple[int, int]]:
        """Owned intervals of the parameters ``keep`` selects, adjacent ones merged (global offsets)."""
        runs: list[tuple[int, int, int]] = []  # (start, end, bucket)
        for info in self._params:  # offsets increase along self._params
            if not keep(info) or info.own_end == info.own_start:
                continue
            if runs and runs[-1][1] == info.own_start and runs[-1][2] == info.bucket:
                runs[-1] = (runs[-1][0], info.own_end, info.bucket)
            else:
                runs.append((info.own_start, info.own_end, info.bucket))
        return [(a, b) for a, b, _ in runs]

    def _to_local(self, start: int, end: int) -> tuple[int, int]:
        """Local-shard offsets of an owned global interval (inside one bucket's chunk)."""
        if end == start:
            return 0, 0
        b = self._bucket_at(start)
        lo = b.local_start + start - b.shard_start
        return lo, lo + end - start

    def _bucket_at(self, start: int) -> _Bucket:
        """The bucket holding global offset ``start``."""
        return next(b for b in self._buckets if b.start <= start < b.start + b.numel)

    def _in(self, buffer: torch.Tensor, local: bool, start: int, end: int) -> torch.Tensor:
        """``buffer``'s part for an owned global interval: ``buffer`` is full-size, or (``local``) this rank's shard."""
        if not local:
            return buffer[start:end]
        lo, hi = self._to_local(start, end)
        return buffer[lo:hi]

    def _grad(self, start: int, end: int) -> torch.Tensor:
        """The main grads of an owned global interval (ZeRO-2: in the local shard ``grad_buffer``)."""
        return self._in(self.grad_buffer, self._zero2, start, end)

    def _param(self, start: int, end: int) -> torch.Tensor:
        """The parameters of an owned global interval (ZeRO-3: in the local shard ``param_buffer``)."""
        return self._in(self.param_buffer, self._zero3, start, end)

    def _master_view(self, start: int, end: int) -> torch.Tensor:
        """The fp32 master weights of an owned global interval."""
        if self._master_local is None:
            return self._param(start, end)
        lo, hi = self._to_local(start, end)
        return self._master_local[lo:hi]

    def _on_grad(self, index: int) -> None:
        """Accumulate into main_grad; on the last micro-batch mark ready and launch finished buckets. ZeRO-2: into the
        bucket's staging buffer, launched as soon as each of its parameters has a gradient there (every micro-batch)."""
        info = self._params[index]
        p = info.param
        if p.grad is None:
            return
        if self.sync_grads and self._synced:
            raise RuntimeError(f"gradient of '{info.name}' arrived after finish_grad_sync(); call zero_grad() "
                               "before the next step's backward")
        bucket = self._buckets[info.bucket]
        if self._zero2 and bucket.sharded:
            self._stage(bucket, info)
            return
        if bucket.launched:
            raise RuntimeError(f"gradient of '{info.name}' arrived after its bucket's reduction started: set "
                               "sync_grads = False (or use no_sync()) on all but the step's last micro-batch")
        if info.fresh:  # 0 + g is g: one pass, where a bf16 g added to fp32 would be converted into a temporary first
            p.main_grad.copy_(p.grad)
            info.fresh = False
        else:
            p.main_grad.add_(p.grad)
        p.grad = None
        if not self.sync_grads or not self._reduces or self._zero2:
            return
        bucket.ready.add(index)
        while self._next_launch < len(self._buckets) and \
                len(self._buckets[self._next_launch].ready) == len(self._buckets[self._next_launch].params):
            self._launch(self._buckets[self._next_launch])

    def _stage(self, bucket: _Bucket, info: _Param) -> None:
        if bucket.staged is None:
            bucket.staged = torch.zeros(bucket.numel, dtype=torch.float32, device=self.device)
        view = bucket.staged[info.start - bucket.start:info.end - bucket.start].view_as(info.param)
        if info.index in bucket.ready:
            view.add_(info.param.grad)
        else:  # (as ``fresh`` below: no fp32 temporary of a bf16 gradient)
            view.copy_(info.param.grad)
        info.param.grad = None
        bucket.ready.add(info.index)
        if len(bucket.ready) == len(bucket.params):
            self._launch(bucket)

    def _drain(self, keep: int) -> None:
        """ZeRO-2: wait for the oldest launched reductions until at most ``keep`` remain; add each into the shard."""
        while len(self._inflight) > keep:
            bucket, pending = self._inflight.pop(0)
            self._grad_pieces[bucket.index].add_(pending.wait())

    def _launch(self, bucket: _Bucket) -> None:
        if self._zero2 and bucket.sharded:  # the staging buffer goes with the reduction; the next one starts empty
            self._inflight.append((bucket, comm.reduce_scatter_async(bucket.staged, bucket.group)))
            bucket.staged = None
            bucket.ready.clear()
            if self.units is not None:  # every parameter of the bucket has its gradient: no backward reads it again
                self.units.free_bucket(bucket)
            self._drain(ZERO2_INFLIGHT)
            return
        region = self.grad_buffer[bucket.start:bucket.start + bucket.numel]
        # ZeRO-1: each rank keeps its reduced chunk; otherwise every rank needs the whole reduced bucket.
        bucket.reduce = (comm.reduce_scatter_async(region, bucket.group) if bucket.sharded
                         else comm.all_reduce_async(region, bucket.group))
        bucket.launched = True
        self._next_launch = bucket.index + 1

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients without reducing them (every micro-batch but the step's last)."""
        previous = self.sync_grads
        self.sync_grads = False
        try:
            yield
        finally:
            self.sync_grads = previous

    def finish_grad_sync(self) -> None:
        """Launch the buckets not launched yet, wait for all, then sum ``sequence_parallel`` grads over TP.
        Idempotent within a step (``zero_grad`` re-arms it). Collective over dp_cp (and tp)."""
        if self._synced:
            return
        if self._zero2:
            for bucket in self._buckets:
                if bucket.ready:  # a partly filled staging buffer (the last micro-batch's, or a parameter without one)
                    self._launch(bucket)
            self._drain(0)
            if self.units is not None:
                self.units.free_all()
        elif self._reduces:
            for bucket in self._buckets[self._next_launch:]:
                self._launch(bucket)
            for bucket, piece in zip(self._buckets, self._grad_pieces):
                assert bucket.reduce is not None
                reduced = bucket.reduce.wait()
                bucket.reduce = None
                if bucket.sharded:
                    piece.copy_(reduced)  # (an all-reduce already reduced the bucket in place)
        self._synced = True
        if self._sp_params and self.state is not None and self.state.tp_size > 1:
            self.sync_grads_over(self._sp_params, self.state.tp_group)

    def sync_grads_over(self, params: Sequence[nn.Parameter], group: Any) -> None:
        """Sum the reduced main grads of ``params`` over ``group`` (SP grads over TP, a tied embedding over its
        stages) after ``finish_grad_sync``, every member passing corresponding parameters in order. Under ZeRO,
        unless every member owns the same elements, the grads are first assembled over dp_cp."""
        if comm.group_size(group) == 1 or not params:
            return
        infos = [self._info_of(p) for p in params]
        with torch.no_grad():
            if not self._sharded:
                self._all_reduce_slices([(i.start, i.end) for i in infos], group)
            elif self._owned_alike(infos, group):
                self._all_reduce_slices([(i.own_start, i.own_end) for i in infos], group)
            else:  # the full grads assembled over dp_cp from the owned parts (zeros elsewhere), summed, owned kept
                full = torch.zeros(sum(i.numel for i in infos), dtype=torch.float32, device=self.device)
                owned, offset = [], 0
                for i in infos:
                    owned.append((full[offset + i.own_start - i.start:offset + i.own_end - i.start],
                                  self._grad(i.own_start, i.own_end)))
                    offset += i.numel
                for piece, grad in owned:
                    piece.copy_(grad)
                comm.all_reduce(comm.all_reduce(full, self._dp_group), group)
                for piece, grad in owned:
                    grad.copy_(piece)

    def _info_of(self, p: nn.Parameter) -> _Param:
        info = self._by_id.get(id(p))
        if info is None or info.param is not p:
            raise ValueError("sync_grads_over: a parameter not managed by this optimizer")
        return info

    def _all_reduce_slices(self, spans: list[tuple[int, int]], group: Any) -> None:
        flat = torch.cat([self._grad(a, b) for a, b in spans])
        comm.all_reduce(flat, group)
        offset = 0
        for a, b in spans:
            self._grad(a, b).copy_(flat[offset:offset + b - a])
            offset += b - a

    def _owned_alike(self, infos: list[_Param], group: Any) -> bool:
        """Whether every member of ``group`` owns the same part of each parameter (collective, cached)."""
        key = (id(group), tuple(i.index for i in infos))
        if key not in self._align_cache:
            sig = torch.tensor([[i.numel, i.own_start - i.start, i.own_end - i.start] for i in infos],
                               dtype=torch.int64, device=self.device)
            hi, lo = comm.all_reduce(sig.clone(), group, comm.ReduceOp.MAX), comm.all_reduce(sig.clone(), group, comm.ReduceOp.MIN)
            if not torch.equal(hi[:, 0], lo[:, 0]):
                raise ValueError("sync_grads_over: the group's members passed parameters of different sizes")
            alike = torch.tensor([int(torch.equal(hi, lo))], dtype=torch.int64, device=self.device)
            comm.all_reduce(alike, self._dp_group, comm.ReduceOp.MIN)  # the fallback is collective over dp_cp
            self._align_cache[key] = bool(alike.item())
        return self._align_cache[key]

    @torch.no_grad()
    def scale_grads(self, factor: float) -> None:
        """Multiply the reduced main grads by ``factor`` (fp16: undo the loss scale before the norm)."""
        self.finish_grad_sync()
        self.grad_buffer.mul_(factor)

    def zero_grad(self) -> None:
        """Zero the main grads and re-arm the reduction for the next step."""
        self.grad_buffer.zero_()
        for info in self._params:
            info.param.grad = None
            info.fresh = True
        for _, pending in self._inflight:  # (ZeRO-2) a step abandoned mid-reduction: drain it
            pending.wait()
        self._inflight.clear()
        for bucket in self._buckets:
            bucket.staged = None
            if bucket.reduce is not None:  # a step abandoned mid-reduction: drain it before reuse
                bucket.reduce.wait()
                bucket.reduce = None
            bucket.ready.clear()
            bucket.launched = False
        self._next_launch = 0
        self._synced = False

    def publish_params(self) -> None:
        """Make the model parameters equal the updated masters on every rank (ZeRO-1/2: all-gather; ZeRO-3: the
        shard, gathered at the next use)."""
        if self._zero3:
            self.units.free_all()  # type: ignore[union-attr]
            if self._master_local is not None:
                self.param_buffer.copy_(self._master_local)
            return
        if not self._sharded:
            if self._master_local is not None:  # (fp32 without ZeRO: the parameters are the masters)
                self.param_buffer.copy_(self._master_local)
            return
        local = self._master_local if self._master_local is not None else self._local_of(self.param_buffer)
        self._gather_global(local.to(self.param_dtype), out=self.param_buffer)  # a copy: no input aliases the output

    @contextlib.contextmanager
    def full_params(self) -> Iterator[None]:
        """ZeRO-3: the parameters whole on every rank for the duration (to load weights into them); afterwards this
        rank's part of them is its shard again. Other ZeRO stages: nothing to do. Collective over dp_cp (and edp)."""
        if self.units is None:
            yield
            return
        self.units.gather(list(self.units.buckets))
        try:
            yield
        finally:
            with torch.no_grad():
                for buckets in self.units.buckets.values():
                    for b in buckets:
                        self._keep_own(b)
            self.units.free_all()

    def _keep_own(self, b: _Bucket) -> None:
        """ZeRO-3: this rank's chunk of a bucket's gathered parameters into its shard."""
        lo = b.shard_start - b.start
        self._param(b.shard_start, b.shard_start + b.shard_numel).copy_(b.full[lo:lo + b.shard_numel])  # type: ignore[index]

    def _gather_global(self, local: torch.Tensor, out: torch.Tensor | None = None,
                       kind: Any = ...) -> torch.Tensor:
        """A full-buffer tensor (``out``) from this rank's shard tensor (collective over dp_cp under ZeRO); ``kind``:
        of the buckets of that ``_bucket_kind`` only (the others' regions left as they are)."""
        if not self._sharded:
            return local
        out = torch.empty(self.numel, dtype=local.dtype, device=local.device) if out is None else out
        buckets = [b for b in self._buckets if kind is ... or b.kind == kind]
        pending = [comm.all_gather_async(local[b.local_start:b.local_start + b.shard_numel], b.group,
                                         out=out[b.start:b.start + b.numel]) for b in buckets if b.sharded]
        for b in buckets:
            if not b.sharded:  # an expert bucket whose edp group is one rank: this rank holds all of it
                out[b.start:b.start + b.numel].copy_(local[b.local_start:b.local_start + b.numel])
        for p in pending:
            p.wait()
        return out

    def _local_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a full-buffer tensor (a view when not sharded)."""
        if not self._sharded:
            return full
        return torch.cat([full[b.shard_start:b.shard_start + b.shard_numel] for b in self._buckets]) \
            if self._buckets else full[:0]

    @torch.no_grad()
    def sync_master_from_params(self) -> None:
        """Re-read the fp32 masters from the (bf16) parameters, e.g. after loading weights only."""
        if self._master_local is not None:
            self._master_local.copy_(self.param_buffer if self._zero3 else self._local_of(self.param_buffer.float()))

    def remove_hooks(self) -> None:
        """Detach the gradient hooks (the parameters keep their buffer views)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
