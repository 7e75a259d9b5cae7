"""Sharded checkpoint save/load at world 4 (tp2 · dp2, ZeRO-1): bytes per rank, blocked time, load time.

Method: docs/benchmarks.md. Run from the repo root:  python tools/bench/checkpoint.py [--layers 4 --hidden 512 ...]
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from common import gpt_config, parser
from megatron_sp import checkpointing
from megatron_sp.model import GPTModel
from megatron_sp.mpu import ParallelContext, ParallelDims, comm, initialize
from megatron_sp.mpu.sharding import gather_full
from megatron_sp.optim import DistributedOptimizer, named_trainable
from megatron_sp.testing import run_distributed

TP, DP = 2, 2
TIMED = ("sync", "async", "until latest", "gather to rank 0", "load same layout")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__, layers=4, hidden=512, heads=8, vocab=8192)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    return p.parse_args(argv)


def _timed(fn: Any) -> float:
    comm.barrier()
    t = time.perf_counter()
    fn()
    comm.barrier()
    return time.perf_counter() - t


def rank_run(rank: int, world_size: int, args: argparse.Namespace, root: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    state = initialize(ParallelDims(tp=TP, dp=DP))
    cfg = gpt_config(args, None, f"parallel.tp={TP}", f"parallel.dp={DP}", "parallel.zero=1", f"checkpoint.save={root}/ckpt",
                     world_size=TP * DP)
    model = GPTModel(cfg.model, seed=1, parallel=ParallelContext.from_state(state))
    opt = DistributedOptimizer(named_trainable(model), cfg.train, state, zero=1)
    gen = torch.Generator().manual_seed(rank)
    opt.exp_avg.copy_(torch.randn(opt.exp_avg.shape, generator=gen))
    opt.exp_avg_sq.copy_(torch.rand(opt.exp_avg_sq.shape, generator=gen))
    saver = checkpointing.Checkpointer(cfg, state, torch.device("cpu"))
    out: dict[str, list[float]] = {k: [] for k in TIMED}
    baseline = Path(root) / "baseline.pt"
    for i in range(args.repeats):
        out["sync"].append(_timed(lambda i=i: saver.save(10 + i, 0, model, opt, asynchronous=False)))
        comm.barrier()
        t = time.perf_counter()
        saver.save(100 + i, 0, model, opt, asynchronous=True)
        out["async"].append(time.perf_counter() - t)
        while not saver.poll():
            time.sleep(0.01)
        out["until latest"].append(time.perf_counter() - t)

        def gather() -> None:
            named = named_trainable(model)
            weights = gather_full(named, state)
            moments = opt.state_dict_by_name()
            name_of = {id(p): n for n, p in named}
            full = {k: gather_full(named, state, lambda p, k=k: moments[name_of[id(p)]][k])
                    for k in ("exp_avg", "exp_avg_sq")}
            if rank == 0:
                torch.save({"model": weights, **full}, baseline)
        out["gather to rank 0"].append(_timed(gather))
        ckpt = checkpointing.resolve(f"{root}/ckpt")
        out["load same layout"].append(_timed(lambda ckpt=ckpt: checkpointing.load(
            ckpt, model, opt, state, torch.device("cpu"), seed=1, layout=checkpointing.writer_layout(cfg))))
    result: dict[str, Any] = {k: statistics.median(v) for k, v in out.items()}
    ckpt = checkpointing.resolve(f"{root}/ckpt")
    result["file_bytes"] = (ckpt / checkpointing.store.rank_file(rank)).stat().st_size
    if rank == 0:
        result["baseline_bytes"] = baseline.stat().st_size
        result["params"] = sum(math.prod(v["shape"]) for k, v in checkpointing.Reader(ckpt).tensors.items()
                               if k.startswith("model/"))
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        results = run_distributed(rank_run, TP * DP, timeout_s=1800, args=args, root=root)
        t = time.perf_counter()
        full = checkpointing.read_full(checkpointing.resolve(f"{root}/ckpt"), "")
        load_one = time.perf_counter() - t
    sizes = [r["file_bytes"] for r in results]
    r0 = results[0]
    rows = [(k, max(r[k] for r in results)) for k in TIMED]
    rows.append(("load 1 rank (read_full)", load_one))
    print(f"model: {r0['params'] / 1e6:.2f}M parameters, layout tp{TP}·dp{DP} ZeRO-1, median of {args.repeats}, "
          "slowest rank")
    print(f"{'operation':<26}{'seconds':>10}")
    for name, sec in rows:
        print(f"{name:<26}{sec:>10.3f}")
    print(f"\nbytes per rank file: {sizes} (max/min {max(sizes) / min(sizes):.3f}); total {sum(sizes) / 1e6:.1f} MB "
          f"vs the gather-to-rank-0 file {r0['baseline_bytes'] / 1e6:.1f} MB; {len(full)} tensors read back")
    print(f"blocked by a save: async {rows[1][1]:.3f} s vs sync {rows[0][1]:.3f} s "
          f"({rows[1][1] / rows[0][1]:.2f}×); sharded sync vs gather to rank 0: {rows[0][1] / rows[3][1]:.2f}×")
    print(json.dumps({"bench": "checkpoint", "params": r0["params"], "seconds": dict(rows), "rank_bytes": sizes,
                      "baseline_bytes": r0["baseline_bytes"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
