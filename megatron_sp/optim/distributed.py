"""Data-parallel gradient reduction and the (ZeRO-1) distributed AdamW: replaces torch DDP + torch AdamW.

``DistributedOptimizer(named_params, cfg, state, zero, precision)`` takes over a model's trainable
parameters; nothing wraps the model (its gradient hooks do what DDP did). Parameters, fp32 grads
(``param.main_grad``) and master weights live in flat bucketed buffers (reverse parameter order,
each bucket padded to a multiple of dp_cp); under ZeRO-1 data-parallel rank r owns chunk r of
every bucket. Entry points: ``no_sync()`` / ``sync_grads`` (micro-batches), ``finish_grad_sync()``
(wait for the async bucket reductions, sum SP grads over TP), ``step(lr, clip)`` ->
``(grad_norm_before_clipping, stepped)`` (norm accumulated in fp64, non-finite norm skips the step,
exact ``torch.optim.AdamW`` arithmetic), ``main_grads_by_name()``, ``state_dict_by_name()`` /
``load_state_dict_by_name()`` (independent of the data-parallel size).

Theory and invariants (buffer layout, shard layout, async-reduction rules, grad-norm ownership,
the AdamW update): docs/optimizer.md.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..config import TrainConfig
from ..errors import ConfigError, DataError
from ..mpu import ParallelState, comm
from ..mpu.comm import Pending

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
STATE_KEYS = ("exp_avg", "exp_avg_sq")
NORM_CHUNK = 2**20  # elements per fp64 batch of the grad norm: an 8 MiB scratch buffer
_NormBatch = tuple[list[torch.Tensor], list[torch.Tensor], int]  # fp32 sources, their fp64 scratch slices, numel


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
    own_start: int = 0  # the owned interval [own_start, own_end) in global offsets (may be empty)
    own_end: int = 0

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
    shard_start: int = 0  # global offset of this rank's owned chunk
    shard_numel: int = 0
    local_start: int = 0  # offset of that chunk in this rank's local shard tensors
    ready: set[int] = field(default_factory=set)
    reduce: Pending | None = None
    launched: bool = False


class DistributedOptimizer:
    """Flat fp32 main grads reduced over dp_cp in overlapping buckets, AdamW on flat buffers, optional ZeRO-1.

    Args:
        named_params: ``(name, parameter)`` of every trainable parameter, in ``named_parameters``
            order (e.g. ``optim.named_trainable(model)``); the names key checkpoints and dumps.
        cfg: betas, eps and weight decay (``adam_beta1/2``, ``adam_eps``, ``weight_decay``) and the
            default ``clip_grad``.
        state: the process groups (dp_cp for gradients and shards; tp for ``sequence_parallel``
            grads and norm counting; mp for the norm). None: one process, no communication.
        zero: 0 (every rank holds the full optimizer state) or 1 (state and master weights
            sharded over dp_cp).
        precision: ``"fp32"`` (params are the fp32 masters) or ``"bf16"`` / ``"fp16"`` (params become 16-bit,
            fp32 masters kept here). Gradients always accumulate in fp32.
        bucket_bytes: target size of a bucket's fp32 gradient.

    Per step: ``zero_grad()``; for each micro-batch ``sync_grads = is_last`` (or ``with
    no_sync():`` for all but the last) and backward; ``finish_grad_sync()`` (optional: ``step``
    calls it); ``step(lr, clip)``.
    """

    def __init__(self, named_params: Sequence[tuple[str, nn.Parameter]], cfg: TrainConfig,
                 state: ParallelState | None, zero: int = 0, precision: str = "fp32",
                 bucket_bytes: int = 25 * 2**20) -> None:
        if zero not in (0, 1):
            raise ConfigError(f"parallel.zero = {zero}: must be 0 or 1")
        if precision not in PRECISIONS:
            raise ConfigError(f"precision '{precision}' is not supported by DistributedOptimizer "
                              f"(one of {sorted(PRECISIONS)})")
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes = {bucket_bytes} must be positive")
        named = list(named_params)
        seen: set[int] = set()
        for name, p in named:
            if id(p) in seen:
                raise ValueError(f"parameter '{name}' is listed twice")
            if not p.requires_grad:
                raise ValueError(f"parameter '{name}' does not require grad; pass trainable parameters only")
            seen.add(id(p))
        devices = {p.device for _, p in named}
        if len(devices) > 1:
            raise ValueError(f"parameters are on several devices {sorted(map(str, devices))}")
        self.device = devices.pop() if devices else torch.device("cpu")

        self.cfg = cfg
        self.state = state
        self.zero = zero
        self.precision = precision
        self.param_dtype = PRECISIONS[precision]
        self.bucket_bytes = bucket_bytes
        self.sync_grads = True
        self.step_count = 0
        self._dp_group = state.dp_cp_group if state is not None else None
        self.dp_size = state.dp_cp_size if state is not None else 1
        self.dp_rank = state.dp_cp_rank if state is not None else 0
        self._sharded = zero == 1 and self.dp_size > 1
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
        self._hooks = [info.param.register_post_accumulate_grad_hook(self._hook(info.index)) for info in self._params]

    # ------------------------------------------------------------------------------------ layout

    def _layout(self, named: list[tuple[str, nn.Parameter]]) -> None:
        """Assign offsets (reverse order), close buckets at ``bucket_bytes``, pad each to a multiple of dp."""
        tp_rank = self.state.tp_rank if self.state is not None else 0
        skip_shared = self.state is not None and self.state.pp_size > 1 and not self.state.is_first_stage
        offset = 0
        current: _Bucket | None = None
        for name, p in reversed(named):
            if current is None:
                current = _Bucket(index=len(self._buckets), start=offset, numel=0)
            info = _Param(index=len(self._params), name=name, param=p, start=offset, numel=p.numel(),
                          bucket=current.index, decay=p.ndim >= 2,
                          in_norm=(bool(getattr(p, "tensor_model_parallel", False)) or tp_rank == 0)
                          and not (skip_shared and getattr(p, "shared_embedding", False)))
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
            chunk = b.numel // self.dp_size if self._sharded else b.numel
            b.shard_start = b.start + (self.dp_rank * chunk if self._sharded else 0)
            b.shard_numel = chunk
            b.local_start = local
            local += chunk
            for i in b.params:
                info = self._params[i]
                info.own_start = min(max(info.start, b.shard_start), b.shard_start + chunk)
                info.own_end = max(min(info.end, b.shard_start + chunk), info.own_start)

    def _close(self, bucket: _Bucket) -> int:
        pad = -bucket.numel % self.dp_size
        bucket.numel += pad
        self._buckets.append(bucket)
        return pad

    def _build_buffers(self) -> None:
        dev, n, n_local = self.device, self.numel, self.shard_numel
        self.grad_buffer = torch.zeros(n, dtype=torch.float32, device=dev)
        self.param_buffer = torch.zeros(n, dtype=self.param_dtype, device=dev)
        self._master_local: torch.Tensor | None = None
        if self.precision != "fp32":
            self._master_local = torch.zeros(n_local, dtype=torch.float32, device=dev)
        self.exp_avg = torch.zeros(n_local, dtype=torch.float32, device=dev)
        self.exp_avg_sq = torch.zeros(n_local, dtype=torch.float32, device=dev)
        with torch.no_grad():
            for info in self._params:
                p = info.param
                if self._master_local is not None:  # the master keeps the fp32 value before the cast to bf16
                    lo, hi = self._to_local(info.own_start, info.own_end)
                    own = p.detach().reshape(-1)[info.own_start - info.start:info.own_end - info.start]
                    self._master_local[lo:hi].copy_(own)
                view = self.param_buffer[info.start:info.end].view_as(p)
                view.copy_(p.detach())
                p.data = view
                p.main_grad = self.grad_buffer[info.start:info.end].view_as(p)
                p.grad = None

        # per-bucket views of the owned elements, and the runs AdamW and the norm touch
        owned = [(b.shard_start, b.shard_numel, b.local_start) for b in self._buckets]
        self._grad_pieces = [self.grad_buffer[g:g + c] for g, c, _ in owned]
        self._master_pieces = [self._master_view(g, g + c) for g, c, _ in owned]
        self._avg_pieces = [self.exp_avg[lo:lo + c] for _, c, lo in owned]
        self._avg_sq_pieces = [self.exp_avg_sq[lo:lo + c] for _, c, lo in owned]
        self._decay_views = [self._master_view(a, b) for a, b in self._runs(lambda i: i.decay)]
        self._norm_views = [self.grad_buffer[a:b] for a, b in self._runs(lambda i: i.in_norm)]
        self._norm_scratch, self._norm_batches = self._batch_for_norm(self._norm_views)
        self._sp_params = [i.param for i in self._params if getattr(i.param, "sequence_parallel", False)]

    def _batch_for_norm(self, views: list[torch.Tensor]) -> tuple[torch.Tensor, list[_NormBatch]]:
        """An fp64 scratch buffer, and ``views`` packed into batches of at most ``NORM_CHUNK`` elements.

        ``grad_norm`` copies a batch's fp32 sources into consecutive slices of the scratch buffer
        and takes its dot product with itself. Invariant: the batches are processed one after the
        other, so one scratch buffer serves them all; memory stays at ``NORM_CHUNK`` fp64 elements
        whatever the model size.
        """
        total = sum(v.numel() for v in views)
        scratch = torch.empty(min(total, NORM_CHUNK), dtype=torch.float64, device=self.device)
        batches: list[_NormBatch] = []
        sources: list[torch.Tensor] = []
        slices: list[torch.Tensor] = []
        fill = 0
        for view in views:
            for a in range(0, view.numel(), NORM_CHUNK):
                piece = view[a:a + NORM_CHUNK]
                if fill + piece.numel() > NORM_CHUNK:
                    batches.append((sources, slices, fill))
                    sources, slices, fill = [], [], 0
                sources.append(piece)
                slices.append(scratch[fill:fill + piece.numel()])
                fill += piece.numel()
        if sources:
            batches.append((sources, slices, fill))
        return scratch, batches

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

    def _bucket_of(self, offset: int) -> int:
        for b in self._buckets:
            if b.start <= offset < b.start + b.numel:
                return b.index
        raise IndexError(offset)

    def _to_local(self, start: int, end: int) -> tuple[int, int]:
        """Local-shard offsets of an owned global interval (inside one bucket's chunk)."""
        if end == start:
            return 0, 0
        b = self._buckets[self._bucket_of(start)]
        lo = b.local_start + start - b.shard_start
        return lo, lo + end - start

    def _master_view(self, start: int, end: int) -> torch.Tensor:
        """The fp32 master weights of an owned global interval."""
        if self._master_local is None:
            return self.param_buffer[start:end]
        lo, hi = self._to_local(start, end)
        return self._master_local[lo:hi]

    # ------------------------------------------------------------------------------ grad reduction

    def _hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            self._on_grad(index)
        return hook

    def _on_grad(self, index: int) -> None:
        """Accumulate into main_grad; on the last micro-batch mark ready and launch finished buckets."""
        info = self._params[index]
        p = info.param
        if p.grad is None:
            return
        if self.sync_grads and self._synced:
            raise RuntimeError(f"gradient of '{info.name}' arrived after finish_grad_sync(); call zero_grad() "
                               "before the next step's backward")
        bucket = self._buckets[info.bucket]
        if bucket.launched:
            raise RuntimeError(f"gradient of '{info.name}' arrived after its bucket's reduction started: set "
                               "sync_grads = False (or use no_sync()) on all but the step's last micro-batch")
        p.main_grad.add_(p.grad)
        p.grad = None
        if not self.sync_grads or self.dp_size == 1:
            return
        bucket.ready.add(index)
        if len(bucket.ready) == len(bucket.params):
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next_launch < len(self._buckets) and \
                len(self._buckets[self._next_launch].ready) == len(self._buckets[self._next_launch].params):
            self._launch(self._buckets[self._next_launch])

    def _launch(self, bucket: _Bucket) -> None:
        region = self.grad_buffer[bucket.start:bucket.start + bucket.numel]
        # ZeRO-1: each rank keeps its reduced chunk; otherwise every rank needs the whole reduced bucket.
        bucket.reduce = (comm.reduce_scatter_async(region, self._dp_group) if self._sharded
                         else comm.all_reduce_async(region, self._dp_group))
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

        Idempotent within a step (``zero_grad`` re-arms it). Collective over dp_cp (and tp).
        """
        if self._synced:
            return
        if self.dp_size > 1:
            for bucket in self._buckets[self._next_launch:]:
                self._launch(bucket)
            for bucket, piece in zip(self._buckets, self._grad_pieces):
                assert bucket.reduce is not None
                reduced = bucket.reduce.wait()
                bucket.reduce = None
                if self._sharded:
                    piece.copy_(reduced)  # (an all-reduce already reduced the bucket in place)
        self._synced = True
        if self._sp_params and self.state is not None and self.state.tp_size > 1:
            self.sync_grads_over(self._sp_params, self.state.tp_group)

    def sync_grads_over(self, params: Sequence[nn.Parameter], group: Any) -> None:
        """Sum the reduced main grads of ``params`` over ``group`` in one flat all-reduce.

        For ``sequence_parallel`` grads over TP (done by ``finish_grad_sync``) and for a tied
        embedding over the embedding group (first and last pipeline stage: pass the embedding on
        one and its ``shared_embedding`` copy on the other). Call after ``finish_grad_sync``;
        every rank of ``group`` passes corresponding parameters of equal sizes in the same order.

        Under ZeRO only the owned elements are valid. When every member owns the same elements of
        each parameter (the usual case for TP: same layout on every TP rank) only those are
        all-reduced. Otherwise the full gradients are first assembled over dp_cp (one all-reduce of
        the parameters' size), then summed over ``group``. The choice is made once per
        (group, parameters) and agreed on by all ranks involved.
        """
        if comm.group_size(group) == 1 or not params:
            return
        infos = [self._info_of(p) for p in params]
        with torch.no_grad():
            if not self._sharded:
                self._all_reduce_slices([(i.start, i.end) for i in infos], group)
            elif self._owned_alike(infos, group):
                self._all_reduce_slices([(i.own_start, i.own_end) for i in infos], group)
            else:
                flat = torch.zeros(sum(i.numel for i in infos), dtype=torch.float32, device=self.device)
                offset = 0
                for i in infos:
                    flat[offset + i.own_start - i.start:offset + i.own_end - i.start] = self.grad_buffer[i.own_start:i.own_end]
                    offset += i.numel
                comm.all_reduce(flat, self._dp_group)  # every rank now has the full reduced grads
                comm.all_reduce(flat, group)
                offset = 0
                for i in infos:
                    self.grad_buffer[i.start:i.end].copy_(flat[offset:offset + i.numel])
                    offset += i.numel

    def _info_of(self, p: nn.Parameter) -> _Param:
        info = self._by_id.get(id(p))
        if info is None or info.param is not p:
            raise ValueError("sync_grads_over: a parameter not managed by this optimizer")
        return info

    def _all_reduce_slices(self, spans: list[tuple[int, int]], group: Any) -> None:
        flat = torch.cat([self.grad_buffer[a:b] for a, b in spans])
        comm.all_reduce(flat, group)
        offset = 0
        for a, b in spans:
            self.grad_buffer[a:b].copy_(flat[offset:offset + b - a])
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

    # ---------------------------------------------------------------------------------------- step

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
        for bucket in self._buckets:
            if bucket.reduce is not None:  # a step abandoned mid-reduction: drain it before reuse
                bucket.reduce.wait()
                bucket.reduce = None
            bucket.ready.clear()
            bucket.launched = False
        self._next_launch = 0
        self._synced = False

    def grad_norm(self) -> torch.Tensor:
        """The global L2 norm (fp64 scalar) of the reduced gradients, each element counted once (collective).

        Squares of fp32 values are exact in fp64, and their sums are accumulated and all-reduced
        in fp64, in batches of ``NORM_CHUNK`` elements (see ``_batch_for_norm``).
        """
        self.finish_grad_sync()
        partials = torch.zeros(len(self._norm_batches), dtype=torch.float64, device=self.device)
        for i, (sources, slices, numel) in enumerate(self._norm_batches):
            torch._foreach_copy_(slices, sources)  # fp32 → fp64
            batch = self._norm_scratch[:numel]
            torch.dot(batch, batch, out=partials[i])
        total = partials.sum()
        if self.state is not None:
            if self._sharded:
                comm.all_reduce(total, self._dp_group)
            if self.state.tp_size * self.state.pp_size > 1:
                comm.all_reduce(total, self.state.mp_group)
        return total.sqrt()

    @torch.no_grad()
    def step(self, lr: float, clip: float | None = None) -> tuple[float, bool]:
        """Clip and apply AdamW; returns (grad norm before clipping, whether the update was applied).

        ``clip`` None: ``cfg.clip_grad``; 0 disables clipping. A non-finite norm skips the update.
        Collective over dp_cp, tp (via ``finish_grad_sync``) and mp.
        """
        clip = self.cfg.clip_grad if clip is None else clip
        norm = self.grad_norm()
        norm_value = float(norm)
        if not math.isfinite(norm_value):
            return norm_value, False
        if clip > 0 and self._grad_pieces:
            coeff = torch.clamp(clip / (norm + 1e-6), max=1.0)  # fp64, from the fp64 norm
            torch._foreach_mul_(self._grad_pieces, coeff.to(torch.float32))
        self._adamw(lr)
        self._publish_params()
        return norm_value, True

    def _adamw(self, lr: float) -> None:
        cfg = self.cfg
        beta1, beta2, eps = cfg.adam_beta1, cfg.adam_beta2, cfg.adam_eps
        self.step_count += 1
        if not self._grad_pieces:
            return
        if self._decay_views and lr * cfg.weight_decay != 0:
            torch._foreach_mul_(self._decay_views, 1 - lr * cfg.weight_decay)
        step_size = lr / (1 - beta1 ** self.step_count)
        bias_correction2_sqrt = (1 - beta2 ** self.step_count) ** 0.5
        for g, m, v, w in zip(self._grad_pieces, self._avg_pieces, self._avg_sq_pieces, self._master_pieces):
            m.lerp_(g, 1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            denom = (v.sqrt() / bias_correction2_sqrt).add_(eps)  # temporary: one bucket chunk
            w.addcdiv_(m, denom, value=-step_size)

    def _publish_params(self) -> None:
        """Make the model parameters equal the updated masters on every rank (ZeRO: all-gather)."""
        if self._master_local is not None and not self._sharded:
            self.param_buffer.copy_(self._master_local)
            return
        if not self._sharded:
            return  # fp32 without ZeRO: the parameters are the masters
        pending = []
        for b, w in zip(self._buckets, self._master_pieces):
            own = w.to(self.param_dtype, copy=True)  # a copy: the input must not alias the output
            region = self.param_buffer[b.start:b.start + b.numel]
            pending.append(comm.all_gather_async(own, self._dp_group, out=region))
        for p in pending:
            p.wait()

    # ------------------------------------------------------------------------------ state by name

    def _gather_global(self, local: torch.Tensor) -> torch.Tensor:
        """A full-buffer tensor from this rank's shard tensor (collective over dp_cp under ZeRO)."""
        if not self._sharded:
            return local
        out = torch.empty(self.numel, dtype=local.dtype, device=local.device)
        pending = [comm.all_gather_async(local[b.local_start:b.local_start + b.shard_numel], self._dp_group,
                                         out=out[b.start:b.start + b.numel]) for b in self._buckets]
        for p in pending:
            p.wait()
        return out

    def _local_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a full-buffer tensor (a view when not sharded)."""
        if not self._sharded:
            return full
        return torch.cat([full[b.shard_start:b.shard_start + b.shard_numel] for b in self._buckets]) \
            if self._buckets else full[:0]

    def main_grads_by_name(self) -> dict[str, torch.Tensor]:
        """{name: full reduced fp32 main grad, this TP rank's parameter shape} (collective over dp_cp under ZeRO).

        Call after ``finish_grad_sync`` (and before ``step``, which clips in place) — e.g. for the
        parity dump: ``gather_full(named, state, lambda p: grads[name_of[p]])``.
        """
        self.finish_grad_sync()
        full = self._gather_global(self._local_of(self.grad_buffer)) if self._sharded else self.grad_buffer
        return {i.name: full[i.start:i.end].view_as(i.param).clone() for i in self._params}

    def checkpoint_parts(self) -> dict[str, tuple[int, dict[str, torch.Tensor]]]:
        """{name: (start, {"param", "exp_avg", "exp_avg_sq"[, "master_param"]: flat tensor})}: what this rank saves.

        Data-parallel rank ``r`` saves chunk ``r`` of every bucket — the elements ZeRO-1 makes it
        own, and the same split without ZeRO (every rank holds everything then, and the writing is
        spread over dp_cp all the same). ``start`` is the part's first element in the parameter's
        flattened (this TP rank's) shape; the tensors are views. No communication.
        """
        out: dict[str, tuple[int, dict[str, torch.Tensor]]] = {}
        for info in self._params:
            b = self._buckets[info.bucket]
            chunk = b.numel // self.dp_size
            lo = min(max(info.start, b.start + self.dp_rank * chunk), info.end)
            hi = max(min(info.end, b.start + (self.dp_rank + 1) * chunk), lo)
            if hi == lo:
                continue
            a, z = self._to_local(lo, hi)
            parts = {"param": self.param_buffer[lo:hi], "exp_avg": self.exp_avg[a:z], "exp_avg_sq": self.exp_avg_sq[a:z]}
            if self._master_local is not None:
                parts["master_param"] = self._master_local[a:z]
            out[info.name] = (lo - info.start, parts)
        return out

    def state_dict_by_name(self) -> dict[str, dict[str, torch.Tensor]]:
        """{name: {"exp_avg", "exp_avg_sq", "step"[, "master_param"]}}: parameter-shaped fp32, same at any dp.

        ``master_param`` (bf16 only) is the fp32 master weight. Collective over dp_cp under ZeRO.
        """
        full = {"exp_avg": self._gather_global(self.exp_avg), "exp_avg_sq": self._gather_global(self.exp_avg_sq)}
        if self._master_local is not None:
            full["master_param"] = self._gather_global(self._master_local)
        step = torch.tensor(float(self.step_count))
        return {i.name: {**{k: v[i.start:i.end].view_as(i.param).clone() for k, v in full.items()}, "step": step.clone()}
                for i in self._params}

    @torch.no_grad()
    def load_state_dict_by_name(self, saved: dict[str, dict[str, torch.Tensor]]) -> None:
        """Restore from ``state_dict_by_name`` output (of any dp size), keeping this rank's part.

        Tensors are this TP rank's parameter shape (slice TP shards before calling). Load the
        model weights first: the masters are refreshed from the parameters, then overridden by
        ``master_param`` where present (bf16 runs write it; for fp32 it is copied into the params).
        """
        names = {i.name for i in self._params}
        if set(saved) != names:
            missing, unknown = sorted(names - set(saved)), sorted(set(saved) - names)
            raise DataError(f"optimizer state does not match the model: missing {missing[:5]}, unknown {unknown[:5]}")
        steps = {float(v["step"]) for v in saved.values() if "step" in v}
        if len(steps) > 1:
            raise DataError(f"optimizer state has different step counts {sorted(steps)}")
        full = {k: torch.zeros(self.numel, dtype=torch.float32, device=self.device)
                for k in (*STATE_KEYS, "master_param")}
        has_master = True
        for info in self._params:
            entry = saved[info.name]
            for key in (*STATE_KEYS, "master_param"):
                value = entry.get(key)
                if value is None:
                    if key != "master_param":
                        raise DataError(f"optimizer state of '{info.name}' has no '{key}'")
                    has_master = False
                    continue
                if tuple(value.shape) != tuple(info.param.shape):
                    raise DataError(f"optimizer state '{key}' of '{info.name}' has shape {tuple(value.shape)}, "
                                    f"the parameter {tuple(info.param.shape)}")
                full[key][info.start:info.end].copy_(value.reshape(-1))
        self.exp_avg.copy_(self._local_of(full["exp_avg"]))
        self.exp_avg_sq.copy_(self._local_of(full["exp_avg_sq"]))
        self.step_count = int(steps.pop()) if steps else 0
        if has_master and self._params:
            if self._master_local is not None:
                self._master_local.copy_(self._local_of(full["master_param"]))
                self.param_buffer.copy_(full["master_param"])
            else:
                self.param_buffer.copy_(full["master_param"])
        else:
            self.sync_master_from_params()

    @torch.no_grad()
    def sync_master_from_params(self) -> None:
        """Re-read the fp32 masters from the (bf16) parameters, e.g. after loading weights only."""
        if self._master_local is not None:
            self._master_local.copy_(self._local_of(self.param_buffer.float()))

    def remove_hooks(self) -> None:
        """Detach the gradient hooks (the parameters keep their buffer views)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
