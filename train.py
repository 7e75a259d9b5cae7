#!/usr/bin/env python3
"""Train a GPT: python train.py --conf configs/demo.yml [--conf more.yml] [section.key=value ...]

Run it plainly (it starts the local ranks the config needs) or under torchrun; both behave the same.
``main(argv)`` checks, once and before any rank starts, what can fail early (sinks, output directories,
checkpoints, data files); then, run plainly with world size > 1, it starts the local ranks
(``launcher.start_local``), else it trains on this rank (``training.run``). A user error is one line
from rank 0 and its exit code; Ctrl-C exits 130.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from megatron_sp import checkpointing, config as config_mod, faults, launcher, metrics as metrics_mod, training
from megatron_sp.errors import OneLineArgumentParser, UserError


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = OneLineArgumentParser(
        prog="train.py", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train a GPT. Config keys can be set in --conf files (YAML/JSON, merged in order) "
                    "and as section.key=value overrides; --help-config lists every key.")
    parser.add_argument("--conf", action="append", default=[], help="config file; repeat to merge (later wins)")
    parser.add_argument("--help-config", action="store_true", help="list every config key with its doc and exit")
    parser.add_argument("overrides", nargs="*", help="dotted overrides like parallel.dp=2 train.iters=50")
    return parser.parse_intermixed_args(argv)  # overrides between --conf options (the ranks' argv gets one appended)


def preflight(cfg: config_mod.Config, args: argparse.Namespace) -> str | None:
    """The planner's memory per rank against this host's (one line refusing a layout that cannot fit, before any
    data is built or rank started); the note a rank killed later is reported with. Off: ``train.preflight=false``."""
    if not cfg.train.preflight:
        return None
    from tools.planner import preflight as preflight_mod

    def build(extra: list[str]) -> config_mod.Config:
        return config_mod.load(args.conf, [*args.overrides, *extra])

    command = " ".join(["python train.py", *(f"--conf {c}" for c in args.conf), *args.overrides])
    return preflight_mod.check(cfg, build, preflight_mod.local_ranks(cfg), training=True, command=command)


def main(argv: list[str] | None = None) -> int:
    """``train.py``: returns the process exit code; user errors print one line."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.help_config:
        print(config_mod.help_text())
        return 0
    rank, cfg = 0, None
    try:
        torchrun = launcher.under_torchrun()  # a partial torchrun environment: one line
        rank = int(os.environ["RANK"]) if torchrun else 0
        world = int(os.environ["WORLD_SIZE"]) if torchrun else None
        notes: list[str] = []
        cfg = config_mod.load(args.conf, args.overrides, world_size=world, notes=notes)
        metrics_mod.setup_logging(cfg.logging.level, rank)
        for note in notes if torchrun or cfg.parallel.world_size == 1 else []:  # (not twice: the ranks say it)
            metrics_mod.log.info(note)
        metrics_mod.check_sinks(cfg)  # a missing wandb/tensorboard: one line now, not a rank failing later
        checkpointing.check_output_dir(cfg.logging.dir, "logging.dir")  # a file there: one line, not after training
        if rank == 0:  # checkpoint.save: a file, in use by a run now, or another run's checkpoints: one line now
            checkpointing.check_save_dir(cfg)
        memory_note = preflight(cfg, args) if int(os.environ.get("LOCAL_RANK", "0")) == 0 else None
        if not torchrun:
            tokenizer = training.prepare_inputs(cfg)  # build the demo data once, check files, before any rank starts
            ckpt = checkpointing.resume_source(cfg)  # a bad path: one line now
            if ckpt is not None:  # so is another seq_length or tokenizer (allowed: rank 0 warns)
                meta = checkpointing.read_meta(ckpt)
                if not cfg.checkpoint.allow_data_change:
                    training.check_resume_data(cfg, meta, ckpt, training.tokenizer_fingerprint(tokenizer))
            if cfg.parallel.world_size > 1:
                ranks_argv = [*argv, "train.preflight=false"] if cfg.train.preflight else argv  # checked here, once
                return launcher.start_local(cfg.parallel.world_size, ranks_argv, Path(cfg.logging.dir) / "ranks",
                                            cfg.checkpoint.save, cpu=cfg.parallel.device == "cpu",
                                            memory_note=memory_note)
            launcher.single_rank_env()
        # Global rank 0 locks checkpoint.save for the whole run (released on any exit) and checks it again
        with checkpointing.claim_save_dir(cfg) if rank == 0 else contextlib.nullcontext():
            training.run(cfg)
    except UserError as exc:
        if cfg is not None or rank == 0:  # every rank reads the same config and fails alike: rank 0 says it
            print(f"error: {exc}", file=sys.stderr)
        faults.record_error(f"error: {exc}")  # under torchrun: its failure report shows the line as the root cause
        return exc.exit_code
    except KeyboardInterrupt as exc:  # Ctrl-C: a first one saves (faults.Preemption; a second one exits at once)
        if rank == 0:
            print("interrupted" + (f": {exc}" if str(exc) else ""), file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
