#!/usr/bin/env python3
"""GPU check: one command, one GPU, under 8 minutes. What it runs and reports: docs/benchmarks.md, "GPU check".

  a. train.py trains the model shape of configs/125M.yml in bf16 for a few steps on synthetic data built here (a
     WordLevel tokenizer of the config's 50277 words, Zipf-distributed tokens), with torch's SDPA and with flash-attn
     when it imports, eager and compiled (``train.compile``): tokens/s and MFU against the GPU's datasheet peak (from
     its metrics.jsonl), peak memory (``torch.cuda.max_memory_allocated``) against the planner's figure;
  b. a tiny model in fp32 for a few steps on the GPU and on the CPU, same seed and batches: loss per step, relative
     difference (TF32 off: torch's default, which train.py keeps);
  c. greedy generation by our model and by transformers (the exported model, same weights) on the GPU: tokens
     checked equal first, then prefill and decode tokens/s;
  d. a table, then one JSON line last: every number, the device, torch, which parts ran, which were skipped and why.

Each part runs under a deadline within ``--budget-s`` (the later parts keep a reserve); what no longer fits is
skipped with the reason. Without a GPU, or with ``--dry``, the same code runs on the CPU at a tiny size (what CI runs).
Run from the repo root (the checkout need not be installed; no network):
    python tools/gpu_check.py [--json FILE] [--budget-s 450] [--peak-tflops N] [key=value ...]
    python tools/gpu_check.py --dry
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tools" / "bench")]  # megatron_sp from the checkout, as train.py does

import numpy as np  # noqa: E402
import torch  # noqa: E402

from megatron_sp import config as config_mod, device  # noqa: E402

CONFIG = ROOT / "configs" / "125M.yml"
SHAPE_KEYS = ("arch", "num_layers", "hidden_size", "num_heads", "num_kv_heads", "ffn_hidden_size", "seq_length",
              "rotary_pct")
DATASHEET_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H200 NVL", 836.0), ("GH200", 989.0), ("H200", 989.0),
                    ("H100", 989.0), ("A100", 312.0), ("B200", 2250.0))
"""Dense bf16 TFLOP/s (no sparsity) by a substring of the device name, the first match wins (NVIDIA datasheets:
H100 SXM, H200 and GH200 989, H100 NVL 835, H200 NVL 836, H100 PCIe 756, A100 312, B200 2250)."""
PARITY_RTOL = 1e-5  # GPU vs CPU fp32 loss, per step (TF32 off): what part b expects


@dataclass(frozen=True)
class Sizes:
    """What each part runs: the full sizes on a GPU, ``DRY`` on the CPU."""

    train_model: tuple[str, ...]  # model overrides over configs/125M.yml (none: its shape)
    train_vocab: int
    micro_batch: int
    iters: int
    interval: int  # tokens/s and MFU: the last logging interval (the first includes warm-up and compiling)
    parity_model: tuple[str, ...]
    parity_vocab: int
    parity_iters: int
    gen_model: tuple[str, ...]
    gen_vocab: int
    gen_batches: tuple[int, ...]
    prompt_len: int
    new_tokens: int
    reps: int
    reserve_s: dict[str, float]  # seconds kept for the later parts
    min_run_s: float  # a train.py run is not started with less left


TINY = ("model.num_layers=2", "model.hidden_size=64", "model.num_heads=4", "model.seq_length=64")
FULL = Sizes(train_model=(), train_vocab=50277, micro_batch=16, iters=30, interval=10,
             parity_model=("model.num_layers=2", "model.hidden_size=128", "model.num_heads=4", "model.seq_length=128"),
             parity_vocab=512, parity_iters=5, gen_model=("model.init_std=0.05",), gen_vocab=50277, gen_batches=(1, 8),
             prompt_len=64, new_tokens=64, reps=3, reserve_s={"parity": 70.0, "generate": 80.0}, min_run_s=20.0)
DRY = replace(FULL, train_model=TINY, train_vocab=512, micro_batch=2, iters=4, interval=2, parity_model=TINY,
              parity_iters=3, gen_model=(*TINY, "model.init_std=0.05"), gen_vocab=512, gen_batches=(1, 2), prompt_len=6,
              new_tokens=4, reps=1, reserve_s={"parity": 10.0, "generate": 5.0}, min_run_s=3.0)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry", action="store_true", help="the CPU at a tiny size, in seconds (automatic without a GPU)")
    p.add_argument("--budget-s", type=float, default=None, help="seconds for all parts (default 450; --dry 120)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="the device's dense bf16 peak for MFU (default: the datasheet figure of a known GPU)")
    p.add_argument("--parts", default="train,parity,generate", help="comma-separated subset of train,parity,generate")
    p.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                   help="compiled training runs: auto runs them on a GPU only (on the CPU inductor takes minutes)")
    p.add_argument("--json", type=Path, default=None, help="also write the JSON line to this file")
    p.add_argument("--work", type=Path, default=None, help="keep the data and run directories here (default: a temp dir)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("overrides", nargs="*", help="dotted overrides for every train.py run (e.g. parallel.backend=gloo)")
    args = p.parse_args(argv)
    args.parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    if not set(args.parts) <= {"train", "parity", "generate"}:
        p.error(f"--parts: {args.parts} has a part other than train, parity, generate")
    return args


@dataclass
class Check:
    """The state every part shares: where it computes, the clock, the data built so far."""

    dev: torch.device
    sizes: Sizes
    work: Path
    end: float  # time.monotonic() deadline of the whole check
    seed: int
    peak_tflops: float | None
    overrides: list[str]  # the user's, after the check's own, on every train.py run
    data: dict[int, tuple[str, str]] = field(default_factory=dict)  # vocab → (data prefix, tokenizer.json)

    def left(self, reserve: float = 0.0) -> float:
        return self.end - reserve - time.monotonic()


def datasheet_peak(name: str) -> float | None:
    return next((tflops for key, tflops in DATASHEET_TFLOPS if key in name), None)


# ----------------------------------------------------------------------------- synthetic data

def synthetic_data(ck: Check, vocab: int, tokens: int) -> tuple[str, str]:
    """(data prefix, tokenizer.json) for ``vocab`` words: a WordLevel tokenizer (id 0 ``<|endoftext|>``) and at least
    ``tokens`` Zipf-distributed tokens in documents of 100-4000 (learnable: the loss falls), from the check's seed."""
    if vocab in ck.data:
        return ck.data[vocab]
    from tokenizers import Tokenizer, models, pre_tokenizers

    from megatron_sp.data.indexed import IndexedDatasetWriter, best_dtype

    out = ck.work / f"data_v{vocab}"
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordLevel({"<|endoftext|>": 0, **{f"w{i}": i for i in range(1, vocab)}},
                                     unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(out / "tokenizer.json"))
    rng = np.random.default_rng(ck.seed)
    with IndexedDatasetWriter(out / "synthetic", best_dtype(vocab)) as writer:
        written = 0
        while written < tokens:
            doc = rng.zipf(1.2, int(rng.integers(100, 4000))) % (vocab - 1) + 1
            writer.add_document(np.append(doc, 0))  # ends with the end-of-document token, as preprocess_data's
            written += len(doc) + 1
    ck.data[vocab] = (str(out / "synthetic"), str(out / "tokenizer.json"))
    return ck.data[vocab]


