"""The layer's causal attention on CPU: the block-causal explicit-scores kernel against torch's CPU flash kernel;
with ``--window W``: sliding-window attention (``model.sliding_window``) against full causal, both on the path a
window takes (``context_parallel_attention`` at cp = 1: contiguous chunks on the CPU flash op, ``band.py``).

Forward + backward of ``dot_product_attention``'s CPU kernels on q ``[s, b, n, d]``, k/v ``[s, b, g, d]``: time,
bytes saved for backward and the error against an fp64 reference. Method: docs/attention.md.
Run from the repo root:  python tools/bench/attention.py [--seq 512 --batch 4 --heads 8 --rows 64,512] [--window 1024]
"""
from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch

from common import DTYPES, alternating, host_memory, ints, mib, names, parser, print_json, wall_cpu, wall_cpu_stats
from planner.measure import SavedBytes
from megatron_sp.model.attention import kernels
from megatron_sp.model.attention.context_parallel import AttentionMeta, context_parallel_attention
from megatron_sp.mpu import comm

Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__, seq=512, batch=4, heads=8, kv_heads=None, seed=1234, reps=6, warmup=2, system_malloc=False)
    p.add_argument("--head-dim", type=int, default=64, help="d, the size of one head")
    p.add_argument("--dtypes", default="fp32,bf16", help=f"comma-separated, of {','.join(DTYPES)}")
    p.add_argument("--rows", default=f"{kernels.CAUSAL_BLOCK_ROWS},{kernels.CAUSAL_BLOCK_ROWS_16BIT}",
                   help="comma-separated query rows per block of the block kernel (rows >= seq: one block, the "
                        "unblocked explicit-scores kernel); default: the fp32 and the 16-bit choice")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--window", type=int, default=0, help="time a sliding window of this many tokens against full "
                   "causal instead (its error: against its own fp64 run)")
    args = p.parse_args(argv)
    args.kv_heads = args.kv_heads or args.heads
    if any(d not in DTYPES for d in names(args.dtypes)):
        raise SystemExit(f"--dtypes: choose from {', '.join(DTYPES)}")
    if min(args.seq, args.batch, args.heads, args.kv_heads, args.head_dim, args.reps, *ints(args.rows)) < 1:
        raise SystemExit("--seq, --batch, --heads, --kv-heads, --head-dim, --reps and --rows must be >= 1")
    if args.heads % args.kv_heads or args.warmup < 0:
        raise SystemExit("--kv-heads must divide --heads, and --warmup must be >= 0")
    return args


def block_kernel(rows: int) -> Kernel:
    return lambda q, k, v: kernels._BlockCausalAttention.apply(q, k, v, 0.0, rows)


def flash_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return kernels._sdpa(q, k, v, is_causal=True)


def windowed(window: int | None) -> Kernel:
    """Attention of the window's path (cp = 1 ``AttentionMeta``): full causal for None."""
    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        s, b = q.shape[:2]
        meta = AttentionMeta.build(torch.arange(s).expand(b, s), None, "ring", comm.LOCAL, window=window)
        return context_parallel_attention(q, k, v, meta)
    return run


def fwd_bwd(fn: Kernel, inputs: tuple[torch.Tensor, ...], dout: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The output and the gradients of q, k, v."""
    leaves = tuple(t.detach().requires_grad_(True) for t in inputs)
    out = fn(*leaves)
    return (out, *torch.autograd.grad(out, leaves, dout))


def saved_bytes(fn: Kernel, inputs: tuple[torch.Tensor, ...]) -> int:
    """Bytes autograd keeps for backward beyond the inputs themselves (a view of an input saved costs nothing)."""
    leaves = tuple(t.detach().requires_grad_(True) for t in inputs)
    saved = SavedBytes({t.untyped_storage().data_ptr() for t in leaves})
    with saved.record():
        out = fn(*leaves)
    del out
    return saved.nbytes


def measure(args: argparse.Namespace, dtype_name: str) -> list[dict[str, Any]]:
    s, b, n, g, d = args.seq, args.batch, args.heads, args.kv_heads, args.head_dim
    gen = torch.Generator().manual_seed(args.seed)
    full = [torch.randn(s, b, heads, d, generator=gen, dtype=torch.float64) for heads in (n, g, g, n)]
    inputs, dout = tuple(t.to(DTYPES[dtype_name]) for t in full[:3]), full[3].to(DTYPES[dtype_name])
    variants: dict[str, Kernel] = {"flash": flash_kernel, **{f"block {r}": block_kernel(r) for r in ints(args.rows)}}
    if args.window:
        variants = {"causal": windowed(None), f"window {args.window}": windowed(args.window)}
    rows = []
    for name, fn in variants.items():
        reference = fwd_bwd(fn if args.window else flash_kernel, tuple(full[:3]), full[3])  # fp64 (SDPA's math kernel)
        errors = [((x.double() - ref).abs().max() / ref.abs().max()).item()
                  for x, ref in zip(fwd_bwd(fn, inputs, dout), reference)]
        block = int(name.split()[1]) if name.startswith("block") else None
        rows.append({"dtype": dtype_name, "kernel": name, "block_rows": block,
                     "scores_per_head": None if block is None else kernels.causal_block_scores(s, block),
                     "saved_bytes": saved_bytes(fn, inputs), "max_rel_error": max(errors)})
    times = alternating({name: lambda fn=fn: wall_cpu(lambda: fwd_bwd(fn, inputs, dout))
                         for name, fn in variants.items()}, args.warmup, args.reps)
    for row, name in zip(rows, variants):
        row.update(wall_cpu_stats(times[name]))
    flash = rows[0]
    for row in rows:
        row["speedup_vs_flash"] = flash["s"] / row["s"]
        row["best_speedup_vs_flash"] = flash["best_s"] / row["best_s"]
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    host_memory(args)
    rows = [row for dtype_name in names(args.dtypes) for row in measure(args, dtype_name)]
    print(f"causal attention forward + backward (× the first row), s {args.seq}, b {args.batch}, heads {args.heads} (kv "
          f"{args.kv_heads}), d {args.head_dim}, {args.threads} threads, median (best) of {args.reps}")
    head = ("dtype", "kernel", "scores/s²", "saved MiB", "ms", "best ms", "cpu ms", "× flash", "max rel err")
    print(" | ".join(f"{h:>11}" for h in head))
    for r in rows:
        share = "-" if r["scores_per_head"] is None else f"{r['scores_per_head'] / args.seq ** 2:.3f}"
        cells = (r["dtype"], r["kernel"], share, mib(r["saved_bytes"], 1), f"{r['s'] * 1e3:.1f}",
                 f"{r['best_s'] * 1e3:.1f}", f"{r['cpu_s'] * 1e3:.1f}",
                 f"{r['speedup_vs_flash']:.2f} ({r['best_speedup_vs_flash']:.2f})", f"{r['max_rel_error']:.1e}")
        print(" | ".join(f"{c:>11}" for c in cells))
    result = {"seq": args.seq, "batch": args.batch, "heads": args.heads, "kv_heads": args.kv_heads,
              "head_dim": args.head_dim, "threads": args.threads, "reps": args.reps,
              "host_memory_cached": args.host_memory_cached, "rows": rows}
    print_json("attention", **result)
    return result


if __name__ == "__main__":
    main()
