"""The training loop: step → metrics → checkpoint cadence, on every rank.

``run(cfg)``: ``setup`` (process groups → data → model → optimizer → resume) then ``_loop``. ``train_step`` is
short and linear: ``loss = Σ token losses / global valid tokens``, gradients summed over dp_cp (never averaged).
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from . import checkpointing, config as config_mod, device as device_mod, faults, metrics as metrics_mod
from .config import Config
from .data import build_datasets, build_tokenizer, check_inputs, ensure_demo_data
from .data.batching import next_train_batch, rank_batch
from .data.packed import IGNORE_INDEX
from .files import atomic_file
from .errors import ConfigError, TrainingError
from .mpu import ParallelContext, ParallelDims, ParallelState, comm, init_default_group, initialize
from .mpu.random import get_tracker, init_rng
from .optim.grad_scaler import DynamicLossScaler
from .optim import DistributedOptimizer, lr_at, named_trainable
from .parity import full_main_grads
from .pipeline.executor import ScheduleStats, agree_costs, forward_backward, forward_only
from .model import count_parameters, flops_per_token
from .model.gpt import param_unit
from .model.inference import generate_batch
from .model import moe, mtp
from .model.transformer import compile_cache_dir
from .pipeline.partition import build_stage, stage_chunks, tied_embedding_params

log = logging.getLogger("megatron_sp")


def prepare_inputs(cfg: Config) -> Any:
    """Build the demo data if asked and absent; load the tokenizer and derive the vocab sizes (the checkpoint's
    vocabulary when it has more rows than the tokenizer has ids, as an imported Qwen); open the dataset."""
    if cfg.data.build_demo:
        ensure_demo_data(cfg)
    tokenizer = build_tokenizer(cfg.tokenizer)
    ckpt = checkpointing.resume_source(cfg)
    rows = checkpointing.read_meta(ckpt).get("config", {}).get("model", {}).get("vocab_size") if ckpt else None
    if cfg.model.vocab_size is None and rows is not None and rows >= tokenizer.vocab_size:
        cfg.model.vocab_size = rows  # (fewer: another tokenizer, which check_resume_data refuses)
    config_mod.set_vocab(cfg, tokenizer.vocab_size)
    check_inputs(cfg)  # a missing, malformed or empty .bin/.idx, or too many samples: one line, before any rank starts
    return tokenizer


# ----------------------------------------------------------------------------- the run

@dataclass
class Runtime:
    """What a rank holds while training."""

    cfg: Config
    state: ParallelState
    device: torch.device
    model: nn.Module
    optimizer: DistributedOptimizer
    tokenizer: Any
    train_ds: Any
    valid_ds: Any
    scaler: DynamicLossScaler
    step: int = 0
    consumed_samples: int = 0
    skipped_steps: int = 0
    pipeline_costs: dict[str, float] | None = None  # zero-bubble: the last step's agreed action costs
    train_loader: Any = None  # data.loader.BatchLoader reading ahead from consumed_samples (next_train_batch)
    lineage: checkpointing.Lineage | None = None  # which checkpoints are this run's history (set by setup)
    tokenizer_sha256: str = ""  # tokenizer_fingerprint, recorded in each checkpoint's meta.json


def setup(cfg: Config) -> Runtime:
    """Everything before the first step, on every rank."""
    p = cfg.parallel
    host_cached = cfg.train.cache_host_memory and device_mod.cache_host_memory()  # before the large allocations
    if not dist.is_initialized():  # from torchrun's environment (train.py at world size 1: launcher.single_rank_env)
        init_default_group(p.backend, p.timeout_s)  # type: ignore[arg-type]
    rank = dist.get_rank()
    metrics_mod.setup_logging(cfg.logging.level, rank)
    if cfg.train.cache_host_memory:
        log.info("train.cache_host_memory: %s", "freed memory is kept for reuse (glibc malloc: no mmap up to 2 GiB, "
                 "no trim)" if host_cached else "not glibc, so the system allocator is left as it is")
    state = initialize(parallel_dims(cfg), timeout_s=p.timeout_s)
    dev = device_mod.local_device(p.device, int(os.environ.get("LOCAL_RANK", "0")))  # type: ignore[arg-type]
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if dev.type == "cpu" and p.world_size > 1:
        torch.set_num_threads(max(1, device_mod.host_cores() // local_ranks))
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:  # each host's first rank
        metrics_mod.log_host_load(torch.get_num_threads(), local_ranks, device_mod.host_cores(),
                                  device_mod.load_average(), cpu=dev.type == "cpu")

    tokenizer = _rank0_first(rank, lambda: prepare_inputs(cfg))
    tokenizer_sha256 = tokenizer_fingerprint(tokenizer)
    ckpt = checkpointing.resume_source(cfg)  # auto_resume: checkpoint.save's latest if any, else checkpoint.load
    saved = checkpointing.read_meta(ckpt) if ckpt is not None else {"step": 0, "consumed_samples": 0}
    if ckpt is not None:  # before anything is written: a refusal leaves the run directory as it was
        check_resume_data(cfg, saved, ckpt, tokenizer_sha256)
    if rank == 0:  # an earlier run's different config.yml is kept as config.yml.N, like its metrics.jsonl
        metrics_mod.keep_earlier_config(Path(cfg.logging.dir) / "config.yml", config_mod.dumps(cfg))
        config_mod.save(cfg, Path(cfg.logging.dir) / "config.yml")

    tracker = get_tracker()
    init_rng(tracker, cfg.train.seed, state.tp_rank, state.pp_rank)
    model, optimizer = build_model(cfg, state, dev, compiled=cfg.train.compile)
    if state.pp_size > 1:
        stages = "; ".join(f"stage {r}: " + ", ".join(f"{c.start}-{c.stop - 1}" for c in stage_chunks(
            cfg.model, p.pp, r, p.virtual_stages, p.pp_partition)) for r in range(p.pp))
        log.info("pipeline: schedule %s, partition %s, layers %s", p.pp_schedule, p.pp_partition, stages)
    t = cfg.train
    scaler = DynamicLossScaler(enabled=t.precision == "fp16", scale=t.loss_scale_init,
                               growth_interval=t.loss_scale_window, hysteresis=t.loss_scale_hysteresis)

    n_train, n_valid = split_samples(cfg, int(saved["step"]), int(saved["consumed_samples"]))
    train_ds, valid_ds = _rank0_first(rank, lambda: build_datasets(cfg, tokenizer, n_train, n_valid))

    rt = Runtime(cfg, state, dev, model, optimizer, tokenizer, train_ds, valid_ds, scaler,
                 tokenizer_sha256=tokenizer_sha256)
    meta = None
    if ckpt is not None:
        if cfg.checkpoint.auto_resume and (Path(cfg.checkpoint.save) / "latest").is_file():  # type: ignore[arg-type]
            log.info("checkpoint.auto_resume: resuming from %s", ckpt)
        meta = checkpointing.load(ckpt, model, optimizer, state, dev, cfg.train.seed, tracker,
                                  layout=checkpointing.writer_layout(cfg),
                                  weights_only=trained_optimizer(saved) != cfg.train.optimizer)
        rt.step, rt.consumed_samples = int(meta["step"]), int(meta["consumed_samples"])
        rt.skipped_steps = int(meta.get("skipped_steps", 0))
        moe.load_expert_bias(model, meta.get("moe_expert_bias"))
        if scaler.enabled and "loss_scaler" in meta:
            scaler.load_state_dict(meta["loss_scaler"])
        log.info("resumed from %s at step %d", ckpt, rt.step)
    rt.lineage = checkpointing.Lineage.start(meta, ckpt, cfg.checkpoint.save)
    return rt


def parallel_dims(cfg: Config) -> ParallelDims:
    """The rank grid of ``cfg.parallel`` (``setup`` initializes it; so does tools/evaluate.py)."""
    p = cfg.parallel
    return ParallelDims(tp=p.tp, cp=p.cp, dp=p.dp, pp=p.pp, world_size=p.world_size,  # type: ignore[arg-type]
                        cp_ulysses=p.cp_ulysses if p.cp_algo == "usp" else 1, ep=p.ep,  # type: ignore[arg-type]
                        ep_tp=p.sequence_parallel and p.tp > 1)


def split_samples(cfg: Config, step: int = 0, consumed_samples: int = 0) -> tuple[int, int]:
    """(train, valid) samples the run reads: the ``consumed_samples`` of a checkpoint at ``step`` and the
    ``train.iters - step`` global batches still to go (Megatron's ramp-up: a resume with another global batch size goes
    on from ``consumed_samples``), and ``train.eval_iters`` per validation (every ``train.eval_interval`` steps and at
    the end); the datasets are built for these counts."""
    t = cfg.train
    n_valid = (t.iters // t.eval_interval + 1) * t.eval_iters * t.global_batch_size if t.eval_interval else 0  # type: ignore[operator]
    return consumed_samples + max(0, t.iters - step) * t.global_batch_size, n_valid  # type: ignore[operator]


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 of the tokenizer's kind, vocabulary size, EOD id and the file that defines it (sentencepiece, hf)."""
    digest = hashlib.sha256(f"{tokenizer.name} {tokenizer.vocab_size} {tokenizer.eod}".encode())
    path = getattr(tokenizer, "model_path", None) or getattr(tokenizer, "path", None)
    if path is not None:
        digest.update(Path(path).read_bytes())
    return digest.hexdigest()


