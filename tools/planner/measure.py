"""``--verify``: the real training code on gloo ranks, measured through its hooks (``pipeline.executor.observe``,
``comm.count``, saved-tensor hooks) and put beside the plan; nothing is replaced."""
from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from megatron_sp import config as config_mod
from megatron_sp import training
from megatron_sp.data.batching import mtp_targets, rank_batch
from megatron_sp.model.gpt import GPTModel
from megatron_sp.mpu import ParallelContext, comm
from megatron_sp.mpu.memory import default_gather_buffer
from megatron_sp.mpu.random import get_tracker, init_rng
from megatron_sp.optim import DistributedOptimizer, named_trainable
from megatron_sp.pipeline import executor
from megatron_sp.testing import run_distributed

from .layouts import LayoutPlan, plan_layout


class _Packed:
    """A saved tensor held by ``SavedBytes``: its release (autograd frees the saved variable) is counted."""

    __slots__ = ("owner", "ptr", "tensor")

    def __init__(self, tensor: torch.Tensor, ptr: int, owner: SavedBytes) -> None:
        self.tensor, self.ptr, self.owner = tensor, ptr, owner

    def __del__(self) -> None:
        self.owner._release(self.ptr)


class SavedBytes:
    """Storages autograd saves inside ``record()``, parameters left out (``exclude``: their addresses, or their
    identities as ``parameter_exclusions`` gives them): ``nbytes`` of the distinct
    storages saved, ``peak`` of those alive at once (a storage counts from its first save until autograd
    releases its last use; tensors other references keep alive, e.g. zero-bubble's deferred weight-gradient
    inputs, are not seen)."""

    def __init__(self, exclude: set[int]) -> None:
        self.exclude = exclude
        self.storages: dict[int, int] = {}
        self.refs: dict[int, int] = {}
        self.live = self.peak = 0

    def _pack(self, t: torch.Tensor) -> Any:
        storage = t.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if ptr in self.exclude or storage._cdata in self.exclude or not nbytes:
            return t
        if not self.refs.get(ptr):
            self.storages[ptr] = nbytes
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        self.refs[ptr] = self.refs.get(ptr, 0) + 1
        return _Packed(t, ptr, self)

    def _release(self, ptr: int) -> None:
        self.refs[ptr] -= 1
        if not self.refs[ptr]:
            del self.refs[ptr]
            self.live -= self.storages[ptr]

    def record(self) -> Any:
        return torch.autograd.graph.saved_tensors_hooks(
            self._pack, lambda packed: packed.tensor if isinstance(packed, _Packed) else packed)

    @property
    def nbytes(self) -> int:
        return sum(self.storages.values())


def _param_storages(optimizer: Any, model: Any) -> dict[int, int]:
    """Bytes of each parameter storage (``param_buffer`` and any outside it) by address."""
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in [optimizer.param_buffer, *model.parameters()]}


def measure_state(optimizer: Any, model: Any) -> dict[str, int]:
    """Bytes of the parameters, the fp32 main gradients (``grad_buffer``) and the optimizer state (Adam moments,
    fp32 masters) a rank holds."""
    optim = [optimizer.exp_avg, optimizer.exp_avg_sq, getattr(optimizer, "_master_local", None)]
    return {"params": sum(_param_storages(optimizer, model).values()),
            "grads": optimizer.grad_buffer.untyped_storage().nbytes(),
            "optim": sum(t.untyped_storage().nbytes() for t in optim if t is not None)}


def parameter_exclusions(optimizer: Any, model: Any) -> set[int]:
    """The parameters' storages (not activations), by identity: a ZeRO-3 unit's gathered storage gets another
    address each time it is gathered again."""
    return {t.untyped_storage()._cdata for t in [optimizer.param_buffer, *model.parameters()]}


