"""``DistributedOptimizer``: ``reducer.GradReducer`` plus the fp64 norm, clip and AdamW of ``adamw`` and the optimizer
state by name (checkpoints, parity dumps); replaces torch DDP + torch AdamW. Theory: docs/optimizer.md.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import nn

from ..config import ModelConfig, TrainConfig
from ..errors import DataError
from ..mpu import ParallelState, comm
from ..mpu.layers import shard
from ..mpu.sharding import is_sharded
from .adamw import AdamGroup, NormBatches, adamw_, clip_, global_norm
from .muon import is_muon_param, muon_owners, orthogonalised
from .reducer import GradReducer

STATE_KEYS = ("exp_avg", "exp_avg_sq")


class DistributedOptimizer(GradReducer):
    """``GradReducer`` plus AdamW on flat buffers (ZeRO-1/2/3 also shard the moments); ``cfg``: AdamW betas, eps,
    weight decay, default ``clip_grad``, ``optimizer`` (``muon``: Muon for ``muon.is_muon_param`` weights, its momentum
    in ``exp_avg``; ``model_cfg`` then names their logical matrices). Per step: ``zero_grad()``; per micro-batch
    ``sync_grads = is_last`` (or ``no_sync()``) and backward; ``step(lr, clip)``."""

    def __init__(self, named_params: Sequence[tuple[str, nn.Parameter]], cfg: TrainConfig,
                 state: ParallelState | None, zero: int = 0, precision: str = "fp32",
                 bucket_bytes: int = 25 * 2**20, unit_of: Callable[[str], str] | None = None, prefetch: int = 1,
                 model_cfg: ModelConfig | None = None) -> None:
        self.cfg = cfg  # (read by _bucket_kind while the buckets are laid out)
        super().__init__(named_params, state, zero, precision, bucket_bytes, unit_of, prefetch)
        self.model_cfg = model_cfg
        self._muon = [i for i in self._params if self._buckets[i.bucket].kind]  # (Muon's buckets: _bucket_kind)
        if self._muon and model_cfg is None:
            raise ValueError("train.optimizer=muon needs model_cfg (the logical matrices of the fused weights)")
        muon_ids = {i.index for i in self._muon}
        self.step_count = 0
        n_local = self.shard_numel
        self.exp_avg = torch.zeros(n_local, dtype=torch.float32, device=self.device)
        # exp_avg_sq: AdamW's buckets only (Muon's are buckets of their own: its momentum is exp_avg), compact
        self._sq_start, n_sq = {}, 0
        for b in self._buckets:
            if not b.kind:
                self._sq_start[b.index], n_sq = n_sq, n_sq + b.shard_numel
        self.exp_avg_sq = torch.zeros(n_sq, dtype=torch.float32, device=self.device)
        self._sq_shift = {i: start - self._buckets[i].local_start for i, start in self._sq_start.items()}
        # AdamW's two weight-decay groups as runs of owned elements, and the runs the norm reads
        self._adam = {decays: self._views(self._runs(lambda i, d=decays: i.decay == d and i.index not in muon_ids))
                      for decays in (True, False)}
        self._muon_spans = self._runs(lambda i: i.index in muon_ids)
        self._muon_owners = muon_owners(self._muon, self._buckets, state.tp_size if state is not None else 1,
                                        cfg.muon_ns_steps)
        self._muon_views = self._views(self._muon_spans, adam=False)
        self._norm = NormBatches([self._grad(a, b) for a, b in self._runs(lambda i: i.in_norm and not i.expert)],
                                 self.device)
        self._expert_norm = None if self._ep == 1 else (  # ep > 1: every rank of the stage takes part
            NormBatches([self._grad(a, b) for a, b in self._runs(lambda i: i.in_norm and i.expert)], self.device),
            any(b.sharded for b in self._buckets if b.expert))

    def _bucket_kind(self, name: str, param: nn.Parameter) -> bool:
        return self.cfg.optimizer == "muon" and is_muon_param(name, param)

    def _views(self, runs: list[tuple[int, int]], adam: bool = True) -> AdamGroup:
        """(masters, grads, exp_avg, exp_avg_sq (``adam``; else none)) views of the owned global intervals ``runs``."""
        group: AdamGroup = ([], [], [], [])
        for a, b in runs:
            lo, hi = self._to_local(a, b)
            for views, view in zip(group, (self._master_view(a, b), self._grad(a, b), self.exp_avg[lo:hi])):
                views.append(view)
            if adam:
                shift = self._sq_shift[self._bucket_at(a).index]
                group[3].append(self.exp_avg_sq[lo + shift:hi + shift])
        return group

    def _sq_pairs(self, local: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(``exp_avg_sq`` chunk, the same bucket's chunk of the local-shard layout tensor ``local``) per AdamW bucket."""
        return [(self.exp_avg_sq[start:start + self._buckets[i].shard_numel],
                 local[start - self._sq_shift[i]:start - self._sq_shift[i] + self._buckets[i].shard_numel])
                for i, start in self._sq_start.items()]

    def _sq_local(self) -> torch.Tensor:
        """``exp_avg_sq`` in the local-shard layout (zeros in Muon's buckets)."""
        out = torch.zeros(self.shard_numel, dtype=torch.float32, device=self.device)
        for compact, part in self._sq_pairs(out):
            part.copy_(compact)
        return out

    def grad_norm(self) -> torch.Tensor:
        """The global L2 norm (fp64 scalar) of the reduced gradients, each element counted once (collective)."""
        self.finish_grad_sync()
        return global_norm(self._norm, self.state, self._sharded, self._dp_group, self._expert_norm)

    @torch.no_grad()
    def step(self, lr: float, clip: float | None = None) -> tuple[float, bool]:
        """Clip and apply AdamW; returns (grad norm before clipping, whether the update was applied).
        ``clip`` None: ``cfg.clip_grad``; 0: no clipping. A non-finite norm skips the update. Collective."""
        clip = self.cfg.clip_grad if clip is None else clip
        norm = self.grad_norm()
        norm_value = float(norm)
        if not math.isfinite(norm_value):
            return norm_value, False
        clip_(self._grad_pieces, norm, clip)
        self.step_count += 1
        adamw_(self.cfg, lr, self.step_count, self._adam)
        if self._muon:
            self._muon_step(lr)
        self.publish_params()
        return norm_value, True

    def _muon_step(self, lr: float) -> None:
        """Muon on the owned elements' momentum, each logical matrix orthogonalised whole by one owner: the updates of
        the owned elements are all-gathered over each bucket's group (ZeRO), a TP-split weight over TP; the owner (a
        rank of the bucket's group, ``_muon_owners``: balanced by Newton–Schulz FLOPs) orthogonalises it (the same
        full matrix as one rank's run) and the others get their elements back by a reduce-scatter (ZeRO; an
        all-reduce without) of the owners' results, zeros elsewhere: exact. Collective."""
        t = self.cfg
        masters, grads, bufs, _ = self._muon_views
        torch._foreach_lerp_(bufs, grads, 1.0 - t.muon_momentum)  # buf = μ·buf + (1-μ)·g
        local = torch.zeros(self.shard_numel, dtype=torch.float32, device=self.device)
        for (a, b), grad, buf in zip(self._muon_spans, grads, bufs):
            lo, hi = self._to_local(a, b)
            torch.lerp(grad, buf, t.muon_momentum, out=local[lo:hi]) if t.muon_nesterov else local[lo:hi].copy_(buf)
        full = self._gather_global(local, kind=True)  # (Muon's buckets only)
        ortho = torch.zeros(self.numel, dtype=torch.float32, device=self.device)  # the owners' results
        tp, tp_rank = (self.state.tp_size, self.state.tp_rank) if self.state is not None else (1, 0)
        for info in self._muon:
            if self._muon_owners[info.index] != self._buckets[info.bucket].rank:
                continue
            p = info.param
            update = full[info.start:info.end].view(p.shape)
            split = tp > 1 and is_sharded(p)
            if split:  # (every TP rank of the owner's data-parallel rank takes part)
                update = comm.all_gather(update.contiguous(), self.state.tp_group, dim=p.partition_dim)  # type: ignore[union-attr]
            update = orthogonalised(info.name, update, self.model_cfg, t)  # type: ignore[arg-type]
            ortho[info.start:info.end] = (shard(update, p.partition_dim, tp_rank, tp) if split else update).reshape(-1)
        for b in {self._buckets[i.bucket].index: self._buckets[i.bucket] for i in self._muon}.values():
            region = ortho[b.start:b.start + b.numel]
            if b.sharded:  # this rank's chunk, where its own elements are
                ortho[b.shard_start:b.shard_start + b.shard_numel] = comm.reduce_scatter(region, b.group)
            else:
                comm.all_reduce(region, b.group)
        for info in self._muon:
            if info.own_end > info.own_start:
                own = ortho[info.own_start:info.own_end]
                self._master_view(info.own_start, info.own_end).mul_(1.0 - lr * t.weight_decay).add_(own, alpha=-lr)

    def main_grads_by_name(self) -> dict[str, torch.Tensor]:
        """{name: full reduced fp32 main grad, this TP rank's parameter shape} (collective over dp_cp under ZeRO).
        Call before ``step``, which clips in place."""
        self.finish_grad_sync()
        local = self.grad_buffer if self._zero2 else self._local_of(self.grad_buffer)
        full = self._gather_global(local) if self._sharded else self.grad_buffer
        return {i.name: full[i.start:i.end].view_as(i.param).clone() for i in self._params}

    def checkpoint_parts(self) -> dict[str, tuple[int, dict[str, torch.Tensor]]]:
        """{name: (start, {"param", "exp_avg", "exp_avg_sq"[, "master_param"]: flat view})}: what this rank saves.
        Data-parallel rank ``r`` saves chunk ``r`` of every bucket, with or without ZeRO (the writing is spread over
        dp_cp); ``start`` is the part's first element in the flattened parameter."""
        out: dict[str, tuple[int, dict[str, torch.Tensor]]] = {}
        sq = self._sq_local()
        for info in self._params:
            b = self._buckets[info.bucket]
            chunk = b.numel // b.size  # (expert buckets: edp rank r writes chunk r; the ep ranks hold other experts)
            lo = min(max(info.start, b.start + b.rank * chunk), info.end)
            hi = max(min(info.end, b.start + (b.rank + 1) * chunk), lo)
            if hi == lo:
                continue
            a, z = self._to_local(lo, hi)
            parts = {"param": self._param(lo, hi), "exp_avg": self.exp_avg[a:z], "exp_avg_sq": sq[a:z]}
            if self._master_local is not None:
                parts["master_param"] = self._master_local[a:z]
            out[info.name] = (lo - info.start, parts)
        return out

    def state_dict_by_name(self) -> dict[str, dict[str, torch.Tensor]]:
        """{name: {"exp_avg", "exp_avg_sq", "step"[, "master_param"]}}: parameter-shaped fp32, same at any dp.
        ``master_param``: the fp32 master (16-bit params only). Collective over dp_cp under ZeRO."""
        full = {k: self._gather_global(self.exp_avg if k == "exp_avg" else self._sq_local()) for k in STATE_KEYS}
        if self._master_local is not None:
            full["master_param"] = self._gather_global(self._master_local)
        step = torch.tensor(float(self.step_count))
        return {i.name: {**{k: v[i.start:i.end].view_as(i.param).clone() for k, v in full.items()}, "step": step.clone()}
                for i in self._params}

    @torch.no_grad()
    def load_state_dict_by_name(self, saved: dict[str, dict[str, torch.Tensor]]) -> None:
        """Restore from ``state_dict_by_name`` output (of any dp size, this TP rank's shapes), keeping this
        rank's part. Load the model weights first: without ``master_param`` the masters are read from them."""
        names = {i.name for i in self._params}
        if set(saved) != names:
            missing, unknown = sorted(names - set(saved)), sorted(set(saved) - names)
            raise DataError(f"optimizer state does not match the model: missing {missing[:5]}, unknown {unknown[:5]}")
        steps = {float(v["step"]) for v in saved.values() if "step" in v}
        if len(steps) > 1:
            raise DataError(f"optimizer state has different step counts {sorted(steps)}")
        has_master = all(saved[i.name].get("master_param") is not None for i in self._params)
        keys = (*STATE_KEYS, "master_param") if has_master else STATE_KEYS
        full = {k: torch.zeros(self.numel, dtype=torch.float32, device=self.device) for k in keys}
        for info in self._params:
            for key in keys:
                value = saved[info.name].get(key)
                if value is None:
                    raise DataError(f"optimizer state of '{info.name}' has no '{key}'")
                if tuple(value.shape) != tuple(info.param.shape):
                    raise DataError(f"optimizer state '{key}' of '{info.name}' has shape {tuple(value.shape)}, "
                                    f"the parameter {tuple(info.param.shape)}")
                full[key][info.start:info.end].copy_(value.reshape(-1))
        self.exp_avg.copy_(self._local_of(full["exp_avg"]))
        for compact, part in self._sq_pairs(self._local_of(full["exp_avg_sq"])):
            compact.copy_(part)
        self.step_count = int(steps.pop()) if steps else 0
        if has_master and self._params:
            if self._master_local is not None:
                self._master_local.copy_(self._local_of(full["master_param"]))
            self.param_buffer.copy_(self._local_of(full["master_param"]) if self._zero3 else full["master_param"])
        else:
            self.sync_master_from_params()