def trained_optimizer(meta: dict[str, Any]) -> str:
    """The ``train.optimizer`` a checkpoint's run used (its meta.json's config; adamw before the key existed)."""
    return meta.get("config", {}).get("train", {}).get("optimizer", "adamw")


def check_resume_data(cfg: Config, meta: dict[str, Any], ckpt: Path, tokenizer_sha256: str) -> None:
    """Refuse to resume from ``ckpt`` when its ``consumed_samples`` would index other samples than those it trained
    on: another ``model.seq_length`` (once samples were consumed) or another tokenizer (its meta.json's
    ``tokenizer_sha256``), unless ``checkpoint.allow_data_change`` (docs/checkpoints.md, "Resuming"); or when it
    trained with another ``train.optimizer``, unless ``checkpoint.allow_optimizer_change``."""
    old = meta.get("config", {})
    consumed, seq = int(meta["consumed_samples"]), old.get("model", {}).get("seq_length", cfg.model.seq_length)
    changes = [f"model.seq_length {seq} -> {cfg.model.seq_length}"] if consumed and seq != cfg.model.seq_length else []
    if meta.get("tokenizer_sha256", tokenizer_sha256) != tokenizer_sha256:
        was = old.get("tokenizer", {})
        changes.append(f"another tokenizer ({cfg.tokenizer.type} {cfg.tokenizer.model}; it trained with "
                       f"{was.get('type')} {was.get('model')}, same name or not: the file's sha256 differs)")
    optimizer = trained_optimizer(meta)
    if optimizer != cfg.train.optimizer and not cfg.checkpoint.allow_optimizer_change:
        raise ConfigError(f"resuming from {ckpt}: it trained with train.optimizer={optimizer}, this run has "
                          f"{cfg.train.optimizer}: restore it, or set checkpoint.allow_optimizer_change=true to load "
                          f"the weights with a fresh optimizer state")
    if not changes:
        return
    if not cfg.checkpoint.allow_data_change:
        raise ConfigError(f"resuming from {ckpt}: {'; '.join(changes)}; its consumed_samples {consumed} count samples "
                          f"of its data: restore the setting, or set checkpoint.allow_data_change=true to go on from "
                          f"sample {consumed} of the new data order")
    log.warning("checkpoint.allow_data_change: %s; going on from sample %d of the new data order", "; ".join(changes),
                consumed)


