"""The optimizer step of Muon against AdamW at the same layout, and how evenly Muon's owners share the work.

Each optimizer trains its own copy of the same GPT at tp·dp (ZeRO-1 by default) on gloo ranks, the two taking steps
in turn (ABBA); only ``optimizer.step`` is timed, after a barrier, so every rank starts it together.
Method and limits: docs/benchmarks.md.
Run from the repo root:  python tools/bench/muon.py [--tp 2] [--dp 2] [--zero 1] [--steps 5] [--verbose]
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from common import gpt_config, parser, print_json
from megatron_sp.model import GPTModel
from megatron_sp.mpu import ParallelContext, ParallelDims, comm, initialize
from megatron_sp.mpu.sharding import full_shape
from megatron_sp.optim import DistributedOptimizer, named_trainable
from megatron_sp.optim.muon import ns_flops, orthogonalised
from megatron_sp.testing import run_distributed

OPTIMIZERS = ("adamw", "muon")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__, arch="neox", layers=4, hidden=256, heads=4, seq=128, batch=2, vocab=4096, warmup=2, steps=5,
               seed=1234, verbose=False)
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size")
    p.add_argument("--dp", type=int, default=2, help="data-parallel size")
    p.add_argument("--zero", type=int, default=1, choices=(0, 1, 2), help="parallel.zero")
    p.add_argument("--ns-steps", type=int, default=5, help="train.muon_ns_steps")
    return p.parse_args(argv)


def rank_run(rank: int, world_size: int, args: argparse.Namespace) -> dict[str, Any]:
    """Both optimizers on this rank: their step times, Muon's orthogonalisation time and owned FLOPs."""
    torch.set_num_threads(1)
    state = initialize(ParallelDims(tp=args.tp, dp=args.dp))
    gen = torch.Generator().manual_seed(args.seed + state.dp_rank)  # each data-parallel rank its own batch
    data = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)
    tokens, labels = data[:, :-1].contiguous(), data[:, 1:].contiguous()  # [b, s]
    setups = {}
    for name in OPTIMIZERS:
        cfg = gpt_config(args, None, f"parallel.tp={args.tp}", f"parallel.dp={args.dp}", f"parallel.zero={args.zero}",
                         f"train.optimizer={name}", f"train.muon_ns_steps={args.ns_steps}", world_size=world_size)
        model = GPTModel(cfg.model, seed=args.seed, parallel=ParallelContext.from_state(state)).train()
        setups[name] = (model, DistributedOptimizer(named_trainable(model), cfg.train, state, zero=args.zero,
                                                    model_cfg=cfg.model))
    times: dict[str, dict[str, list[float]]] = {name: {"step_s": [], "ns_s": []} for name in OPTIMIZERS}
    for i in range(args.warmup + args.steps):
        for name in OPTIMIZERS if i % 2 == 0 else OPTIMIZERS[::-1]:  # ABBA: drifting load hits both alike
            model, opt = setups[name]
            opt.zero_grad()
            loss = model(tokens, labels=labels).sum() / (tokens.numel() * args.dp)
            loss.backward()
            opt.finish_grad_sync()
            comm.barrier()
            t = time.perf_counter()
            opt.step(lr=1e-4, clip=1.0)
            if i >= args.warmup:
                times[name]["step_s"].append(time.perf_counter() - t)
                times[name]["ns_s"].append(_owned_ns_seconds(opt, args.tp))
    out: dict[str, Any] = {"rank": rank}
    for name, (_, opt) in setups.items():
        owned = [i for i in opt._muon if opt._muon_owners[i.index] == opt._buckets[i.bucket].rank]
        out[name] = {**times[name], "matrices": len(opt._muon), "owned": len(owned),
                     "owned_flops": sum(ns_flops(full_shape(i.param, args.tp), args.ns_steps) for i in owned)}
    return out


