"""Helpers for end-to-end train.py runs: a tiny byte-level dataset, a runner and cached reference runs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from megatron_sp.testing import train_ranks

ROOT = Path(__file__).resolve().parents[2]

# A small model on byte-level tokens: fast on 2 cores, big enough that every parameter gets a gradient.
BASE = ["model.num_layers=2", "model.hidden_size=64", "model.num_heads=4", "model.seq_length=64",
        "model.make_vocab_size_divisible_by=32", "tokenizer.type=byte", "train.micro_batch_size=2",
        "train.global_batch_size=8", "train.lr=1e-3", "train.min_lr=1e-4", "train.lr_warmup_iters=2",
        "train.lr_decay_iters=10", "train.seed=7", "logging.interval=1", "data.build_demo=false",
        "logging.peak_tflops=0.1"]

# What the parity standard runs: 5 steps, every step logged, step-1 gradients dumped.
PARITY = ["train.iters=5", "logging.dump_grads_step=1"]

# Dropout on both RNG streams: the default generator (hidden states) and the tracker's tp-different (attention).
DROPOUT = ["model.hidden_dropout=0.1", "model.attention_dropout=0.1"]


def make_byte_dataset(directory: Path) -> str:
    """A ~400 kB slice of the demo corpus tokenized to bytes; returns the dataset prefix."""
    from megatron_sp.config import TokenizerConfig
    from megatron_sp.data import build_tokenizer
    from megatron_sp.data.corpus import make_demo_corpus
    from megatron_sp.data.preprocess import preprocess_jsonl

    corpus = make_demo_corpus(directory / "corpus.jsonl", max_bytes=400_000)
    preprocess_jsonl([corpus], str(directory / "byte"), build_tokenizer(TokenizerConfig(type="byte")))
    return str(directory / "byte_text_document")


def train_argv(run_dir: Path, data: str, *overrides: str) -> list[str]:
    """train.py's arguments for ``train``: BASE, the data, logging.dir run_dir/log, then ``overrides``."""
    return [*BASE, f"data.paths=[{data}]", f"logging.dir={run_dir}/log", f"data.cache_dir={Path(data).parent}/cache",
            *overrides]


def train(run_dir: Path, data: str, *overrides: str, expect_ok: bool = True, cli: bool = False,
          env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run train.py with BASE + overrides; its logging.dir is run_dir/log. By default its ``main`` runs on the
    harness's ranks (``testing.train_ranks``: what torchrun starts, without the launching process and its
    pre-flight; stdout holds every rank's output). ``cli``, ``env`` (added to the environment) or an expected failure
    runs the command line itself in a subprocess: the launcher, the pre-flight, exit codes and output as a user
    sees them."""
    args = train_argv(run_dir, data, *overrides)
    if cli or env or not expect_ok:
        p = subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, capture_output=True, text=True,
                           timeout=900, env={**os.environ, **env} if env else None)
    else:
        ranks = train_ranks(args)
        code = next((c for c, _ in ranks if c), 0)
        p = subprocess.CompletedProcess(args, code, "".join(out for _, out in ranks), "")
    if expect_ok:
        assert p.returncode == 0, f"train.py failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p


def metrics(run_dir: Path) -> dict[int, dict]:
    """{step: record} of the run's loss records."""
    rows = [json.loads(line) for line in (run_dir / "log" / "metrics.jsonl").read_text().splitlines() if line]
    return {r["step"]: r for r in rows if "loss" in r}


def make_packed_dataset(directory: Path) -> str:
    """Short documents (20–60 bytes of stdlib source lines each), so that every 65-token sample packs
    several of them: what ``data.reset_attention_mask`` and ``reset_position_ids`` act on."""
    from megatron_sp.config import TokenizerConfig
    from megatron_sp.data import build_tokenizer
    from megatron_sp.data.corpus import make_demo_corpus
    from megatron_sp.data.preprocess import preprocess_jsonl

    corpus = make_demo_corpus(directory / "corpus.jsonl", max_bytes=200_000)
    lines = [line.strip() for row in corpus.read_text().splitlines() for line in json.loads(row)["text"].splitlines()]
    docs = [line[:60] for line in lines if len(line) >= 20][:4000]
    short = directory / "short.jsonl"
    short.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    preprocess_jsonl([short], str(directory / "packed"), build_tokenizer(TokenizerConfig(type="byte")))
    return str(directory / "packed_text_document")


def make_hf_packed_dataset(directory: Path, seq_length: int = 64) -> str:
    """The short documents of ``make_packed_dataset`` (byte tokens, each ended by EOD) packed greedily the
    Hugging Face way (a JSONL line per sample: input_ids, position_ids restarting at 0 per document, labels
    -100 on each document's first token, at most ``seq_length + 1`` tokens), converted by
    ``convert_packed_jsonl``: a prefix for ``data.packing=position_ids``."""
    from megatron_sp.config import TokenizerConfig
    from megatron_sp.data import build_tokenizer
    from megatron_sp.data.corpus import make_demo_corpus
    from megatron_sp.data.packed import convert_packed_jsonl

    tokenizer = build_tokenizer(TokenizerConfig(type="byte"))
    corpus = make_demo_corpus(directory / "corpus.jsonl", max_bytes=100_000)
    lines = [line.strip() for row in corpus.read_text().splitlines() for line in json.loads(row)["text"].splitlines()]
    docs = [[*tokenizer.encode(line[:60]), tokenizer.eod] for line in lines if len(line) >= 20][:1500]
    rows, current = [], []
    for doc in docs:
        if sum(map(len, current)) + len(doc) > seq_length + 1:
            rows.append(current)
            current = []
        current.append(doc)
    rows.append(current)
    packed = directory / "hf_packed.jsonl"
    packed.write_text("".join(json.dumps({
        "input_ids": [t for d in row for t in d],
        "position_ids": [p for d in row for p in range(len(d))],
        "labels": [-100 if p == 0 else t for d in row for p, t in enumerate(d)]}) + "\n" for row in rows))
    return convert_packed_jsonl([packed], directory / "hf", seq_length, tokenizer.vocab_size,
                                tokenizer.pad)["outputs"][0]