def build_model(cfg: Config, state: ParallelState, dev: torch.device,
                compiled: bool) -> tuple[nn.Module, DistributedOptimizer]:
    """This rank's stage of the model (the whole model when pp == 1) on ``dev``, and its optimizer. ``compiled``:
    the layers' regions go through torch.compile (at the first step). The RNG tracker must be seeded (``init_rng``)."""
    p = cfg.parallel
    parallel = ParallelContext.from_state(state, cfg)  # its RNG tracker: get_tracker()
    model: nn.Module = build_stage(cfg.model, cfg.train.seed, state, parallel, virtual_stages=p.virtual_stages,
                                   partition=p.pp_partition, label_smoothing=cfg.train.label_smoothing,
                                   z_loss=cfg.train.z_loss).to(dev)
    if compiled:
        model.compile_regions()
    optimizer = DistributedOptimizer(named_trainable(model), cfg.train, state, zero=p.zero,
                                     precision=cfg.train.precision, unit_of=param_unit, prefetch=p.zero3_prefetch,
                                     model_cfg=cfg.model)
    model.param_units = optimizer.units  # (ZeRO-3; else None)
    return model, optimizer


def _rank0_first(rank: int, fn: Callable[[], Any]) -> Any:
    """``fn()`` on rank 0, then on the others (which read the files and caches rank 0 wrote)."""
    out = fn() if rank == 0 else None
    comm.barrier()
    return out if rank == 0 else fn()


