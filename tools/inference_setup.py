"""What tools/evaluate.py and tools/generate.py share: a checkpoint's config with the user's layout, its ranks started
(or torchrun's), and on each rank its stage of the model with the checkpoint's weights.

A checkpoint is layout-free: the saved ``parallel`` section is dropped (one rank unless the overrides say otherwise)
and every rank reads its own shard (``checkpointing.load_model_state``); no rank ever holds more than its shard.
"""
from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_sp import checkpointing, device as device_mod, faults, launcher, metrics as metrics_mod
from megatron_sp.config import Config
from megatron_sp.config.loader import apply_overrides, apply_sections, finalize, set_vocab
from megatron_sp.data import build_tokenizer
from megatron_sp.data.tokenizer import Tokenizer
from megatron_sp.errors import ConfigError, DataError, UserError

EXIT_USER_ERROR = 2  # every user error of these tools: a bad path, a layout that cannot hold the model, ...


def resolve_checkpoint(load: str) -> Path:
    """The checkpoint directory ``--load`` names (its ``latest``, or itself)."""
    root = Path(load)
    if not root.is_dir():
        raise DataError(f"--load: '{root}' is not a directory; give a checkpoint.save directory or an iter_* "
                        "directory inside it")
    try:
        return checkpointing.resolve(root)
    except DataError as exc:
        raise DataError(str(exc).replace("checkpoint.load:", "--load:", 1)) from None


def checkpoint_config(meta: dict[str, Any], ckpt: Path, overrides: list[str], world_size: int | None,
                      batches: bool = True) -> Config:
    """The checkpoint's config without its layout (``parallel`` is the overrides', one rank by default), the values
    derived from the layout recomputed, then ``overrides`` (not ``model.*``: the model is the checkpoint's).
    ``batches`` False (generation): the training batch and schedule do not constrain the layout. ``data.paths`` may
    be empty (no data to read)."""
    saved = meta.get("config")
    if not isinstance(saved, dict):
        raise DataError(f"checkpoint file '{ckpt / 'meta.json'}' holds no config")
    cfg = Config()
    apply_sections(cfg, {s: v for s, v in saved.items() if s != "parallel"}, f"checkpoint file '{ckpt / 'meta.json'}'")
    cfg.model.padded_vocab_size = None  # padded for this layout's tp (the checkpoint stores the vocabulary unpadded)
    cfg.train.grad_accum_steps = None  # derived from this layout's dp
    cfg.train.compile = False  # inference runs eager
    cfg.data.build_demo = False  # use the files there are: never build a corpus or train a tokenizer
    if not batches:
        cfg.train.global_batch_size, cfg.train.micro_batch_size, cfg.parallel.pp_schedule = None, 1, "none"
    for item in overrides:
        if item.split("=", 1)[0].strip().startswith("model."):
            raise ConfigError(f"override '{item}': the model is the checkpoint's; set the layout (parallel.*), batch "
                              "sizes (train.*) or data (data.*)")
    apply_overrides(cfg, overrides)
    if not cfg.train.eval_interval:  # a run without validation: its first eval_iters batches (as at its last step)
        cfg.train.eval_interval = cfg.train.iters + 1
    no_data = not cfg.data.paths  # an imported checkpoint: generation reads none (evaluate checks its own)
    if no_data:
        cfg.data.paths = ["<unset>"]  # finalize checks a training run's data.paths (as convert_checkpoint's probe)
    cfg = finalize(cfg, world_size)
    if no_data:
        cfg.data.paths = []
    return cfg


def load_tokenizer(cfg: Config) -> Tokenizer:
    """The checkpoint's tokenizer; the vocabulary sizes of ``cfg.model`` set from it (padded for this layout)."""
    tokenizer = build_tokenizer(cfg.tokenizer)
    set_vocab(cfg, tokenizer.vocab_size)
    return tokenizer


