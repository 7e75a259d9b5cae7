"""Per-rank bytes of parameters, gradients and optimizer state under ZeRO-1, against the theory.

Theory, categories and what is not counted: docs/benchmarks.md.
Run from the repo root:  python tools/bench/optimizer_memory.py [--dp 1,2,4] [--precision bf16,fp32] ...
"""
from __future__ import annotations

import argparse
import inspect
from typing import Any

import torch

from common import gpt_config, ints, mib, names, parser, per_rank, print_json
from megatron_sp.model import GPTModel
from megatron_sp.mpu import ParallelContext, ParallelDims, ParallelState, initialize
from megatron_sp.optim import DistributedOptimizer, named_trainable

PARAM_BYTES = {"bf16": 2, "fp32": 4}  # P: bytes of one model parameter
MASTER_BYTES = {"bf16": 4, "fp32": 0}  # M: the separate fp32 master (fp32: the parameters are the masters)
GRAD_BYTES = 4  # fp32 main grads
MOMENT_BYTES = 8  # exp_avg + exp_avg_sq, fp32
CATEGORIES = ("params", "grads", "optim")
DEFAULT_BUCKET_BYTES = inspect.signature(DistributedOptimizer).parameters["bucket_bytes"].default


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__, arch="neox", layers=4, hidden=256, heads=8, seq=128, vocab=4096, seed=1234)
    p.add_argument("--dp", default="1,2,4", help="comma-separated data-parallel sizes")
    p.add_argument("--precision", default="bf16,fp32", help="comma-separated: bf16,fp32")
    p.add_argument("--bucket-bytes", type=int, default=DEFAULT_BUCKET_BYTES,
                   help="DistributedOptimizer bucket_bytes (default: the optimizer's)")
    return p.parse_args(argv)


def theory_per_param(precision: str, d: int, zero: int) -> dict[str, float]:
    """Bytes per parameter of each category: ``P``, ``4`` and ``(M + 8) / d_z``."""
    d_z = d if zero else 1
    return {"params": PARAM_BYTES[precision], "grads": GRAD_BYTES,
            "optim": (MASTER_BYTES[precision] + MOMENT_BYTES) / d_z}


def formula(precision: str, zero: int) -> str:
    """The bytes/param formula of one (precision, zero) as text, e.g. ``6 + 12/d``."""
    fixed = PARAM_BYTES[precision] + GRAD_BYTES
    sharded = MASTER_BYTES[precision] + MOMENT_BYTES
    return f"{fixed} + {sharded}/d" if zero else f"{fixed + sharded}"


def measure(opt: DistributedOptimizer, params: list[torch.nn.Parameter]) -> dict[str, Any]:
    """This rank's bytes and storages per category, read off the optimizer's tensors and the model's parameters;
    a storage already counted (in any category) is skipped."""
    seen: set[int] = set()
    nbytes, storages = dict.fromkeys(CATEGORIES, 0), dict.fromkeys(CATEGORIES, 0)
    held = {"params": [opt.param_buffer, *params],
            "grads": [opt.grad_buffer, *(p.main_grad for p in params), *(p.grad for p in params)],
            "optim": [opt.exp_avg, opt.exp_avg_sq, opt._master_local]}  # fp32: the master is param_buffer
    for category, tensors in held.items():
        for t in tensors:
            if t is not None and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                nbytes[category] += t.untyped_storage().nbytes()
                storages[category] += 1
    return {"bytes": nbytes, "storages": storages, "numel": opt.numel, "shard_numel": opt.shard_numel,
            "buckets": len(opt._buckets)}


