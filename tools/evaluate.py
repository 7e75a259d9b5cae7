#!/usr/bin/env python
"""Loss and perplexity of a checkpoint written by train.py, under any parallel layout.

    python tools/evaluate.py --load checkpoints/demo --data data/demo/demo_text_document
    python tools/evaluate.py --load checkpoints/demo parallel.tp=2 parallel.pp=2 --json
    torchrun --standalone --nproc-per-node 4 tools/evaluate.py --load checkpoints/demo parallel.tp=2 parallel.pp=2

``--data PREFIX`` (repeatable): every document of each Megatron .bin/.idx dataset once, in global batches of
``train.global_batch_size`` samples (a last partial batch is left out). Without it: the validation that train.py
reports at the checkpoint's step, that is ``train.eval_iters`` global batches of the validation split of the training
blend (of a run without validation, the first ones). The model, tokenizer and data settings come from the config in
the checkpoint's meta.json; ``section.key=value`` overrides (as for train.py) set the layout (``parallel.*``, one rank
by default: the writer's layout is not special) and may change anything but the model, e.g.
``train.micro_batch_size`` for memory, ``train.eval_iters`` or ``data.paths``. Run plainly, it starts the local ranks
the layout needs; under torchrun, ``parallel.dp`` fills the world. The figures are those train.py's validation
computes (``training.loss_sums``), the same for every layout. Prints one line per dataset (tokens, loss,
perplexity), or with ``--json`` one JSON object. See docs/generation.md, "Evaluation".
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

if importlib.util.find_spec("megatron_sp") is None:  # run from a checkout without installing the package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist

from megatron_sp import checkpointing, device as device_mod, faults, launcher, metrics as metrics_mod
from megatron_sp.config import Config
from megatron_sp.config.loader import _apply_section, apply_override, finalize, set_vocab
from megatron_sp.data import (build_datasets, build_tokenizer, check_inputs, open_dataset, parse_blend,
                              split_documents, whole_dataset)
from megatron_sp.data.tokenizer import Tokenizer
from megatron_sp.errors import ConfigError, DataError, OneLineArgumentParser, UserError

EXIT_USER_ERROR = 2  # every user error of this tool: a bad path, a layout that cannot hold the model, ...


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = OneLineArgumentParser(prog="evaluate.py", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--load", required=True, metavar="DIR",
                        help="Checkpoint directory: a checkpoint.save directory (uses 'latest') or an iter_* dir.")
    parser.add_argument("--data", action="append", default=[], metavar="PREFIX",
                        help="A dataset (PREFIX.bin, PREFIX.idx) to evaluate whole; repeat for more. Default: the "
                             "validation split of the checkpoint's data.paths.")
    parser.add_argument("--json", action="store_true",
                        help="Print one JSON object: checkpoint, step, layout and a result per dataset.")
    parser.add_argument("overrides", nargs="*", help="dotted overrides like parallel.tp=2 train.micro_batch_size=1")
    return parser.parse_args(argv)


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


def eval_config(meta: dict[str, Any], ckpt: Path, overrides: list[str], world_size: int | None) -> Config:
    """The checkpoint's config without its layout (``parallel`` is the overrides', one rank by default), the values
    derived from the layout recomputed, then ``overrides`` (not ``model.*``: the model is the checkpoint's)."""
    saved = meta.get("config")
    if not isinstance(saved, dict):
        raise DataError(f"checkpoint file '{ckpt / 'meta.json'}' holds no config")
    cfg = Config()
    for section, values in saved.items():
        if section != "parallel":
            _apply_section(cfg, str(section), values, f"checkpoint file '{ckpt / 'meta.json'}'")
    cfg.model.padded_vocab_size = None  # padded for this layout's tp (the checkpoint stores the vocabulary unpadded)
    cfg.train.grad_accum_steps = None  # derived from this layout's dp
    cfg.train.compile = False  # evaluation runs eager
    cfg.data.build_demo = False  # evaluate the files there are: never build a corpus or train a tokenizer
    for item in overrides:
        if item.split("=", 1)[0].strip().startswith("model."):
            raise ConfigError(f"override '{item}': the model is the checkpoint's; set the layout (parallel.*), batch "
                              "sizes (train.*) or data (data.*)")
        apply_override(cfg, item)
    if not cfg.train.eval_interval:  # a run without validation: its first eval_iters batches (as at its last step)
        cfg.train.eval_interval = cfg.train.iters + 1
    return finalize(cfg, world_size)


def load_tokenizer(cfg: Config) -> Tokenizer:
    """The checkpoint's tokenizer; the vocabulary sizes of ``cfg.model`` set from it (padded for this layout)."""
    tokenizer = build_tokenizer(cfg.tokenizer)
    set_vocab(cfg, tokenizer.vocab_size)
    return tokenizer


def prepare(cfg: Config, prefixes: list[str]) -> None:
    """Before any rank starts: the tokenizer and every dataset to read checked (a missing file is one line)."""
    tokenizer = load_tokenizer(cfg)
    for prefix in prefixes:
        dataset(cfg, tokenizer, prefix)
    if not prefixes:
        check_inputs(cfg)
        if not any(split_documents(open_dataset(prefix).num_documents, cfg.data.split)[1].size
                   for prefix in parse_blend(cfg.data.paths)[0]):
            raise DataError(f"the validation split of data.paths {cfg.data.paths} is empty (data.split="
                            f"{cfg.data.split}); give --data PREFIX or a data.split with a validation share")


def dataset(cfg: Config, tokenizer: Tokenizer, prefix: str) -> Any:
    """``--data PREFIX`` whole (``data.whole_dataset``), refused when it holds less than one global batch."""
    ds = whole_dataset(cfg, tokenizer, prefix)
    gbs: int = cfg.train.global_batch_size  # type: ignore[assignment]
    if len(ds) < gbs:
        raise DataError(f"--data {prefix}: {len(ds)} samples of {cfg.model.seq_length + 1} tokens, fewer than one "
                        f"global batch of train.global_batch_size={gbs}; lower it")
    return ds


def evaluate_checkpoint(cfg: Config, ckpt: Path, meta: dict[str, Any], prefixes: list[str]) -> list[dict[str, Any]]:
    """On every rank: {name, samples, tokens, loss, perplexity} per dataset of ``prefixes`` (none: the validation
    train.py reports at the checkpoint's step). Creates the default process group unless it exists."""
    from megatron_sp import training  # the model side: imported by the ranks only, not by the launching process
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
        rank = dist.get_rank()
        metrics_mod.setup_logging(cfg.logging.level, rank)
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
        for param in model.parameters():  # bf16/fp16 runs validate with 16-bit weights (the optimizer casts them)
            param.data = param.data.to(PRECISIONS[cfg.train.precision])
        checkpointing.load_model_state(model, ckpt, state)
        moe.load_expert_bias(model, meta.get("moe_expert_bias"))
        rt = training.Runtime(cfg, state, dev, model, None, tokenizer, None, None, None,  # type: ignore[arg-type]
                              step=int(meta.get("step", 0)))
        gbs: int = cfg.train.global_batch_size  # type: ignore[assignment]
        results = []
        for prefix in prefixes:
            ds = dataset(cfg, tokenizer, prefix)
            starts = list(range(0, len(ds) - gbs + 1, gbs))
            results.append(_result(str(prefix), len(starts) * gbs, *training.loss_sums(rt, ds, starts)))
        if not prefixes:
            rt.valid_ds = training._rank0_first(rank, lambda: build_datasets(cfg, tokenizer, *training.split_samples(cfg)))[1]
            if rt.valid_ds is None:
                raise DataError(f"the validation split of data.paths {cfg.data.paths} is empty (data.split="
                                f"{cfg.data.split}); give --data PREFIX or a data.split with a validation share")
            starts = training.validation_starts(cfg, rt.step, len(rt.valid_ds))
            results.append(_result(f"validation at step {rt.step}", len(starts) * gbs,
                                   *training.loss_sums(rt, rt.valid_ds, starts)))
        return results
    finally:
        if state is not None:
            state.destroy()
        if created and dist.is_initialized():
            dist.destroy_process_group()


def _result(name: str, samples: int, loss_sum: float, tokens: float) -> dict[str, Any]:
    loss = loss_sum / max(tokens, 1.0)
    return {"name": name, "samples": samples, "tokens": int(tokens), "loss": loss,
            "perplexity": math.exp(loss) if loss < 700 else math.inf}


def report(results: list[dict[str, Any]], ckpt: Path, step: int, cfg: Config, as_json: bool) -> str:
    """The output: one line per dataset, or one JSON object."""
    p = cfg.parallel
    if as_json:
        layout = {"tp": p.tp, "pp": p.pp, "cp": p.cp, "dp": p.dp, "world_size": p.world_size}
        return json.dumps({"checkpoint": str(ckpt), "step": step, "layout": layout, "results": results})
    return "\n".join(f"{r['name']}: {r['tokens']} tokens | loss {r['loss']:.6f} | perplexity {r['perplexity']:.4f}"
                     for r in results)


def main(argv: list[str] | None = None) -> int:
    """``tools/evaluate.py``: returns the exit code; a user error is one ``error:`` line (exit code 2)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    torchrun = launcher.under_torchrun()
    rank = int(os.environ.get("RANK", "0")) if torchrun else 0
    cfg = None
    try:
        ckpt = resolve_checkpoint(args.load)
        meta = checkpointing.read_meta(ckpt)
        cfg = eval_config(meta, ckpt, args.overrides, int(os.environ["WORLD_SIZE"]) if torchrun else None)
        if not torchrun:
            prepare(cfg, args.data)  # a missing file or tokenizer: one line before any rank starts
            if cfg.parallel.world_size > 1:  # type: ignore[operator]
                with tempfile.TemporaryDirectory(prefix="evaluate_ranks_") as logs:
                    return launcher.start_local(cfg.parallel.world_size, argv, Path(logs), None,  # type: ignore[arg-type]
                                                cpu=cfg.parallel.device == "cpu")
            launcher.single_rank_env()
        results = evaluate_checkpoint(cfg, ckpt, meta, args.data)
        if rank == 0:
            print(report(results, ckpt, int(meta.get("step", 0)), cfg, args.json), flush=True)
    except UserError as exc:
        if cfg is not None or rank == 0:
            print(f"error: {exc}", file=sys.stderr)
        faults.record_error(f"error: {exc}")
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