def _owned_ns_seconds(opt: DistributedOptimizer, tp: int) -> float:
    """This rank's owner share of the Newton–Schulz work, timed on its own: ``orthogonalised`` of the whole (TP-gathered)
    shape of every Muon weight it owns (the step's TP gather not included); 0 for AdamW."""
    if not opt._muon:
        return 0.0
    t = time.perf_counter()
    for info in opt._muon:
        if opt._muon_owners[info.index] == opt._buckets[info.bucket].rank:
            orthogonalised(info.name, torch.randn(full_shape(info.param, tp)), opt.model_cfg, opt.cfg)
    return time.perf_counter() - t


def combine(per_rank: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per optimizer: the step's median of the slowest rank, and the spread over ranks of the ranks' medians."""
    rows = []
    for name in OPTIMIZERS:
        rs = [r[name] for r in per_rank]
        slowest = [max(r["step_s"][j] for r in rs) for j in range(len(rs[0]["step_s"]))]
        step = [statistics.median(r["step_s"]) for r in rs]
        ns = [statistics.median(r["ns_s"]) for r in rs]
        flops = [r["owned_flops"] for r in rs]
        rows.append({"optimizer": name, "step_ms": 1e3 * statistics.median(slowest),
                     "rank_step_ms": [1e3 * s for s in step], "step_spread": max(step) / min(step),
                     "rank_ns_ms": [1e3 * s for s in ns], "ns_spread": max(ns) / min(ns) if min(ns) else None,
                     "matrices": rs[0]["matrices"], "rank_owned": [r["owned"] for r in rs],
                     "rank_owned_gflop": [f / 1e9 for f in flops],
                     "flop_spread": max(flops) / min(flops) if min(flops) else None})
    return rows


def spread(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def print_report(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    """The table, the notes and the JSON line."""
    print(f"optimizer step at tp{args.tp}·dp{args.dp} ZeRO-{args.zero} (gloo, {args.arch} L={args.layers} "
          f"h={args.hidden} s={args.seq} b={args.batch}/rank, fp32, {args.tp * args.dp} ranks × 1 thread); "
          f"ms: median over {args.steps} steps after {args.warmup}")
    print(f"{'optimizer':9} {'step':>7} {'vs adamw':>8} {'rank max/min':>12} {'NS ms/rank':>10} {'NS max/min':>10} "
          f"{'owned matrices':>14} {'owned GFLOP max/min':>19}")
    base = rows[0]["step_ms"]
    for r in rows:
        owned = "/".join(map(str, r["rank_owned"])) if r["matrices"] else "-"
        print(f"{r['optimizer']:9} {r['step_ms']:>7.1f} {r['step_ms'] / base:>7.2f}x {r['step_spread']:>12.2f} "
              f"{statistics.mean(r['rank_ns_ms']):>10.1f} {spread(r['ns_spread']):>10} {owned:>14} "
              f"{spread(r['flop_spread']):>19}")
    print("step = the slowest rank's optimizer.step (norm, clip, AdamW, Muon's gathers, Newton–Schulz and scatter, the "
          "ZeRO parameter all-gather); rank max/min = the spread of the ranks' median steps (a step ends in "
          "collectives, so every rank waits for the slowest). NS = each rank's owned orthogonalisations (Newton–Schulz "
          "on the whole shapes, timed apart from the step), median over steps; owned = the matrices each rank orthogonalises, "
          "GFLOP = their Newton–Schulz FLOPs (both TP ranks of an owner run the full matrix).")
    if args.verbose:
        for r in rows:
            print(f"  {r['optimizer']}: step ms per rank {[round(x, 1) for x in r['rank_step_ms']]}, NS ms per rank "
                  f"{[round(x, 1) for x in r['rank_ns_ms']]}, GFLOP per rank {[round(x, 3) for x in r['rank_owned_gflop']]}")
    print_json("muon", config=vars(args), rows=rows)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Run both optimizers on tp·dp gloo ranks and print the report; returns the rows."""
    args = parse_args(argv)
    if min(args.tp, args.dp, args.steps) < 1 or args.warmup < 0:
        raise SystemExit("--tp, --dp and --steps must be positive, --warmup >= 0")
    rows = combine(run_distributed(rank_run, args.tp * args.dp, timeout_s=1800, args=args))
    print_report(args, rows)
    return rows


if __name__ == "__main__":
    main()
