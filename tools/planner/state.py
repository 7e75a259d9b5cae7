"""Parameters, fp32 main gradients and optimizer state per rank: the real stage and optimizer on the meta device."""
from __future__ import annotations

import dataclasses
import types
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from megatron_sp.config.schema import Config
from megatron_sp.model.gpt import param_unit
from megatron_sp.model.moe import Experts, Router
from megatron_sp.model.transformer import arch_spec
from megatron_sp.mpu.parallel_state import ParallelContext
from megatron_sp.optim import DistributedOptimizer, named_trainable
from megatron_sp.mpu.sharding import full_shape, is_sharded
from megatron_sp.mpu.zero3 import Entry
from megatron_sp.optim.muon import ns_flops
from megatron_sp.pipeline.partition import build_stage

from .dims import DEFAULT_BUCKET_BYTES, dims_of

VOCAB_TABLES = ("embedding.weight", "output_layer.weight")
_STAGES: dict[tuple[object, ...], tuple[list[tuple[str, nn.Parameter]], list[list[Entry]]]] = {}


class _NoInitDraws(TorchFunctionMode):
    """Skips ``Tensor.normal_`` (in place, returns its input): on meta tensors the init draws compute nothing
    yet cost milliseconds each; shapes and attributes do not depend on them."""

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict | None = None) -> Any:
        if func is torch.Tensor.normal_:
            return args[0]
        return func(*args, **(kwargs or {}))


