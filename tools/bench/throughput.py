"""Single-process training throughput of our GPTModel against Hugging Face transformers.

Same config, weights and batch, steps alternating between the models; method and MFU: docs/benchmarks.md.
Run from the repo root:  python tools/bench/throughput.py [--arch neox] [--dtype bf16] [--compile] ...
"""
from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Callable

import torch

from common import DTYPES, gpt_config, host_memory, parser, print_json, wall_cpu
from megatron_sp import device
from megatron_sp.config.schema import ModelConfig, TrainConfig
from megatron_sp.model import GPTModel, flops_per_token
from megatron_sp.model.hf_names import build_hf_model
from megatron_sp.optim import DistributedOptimizer, named_trainable

LR = 1e-4


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__, layers=4, hidden=256, heads=8, kv_heads=None, seq=256, batch=4, vocab=4096, seed=1234,
               system_malloc=False)
    p.add_argument("--arch", default="neox,llama", help="comma-separated: neox,llama")
    p.add_argument("--dtype", default="fp32,bf16", help="comma-separated: fp32,bf16")
    p.add_argument("--ffn", type=int, default=None, help="MLP width (default: the config's derived value)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=5, help="timed steps per round (and model)")
    p.add_argument("--rounds", type=int, default=5, help="alternating timed rounds per model")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--no-hf", action="store_true", help="only time our model")
    p.add_argument("--compile", action="store_true", help="also time both models compiled (torch.compile)")
    return p.parse_args(argv)


def configs(args: argparse.Namespace, arch: str) -> tuple[ModelConfig, TrainConfig]:
    """The finalized model config for ``arch`` from the flags (derived sizes from the config loader), and the
    default train config (AdamW, clipping)."""
    cfg = gpt_config(args, arch=arch, num_kv_heads=args.kv_heads if arch == "llama" else None, ffn_hidden_size=args.ffn)
    return cfg.model, cfg.train


def make_step(model: torch.nn.Module, loss_fn: Callable[[], torch.Tensor], dtype: torch.dtype,
              train: TrainConfig) -> Callable[[], float]:
    """One training step as each project runs it, as a closure: forward under autocast for bf16, backward, the
    global norm clipped to ``train.clip_grad``, AdamW. Ours: train.py's ``DistributedOptimizer`` (bf16: bf16
    parameters, fp32 masters and gradient accumulation); HF: the Trainer's fp32 parameters and torch's fused
    AdamW (decay on matrices only, as ours)."""
    model.train()
    bf16 = dtype == torch.bfloat16
    if isinstance(model, GPTModel):
        ours = DistributedOptimizer(named_trainable(model), train, None, precision="bf16" if bf16 else "fp32")
        zero_grad, update = ours.zero_grad, lambda: ours.step(LR)
    else:
        groups = [{"params": [p for p in model.parameters() if (p.ndim >= 2) == decays],
                   "weight_decay": train.weight_decay if decays else 0.0} for decays in (True, False)]
        hf = torch.optim.AdamW(groups, lr=LR, betas=(train.adam_beta1, train.adam_beta2), eps=train.adam_eps,
                               fused=True)

        def zero_grad() -> None:
            hf.zero_grad(set_to_none=True)

        def update() -> None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), train.clip_grad)
            hf.step()

    def step() -> float:
        zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = loss_fn()
        loss.backward()
        update()
        return float(loss.detach())

    return step


def best_peak_flops(dtype: torch.dtype, tries: int = 5) -> float:
    """The best of ``tries`` ``device.measured_peak_flops`` measurements (the MFU denominator): the least
    disturbed by other processes; slightly different durations defeat its per-argument cache."""
    return max(device.measured_peak_flops(dtype, seconds=0.3 + 0.01 * i) for i in range(tries))