def autocast(cfg: Config, dev: torch.device) -> contextlib.AbstractContextManager:
    """The forward's mixed-precision context of ``train.precision`` (the planner measures under it too)."""
    if cfg.train.precision in ("bf16", "fp16"):
        return torch.autocast(dev.type, dtype=torch.bfloat16 if cfg.train.precision == "bf16" else torch.float16)
    return contextlib.nullcontext()


def _global_sum(values: list[float], rt: Runtime) -> list[float]:
    """Sum floats over the dp_cp group in fp64."""
    return comm.all_reduce(torch.tensor(values, dtype=torch.float64), rt.state.dp_cp_group).tolist()


def train_step(rt: Runtime) -> dict[str, Any]:
    """One optimizer step over one global batch. Returns loss, grad_norm, lr, tokens, stepped (and a MoE model's
    ``moe`` stats of the global batch, after the expert biases moved: ``moe.end_step``)."""
    cfg, opt, st = rt.cfg, rt.optimizer, rt.state
    opt.zero_grad()
    batch = next_train_batch(rt)
    depth = cfg.model.mtp_layers  # multi-token prediction: each module's valid targets count on their own
    counts = _global_sum([float(batch["loss_mask"].sum()),
                          *(float((batch["mtp_labels"][..., k] != IGNORE_INDEX).sum()) for k in range(depth))], rt)
    global_tokens, mtp_counts = counts[0], counts[1:]
    denom = max(global_tokens, 1.0)

    def loss_fn(token_losses: torch.Tensor, mb: dict[str, torch.Tensor]) -> torch.Tensor:
        return (token_losses.float() * mb["loss_mask"]).sum() / denom

    # The pipeline schedule (plain accumulation when pp == 1); the optimizer reduces gradients over dp_cp from the
    # last gradient-producing action on. Zero-bubble: list-scheduled on the action costs of the previous step.
    stats = ScheduleStats()
    progress = metrics_mod.StepProgress(rt.step + 1, cfg.train.grad_accum_steps * cfg.parallel.virtual_stages,  # type: ignore[operator]
                                        enabled=st.rank == 0)

    def forward_context() -> contextlib.AbstractContextManager:
        progress.tick()  # a step longer than a minute logs its micro-batches done and its ETA
        return autocast(cfg, rt.device)

    grad_scale = rt.scaler.scale if rt.scaler.enabled else 1.0
    if cfg.model.num_experts:  # each micro-batch's MoE aux losses weigh mbs / gbs of the objective (docs/moe.md)
        moe.set_aux_loss_scale(rt.model, grad_scale * cfg.train.micro_batch_size / cfg.train.global_batch_size)  # type: ignore[operator]
    if depth:
        mtp.set_loss_scales(rt.model, cfg.model, mtp_counts, grad_scale)
    loss_sum = forward_backward(rt.model, _micro_batches(batch, cfg), st, loss_fn, cfg.parallel.pp_schedule,
                                lambda on: setattr(opt, "sync_grads", on),
                                grad_scale=grad_scale,
                                forward_context=forward_context, stats=stats,
                                costs=rt.pipeline_costs)
    if cfg.parallel.pp_schedule == "zero_bubble" and st.pp_size > 1:
        rt.pipeline_costs = agree_costs(stats)
    opt.finish_grad_sync()
    tied = tied_embedding_params(rt.model, st)
    if tied:  # tied input/output embeddings on the first and last stage: sum their grads
        opt.sync_grads_over(tied, st.embedding_group)
    if rt.scaler.enabled:
        opt.scale_grads(rt.scaler.inv_scale)
    loss_sum = comm.all_reduce(loss_sum, st.pp_group)  # the loss lives on the last stage
    global_loss = _global_sum([loss_sum.item()], rt)[0]
    mtp_losses = mtp.step_losses(rt.model, cfg.model, mtp_counts, st) if depth else None
    if cfg.logging.dump_grads_step == rt.step + 1:
        dump_grads(rt)
    lr = lr_at(rt.step, cfg.train)
    grad_norm, stepped = opt.step(lr, cfg.train.clip_grad)
    moe_stats = moe.end_step(rt.model, cfg.model, st, stepped) if cfg.model.num_experts else None
    rt.step += 1
    rt.consumed_samples += cfg.train.global_batch_size  # type: ignore[operator]
    _check_step(rt, stepped, grad_norm, global_loss)
    return {"loss": global_loss, "grad_norm": grad_norm, "lr": lr, "tokens": global_tokens, "stepped": stepped,
            "moe": moe_stats, "mtp": mtp_losses}