# ----------------------------------------------------------------------------- train.py runs

BLOCK_FLASH = "import runpy, sys; sys.modules['flash_attn'] = None; sys.argv[0] = 'train.py'; " \
              "runpy.run_path('train.py', run_name='__main__')"
"""train.py with flash-attn made unimportable, so attention takes torch's SDPA (``device.flash_attn_func``)."""


def train_overrides(ck: Check, name: str, vocab: int, model: tuple[str, ...], iters: int, batch: int,
                    extra: list[str], where: str) -> list[str]:
    """The overrides of a one-rank train.py run over configs/125M.yml on ``where`` (cpu | cuda): the synthetic data
    of ``vocab`` words (enough for ``iters`` batches of ``batch``, built on first use), no checkpoints, no
    validation, ``logging.dir`` the check's ``name`` directory."""
    seq = config_mod.load([CONFIG], list(model)).model.seq_length
    prefix, tokenizer = synthetic_data(ck, vocab, int(1.2 * iters * batch * (seq + 1)) + 8000)
    return [f"data.paths=[{prefix}]", "data.split=100,0,0", "data.build_demo=false", "tokenizer.type=hf",
            f"tokenizer.model={tokenizer}", "checkpoint.save=null", "checkpoint.interval=0", f"logging.dir={ck.work / name}",
            "train.eval_interval=0", "parallel.dp=1", f"parallel.device={where}",
            f"train.seed={ck.seed}", f"train.iters={iters}", f"train.micro_batch_size={batch}",
            f"train.global_batch_size={batch}", *model, *extra, *ck.overrides]


