"""How much faster `train.compile` makes train.py under each layout: 1 rank, tp2 + SP, dp2.

Each (layout, dtype) trains on a byte-level dataset built in a temporary directory; the byte vocabulary is padded to
``--vocab`` embedding rows (``model.make_vocab_size_divisible_by``), as in tools/bench/throughput.py. Two methods:
``--method processes`` runs train.py itself, eager and compiled, in ABBA order over ``--rounds``; tokens/s is
train.py's own per-step rate (metrics.jsonl). ``--method steps`` starts the layout's ranks once, with train.py's setup
and an eager and a compiled model side by side, and times ``--iters`` of train.py's steps (``training.train_step``)
of each, alternating ABBA: no process-to-process variance. Both keep the steps after ``--skip`` (compiling, warm-up),
best and median. Method: docs/benchmarks.md. Run from the repo root:
  python tools/bench/compile_layouts.py [--method steps] [--dtype fp32,bf16] [--layouts "1:,dp2:parallel.dp=2"] ...
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from common import CONFIG_KEYS, names, parser, print_json, run_distributed
from megatron_sp import config as config_mod, training
from megatron_sp.config import TokenizerConfig
from megatron_sp.data import build_tokenizer
from megatron_sp.data.corpus import make_demo_corpus
from megatron_sp.data.preprocess import preprocess_jsonl
from megatron_sp.mpu import comm

ROOT = Path(__file__).resolve().parents[2]
LAYOUTS = "1:,tp2+SP:parallel.tp=2 parallel.sequence_parallel=true,dp2:parallel.dp=2"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__, arch="llama", layers=4, hidden=512, heads=8, seq=512, batch=4, vocab=8192, seed=1234)
    p.add_argument("--dtype", default="fp32,bf16", help="comma-separated: fp32,bf16")
    p.add_argument("--layouts", default=LAYOUTS,
                   help="comma-separated name:overrides (space-separated train.py overrides; world = their product)")
    p.add_argument("--global-batch", type=int, default=8, help="train.global_batch_size (1 rank: b·accumulation)")
    p.add_argument("--method", choices=("processes", "steps"), default="processes",
                   help="processes: train.py runs in ABBA order; steps: one run per cell, eager and compiled steps "
                        "alternating")
    p.add_argument("--iters", type=int, default=10, help="train.iters of each run (steps: steps of each model)")
    p.add_argument("--skip", type=int, default=3, help="first steps left out (compiling, warm-up)")
    p.add_argument("--rounds", type=int, default=4, help="processes: runs of each mode per cell, in ABBA order")
    args = p.parse_args(argv)
    if args.iters <= args.skip or args.skip < 0 or args.rounds < 1:
        raise SystemExit("--iters must exceed --skip (>= 0), --rounds must be >= 1")
    return args


def byte_dataset(directory: Path, samples: int, seq: int) -> str:
    """A byte-level dataset of at least ``samples`` sequences of ``seq + 1`` tokens (the demo corpus)."""
    corpus = make_demo_corpus(directory / "corpus.jsonl", max_bytes=max(200_000, 2 * samples * (seq + 1)))
    preprocess_jsonl([corpus], str(directory / "byte"), build_tokenizer(TokenizerConfig(type="byte")))
    return str(directory / "byte_text_document")


def overrides(args: argparse.Namespace, layout: str, dtype: str, data: str, run_dir: Path,
              iters: int | None = None) -> list[str]:
    """train.py's overrides for one run of ``iters`` steps (default ``--iters``): the model of the flags, the
    vocabulary padded to ``--vocab`` rows."""
    iters = iters or args.iters
    tp = next((int(x.split("=")[1]) for x in layout.split() if x.startswith("parallel.tp=")), 1)
    model = [f"model.{key}={getattr(args, flag)}" for flag, key in CONFIG_KEYS.items()
             if getattr(args, flag, None) is not None]
    return [*model, f"model.make_vocab_size_divisible_by={args.vocab // tp}", "tokenizer.type=byte",
            f"data.paths=[{data}]", f"data.cache_dir={Path(data).parent}/cache", "data.build_demo=false",
            f"train.micro_batch_size={args.batch}", f"train.global_batch_size={args.global_batch}",
            f"train.iters={iters}", f"train.lr_warmup_iters={min(2, iters)}", f"train.seed={args.seed}",
            f"train.precision={dtype}", "train.eval_interval=0", "logging.interval=1",
            f"logging.dir={run_dir}", *layout.split()]


def run(args: argparse.Namespace, layout: str, dtype: str, compiled: bool, data: str, run_dir: Path) -> list[float]:
    """Tokens/s of every step after ``--skip`` of one train.py run."""
    argv = [sys.executable, "train.py", *overrides(args, layout, dtype, data, run_dir), f"train.compile={compiled}"]
    p = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    if p.returncode:
        tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
        raise SystemExit(f"train.py {' '.join(argv[2:])} failed ({p.returncode}):\n" + "\n".join(tail))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    return [r["tokens_per_s"] for r in rows if "tokens_per_s" in r and r["step"] > args.skip]


def alternating_rank(rank: int, world: int, argv: list[str], steps: int) -> dict[bool, list[float]]:
    """One rank of ``--method steps``: train.py's setup (its eager model), a compiled model and optimizer beside it,
    then ``steps`` of ``training.train_step`` with each, alternating ABBA; seconds of each step by ``compiled``."""
    if world == 1:  # run_distributed gives a rank one thread; train.py leaves one rank torch's default (setup sets
        torch.set_num_threads(os.cpu_count() or 1)  # cores / local ranks above one rank, as train.py does)
    cfg = config_mod.load([], argv, world_size=world)
    rt = training.setup(cfg)
    models = {False: (rt.model, rt.optimizer), True: training.build_model(cfg, rt.state, rt.device, compiled=True)}
    seconds: dict[bool, list[float]] = {False: [], True: []}
    for i in range(steps):
        for compiled in (False, True) if i % 2 == 0 else (True, False):
            rt.model, rt.optimizer = models[compiled]
            comm.barrier()
            start = time.perf_counter()
            training.train_step(rt)
            seconds[compiled].append(time.perf_counter() - start)
    return seconds


def run_steps(args: argparse.Namespace, layout: str, dtype: str, data: str, run_dir: Path) -> dict[bool, list[float]]:
    """Tokens/s of every step after ``--skip`` of each model, ``--method steps`` (rank 0's clock)."""
    argv = [*overrides(args, layout, dtype, data, run_dir, iters=2 * args.iters), "train.compile=false"]  # both models' data
    world = config_mod.load([], argv).parallel.world_size
    seconds = run_distributed(alternating_rank, world, argv=argv, steps=args.iters, timeout_s=3600)[0]
    tokens = args.global_batch * args.seq
    return {compiled: [tokens / t for t in times[args.skip:]] for compiled, times in seconds.items()}


def bench_cell(args: argparse.Namespace, name: str, layout: str, dtype: str, data: str, work: Path) -> dict:
    """Eager and compiled tokens/s of one (layout, dtype): train.py runs in ABBA order, or alternating steps."""
    if args.method == "steps":
        rates = run_steps(args, layout, dtype, data, work / f"{name}-{dtype}-steps")
    else:
        rates = {False: [], True: []}
        for r in range(args.rounds):
            for compiled in (False, True) if r % 2 == 0 else (True, False):
                run_dir = work / f"{name}-{dtype}-{int(compiled)}-{r}"
                rates[compiled] += run(args, layout, dtype, compiled, data, run_dir)
    out = {"layout": name, "overrides": layout, "dtype": dtype, "method": args.method}
    for compiled, key in ((False, "eager"), (True, "compiled")):
        out[f"{key}_tokens_per_s"] = max(rates[compiled])
        out[f"{key}_tokens_per_s_median"] = statistics.median(rates[compiled])
    out["speedup"] = out["compiled_tokens_per_s"] / out["eager_tokens_per_s"]
    out["speedup_median"] = out["compiled_tokens_per_s_median"] / out["eager_tokens_per_s_median"]
    return out


def main(argv: list[str] | None = None) -> None:
    """Run every (layout, dtype) cell, print the table (speedups against the 1-rank row) and the JSON line."""
    args = parse_args(argv)
    layouts = [spec.split(":", 1) for spec in names(args.layouts)]
    with tempfile.TemporaryDirectory(prefix="compile-layouts-") as tmp:
        work = Path(tmp)
        data = byte_dataset(work / "data", (2 * args.iters + 1) * args.global_batch, args.seq)
        results = [bench_cell(args, name, layout, dtype, data, work)
                   for dtype in names(args.dtype) for name, layout in layouts]
    print(f"{'layout':10} {'dtype':5} {'eager tok/s':>11} {'comp tok/s':>11} {'speedup':>8} {'median':>7} {'vs 1st':>7}")
    for r in results:
        first = next(x for x in results if x["dtype"] == r["dtype"])
        r["speedup_vs_first_layout"] = r["speedup"] / first["speedup"]
        print(f"{r['layout']:10} {r['dtype']:5} {r['eager_tokens_per_s']:11.0f} {r['compiled_tokens_per_s']:11.0f} "
              f"{r['speedup']:8.3f} {r['speedup_median']:7.3f} {r['speedup_vs_first_layout']:7.3f}")
    config = {k: v for k, v in vars(args).items() if k not in ("dtype", "layouts")}
    print_json("compile_layouts", config=config, results=results)


if __name__ == "__main__":
    main()