def rank_rows(rank: int, world_size: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every (precision, zero) row for d = ``world_size`` on this rank (d = 1: no process groups)."""
    state: ParallelState | None = initialize(ParallelDims(dp=world_size)) if world_size > 1 else None
    parallel = ParallelContext.from_state(state) if state is not None else ParallelContext()
    cfg = gpt_config(args)
    rows = []
    for precision in names(args.precision):
        for zero in (0, 1):
            model = GPTModel(cfg.model, seed=args.seed, parallel=parallel)  # fp32: a bf16 optimizer keeps these values as masters
            named = named_trainable(model)
            opt = DistributedOptimizer(named, cfg.train, state, zero=zero, precision=precision,
                                       bucket_bytes=args.bucket_bytes)
            params = [p for _, p in named]
            rows.append({"precision": precision, "dp": world_size, "zero": zero, "rank": rank,
                         "n_params": sum(p.numel() for p in params), **measure(opt, params)})
            opt.remove_hooks()
            del opt, model, named, params
    return rows


def finish_row(row: dict[str, Any], others: list[dict[str, Any]]) -> dict[str, Any]:
    """Add totals, bytes/param, the theory, the ratio and the padding to rank 0's row."""
    n, d, precision, zero = row["n_params"], row["dp"], row["precision"], row["zero"]
    row["total_bytes"] = sum(row["bytes"].values())
    row["bytes_per_param"] = row["total_bytes"] / n
    per_param = theory_per_param(precision, d, zero)
    row["theory_bytes"] = {k: v * n for k, v in per_param.items()}
    row["theory_per_param"] = sum(per_param.values())
    row["formula"] = formula(precision, zero)
    row["ratio"] = row["bytes_per_param"] / row["theory_per_param"]
    row["padding_numel"] = row["numel"] - n
    d_z = d if zero else 1
    row["padding_bytes"] = row["total_bytes"] - sum(row["theory_bytes"].values())
    row["padding_bytes_expected"] = (row["padding_numel"] * (PARAM_BYTES[precision] + GRAD_BYTES)
                                     + (row["shard_numel"] - n / d_z) * (MASTER_BYTES[precision] + MOMENT_BYTES))
    row["ranks_differ"] = [o["rank"] for o in others if o["bytes"] != row["bytes"]]
    return row


def print_report(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    """The table, the notes, and the JSON line."""
    n = rows[0]["n_params"]
    print(f"optimizer memory per rank: {args.arch} GPT, {n:,} parameters (L={args.layers} h={args.hidden} "
          f"vocab={args.vocab}), bucket_bytes={args.bucket_bytes:,}; MiB from the optimizer's tensors (unique storages)")
    print(f"{'precision':>9} {'dp':>3} {'zero':>4} {'params MiB':>11} {'grads MiB':>10} {'optim MiB':>10} "
          f"{'total MiB':>10} {'B/param':>8} {'formula':>9} {'theory':>7} {'meas/theory':>11} {'pad elems':>9}")
    for r in rows:
        b = r["bytes"]
        flag = "  *" if r["ranks_differ"] or r["storages"]["params"] != 1 else ""
        print(f"{r['precision']:>9} {r['dp']:>3} {'on' if r['zero'] else 'off':>4} {mib(b['params'], 3):>11} "
              f"{mib(b['grads'], 3):>10} {mib(b['optim'], 3):>10} {mib(r['total_bytes'], 3):>10} {r['bytes_per_param']:>8.4f} "
              f"{r['formula']:>9} {r['theory_per_param']:>7.3f} {r['ratio']:>11.6f} {r['padding_numel']:>9,}{flag}")
    print("formula: bytes/param = P + 4 + (M + 8)/d_z; P = param bytes (bf16 2, fp32 4), 4 = fp32 grad, "
          "M = separate fp32 master (bf16 4, fp32 0: the params are the masters), 8 = Adam exp_avg + exp_avg_sq; "
          "d_z = d with ZeRO-1, 1 without. bf16: 18 | 6 + 12/d; fp32: 16 | 8 + 8/d.")

    print("\nnotes:")
    worst = max(rows, key=lambda r: r["ratio"])
    pad_rows = [r for r in rows if r["padding_numel"]]
    if pad_rows:
        print(f"  padding: buckets are padded to a multiple of d; the worst row ({worst['precision']} dp={worst['dp']} "
              f"zero={'on' if worst['zero'] else 'off'}) pads {worst['padding_numel']:,} elements over "
              f"{worst['buckets']} bucket(s) = {worst['padding_bytes']:,.0f} B ({worst['ratio'] - 1:.2e} of the total).")
    else:
        print(f"  padding: none in any row — every bucket's element count is already a multiple of d "
              f"(at most d-1 elements per bucket would be added; {max(r['buckets'] for r in rows)} bucket(s) here), "
              "so measured/theory is exactly 1.")
    off = [r for r in rows if abs(r["padding_bytes"] - r["padding_bytes_expected"]) > 0.5]
    for r in off:
        print(f"  UNEXPLAINED {r['precision']} dp={r['dp']} zero={r['zero']}: {r['padding_bytes']:,.0f} B above the "
              f"theory, padding accounts for {r['padding_bytes_expected']:,.0f} B")
    if not off:
        print("  every byte above the theory is bucket padding (checked per row).")
    for r in rows:
        if r["storages"]["params"] != 1:
            print(f"  * {r['precision']} dp={r['dp']} zero={r['zero']}: {r['storages']['params']} parameter storages "
                  "(expected 1: param_buffer) — a copy of the parameters survived the hand-over")
        if r["ranks_differ"]:
            print(f"  * {r['precision']} dp={r['dp']} zero={r['zero']}: ranks {r['ranks_differ']} hold different bytes")
    zero_rows = {(r["precision"], r["dp"]): r for r in rows if r["zero"]}
    for precision in names(args.precision):
        base = next((r for r in rows if r["precision"] == precision and not r["zero"]), None)
        big = max((d for p, d in zero_rows if p == precision), default=1)
        if base is not None and big > 1:
            saved = 1 - zero_rows[(precision, big)]["total_bytes"] / base["total_bytes"]
            print(f"  {precision}: ZeRO-1 at dp={big} saves {saved:.1%} per rank; params + grads "
                  f"({PARAM_BYTES[precision] + GRAD_BYTES} B/param) stay replicated, the limit as d grows.")
    print("  not counted: transients of a step. ZeRO-1 on gloo: each bucket's reduce-scatter clones the bucket and "
          "the clones live until finish_grad_sync waits, so during backward up to +4 B/param (a second fp32 grad "
          "buffer) + 4/d B/param of reduced chunks; the AdamW denominators (one bucket chunk); ZeRO's copy of the "
          "owned shard for the parameter all-gather.")
    print_json("optimizer_memory", config=vars(args), rows=rows)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Measure every row and print the report; returns the rows (rank 0's)."""
    args = parse_args(argv)
    sizes = ints(args.dp)
    if any(d < 1 for d in sizes):
        raise SystemExit(f"--dp {args.dp}: sizes must be >= 1")
    for precision in names(args.precision):
        if precision not in PARAM_BYTES:
            raise SystemExit(f"--precision {precision}: one of {sorted(PARAM_BYTES)}")
    rows: list[dict[str, Any]] = []
    for d in sizes:
        ranks = per_rank(rank_rows, d, args=args)
        rows += [finish_row(row, [other[i] for other in ranks[1:]]) for i, row in enumerate(ranks[0])]
    rows.sort(key=lambda r: (names(args.precision).index(r["precision"]), r["zero"], r["dp"]))
    print_report(args, rows)
    return rows


if __name__ == "__main__":
    main()