def micro_batch_saved_bytes(cfg: Any) -> int:
    """Bytes autograd saves for one micro-batch of random tokens through the whole model of ``cfg`` (1 rank), as
    training runs it: a slice of the rank's batch (multi-token prediction's targets with it), under its autocast."""
    tracker = get_tracker()
    init_rng(tracker, 1, 0, 0)
    model = GPTModel(cfg.model, 1, parallel=ParallelContext(recompute=cfg.model.recompute, tracker=tracker)).train()
    opt = DistributedOptimizer(named_trainable(model), cfg.train, None, precision=cfg.train.precision,
                               model_cfg=cfg.model)
    g, s, b = cfg.train.global_batch_size, cfg.model.seq_length, cfg.train.micro_batch_size
    tokens = torch.randint(0, cfg.model.vocab_size, (g, s + 1), generator=torch.Generator().manual_seed(0))
    batch = {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
             "position_ids": torch.arange(s).expand(g, s).contiguous(), "loss_mask": torch.ones(g, s)}
    batch |= mtp_targets(batch, cfg.model.mtp_layers) if cfg.model.mtp_layers else {}
    mb = {k: v[:b] for k, v in batch.items()}  # slices of the rank's batch, as train_step makes them
    saved = SavedBytes(parameter_exclusions(opt, model))
    with saved.record(), training.autocast(cfg, torch.device("cpu")):
        losses = model(mb["tokens"], position_ids=mb["position_ids"], labels=mb["labels"],
                       mtp=(mb["mtp_tokens"], mb["mtp_labels"]) if cfg.model.mtp_layers else None)
        (losses.float() * mb["loss_mask"]).sum()
    return saved.nbytes


def probe_chunk(rt: Any, micro_batch: dict[str, Any], chunk: int, denom: float) -> int:
    """Saved bytes of one micro-batch's forward through model chunk ``chunk`` of this rank's stage, as the
    executor runs it (a random input of the activation's shape past the first stage; the loss on the last)."""
    stage, st = rt.model, rt.state
    virtual = chunk * st.pp_size + st.pp_rank
    last = virtual == st.pp_size * len(stage.layer_chunks) - 1
    x = None
    if virtual > 0:
        dtype = next(stage.parameters()).dtype
        x = torch.randn(executor.activation_shape(stage, micro_batch), dtype=dtype, device=rt.device).requires_grad_()
    saved = SavedBytes(parameter_exclusions(rt.optimizer, stage))
    with saved.record(), training.autocast(rt.cfg, rt.device):
        out = stage(micro_batch["tokens"] if virtual == 0 else None, position_ids=micro_batch.get("position_ids"),
                    labels=micro_batch["labels"] if last else None, hidden_states=x, chunk=chunk,
                    token_index=micro_batch.get("token_index"), document_ids=micro_batch.get("document_ids"),
                    mtp=(micro_batch["mtp_tokens"], micro_batch["mtp_labels"]) if last and "mtp_tokens" in micro_batch
                    else None)
        if last:
            out = (out.float() * micro_batch["loss_mask"]).sum() / denom
    del out
    return saved.nbytes


def verify_rank(rank: int, world_size: int, conf_files: list[str], overrides: list[str], steps: int) -> dict[str, Any]:
    """On a ``run_distributed`` rank: ``training.setup``, then the optimizer's buffers, one micro-batch's saved
    bytes per model chunk, and over ``steps`` ``train_step`` calls the peak of live saved bytes under the
    schedule, the executor's peak micro-batches in flight, the gather buffer and the bytes sent per op."""
    cfg = config_mod.load(conf_files, overrides, world_size=world_size)
    rt = training.setup(cfg)
    st = rt.state
    result: dict[str, Any] = {"rank": rank, "pp_rank": st.pp_rank, "state": measure_state(rt.optimizer, rt.model)}
    batch = rank_batch(rt, rt.train_ds, 0)
    first_mb = {k: v[:cfg.train.micro_batch_size] for k, v in batch.items()}
    result["chunks"] = [probe_chunk(rt, first_mb, c, float(batch["loss_mask"].numel()))
                        for c in range(len(rt.model.layer_chunks))]
    peaks: list[int] = []
    in_flight: list[int] = []
    exclude = parameter_exclusions(rt.optimizer, rt.model)

    @contextmanager
    def around_schedule(stats: executor.ScheduleStats) -> Iterator[None]:  # each step's forward_backward
        live = SavedBytes(exclude)
        with live.record():
            yield
        peaks.append(live.peak)
        in_flight.append(stats.peak_in_flight)

    units = getattr(rt.optimizer, "units", None)  # ZeRO-3's gatherer: its buckets' gathered storages
    gathered = [0]

    def on_gather(event: comm.CommEvent) -> None:  # a gather's storage is allocated just before it is issued
        if units is not None and event.op == "all_gather":
            gathered[0] = max(gathered[0], sum(b.full.untyped_storage().nbytes()
                                               for buckets in units.buckets.values() for b in buckets))

    with executor.observe(around_schedule), comm.observe(on_gather):
        for _ in range(steps):
            with comm.count() as counter:
                training.train_step(rt)
    result |= {"peak": max(peaks), "in_flight": max(in_flight, default=0), "gathered": gathered[0],
               "gather_buffer": default_gather_buffer().nbytes,
               "comm": {op: v["bytes"] for op, v in counter.summary().items()}}  # the last step (sends included)
    loader = getattr(rt, "train_loader", None)
    if loader is not None:
        loader.close()
    rt.state.destroy()
    del rt
    torch.set_num_threads(1)
    return result