def _micro_batches(batch: dict[str, torch.Tensor], cfg: Config) -> list[dict[str, torch.Tensor]]:
    micro = cfg.train.micro_batch_size
    return [{k: v[i * micro:(i + 1) * micro] for k, v in batch.items()} for i in range(cfg.train.grad_accum_steps)]  # type: ignore[arg-type]


def _check_step(rt: Runtime, stepped: bool, grad_norm: float, loss: float) -> None:
    """Update the loss scale; count a skipped step, or stop on a non-finite norm or loss."""
    cfg = rt.cfg
    if rt.scaler.enabled:
        rt.scaler.update(found_inf=not stepped)
    if not stepped:
        if not (rt.scaler.enabled or cfg.train.skip_nan_steps):
            raise TrainingError(f"step {rt.step}: gradient norm {grad_norm} is not finite; lower train.lr, check the "
                                "data, or set train.skip_nan_steps=true")
        rt.skipped_steps += 1
        log.warning("step %d skipped: gradient norm %s is not finite%s", rt.step, grad_norm,
                    f" (loss scale now {rt.scaler.scale:g})" if rt.scaler.enabled else "")
    elif not math.isfinite(loss):
        raise TrainingError(f"step {rt.step}: loss {loss} is not finite; lower train.lr or check the data")


def dump_grads(rt: Runtime) -> None:
    """Write every parameter's full gradient (after reduction, before clipping) on rank 0."""
    grads = full_main_grads(rt.model, rt.optimizer, rt.state)
    if rt.state.rank == 0:
        with atomic_file(Path(rt.cfg.logging.dir) / f"grads_step{rt.step + 1}.pt") as f:
            torch.save(grads, f)


def evaluate(rt: Runtime) -> float:
    """Mean loss over ``eval_iters`` global batches of the validation split (same for every layout)."""
    total, count = loss_sums(rt, rt.valid_ds, validation_starts(rt.cfg, rt.step, len(rt.valid_ds)))
    return total / max(count, 1.0)


