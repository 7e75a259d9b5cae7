#!/usr/bin/env python3
"""Launch cost of megatron_sp.testing.run_distributed (forkserver, torch preloaded, gloo init).

Prints a table of the first (cold) launch and the mean of warm launches per world size, then one
JSON line. Target: <= 0.5 s per warm launch.
"""
import json
import time

import torch

from common import parser
from megatron_sp.mpu import comm
from megatron_sp.testing import run_distributed


def _all_reduce(rank: int, world: int) -> float:
    t = torch.ones(1)
    comm.all_reduce(t, None)
    return t.item()


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    rows = []
    for world in args.worlds:
        t = time.perf_counter()
        run_distributed(_all_reduce, world)
        cold = time.perf_counter() - t
        t = time.perf_counter()
        for _ in range(args.repeats):
            run_distributed(_all_reduce, world)
        warm = (time.perf_counter() - t) / args.repeats
        rows.append({"world": world, "cold_s": round(cold, 3), "warm_s": round(warm, 3), "target_s": 0.5})
    print(f"{'world':>5} {'first launch s':>15} {'warm launch s':>14} {'target s':>9}")
    for r in rows:
        print(f"{r['world']:>5} {r['cold_s']:>15.3f} {r['warm_s']:>14.3f} {r['target_s']:>9.1f}")
    print(json.dumps({"bench": "harness_launch", "rows": rows}))


if __name__ == "__main__":
    main()
