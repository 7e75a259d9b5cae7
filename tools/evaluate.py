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
import sys
from pathlib import Path
from typing import Any

if importlib.util.find_spec("megatron_sp") is None:  # run from a checkout without installing the package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if str(Path(__file__).resolve().parent) not in sys.path:  # inference_setup beside this script
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from inference_setup import load_tokenizer, loaded_stage, run_tool

from megatron_sp.config import Config
from megatron_sp.data import (build_datasets, check_inputs, open_dataset, parse_blend, split_documents,
                              whole_dataset)
from megatron_sp.data.tokenizer import Tokenizer
from megatron_sp.errors import DataError, OneLineArgumentParser


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
    return parser.parse_intermixed_args(argv)  # the ranks get an override appended


def prepare(cfg: Config, prefixes: list[str]) -> None:
    """Before any rank starts: the tokenizer and every dataset to read checked (a missing file is one line)."""
    tokenizer = load_tokenizer(cfg)
    for prefix in prefixes:
        dataset(cfg, tokenizer, prefix)
    if not prefixes:
        if not cfg.data.paths:
            raise DataError("the checkpoint's config has no data.paths (an imported checkpoint?); give --data PREFIX, "
                            "or data.paths=[PREFIX] for the validation split of that data")
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
    from megatron_sp import training

    with loaded_stage(cfg, ckpt, meta) as (state, model, tokenizer, dev):
        rt = training.Runtime(cfg, state, dev, model, None, tokenizer, None, None, None,  # type: ignore[arg-type]
                              step=int(meta.get("step", 0)))
        gbs: int = cfg.train.global_batch_size  # type: ignore[assignment]
        results = []
        for prefix in prefixes:
            ds = dataset(cfg, tokenizer, prefix)
            starts = list(range(0, len(ds) - gbs + 1, gbs))
            results.append(_result(str(prefix), len(starts) * gbs, *training.loss_sums(rt, ds, starts)))
        if not prefixes:
            rt.valid_ds = training._rank0_first(state.rank, lambda: build_datasets(cfg, tokenizer,
                                                                                  *training.split_samples(cfg)))[1]
            if rt.valid_ds is None:
                raise DataError(f"the validation split of data.paths {cfg.data.paths} is empty (data.split="
                                f"{cfg.data.split}); give --data PREFIX or a data.split with a validation share")
            starts = training.validation_starts(cfg, rt.step, len(rt.valid_ds))
            results.append(_result(f"validation at step {rt.step}", len(starts) * gbs,
                                   *training.loss_sums(rt, rt.valid_ds, starts)))
        return results


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

    def check(cfg: Config, before_ranks: bool) -> None:
        if before_ranks:
            prepare(cfg, args.data)  # a missing file or tokenizer: one line before any rank starts

    def work(cfg: Config, ckpt: Path, meta: dict[str, Any]) -> str:
        return report(evaluate_checkpoint(cfg, ckpt, meta, args.data), ckpt, int(meta.get("step", 0)), cfg, args.json)

    return run_tool(argv, args.load, args.overrides, work, check)


if __name__ == "__main__":
    sys.exit(main())