def bench_one(args: argparse.Namespace, arch: str, dtype_name: str) -> dict:
    """Tokens/s of ours (and HF) for one (arch, dtype)."""
    dtype = DTYPES[dtype_name]
    cfg, train = configs(args, arch)
    ours = GPTModel(cfg, seed=args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    data = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=gen)
    tokens, labels = data[:, :-1].contiguous(), data[:, 1:].contiguous()  # [b, s]

    models = {"ours": ours}
    if args.compile:
        models["ours_compiled"] = GPTModel(cfg, seed=args.seed)
        models["ours_compiled"].compile_regions()
    if not args.no_hf:
        models["hf"] = build_hf_model(cfg, ours.state_dict())
        if args.compile:
            models["hf_compiled"] = build_hf_model(cfg, ours.state_dict())
            models["hf_compiled"].compile()
    steps = {name: make_step(model, loss_closure(model, tokens, labels), dtype, train) for name, model in models.items()}
    first: dict[str, float] = {}
    for name, step in steps.items():
        first[name] = wall_cpu(step)[0]  # compiled models compile here
        for _ in range(args.warmup - 1):
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.rounds * args.steps):  # models alternate step by step: noise hits both alike
        for name, step in steps.items():
            times[name].append(wall_cpu(step)[0])
    tokens_per_step = args.batch * args.seq
    result = {"arch": arch, "dtype": dtype_name, "tokens_per_step": tokens_per_step,
              "params": ours.num_parameters(), "flops_per_token": flops_per_token(cfg)}
    for name, seconds in times.items():
        result[f"{name}_tokens_per_s"] = tokens_per_step / min(seconds)
        result[f"{name}_tokens_per_s_median"] = tokens_per_step / statistics.median(seconds)
    # The MFU denominator is the best rate this host has shown for the dtype (the run's own cache,
    # device.record_peak_flops), raised to any rate achieved here: MFU is never above 100 %.
    achieved = max(result["flops_per_token"] * result[f"{name}_tokens_per_s"] for name in times)
    peak = device.record_peak_flops(dtype, max(best_peak_flops(dtype), achieved))
    result["peak_flops"] = peak
    for name in ("ours", "ours_compiled"):
        if name in times:
            result[f"{name}_mfu"] = result["flops_per_token"] * result[f"{name}_tokens_per_s"] / peak
    for name in times:
        if name.endswith("_compiled"):
            result[f"{name.removesuffix('_compiled')}_compile_s"] = first[name] - min(times[name])
    if "hf" in times:
        result["ratio"] = result["ours_tokens_per_s"] / result["hf_tokens_per_s"]
    return result


def loss_closure(model: torch.nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> Callable[[], torch.Tensor]:
    """The mean training loss of ``model`` (ours, or HF's on the same tokens) as a closure."""
    if isinstance(model, GPTModel):
        return lambda: model(tokens, labels=labels).mean()
    # HF shifts labels itself (labels=input_ids): the same b·s cross-entropy rows, the last one ignored.
    return lambda: model(input_ids=tokens, labels=tokens).loss


def main(argv: list[str] | None = None) -> None:
    """Run every (arch, dtype) pair, print the table and the JSON line."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    host_memory(args)  # for every model timed
    results = [bench_one(args, arch, dt) for arch in args.arch.split(",") for dt in args.dtype.split(",")]
    columns = [("ours", "ours tok/s"), ("hf", "HF tok/s")]
    if args.compile:
        columns += [("ours_compiled", "ours comp"), ("hf_compiled", "HF comp")]
    header = " ".join(f"{title:>11}" for _, title in columns) + f" {'ratio':>6} {'MFU':>6}"
    print(f"{'arch':6} {'dtype':5} {header}" + (f" {'comp MFU':>8}" if args.compile else ""))
    for r in results:
        rates = [r.get(f"{name}_tokens_per_s") for name, _ in columns]
        cells = " ".join(f"{rate:11.0f}" if rate is not None else f"{'-':>11}" for rate in rates)
        ratio = f"{r['ratio']:6.2f}" if "ratio" in r else f"{'-':>6}"
        comp = f" {r['ours_compiled_mfu']:8.1%}" if args.compile else ""
        print(f"{r['arch']:6} {r['dtype']:5} {cells} {ratio} {r['ours_mfu']:6.1%}{comp}")
    if args.compile:
        for r in results:
            ours_c = r["ours_compiled_tokens_per_s"]
            vs = {"ours eager": r["ours_tokens_per_s"]} | {k: r[f"{n}_tokens_per_s"] for k, n in
                                                          (("HF eager", "hf"), ("HF compiled", "hf_compiled"))
                                                          if f"{n}_tokens_per_s" in r}
            print(f"{r['arch']} {r['dtype']}: ours compiled " + ", ".join(f"{ours_c / rate:.2f}x {k}" for k, rate in vs.items())
                  + f"; compile s: ours {r['ours_compile_s']:.1f}"
                  + (f", HF {r['hf_compile_s']:.1f}" if "hf_compile_s" in r else ""))
    config = {k: v for k, v in vars(args).items() if k not in ("arch", "dtype")}
    print_json("throughput", config=config, results=results)


if __name__ == "__main__":
    main()