def validation_starts(cfg: Config, step: int, samples: int) -> list[int]:
    """The first sample of each global batch the validation at ``step`` reads of a split of ``samples``:
    ``eval_iters`` consecutive batches, the next ones at each validation, from sample 0 again past the end."""
    gbs = cfg.train.global_batch_size
    start0 = ((step // cfg.train.eval_interval) * cfg.train.eval_iters * gbs) % max(1, samples)  # type: ignore[operator]
    starts = [start0 + k * gbs for k in range(cfg.train.eval_iters)]  # type: ignore[operator]
    return [s if s + gbs <= samples else 0 for s in starts]  # type: ignore[operator]


@torch.no_grad()
def loss_sums(rt: Runtime, ds: Any, starts: list[int]) -> tuple[float, float]:
    """(Σ token losses, Σ loss tokens) over the global batches of ``ds`` that start at ``starts``, summed over every
    rank: the same for every layout (``evaluate``; tools/evaluate.py)."""
    cfg, model, st = rt.cfg, rt.model, rt.state
    model.eval()
    total = torch.zeros((), dtype=torch.float64)
    count = 0.0
    for start in starts:
        batch = rank_batch(rt, ds, start)
        total += forward_only(model, _micro_batches(batch, cfg), st, lambda tl, mb: (tl.float() * mb["loss_mask"]).sum(),
                              forward_context=lambda: autocast(cfg, rt.device))
        count += float(batch["loss_mask"].sum())
    model.train()
    total = comm.all_reduce(total, st.pp_group)  # the loss lives on the last stage
    total_sum, count_sum = _global_sum([total.item(), count], rt)
    return total_sum, count_sum


def run(cfg: Config) -> Runtime:
    """Train on this rank (the process group is created here unless it exists)."""
    rt = setup(cfg)
    try:
        _loop(rt)
    except RuntimeError as exc:  # a collective with a dead or hung peer: name it, without a traceback
        report = faults.peer_failure(exc, rt.cfg.parallel.timeout_s)
        if report is None:
            raise
        raise report from None
    finally:
        if rt.train_loader is not None:
            rt.train_loader.close()  # loader worker processes, if any
        if dist.is_initialized():
            rt.state.destroy()
            dist.destroy_process_group()
    return rt


def _loop(rt: Runtime) -> None:
    cfg, st = rt.cfg, rt.state
    metrics = metrics_mod.MetricsLogger(cfg, enabled=st.rank == 0, resume_step=rt.step)
    params = metrics_mod.parameter_summary(count_parameters(cfg.model, exclude_embeddings=False),
                                           rt.model.num_parameters(), st.tp_size, st.pp_size, cfg.model.vocab_size,
                                           cfg.model.padded_vocab_size)  # type: ignore[arg-type]
    done_before = rt.step >= cfg.train.iters  # resumed at or past the end: no step, so no peak to measure
    peak = metrics_mod.Peak(0.0) if done_before else metrics_mod.peak_flops_total(cfg, st, rt.device)
    fpt = flops_per_token(cfg.model)
    tokens_per_step = cfg.train.global_batch_size * cfg.model.seq_length  # type: ignore[operator]
    log.info("model: %s, %s; layout tp%d pp%d cp%d dp%d%s (world %d, %s/%s); global batch %d × %d tokens, "
             "%d micro-batches per rank", cfg.model.arch, params, st.tp_size, st.pp_size, st.cp_size,
             st.dp_size, f" ep{st.ep_size}" if st.ep_size > 1 else "", st.dims.world_size, cfg.parallel.device,
             cfg.parallel.backend, cfg.train.global_batch_size,
             cfg.model.seq_length, cfg.train.grad_accum_steps)
    if done_before:
        log.info("step %d of the checkpoint is at or past train.iters %d: nothing to train (raise train.iters to go on)",
                 rt.step, cfg.train.iters)
    elif cfg.train.lr_warmup_fraction is not None:
        log.info("lr warm-up: %d steps (train.lr_warmup_fraction %g of train.lr_decay_iters %d)", cfg.train.lr_warmup_iters,
                 cfg.train.lr_warmup_fraction, cfg.train.lr_decay_iters)
    window: list[dict[str, Any]] = []
    t_window = time.perf_counter()
    start_step = rt.step
    step_seconds: list[float] = []  # the last steps' training time, for the ETA (metrics.eta_seconds)
    paused = 0.0  # seconds of validation and checkpointing inside the current window (not training)
    first_step = 0.0  # seconds, with warm-up (and compiling under train.compile)
    saver = checkpointing.Checkpointer(cfg, st, rt.device, rt.lineage)
    preemption = faults.Preemption(enabled=bool(cfg.checkpoint.save), save_dir=cfg.checkpoint.save)
    while rt.step < cfg.train.iters:
        preemption.step_started(rt.step + 1, float(np.median(step_seconds)) if step_seconds else first_step or None)
        t_step = time.perf_counter()
        out = train_step(rt)
        saver.poll()  # finishes an asynchronous save once every rank has written its part
        if rt.step > start_step + 1:  # the first step's time includes warm-up
            step_seconds = [*step_seconds, time.perf_counter() - t_step][-metrics_mod.ETA_STEPS:]
        else:
            first_step = time.perf_counter() - t_step
        if cfg.train.compile and rt.step == start_step + 2:
            log.info("train.compile: first step %.1f s, second %.2f s: about %.1f s compiling (cached for later runs "
                     "in %s)", first_step, step_seconds[0], first_step - step_seconds[0], compile_cache_dir())
        window.append(out)
        done = rt.step == cfg.train.iters
        if rt.step % cfg.logging.interval == 0 or done:
            device_mod.synchronize(rt.device)
            rate = metrics_mod.throughput(tokens_per_step * len(window), time.perf_counter() - t_window - paused, fpt, peak)
            record = {"step": rt.step, "loss": float(np.mean([w["loss"] for w in window])), "lr": out["lr"],
                      "grad_norm": out["grad_norm"], "tokens_per_s": rate["tokens_per_s"], "tflops": rate["tflops"],
                      "mfu": rate["mfu"], "memory_bytes": device_mod.memory_bytes(rt.device),
                      "world_size": st.dims.world_size, "consumed_samples": rt.consumed_samples,
                      "skipped_steps": rt.skipped_steps}
            if rt.scaler.enabled:
                record["loss_scale"] = rt.scaler.scale
            moe_line = ""
            if cfg.model.num_experts:  # reduced over the global batch by moe.end_step
                record.update(moe.metrics_record([w["moe"] for w in window], cfg.model))
                moe_line = (f" | MoE aux {record['moe_aux_loss']:.4f} z {record['moe_z_loss']:.3g} load max/mean "
                            f"{record['moe_load_imbalance']:.2f} dropped {record['moe_dropped_tokens']:.0f}")
            if cfg.model.mtp_layers:  # each module's mean loss over the global batches of the window
                losses = np.mean([w["mtp"] for w in window], axis=0).tolist()
                record.update({f"mtp_loss_{k + 1}": v for k, v in enumerate(losses)})
                moe_line += " | MTP " + " ".join(f"{v:.4f}" for v in losses)
            metrics.write(record)
            log.info("step %d/%d | loss %.4f | lr %.3e | grad norm %.3f | %.0f tokens/s | MFU %.1f%%%s | ETA %s",
                     rt.step, cfg.train.iters, record["loss"], out["lr"], out["grad_norm"], rate["tokens_per_s"],
                     100 * rate["mfu"], moe_line,
                     metrics_mod.format_eta(metrics_mod.eta_seconds(step_seconds, cfg.train.iters - rt.step)))
            window, t_window, paused = [], time.perf_counter(), 0.0
        t_pause = time.perf_counter()
        if cfg.train.eval_interval and (rt.step % cfg.train.eval_interval == 0 or done) and rt.valid_ds is not None \
                and len(rt.valid_ds) >= cfg.train.global_batch_size:  # type: ignore[operator]
            val = evaluate(rt)
            metrics.write({"step": rt.step, "val_loss": val})
            log.info("step %d | validation loss %.4f | perplexity %.2f", rt.step, val, math.exp(min(val, 50.0)))
        preempted = preemption.agreed(rt.device)
        if cfg.checkpoint.save and ((cfg.checkpoint.interval and rt.step % cfg.checkpoint.interval == 0)
                                    or (done and cfg.checkpoint.save_at_end) or preempted):
            if preempted:
                log.warning("%s: saving a checkpoint at step %d, then exiting", preemption.signal_name, rt.step)
            extra = {"skipped_steps": rt.skipped_steps, "loss_scaler": rt.scaler.state_dict(),
                     "tokenizer_sha256": rt.tokenizer_sha256}
            if cfg.model.num_experts:  # layout-free: {global layer: bias}, gathered over pp
                extra["moe_expert_bias"] = moe.expert_bias_state(rt.model, cfg.model, st)
            saver.save(rt.step, rt.consumed_samples, rt.model, rt.optimizer, get_tracker(), extra=extra,
                       asynchronous=False if preempted else None)
        paused += time.perf_counter() - t_pause
        if preempted:
            saver.wait()
            metrics.close()
            preemption.close()
            preemption.finish(rt.step)  # SIGINT: KeyboardInterrupt, exit code 130
            return
    preemption.close()
    saver.wait()
    metrics.close()
    if cfg.train.sample_prompt and cfg.parallel.virtual_stages > 1:
        log.info("no sample: decoding through virtual pipeline stages is not available (tools/generate.py decodes the "
                 "checkpoint at parallel.virtual_stages=1)")
    elif cfg.train.sample_prompt and st.cp_size > 1 and rt.model.parallel.sp:
        log.info("no sample: context parallelism prefills into the KV cache, which sequence parallelism does not use "
                 "(tools/generate.py decodes the checkpoint at parallel.sequence_parallel=false)")
    elif cfg.train.sample_prompt and (st.dp_rank == 0 or cfg.parallel.ep > 1 or rt.optimizer.units is not None):
        # one model replica (its TP × CP × PP ranks: the prompt is prefilled split over cp) decodes; under ep every
        # rank does, in lockstep, the same prompt (each ep rank holds some experts: the all-to-all needs them all), and
        # under ZeRO-3 (each gather needs every rank of dp·cp)
        ids = rt.tokenizer.encode(cfg.train.sample_prompt)[-cfg.model.seq_length:] or [rt.tokenizer.eod]
        rt.model.compile_regions(False)  # decoding shapes change every call: eager, not one compile per length
        (done,) = generate_batch(rt.model, [ids], cfg.train.sample_tokens, rt.tokenizer.eod, state=st)
        log.info("sample (greedy):\n%s%s", cfg.train.sample_prompt, rt.tokenizer.decode(done.new_ids))