def run_verify(conf: list[str], overrides: list[str], steps: int, bucket_bytes: int) -> tuple[LayoutPlan, list[dict[str, Any]]]:
    """The plan of the shrunk config and one row per (stage, quantity): predicted, measured (largest over the
    stage's ranks), ratio."""
    log_dir = tempfile.mkdtemp(prefix="plan_verify_")
    try:
        overrides = [*overrides, "parallel.device=cpu", "parallel.backend=gloo", f"train.iters={steps}",  # a short CPU run
                     "train.lr_warmup_iters=0", "train.lr_warmup_fraction=none", "train.eval_interval=0", "checkpoint.load=none",
                     "checkpoint.save=none", "checkpoint.auto_resume=false", "checkpoint.interval=0", f"logging.dir={log_dir}",
                     "train.sample_prompt=none",
                     "logging.level=warning", "data.num_workers=0"]  # the ranks are daemons: no loader workers
        cfg = config_mod.load(conf, overrides)
        training.prepare_inputs(cfg)  # builds the demo data if asked; sets the vocabulary
        lp = plan_layout(cfg, bucket_bytes)
        results = run_distributed(verify_rank, cfg.parallel.world_size, conf_files=list(conf), overrides=overrides,
                                  steps=steps, timeout_s=cfg.parallel.timeout_s)
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)
    rows = []
    for stage in lp.stages:
        mine = [r for r in results if r["pp_rank"] == stage.pp_rank]

        def worst(get: Any, mine: list[dict[str, Any]] = mine) -> float:
            return max(get(r) for r in mine)

        pairs = [(label, getattr(stage.state, key), worst(lambda r, key=key: r["state"][key]))
                 for label, key in (("parameters", "params"), ("gradients", "grads"), ("optimizer state", "optim"))]
        for c, chunk in enumerate(stage.chunks):
            label = "activations / micro-batch" + (f" (chunk {c})" if len(stage.chunks) > 1 else "")
            pairs.append((label, chunk.per_micro_batch + sum(chunk.shared.values()), worst(lambda r, c=c: r["chunks"][c])))
        pairs.append(("micro-batches in flight", stage.schedule.in_flight, worst(lambda r: r["in_flight"])))
        pairs.append(("activations at peak (schedule)", stage.activations, worst(lambda r: r["peak"])))
        gather = stage.buffers.get("SP gather buffer (mpu.memory)", 0)
        if gather or worst(lambda r: r["gather_buffer"]):
            pairs.append(("SP gather buffer", gather, worst(lambda r: r["gather_buffer"])))
        zero3 = next((v for k, v in stage.buffers.items() if k.startswith("ZeRO-3 gathered")), 0)
        if zero3 or worst(lambda r: r["gathered"]):
            pairs.append(("ZeRO-3 gathered params at peak", zero3, worst(lambda r: r["gathered"])))
        predicted: dict[str, float] = {}
        for ops in stage.comm.values():
            for op, nbytes in ops.items():
                predicted[op] = predicted.get(op, 0.0) + nbytes
        for op in sorted({op for r in mine for op in r["comm"]} | set(predicted)):
            pairs.append((f"sent per step: {op}", predicted.get(op, 0.0), worst(lambda r, op=op: r["comm"].get(op, 0.0))))
        for name, want, got in pairs:
            ratio = got / want if want else (1.0 if not got else float("inf"))
            rows.append({"stage": stage.pp_rank, "quantity": name, "predicted": want, "measured": got, "ratio": ratio})
    return lp, rows