@contextlib.contextmanager
def loaded_stage(cfg: Config, ckpt: Path, meta: dict[str, Any]) -> Iterator[tuple[Any, Any, Tokenizer, torch.device]]:
    """On every rank: (``ParallelState``, this rank's eval-mode model stage with the checkpoint's weights, the
    tokenizer, the device). Creates the default process group unless it exists; destroys what it made on exit."""
    from megatron_sp import training
    from megatron_sp.model import moe
    from megatron_sp.mpu import ParallelContext, init_default_group, initialize
    from megatron_sp.mpu.random import get_tracker, init_rng
    from megatron_sp.optim.reducer import PRECISIONS
    from megatron_sp.pipeline.partition import build_stage

    p = cfg.parallel
    created = not dist.is_initialized()
    if created:
        init_default_group(p.backend, p.timeout_s)  # type: ignore[arg-type]
    state = None
    try:
        metrics_mod.setup_logging(cfg.logging.level, dist.get_rank())
        metrics_mod.log.handlers[0].setStream(sys.stderr)  # stdout holds the results only
        state = initialize(training.parallel_dims(cfg), timeout_s=p.timeout_s)
        dev = device_mod.local_device(p.device, int(os.environ.get("LOCAL_RANK", "0")))  # type: ignore[arg-type]
        if dev.type == "cpu" and p.world_size > 1:  # type: ignore[operator]
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
        tokenizer = load_tokenizer(cfg)
        init_rng(get_tracker(), cfg.train.seed, state.tp_rank, state.pp_rank)
        model = build_stage(cfg.model, cfg.train.seed, state, ParallelContext.from_state(state, cfg),
                            virtual_stages=p.virtual_stages, partition=p.pp_partition,
                            label_smoothing=cfg.train.label_smoothing, z_loss=cfg.train.z_loss).to(dev)
        for param in model.parameters():  # bf16/fp16 runs use 16-bit weights (the optimizer casts them)
            param.data = param.data.to(PRECISIONS[cfg.train.precision])
        checkpointing.load_model_state(model, ckpt, state)
        moe.load_expert_bias(model, meta.get("moe_expert_bias"))  # aux-loss-free balancing: routing as in training
        yield state, model.eval(), tokenizer, dev
    finally:
        if state is not None:
            state.destroy()
        if created and dist.is_initialized():
            dist.destroy_process_group()


def run_tool(argv: list[str], load: str, overrides: list[str], work: Callable[[Config, Path, dict[str, Any]], str | None],
             check: Callable[[Config, bool], None] | None = None, batches: bool = True) -> int:
    """A tool's ``main``: the checkpoint ``load`` names, its config with ``overrides`` (``checkpoint_config``) and
    ``check(cfg, before_ranks)`` (every user error there: one line before any rank starts); run plainly with world
    size > 1 it starts the local ranks with ``argv`` (each runs this again, under torchrun), else ``work(cfg, ckpt,
    meta)`` runs on this rank and global rank 0 prints what it returns. A user error is one ``error:`` line and exit
    code 2; Ctrl-C 130. Before any rank starts, train.py's pre-flight (``train.preflight``) refuses a layout this host
    cannot hold."""
    rank, cfg = 0, None
    try:
        torchrun = launcher.under_torchrun()  # a partial torchrun environment: one line
        rank = int(os.environ["RANK"]) if torchrun else 0
        world = int(os.environ["WORLD_SIZE"]) if torchrun else None
        ckpt = resolve_checkpoint(load)
        meta = checkpointing.read_meta(ckpt)
        cfg = checkpoint_config(meta, ckpt, overrides, world, batches)
        if cfg.train.preflight and int(os.environ.get("LOCAL_RANK", "0")) == 0:  # as train.py: before the data
            from planner import preflight  # tools/planner (beside this file)

            preflight.check(cfg, lambda extra: checkpoint_config(meta, ckpt, [*overrides, *extra], world, batches),
                            preflight.local_ranks(cfg))
        if check is not None:
            check(cfg, not torchrun)
        if not torchrun:
            if cfg.parallel.world_size > 1:  # type: ignore[operator]
                ranks_argv = [*argv, "train.preflight=false"] if cfg.train.preflight else argv  # checked here, once
                with tempfile.TemporaryDirectory(prefix="ranks_") as logs:
                    return launcher.start_local(cfg.parallel.world_size, ranks_argv, Path(logs), None,  # type: ignore[arg-type]
                                                cpu=cfg.parallel.device == "cpu")
            launcher.single_rank_env()
        out = work(cfg, ckpt, meta)
        if rank == 0 and out is not None:
            print(out, flush=True)
    except UserError as exc:
        if cfg is not None or rank == 0:
            print(f"error: {exc}", file=sys.stderr)
        faults.record_error(f"error: {exc}")
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        return 130
    return 0