def stage_parameters(cfg: Config, pp_rank: int = 0) -> list[tuple[str, nn.Parameter]]:
    """Stage ``pp_rank``'s trainable parameters as one TP rank holds them: meta tensors of the local shape and
    the model's TP/SP attributes, built by ``pipeline.build_stage`` at TP size 1 and then given the rules the
    layers apply at ``tp`` (docs/planner.md, "Parameters, gradients, optimizer state"); a MoE layer's routed experts
    (``expert_parallel``: ``[E, out, in]`` stacks) are cut to the E/ep of expert-parallel rank 0 and, under expert
    tensor parallelism (``parallel.expert_tp`` = tp), take the TP tags ``moe.Experts`` gives them at that size."""
    D, p = dims_of(cfg), cfg.parallel
    key = _stage_key(cfg, pp_rank)
    if key in _STAGES:  # a search asks for each stage many times
        return _STAGES[key][0]
    where = types.SimpleNamespace(pp_size=D.pp, pp_rank=pp_rank, is_first_stage=pp_rank == 0,
                                  is_last_stage=pp_rank == D.pp - 1)
    with torch.device("meta"), _NoInitDraws():
        stage = build_stage(cfg.model, 0, where, ParallelContext(sequence_parallel=D.sp), virtual_stages=D.virtual_stages,
                            partition=p.pp_partition)
    built = {id(q): getattr(mod, "tp_size", 1) for mod in stage.modules() for q in mod.parameters(recurse=False)}
    norms = {id(q) for mod in stage.modules() if isinstance(mod, nn.LayerNorm | nn.RMSNorm) for q in mod.parameters()}
    named = named_trainable(stage)
    routers = {id(mod.weight) for mod in stage.modules() if isinstance(mod, Router)}
    etp = _expert_tp_tags(cfg) if D.etp > 1 else {}
    for name, q in named:  # ``moe.MoE``'s rules at (tp, ep, expert_tp): it sees tp 1 and ep 1 here
        if getattr(q, "expert_parallel", False):
            for attr, value in etp.get(".".join(name.split(".")[-2:]), {}).items():
                setattr(q, attr, value)  # split on ``partition_dim`` by the TP rule below
            if D.ep > 1:  # built with all E experts (meta: no memory); ep rank 0's E/ep
                q.data = q.new_empty((q.shape[0] // D.ep, *q.shape[1:]))
                q.ep_rank, q.ep_size = 0, D.ep
            # under SP every TP rank holding all experts sums their grads; so do the TP ranks the down/fc2 bias of
            # expert TP (its tag from ``Experts``, kept by ``MoE``)
            q.sequence_parallel = D.sp and D.ep == 1 or bool(getattr(q, "sequence_parallel", False))
        elif id(q) in routers:
            q.sequence_parallel = D.sp  # under SP each TP rank routes its own tokens
    for name, q in named:
        if built[id(q)] == D.tp:
            continue
        if not D.kv_split and ".attention.qkv." in name:
            q.tensor_model_parallel, q.partition_dim, q.sequence_parallel = False, -1, True
        elif getattr(q, "tensor_model_parallel", False) and q.partition_dim >= 0:
            shape = list(q.shape)
            shape[q.partition_dim] = shape[q.partition_dim] * built[id(q)] // D.tp
            q.data = q.new_empty(shape)
        q.sequence_parallel = q.sequence_parallel or (D.sp and id(q) in norms)
    last = len(stage.layer_chunks) - 1
    entries = [stage.unit_plan(c, head=stage.post_process and c == last, mtp=stage.post_process and c == last)
               for c in range(last + 1)]
    _STAGES[key] = named, entries
    return named


def stage_entries(cfg: Config, pp_rank: int = 0) -> list[list[Entry]]:
    """Per model chunk of stage ``pp_rank``, the entries its training forward runs in order (``GPTModel.unit_plan``:
    the embedding, each layer, the head, each MTP module's embedding lookup and layer + head)."""
    stage_parameters(cfg, pp_rank)
    return _STAGES[_stage_key(cfg, pp_rank)][1]


def _expert_tp_tags(cfg: Config) -> dict[str, dict[str, object]]:
    """{``gate.weight``, ...: the TP tags} of ``moe.Experts`` built over ``expert_tp`` ranks (one expert, on meta)."""
    D = dims_of(cfg)
    with torch.device("meta"):
        probe = Experts(1, D.h, D.moe_ffn, arch_spec(D.arch), D.etp)
    return {name: {attr: getattr(q, attr) for attr in ("tensor_model_parallel", "partition_dim", "sequence_parallel")}
            for name, q in probe.named_parameters()}


@dataclass
class StateBytes:
    """Per-rank bytes of the parameters, fp32 main gradients and optimizer state (exact)."""

    params: int
    grads: int
    optim: int
    param_elements: int
    padded_elements: int  # of the flat buffers, bucket padding (to a multiple of dp·cp) included
    shard_elements: int
    expert_elements: int  # of ``padded_elements``, the expert buckets' (ep > 1: reduced and ZeRO-sharded over edp)
    tp_synced: int  # elements of ``sequence_parallel`` gradients this rank sums over TP after the dp·cp reduction
    vocab_tables: int  # embedding / output layer on this stage: each has ``padded_vocab − vocab`` padding rows
    param_dtype: str
    master: bool
    staged: list[int]  # ZeRO-2/3: elements of each sharded bucket (its fp32 staging buffer while its gradients arrive)
    units: dict[str, tuple[int, int]]  # ZeRO-3: elements of each unit's sharded buckets (dense, expert), gathered per use
    muon: tuple[int, int] = (0, 0)  # train.optimizer=muon: elements of Muon's buckets (dense, expert), padded
    muon_tp_split: int = 0  # of Muon's weights, this rank's elements of those split over TP (gathered by the owner)
    muon_flops: float = 0.0  # Newton–Schulz FLOPs of the stage's Muon weights (whole), shared by the owners

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optim


_STATE: dict[tuple[object, ...], StateBytes] = {}


def _stage_key(cfg: Config, pp_rank: int) -> tuple[object, ...]:
    D = dims_of(cfg)
    model = repr(dataclasses.replace(cfg.model, recompute="none"))  # the parameters do not depend on recompute
    return (model, D.tp, D.sp, D.pp, D.virtual_stages, cfg.parallel.pp_partition, D.ep, D.etp, pp_rank)


def _runs(named: list[tuple[str, nn.Parameter]], ep: int) -> list[tuple[bool, list[tuple[str, nn.Parameter]]]]:
    """``named`` cut into maximal runs of expert / other parameters (one run at ep 1, where experts are reduced with
    the rest): ``GradReducer`` closes a bucket wherever the kind changes, so each run has its own buckets."""
    runs: list[tuple[bool, list[tuple[str, nn.Parameter]]]] = []
    for name, q in named:
        expert = ep > 1 and bool(getattr(q, "expert_parallel", False))
        if not runs or runs[-1][0] != expert:
            runs.append((expert, []))
        runs[-1][1].append((name, q))
    return runs


def state_bytes(cfg: Config, pp_rank: int = 0, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> StateBytes:
    """The sizes of ``DistributedOptimizer``'s ``param_buffer``, ``grad_buffer``, ``exp_avg``/``exp_avg_sq``
    and fp32 masters on data-parallel rank 0 of stage ``pp_rank``: the real optimizer over the meta stage (ZeRO-2: its
    ``grad_buffer`` is the fp32 shard; ZeRO-3: ``param_buffer`` too, each bucket one unit's, ``param_unit``); the
    sharded buckets' sizes go with them for the temporaries (``planner.zero``).

    Under expert parallelism (ep > 1) the optimizer puts the expert parameters in buckets of their own, padded,
    reduced and ZeRO-sharded over edp instead of dp·cp; here each run of expert (or other) parameters gets its own
    optimizer over a stand-in group of that size (edp or dp·cp). The buckets are the same as the real optimizer's
    (it closes a bucket where the kind changes), so the sums are exact."""
    D = dims_of(cfg)
    key = (*_stage_key(cfg, pp_rank), D.dp_cp, D.edp, D.zero, D.precision, bucket_bytes, cfg.train.optimizer)
    if key in _STATE:
        return _STATE[key]
    named = stage_parameters(cfg, pp_rank)
    sizes = {"params": 0, "grads": 0, "optim": 0, "padded": 0, "shard": 0, "expert": 0, "tp_synced": 0}
    staged: list[int] = []
    units: dict[str, tuple[int, int]] = {}
    muon, muon_tp, flops = (0, 0), 0, 0.0
    for expert, run in _runs(named, D.ep):
        size = D.edp if expert else D.dp_cp
        groups = types.SimpleNamespace(dp_cp_group=None, dp_cp_size=size, dp_cp_rank=0, tp_rank=0, tp_size=D.tp,
                                       pp_size=D.pp, is_first_stage=pp_rank == 0)  # read at construction only
        opt = DistributedOptimizer(run, cfg.train, groups, zero=D.zero, precision=D.precision, bucket_bytes=bucket_bytes,
                                   unit_of=param_unit, model_cfg=cfg.model)
        opt.remove_hooks()
        staged += [b.numel for b in opt._buckets if b.sharded] if D.zero >= 2 else []
        for unit, buckets in (opt.units.buckets if opt.units is not None else {}).items():
            dense, experts = units.get(unit, (0, 0))
            n = sum(b.numel for b in buckets)
            units[unit] = (dense, experts + n) if expert else (dense + n, experts)
        moments = [opt.exp_avg, opt.exp_avg_sq] + ([opt._master_local] if opt._master_local is not None else [])
        sizes["params"] += opt.param_buffer.numel() * opt.param_buffer.element_size()
        sizes["grads"] += opt.grad_buffer.numel() * 4
        sizes["optim"] += sum(t.numel() * t.element_size() for t in moments)
        sizes["padded"] += opt.numel
        sizes["shard"] += opt.shard_numel
        sizes["expert"] += opt.numel if expert else 0
        sizes["tp_synced"] += sum(i.own_end - i.own_start for i in (opt._info_of(q) for _, q in run if q.sequence_parallel))
        muon_numel = sum(b.numel for b in opt._buckets if b.kind)
        muon = (muon[0], muon[1] + muon_numel) if expert else (muon[0] + muon_numel, muon[1])
        muon_tp += sum(i.numel for i in opt._muon if is_sharded(i.param)) if D.tp > 1 else 0
        flops += sum(ns_flops(full_shape(i.param, D.tp), cfg.train.muon_ns_steps) for i in opt._muon)
    _STATE[key] = StateBytes(
        params=sizes["params"], grads=sizes["grads"], optim=sizes["optim"], param_elements=sum(q.numel() for _, q in named),
        padded_elements=sizes["padded"], shard_elements=sizes["shard"], expert_elements=sizes["expert"],
        tp_synced=sizes["tp_synced"], vocab_tables=sum(n in VOCAB_TABLES for n, _ in named), param_dtype=D.precision,
        master=D.precision != "fp32", staged=staged, units=units, muon=muon, muon_tp_split=muon_tp, muon_flops=flops)
    return _STATE[key]
