"""End-to-end runs of train.py: determinism, exact resume, and the parity standard for data parallelism."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_sp.config import TokenizerConfig
from megatron_sp.parity import grad_diffs, load_grads

ROOT = Path(__file__).resolve().parents[2]

# A small neox on byte-level tokens: fast on 2 cores, big enough that every parameter gets a gradient.
BASE = ["model.num_layers=2", "model.hidden_size=64", "model.num_heads=4", "model.seq_length=64",
        "model.make_vocab_size_divisible_by=32", "tokenizer.type=byte", "train.micro_batch_size=2",
        "train.global_batch_size=8", "train.lr=1e-3", "train.min_lr=1e-4", "train.lr_warmup_iters=2",
        "train.lr_decay_iters=10", "train.seed=7", "logging.interval=1", "data.build_demo=false"]


@pytest.fixture(scope="module")
def byte_data(tmp_path_factory) -> str:
    from megatron_sp.data import build_tokenizer
    from megatron_sp.data.corpus import make_demo_corpus
    from megatron_sp.data.preprocess import preprocess_jsonl

    d = tmp_path_factory.mktemp("data")
    corpus = make_demo_corpus(d / "corpus.jsonl", max_bytes=400_000)
    preprocess_jsonl([corpus], str(d / "byte"), build_tokenizer(TokenizerConfig(type="byte")))
    return str(d / "byte_text_document")


def train(run_dir: Path, data: str, *overrides: str, expect_ok: bool = True) -> subprocess.CompletedProcess:
    args = [sys.executable, "train.py", *BASE, f"data.paths=[{data}]", f"logging.dir={run_dir}/log",
            f"data.cache_dir={run_dir.parent}/cache", *overrides]
    p = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)
    if expect_ok:
        assert p.returncode == 0, f"train.py failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p


def metrics(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "log" / "metrics.jsonl").read_text().splitlines() if line]
    return {r["step"]: r for r in rows if "loss" in r}


def test_same_seed_same_losses_and_resume_is_bitwise(tmp_path, byte_data):
    full, again, first, second = (tmp_path / n for n in ("full", "again", "first", "second"))
    train(full, byte_data, "train.iters=10", f"checkpoint.save={full}/ckpt", "checkpoint.interval=5")
    train(again, byte_data, "train.iters=10")
    train(first, byte_data, "train.iters=5", f"checkpoint.save={first}/ckpt")
    train(second, byte_data, "train.iters=10", f"checkpoint.load={first}/ckpt", f"checkpoint.save={second}/ckpt")

    ref, rep = metrics(full), metrics(again)
    assert sorted(ref) == list(range(1, 11))
    assert [ref[s]["loss"] for s in ref] == [rep[s]["loss"] for s in ref]          # determinism: bitwise
    assert ref[10]["loss"] < ref[1]["loss"]

    resumed = metrics(second)
    assert sorted(resumed) == list(range(6, 11))
    for s in range(6, 11):                                                          # 5 + resume + 5: bitwise
        assert resumed[s]["loss"] == ref[s]["loss"], s
        assert resumed[s]["grad_norm"] == ref[s]["grad_norm"], s
    a = torch.load(full / "ckpt" / "iter_0000010" / "model.pt", weights_only=True)
    b = torch.load(second / "ckpt" / "iter_0000010" / "model.pt", weights_only=True)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert (full / "ckpt" / "latest").read_text().strip() == "iter_0000010"
    assert (full / "log" / "config.yml").is_file()


LAYOUTS = {
    "dp2": ["parallel.dp=2"],
    "dp4": ["parallel.dp=4"],
    "dp2_eod_masked": ["parallel.dp=2", "data.eod_mask_loss=true"],
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_data_parallel_parity(tmp_path, byte_data, name):
    """The parity standard: per-step loss 5e-6, step-1 grad norm 1e-5, every full gradient 1e-5."""
    extra = ["data.eod_mask_loss=true"] if "eod" in name else []
    common = ["train.iters=5", "logging.dump_grads_step=1", *extra]
    ref_dir, run_dir = tmp_path / "ref", tmp_path / name
    train(ref_dir, byte_data, *common, "parallel.dp=1")
    train(run_dir, byte_data, *common, *LAYOUTS[name])
    ref, got = metrics(ref_dir), metrics(run_dir)
    assert sorted(got) == sorted(ref) == [1, 2, 3, 4, 5]
    assert got[1]["world_size"] == int(LAYOUTS[name][0].split("=")[1])
    for s in ref:
        assert abs(got[s]["loss"] - ref[s]["loss"]) <= 5e-6 * abs(ref[s]["loss"]), (s, got[s]["loss"], ref[s]["loss"])
    assert abs(got[1]["grad_norm"] - ref[1]["grad_norm"]) <= 1e-5 * ref[1]["grad_norm"]
    diffs = grad_diffs(load_grads(run_dir / "log" / "grads_step1.pt"), load_grads(ref_dir / "log" / "grads_step1.pt"))
    assert len(diffs) > 10
    worst = max(diffs, key=diffs.get)
    assert diffs[worst] <= 1e-5, (worst, diffs[worst])


def test_bf16_runs_close_to_fp32(tmp_path, byte_data):
    train(tmp_path / "fp32", byte_data, "train.iters=3")
    train(tmp_path / "bf16", byte_data, "train.iters=3", "train.precision=bf16")
    a, b = metrics(tmp_path / "fp32"), metrics(tmp_path / "bf16")
    assert abs(a[1]["loss"] - b[1]["loss"]) < 0.05 * a[1]["loss"]
    assert all(torch.isfinite(torch.tensor(b[s]["loss"])) for s in b)


def test_missing_data_is_one_line_naming_the_file(tmp_path):
    p = train(tmp_path / "x", str(tmp_path / "nope" / "missing_text_document"), "train.iters=1", expect_ok=False)
    assert p.returncode != 0
    assert "Traceback" not in p.stderr
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "missing_text_document" in lines[0] and "preprocess_data.py" in lines[0], p.stderr
