"""The chunked vocab-parallel cross entropy against PyTorch's: bytes saved for backward, peak memory, time.

One rank's logits ``[s, b, V/t]``, fp32 and bf16, forward + backward of the per-token loss. Method: docs/benchmarks.md.
Run from the repo root:  python tools/bench/cross_entropy.py [--seq 2048 --batch 4 --vocab-local 25216]
"""
from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from common import DTYPES, LiveBytes, alternating, ints, mib, names, parser, print_json, wall_cpu, wall_cpu_stats
from planner.measure import SavedBytes
from megatron_sp.mpu import layers as ce


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__, seq=512, batch=2, seed=1234, reps=3, warmup=1)
    p.add_argument("--vocab-local", type=int, default=25216, help="V/t, this rank's vocabulary slice")
    p.add_argument("--padding", type=int, default=0,
                   help="of those, the last columns that are vocabulary padding (model.padded_vocab_size − vocab_size)")
    p.add_argument("--dtypes", default="fp32,bf16", help=f"comma-separated, of {','.join(DTYPES)}")
    p.add_argument("--chunks", default=str(ce.CHUNK_ELEMENTS),
                   help="comma-separated CHUNK_ELEMENTS values to measure (logits per chunk)")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    args = p.parse_args(argv)
    if any(d not in DTYPES for d in names(args.dtypes)):
        raise SystemExit(f"--dtypes: choose from {', '.join(DTYPES)}")
    if min(args.seq, args.batch, args.vocab_local, args.reps, *ints(args.chunks)) < 1 or args.warmup < 0:
        raise SystemExit("--seq, --batch, --vocab-local, --reps and --chunks must be >= 1, --warmup >= 0")
    if not 0 <= args.padding < args.vocab_local:
        raise SystemExit("--padding must be >= 0 and below --vocab-local (at least one real column)")
    return args


def memory(loss_fn: Callable[[torch.Tensor], torch.Tensor], logits: torch.Tensor) -> dict[str, int]:
    """Saved-for-backward bytes and the live-bytes peak of one forward + backward."""
    x = logits.detach().requires_grad_(True)
    saved, live = SavedBytes(set()), LiveBytes({x.untyped_storage().data_ptr()})
    with live:
        with saved.record():
            loss = loss_fn(x)
        loss.sum().backward()
    logits_saved = x.untyped_storage().data_ptr() in saved.storages
    return {"saved": saved.nbytes, "saved_beyond_logits": saved.nbytes - logits_saved * x.nbytes, "peak": live.peak}


def step(loss_fn: Callable[[torch.Tensor], torch.Tensor], logits: torch.Tensor) -> tuple[float, float]:
    """Wall and process-CPU seconds of one forward + backward."""
    x = logits.detach().requires_grad_(True)
    return wall_cpu(lambda: loss_fn(x).sum().backward())


def measure(args: argparse.Namespace, dtype_name: str, chunk: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(args.seed)
    logits = (torch.randn(args.seq, args.batch, args.vocab_local, generator=g) * 2).to(DTYPES[dtype_name])
    real = args.vocab_local - args.padding  # padded columns are outside the softmax: torch gets the real ones
    target = torch.randint(0, real, (args.seq, args.batch), generator=g)
    variants: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "ours": lambda x: ce.vocab_parallel_cross_entropy(x, target, None, vocab_size=real),
        "torch": lambda x: F.cross_entropy(x[..., :real].float().flatten(0, 1), target.flatten(), reduction="none"),
    }
    with torch.no_grad(), ce.chunk_size(chunk):
        diff = (variants["ours"](logits) - variants["torch"](logits).view(args.seq, args.batch)).abs().max().item()
    row: dict[str, Any] = {"dtype": dtype_name, "tokens": args.seq * args.batch, "v_local": args.vocab_local,
                           "padding": args.padding, "chunk_elements": chunk, "logits_bytes": logits.nbytes,
                           "loss_max_abs_diff": diff}
    with ce.chunk_size(chunk):
        for name, fn in variants.items():
            for key, value in memory(fn, logits).items():
                row[f"{name}_{key}_bytes"] = value
        times = alternating({name: lambda fn=fn: step(fn, logits) for name, fn in variants.items()},
                            args.warmup, args.reps)
    for name in variants:
        row.update(wall_cpu_stats(times[name], prefix=f"{name}_"))
    row["time_ratio"] = row["ours_s"] / row["torch_s"]
    row["cpu_ratio"] = row["ours_cpu_s"] / row["torch_cpu_s"]
    row["peak_ratio"] = row["ours_peak_bytes"] / row["torch_peak_bytes"]
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = [measure(args, d, c) for d in names(args.dtypes) for c in ints(args.chunks)]
    print(f"cross entropy, logits [s {args.seq}, b {args.batch}, V/t {args.vocab_local}], {args.padding} of them "
          f"padding, {args.threads} threads, median of {args.reps}; MiB and ms")
    head = ("dtype", "chunk", "logits", "saved ours", "saved torch", "peak ours", "peak torch", "ms ours", "ms torch",
            "cpu ms ours", "cpu ms torch", "Δloss")
    print(" | ".join(f"{h:>12}" for h in head))
    for r in rows:
        cells = (r["dtype"], r["chunk_elements"], mib(r["logits_bytes"], 1), mib(r["ours_saved_bytes"], 1),
                 mib(r["torch_saved_bytes"], 1), mib(r["ours_peak_bytes"], 1), mib(r["torch_peak_bytes"], 1),
                 f"{r['ours_s'] * 1e3:.0f}", f"{r['torch_s'] * 1e3:.0f}", f"{r['ours_cpu_s'] * 1e3:.0f}",
                 f"{r['torch_cpu_s'] * 1e3:.0f}", f"{r['loss_max_abs_diff']:.1e}")
        print(" | ".join(f"{c:>12}" for c in cells))
    result = {"seq": args.seq, "batch": args.batch, "v_local": args.vocab_local, "padding": args.padding,
              "threads": args.threads, "reps": args.reps, "rows": rows}
    print_json("cross_entropy", **result)
    return result


if __name__ == "__main__":
    main()