def run_train(ck: Check, overrides: list[str], deadline: float, flash: bool) -> dict[str, Any]:
    """``train.py --conf configs/125M.yml OVERRIDES`` in a process of its own (its own CUDA context and memory peak),
    killed at ``deadline``: its metrics.jsonl records, wall seconds, and whether flash-attn ran; or ``error``."""
    argv = ["--conf", str(CONFIG), *overrides]
    cmd = [sys.executable, "train.py", *argv] if flash else [sys.executable, "-c", BLOCK_FLASH, *argv]
    env = {**os.environ, device.PEAK_CACHE_ENV: str(ck.work)}  # a CPU peak measured here stays here
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):  # the run and whatever it started (its own session)
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return {"error": f"stopped at its deadline after {time.monotonic() - t0:.0f} s (--budget-s)",
                "wall_s": time.monotonic() - t0}
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        lines = [line for line in out.splitlines() if line.strip()]
        return {"error": f"train.py exit {proc.returncode}: {lines[-1] if lines else '(no output)'}", "wall_s": wall}
    log_dir = next(o.split("=", 1)[1] for o in overrides if o.startswith("logging.dir="))
    records = [json.loads(line) for line in (Path(log_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {"records": [r for r in records if "loss" in r], "wall_s": wall,
            "flash_attn_ran": "attention uses flash-attn" in out}


def planned_memory(overrides: list[str], vocab: int) -> dict[str, int]:
    """The planner's peak tensor bytes of the run's one rank, and the pre-flight's figure (plus the process)."""
    from tools.planner.layouts import plan_layout
    from tools.planner.preflight import rank_bytes

    cfg = config_mod.load([CONFIG], overrides)
    config_mod.set_vocab(cfg, vocab)
    lp = plan_layout(cfg)
    return {"planned_peak_bytes": lp.peak_bytes, "preflight_bytes": rank_bytes(lp)}


def check_shape(sizes: Sizes) -> dict[str, Any]:
    """configs/125M.yml's model shape, and that the trained one is it (the full sizes override none of it)."""
    want = config_mod.load([CONFIG]).model
    got = config_mod.load([CONFIG], list(sizes.train_model)).model
    shape = {k: getattr(got, k) for k in SHAPE_KEYS}
    return {"shape": shape, "is_125M": shape == {k: getattr(want, k) for k in SHAPE_KEYS}}


def part_train(ck: Check, compile_mode: str) -> dict[str, Any]:
    """a. bf16 training of the 125M shape: each (attention, compiled) variant as its own train.py run."""
    s = ck.sizes
    flash_reason = None if device.flash_attn_func() is not None else (
        "flash-attn runs on CUDA only" if ck.dev.type == "cpu" else "flash-attn does not import")
    compiled = compile_mode == "on" or (compile_mode == "auto" and ck.dev.type == "cuda")
    variants = [(attn, comp) for comp in (False, True) for attn in ("sdpa", "flash-attn")]  # eager first: cheap, sure
    out: dict[str, Any] = {**check_shape(s), "vocab": s.train_vocab, "micro_batch": s.micro_batch, "steps": s.iters,
                           "peak_tflops": ck.peak_tflops, "runs": []}
    reserve = sum(s.reserve_s.values())
    for i, (attn, comp) in enumerate(variants):
        row: dict[str, Any] = {"attention": attn, "compiled": comp}
        out["runs"].append(row)
        left = ck.left(reserve)
        if attn == "flash-attn" and flash_reason:
            row["skipped"] = flash_reason
        elif comp and not compiled:
            row["skipped"] = "compiled runs are GPU-only by default (--compile on runs them here)"
        elif left < s.min_run_s:
            row["skipped"] = f"budget: {max(left, 0):.0f} s left, a run needs {s.min_run_s:.0f} s"
        if "skipped" in row:
            continue
        runnable = sum(1 for a, c in variants[i:] if (a == "sdpa" or not flash_reason) and (compiled or not c))
        extra = ["train.precision=bf16", f"train.compile={str(comp).lower()}", f"logging.interval={s.interval}"]
        if ck.peak_tflops:
            extra.append(f"logging.peak_tflops={ck.peak_tflops}")
        overrides = train_overrides(ck, f"train_{attn}_{'compiled' if comp else 'eager'}", s.train_vocab,
                                    s.train_model, s.iters, s.micro_batch, extra, ck.dev.type)
        result = run_train(ck, overrides, time.monotonic() + left / runnable, flash=attn == "flash-attn")
        row["wall_s"] = result["wall_s"]
        if "error" in result:
            row["error"] = result["error"]
            continue
        last, first = result["records"][-1], result["records"][0]
        row.update(tokens_per_s=last["tokens_per_s"], tflops=last["tflops"], memory_bytes=last["memory_bytes"],
                   loss_first=first["loss"], loss_last=last["loss"], flash_attn_ran=result["flash_attn_ran"],
                   **planned_memory(overrides, s.train_vocab))
        # MFU uncapped against the datasheet peak; else train.py's own (a CPU's measured peak; 0 on an unknown GPU)
        row["mfu"] = last["tflops"] / ck.peak_tflops if ck.peak_tflops else (last["mfu"] or None)
        # GPU: max allocated (tensors) against the planned tensors; CPU: the peak RSS against the pre-flight figure
        row["memory_kind"] = "max_allocated" if ck.dev.type == "cuda" else "peak_rss"
        row["memory_vs_plan"] = row["memory_bytes"] / row["planned_peak_bytes" if ck.dev.type == "cuda" else
                                                         "preflight_bytes"]
    if all("skipped" in r for r in out["runs"]):
        out["skipped"] = out["runs"][0]["skipped"]
    return out


def part_parity(ck: Check) -> dict[str, Any]:
    """b. The same tiny fp32 run (seed, batches, dropout 0, eager) on this device and on the CPU: loss per step."""
    s = ck.sizes
    extra = ["logging.peak_tflops=1000",  # MFU is not read here: a given peak skips train.py's CPU measurement
             "train.precision=fp32", "train.compile=false", "logging.interval=1", "model.hidden_dropout=0",
             "model.attention_dropout=0"]
    runs = {}
    for where in ("device", "cpu"):
        left = ck.left(s.reserve_s["generate"])
        if left < s.min_run_s:
            return {"skipped": f"budget: {max(left, 0):.0f} s left for the {where} run"}
        overrides = train_overrides(ck, f"parity_{where}", s.parity_vocab, s.parity_model, s.parity_iters, 4, extra,
                                    ck.dev.type if where == "device" else "cpu")
        result = run_train(ck, overrides, time.monotonic() + (left if where == "cpu" else left / 2), flash=True)
        if "error" in result:
            return {"error": f"{where} run: {result['error']}"}
        runs[where] = result["records"]
    dev_loss, cpu_loss = ([r["loss"] for r in runs[w]] for w in ("device", "cpu"))
    rel = [abs(a - b) / abs(b) for a, b in zip(dev_loss, cpu_loss)]
    g_dev, g_cpu = runs["device"][0]["grad_norm"], runs["cpu"][0]["grad_norm"]
    return {"steps": len(rel), "loss_device": dev_loss, "loss_cpu": cpu_loss, "loss_rel_diff": rel,
            "loss_rel_diff_max": max(rel), "grad_norm_rel_diff_step1": abs(g_dev - g_cpu) / g_cpu,
            "float32_matmul_precision": torch.get_float32_matmul_precision(), "rtol": PARITY_RTOL,
            "within_rtol": len(rel) == s.parity_iters and max(rel) <= PARITY_RTOL}


# ----------------------------------------------------------------------------- generation

def hf_run(hf: torch.nn.Module, prompts: list[list[int]], new: int, vocab: int, padded: int,
           dev: torch.device) -> Callable[[], list[list[int]]]:
    """transformers' greedy ``generate`` of exactly ``new`` tokens on ``dev`` (the bench's, placed on a device)."""
    ids = torch.tensor(prompts, device=dev)
    extra = {"suppress_tokens": list(range(vocab, padded))} if padded > vocab else {}

    def run() -> list[list[int]]:
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new,
                              eos_token_id=None, pad_token_id=0, **extra)
        return out[:, ids.shape[1]:].tolist()  # (.tolist() waits for the device)
    return run


def part_generate(ck: Check) -> dict[str, Any]:
    """c. Greedy generation, ours (``inference.generate_batch``) against transformers on the exported model, fp32 on
    this device: tokens equal first, then per batch size prefill and decode tokens/s (medians of ABBA rounds)."""
    import transformers

    from bench_generate import ours_run, timed  # tools/bench/generate.py (loaded under this name: see main)
    from common import alternating
    from megatron_sp.model import GPTModel
    from megatron_sp.model.hf_names import build_hf_model

    s = ck.sizes
    if ck.left() < s.min_run_s:
        return {"skipped": f"budget: {max(ck.left(), 0):.0f} s left"}
    cfg = config_mod.load([CONFIG], ["data.paths=[unused]", "tokenizer.type=byte", f"parallel.device={ck.dev.type}",
                                     "parallel.dp=1", "train.compile=false", *s.gen_model])
    config_mod.set_vocab(cfg, s.gen_vocab)
    m = cfg.model
    model = GPTModel(m, seed=ck.seed).eval()
    hf = build_hf_model(m, model.state_dict()).to(ck.dev)
    model.to(ck.dev)
    gen = torch.Generator().manual_seed(ck.seed)  # its own stream: nothing else draws from the default one
    prompts = torch.randint(0, s.gen_vocab, (max(s.gen_batches), s.prompt_len), generator=gen).tolist()
    out: dict[str, Any] = {"model": {k: getattr(m, k) for k in SHAPE_KEYS} | {"vocab": s.gen_vocab}, "dtype": "fp32",
                           "prompt_len": s.prompt_len, "new_tokens": s.new_tokens, "reps": s.reps,
                           "hf_attention": getattr(hf.config, "_attn_implementation", None),
                           "transformers": transformers.__version__, "rows": []}
    for b in s.gen_batches:
        if ck.left() < 5.0:
            out["rows"].append({"batch": b, "skipped": f"budget: {max(ck.left(), 0):.0f} s left"})
            continue
        batch = prompts[:b]
        runs = {"ours": {n: ours_run(model, batch, k) for n, k in (("prefill", 1), ("full", s.new_tokens))},
                "transformers": {n: hf_run(hf, batch, k, m.vocab_size, m.padded_vocab_size, ck.dev)
                                 for n, k in (("prefill", 1), ("full", s.new_tokens))}}
        tokens = {impl: r["full"]() for impl, r in runs.items()}  # also the warm-up
        equal = tokens["ours"] == tokens["transformers"]
        times = alternating({f"{impl} {ph}": timed(run) for impl, r in runs.items() for ph, run in r.items()},
                            0, s.reps)
        for impl in runs:
            prefill, full = ([w for w, _ in times[f"{impl} {ph}"]] for ph in ("prefill", "full"))
            decode = statistics.median(f - p for p, f in zip(prefill, full))
            out["rows"].append({"impl": impl, "batch": b, "tokens_equal": equal,
                                "prefill_tokens_per_s": b * s.prompt_len / statistics.median(prefill),
                                "decode_tokens_per_s": b * (s.new_tokens - 1) / decode if decode > 0 else None})
    for r in out["rows"]:
        tf = next((t for t in out["rows"] if t.get("impl") == "transformers" and t["batch"] == r["batch"]), None)
        if r.get("impl") == "ours" and tf and r["decode_tokens_per_s"] and tf["decode_tokens_per_s"]:
            r["decode_vs_transformers"] = r["decode_tokens_per_s"] / tf["decode_tokens_per_s"]
            r["prefill_vs_transformers"] = r["prefill_tokens_per_s"] / tf["prefill_tokens_per_s"]
    out["tokens_equal"] = all(r.get("tokens_equal", True) for r in out["rows"])
    return out


# ----------------------------------------------------------------------------- report

def _f(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_report(rep: dict[str, Any]) -> None:
    print(f"GPU check on {rep['device']} ({rep['device_type']}{', dry: tiny sizes' if rep['dry'] else ''}), torch "
          f"{rep['torch']}, transformers {rep['transformers']}; peak {_f(rep['peak_tflops'], '.0f')} TFLOP/s bf16 "
          f"({rep['peak_source']}); {rep['wall_s']:.0f} s of a {rep['budget_s']:.0f} s budget")
    t = rep.get("train")
    if t:
        shape = t["shape"]
        what = "the 125M shape" if t["is_125M"] else "a tiny shape" if rep["dry"] else "NOT the 125M shape"
        print(f"\na. training, {what}: {shape['arch']} L "
              f"{shape['num_layers']} h {shape['hidden_size']} heads {shape['num_heads']} seq {shape['seq_length']}, "
              f"vocab {t['vocab']}, bf16, {t['micro_batch']} sequences a step, {t['steps']} steps (rates: the last "
              "logging interval); memory: max allocated against the planner's peak tensor bytes (CPU: peak RSS against the "
              "pre-flight's figure, which adds the process)")
        print("  attention  | compiled |   tokens/s |   TFLOP/s |    MFU | memory MiB | planned MiB | × plan | "
              "loss first → last | wall s | note")
        for r in t["runs"]:
            note = r.get("skipped") or r.get("error") or ("flash-attn ran" if r.get("flash_attn_ran") else
                                                          "flash-attn did NOT run" if r["attention"] == "flash-attn" else "")
            if "tokens_per_s" not in r:
                print(f"  {r['attention']:<10} | {str(r['compiled']):>8} | {'':>10} | {'':>9} | {'':>6} | {'':>10} | "
                      f"{'':>11} | {'':>6} | {'':>17} | {_f(r.get('wall_s'), '6.0f'):>6} | {note}")
                continue
            print(f"  {r['attention']:<10} | {str(r['compiled']):>8} | {r['tokens_per_s']:>10.0f} | {r['tflops']:>9.2f} | "
                  f"{_f(r['mfu'] and 100 * r['mfu'], '5.1f'):>5}% | {r['memory_bytes'] / 2**20:>10.0f} | "
                  f"{r['planned_peak_bytes' if r['memory_kind'] == 'max_allocated' else 'preflight_bytes'] / 2**20:>11.0f}"
                  f" | {r['memory_vs_plan']:>6.2f} | "
                  f"{r['loss_first']:.3f} → {r['loss_last']:.3f} | {r['wall_s']:>6.0f} | {note}")
    p = rep.get("parity")
    if p and "loss_rel_diff" in p:
        print(f"\nb. loss parity, tiny model fp32, {rep['device_type']} vs CPU (float32 matmul precision "
              f"{p['float32_matmul_precision']}): max rel diff {p['loss_rel_diff_max']:.2e} (expect <= {p['rtol']:g}: "
              f"{'yes' if p['within_rtol'] else 'NO'}), step-1 grad norm rel diff {p['grad_norm_rel_diff_step1']:.2e}")
        for i, (a, b, d) in enumerate(zip(p["loss_device"], p["loss_cpu"], p["loss_rel_diff"]), 1):
            print(f"  step {i}: {a:.7f} vs {b:.7f}  rel {d:.2e}")
    g = rep.get("generate")
    if g and g.get("rows"):
        print(f"\nc. greedy generation, fp32, {g['model']['arch']} L {g['model']['num_layers']} h "
              f"{g['model']['hidden_size']} vocab {g['model']['vocab']}, {g['prompt_len']}-token prompts, "
              f"{g['new_tokens']} new, median of {g['reps']}; transformers attention {g['hf_attention']}")
        print("  impl         |  b | prefill tok/s | decode tok/s | decode × tf | prefill × tf | tokens")
        for r in g["rows"]:
            if "skipped" in r:
                print(f"  {'':<12} | {r['batch']:>2} | {r['skipped']}")
                continue
            print(f"  {r['impl']:<12} | {r['batch']:>2} | {r['prefill_tokens_per_s']:>13.0f} | "
                  f"{_f(r['decode_tokens_per_s'], '12.0f'):>12} | {_f(r.get('decode_vs_transformers'), '11.2f'):>11} | "
                  f"{_f(r.get('prefill_vs_transformers'), '12.2f'):>12} | {'equal' if r['tokens_equal'] else 'DIFFER'}")
    print("\nparts: " + "; ".join(f"{name} {'ran' if s['ran'] else 'skipped'}" + (f" ({s['reason']})" if s.get("reason")
                                  else "") for name, s in rep["parts"].items()))


PARTS: dict[str, Callable[..., dict[str, Any]]] = {"train": part_train, "parity": part_parity,
                                                    "generate": part_generate}


def failed(name: str, result: dict[str, Any]) -> str | None:
    """Why a part that ran did not pass, or None: a run's error, parity outside its tolerance, tokens that differ."""
    if result.get("error"):
        return result["error"]
    if name == "train" and (errors := [r["error"] for r in result["runs"] if r.get("error")]):
        return errors[0]
    if name == "parity" and not result.get("within_rtol", True):
        return f"loss rel diff {result['loss_rel_diff_max']:.2e} above {PARITY_RTOL:g}"
    if name == "generate" and not result.get("tokens_equal", True):
        return "greedy tokens differ from transformers'"
    return None


def main(argv: list[str] | None = None) -> int:
    """Run the parts, print the table and the JSON line; exit 1 when a part that ran failed."""
    import importlib.util

    import transformers

    t0 = time.monotonic()
    args = parse_args(argv)
    dry = args.dry or not device.cuda_available()
    sizes = DRY if dry else FULL
    budget = args.budget_s if args.budget_s is not None else (120.0 if dry else 450.0)
    dev = device.local_device("cpu" if dry else "cuda")
    name = device.accelerator_name() if dev.type == "cuda" else f"CPU {device.accelerator_name()}"
    peak = args.peak_tflops or (None if dev.type == "cpu" else datasheet_peak(name))
    source = "--peak-tflops" if args.peak_tflops else ("datasheet" if peak else
                                                       "unknown: train.py's measured CPU peak" if dev.type == "cpu"
                                                       else "unknown device: pass --peak-tflops")
    spec = importlib.util.spec_from_file_location("bench_generate", ROOT / "tools" / "bench" / "generate.py")
    sys.modules["bench_generate"] = module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    if dry and not args.dry:
        print("no GPU visible: running the CPU dry mode (tiny sizes)")
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        work = args.work or Path(tmp)
        ck = Check(dev, sizes, work.resolve(), t0 + budget, args.seed, peak, args.overrides)
        rep: dict[str, Any] = {"bench": "gpu_check", "device": name, "device_type": dev.type, "dry": dry,
                               "torch": torch.__version__, "transformers": transformers.__version__,
                               "cuda": torch.version.cuda, "flash_attn": device.flash_attn_func() is not None,
                               "peak_tflops": peak, "peak_source": source, "budget_s": budget, "parts": {}}
        for part, fn in PARTS.items():
            if part not in args.parts:
                rep["parts"][part] = {"ran": False, "reason": "not in --parts"}
                continue
            t_part = time.monotonic()
            try:
                result = fn(ck, args.compile) if part == "train" else fn(ck)
            except Exception as exc:  # one part's failure (an OOM, a missing package) is reported; the others run
                result = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
            rep[part] = result
            reason = result.get("skipped") or failed(part, result)
            rep["parts"][part] = {"ran": "skipped" not in result, "ok": "skipped" not in result and reason is None,
                                  "reason": reason, "wall_s": time.monotonic() - t_part}
    rep["wall_s"] = time.monotonic() - t0
    print_report(rep)
    line = json.dumps(rep)
    if args.json:
        args.json.write_text(line + "\n")
    print(line)
    return 1 if any(s["ran"] and not s["ok"] for s in rep["parts"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
