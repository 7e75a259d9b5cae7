"""ZeRO-3 against ZeRO-1 at the same layout: per-rank persistent bytes against the theory, all-gather and
reduce-scatter bytes per step against the planner, step time with the parameter prefetch on and off.

dp ranks on gloo (``run_distributed``, one thread each), bf16 parameters with fp32 masters under autocast, as the
trainer. Method and theory: docs/benchmarks.md.
Run from the repo root:  python tools/bench/zero.py [--dp 2] [--micro-batches 2] [--layers 4 --hidden 256] [--steps 6]
"""
from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from common import gpt_config, mib, parser, print_json
from megatron_sp.config import Config
from megatron_sp.model import GPTModel
from megatron_sp.model.gpt import param_unit
from megatron_sp.mpu import ParallelContext, ParallelDims, comm, initialize
from megatron_sp.optim import DistributedOptimizer, named_trainable
from megatron_sp.testing import run_distributed
from planner.dims import DEFAULT_BUCKET_BYTES
from planner.state import state_bytes
from planner.traffic import comm_per_step

PARAM_BYTES, GRAD_BYTES, STATE_BYTES = 2, 4, 12  # bf16 weight; fp32 main grad; fp32 master + exp_avg + exp_avg_sq
TOLERANCE = 0.05  # |measured / theory - 1| above this is flagged (bucket padding keeps it slightly above 1)
OPS = ("all_gather", "reduce_scatter")  # the bytes compared with the planner
WAITED = ("all_gather", "reduce_scatter", "all_reduce")  # the asynchronous collectives whose waits are timed


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__, arch="llama", layers=4, hidden=256, heads=8, seq=128, batch=2, vocab=4096, warmup=2, steps=6,
               seed=1234)
    p.add_argument("--dp", type=int, default=2, help="data-parallel ranks (gloo); d = dp here (cp 1)")
    p.add_argument("--micro-batches", type=int, default=2, help="micro-batches per step on each rank")
    p.add_argument("--prefetch", type=int, default=1, help="parallel.zero3_prefetch of the 'prefetch on' row")
    p.add_argument("--tie", action="store_true", help="model.tie_embeddings (the head gathers the embedding again)")
    p.add_argument("--bucket-bytes", type=int, default=DEFAULT_BUCKET_BYTES,
                   help="DistributedOptimizer bucket_bytes (default: the trainer's)")
    return p.parse_args(argv)


def setups(args: argparse.Namespace) -> list[tuple[str, int, int]]:
    """(name, zero, prefetch) of each row: ZeRO-1, ZeRO-3 with the prefetch on, and off."""
    return [("ZeRO-1", 1, 0), (f"ZeRO-3 prefetch {args.prefetch}", 3, args.prefetch), ("ZeRO-3 prefetch 0", 3, 0)]


def config_of(args: argparse.Namespace, zero: int, prefetch: int) -> Config:
    """The trainer's config of one row (the planner reads it)."""
    b = args.batch
    return gpt_config(args, None, f"parallel.dp={args.dp}", f"parallel.zero={zero}",
                      f"parallel.zero3_prefetch={prefetch}", "train.precision=bf16", f"train.micro_batch_size={b}",
                      f"train.global_batch_size={b * args.micro_batches * args.dp}",
                      f"model.tie_embeddings={str(args.tie).lower()}")


@dataclass
class Row:
    """One configuration on this rank: its model, optimizer and per-step records."""

    name: str
    zero: int
    prefetch: int
    model: GPTModel
    opt: DistributedOptimizer
    steps: list[dict[str, Any]] = field(default_factory=list)


def persistent_bytes(row: Row) -> dict[str, int]:
    """This rank's bytes held between steps, each storage once: params (``param_buffer`` and every storage the model's
    parameters and buffers hold: ZeRO-3's gathered buckets are empty here), grads (``grad_buffer``, any ``main_grad``
    or ``.grad`` left), state (Adam's moments and the fp32 masters)."""
    opt, model = row.opt, row.model
    seen: set[int] = set()
    params = list(model.parameters())
    held = {"params": [opt.param_buffer, *params, *model.buffers()],
            "grads": [opt.grad_buffer, *(getattr(p, "main_grad", None) for p in params), *(p.grad for p in params)],
            "state": [opt.exp_avg, opt.exp_avg_sq, opt._master_local]}
    out = dict.fromkeys(held, 0)
    for category, tensors in held.items():
        for t in tensors:
            storage = None if t is None else t.untyped_storage()
            if storage is not None and storage.nbytes() and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                out[category] += storage.nbytes()
    return out


def rule_bytes(row: Row, args: argparse.Namespace) -> dict[str, float]:
    """All-gather and reduce-scatter bytes per step by hand from the optimizer's buckets (docs/benchmarks.md): ZeRO-3
    per micro-batch (n-1)/n · 2 B · (the padded units of every forward entry — embedding, each layer, the head, with
    the embedding when tied — plus every unit once for backward), and (n-1)/n · 4 B · padded numel of reduce-scatter;
    ZeRO-1 once per step: the gradients reduce-scattered, the updated bf16 parameters all-gathered."""
    n, m, opt = args.dp, args.micro_batches, row.opt
    share = (n - 1) / n
    if row.zero == 1:
        return {"all_gather": share * PARAM_BYTES * opt.numel, "reduce_scatter": share * GRAD_BYTES * opt.numel}
    assert opt.units is not None
    size = {unit: sum(b.numel for b in buckets) for unit, buckets in opt.units.buckets.items()}
    entries = [["embedding"], *([f"layers.{i}"] for i in range(args.layers)), ["head"] + (["embedding"] if args.tie else [])]
    gathered = sum(size.get(u, 0) for entry in entries for u in entry) + sum(size.values())
    return {"all_gather": m * share * PARAM_BYTES * gathered, "reduce_scatter": m * share * GRAD_BYTES * opt.numel}


def train_step(row: Row, batches: list[torch.Tensor], world: int, events: list[dict[str, Any]]) -> dict[str, Any]:
    """One step of ``row`` (``events`` empty at the start, filled by the observer); returns its wall time, the bytes
    and calls ``comm`` counted, and per waited op kind the time spent in ``wait()`` and the part of the in-flight time
    (issued -> done) before the wait began (hidden behind compute)."""
    with comm.count() as counter:
        t0 = time.perf_counter()
        row.opt.zero_grad()
        for j, tokens in enumerate(batches):
            row.opt.sync_grads = j == len(batches) - 1
            with torch.autocast("cpu", dtype=torch.bfloat16):
                token_losses = row.model(tokens[:, :-1], labels=tokens[:, 1:])  # [b, s]
            (token_losses.float().sum() / (token_losses.numel() * len(batches) * world)).backward()
        row.opt.step(lr=1e-4, clip=1.0)
        step_s = time.perf_counter() - t0
    out: dict[str, Any] = {"step_s": step_s, "bytes": dict(counter.bytes), "calls": dict(counter.calls)}
    for kind in WAITED:
        mine = [e for e in events if e["event"].op == kind]
        out[f"{kind}_ops"] = len(mine)
        out[f"{kind}_wait_s"] = sum(e["event"].wait_end - e["event"].wait_start for e in mine
                                    if e["event"].wait_start is not None and e["event"].wait_end is not None)
        flight = hidden = 0.0
        for e in mine:
            ev = e["event"]
            end = e["done"] if e["done"] is not None else ev.wait_end
            if end is None:
                continue
            flight += end - ev.issued
            hidden += max(0.0, min(end, ev.wait_start if ev.wait_start is not None else end) - ev.issued)
        out[f"{kind}_flight_s"], out[f"{kind}_hidden_s"] = flight, hidden
    return out


def rank_run(rank: int, world_size: int, args: argparse.Namespace) -> dict[str, Any]:
    """Build every row on this rank and train them in turn (ABBA order); return the records and the bytes."""
    state = initialize(ParallelDims(dp=world_size))
    parallel = ParallelContext.from_state(state)
    rows = []
    for name, zero, prefetch in setups(args):
        cfg = config_of(args, zero, prefetch)
        model = GPTModel(cfg.model, seed=args.seed, parallel=parallel).train()  # fp32: the optimizer keeps the masters
        opt = DistributedOptimizer(named_trainable(model), cfg.train, state, zero=zero, precision="bf16",
                                   bucket_bytes=args.bucket_bytes, unit_of=param_unit, prefetch=prefetch,
                                   model_cfg=cfg.model)
        model.param_units = opt.units
        rows.append(Row(name, zero, prefetch, model, opt))
    gen = torch.Generator().manual_seed(args.seed + rank)  # each data-parallel rank its own micro-batches
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen) for _ in range(args.micro_batches)]
    events: list[dict[str, Any]] = []

    def on_event(event: comm.CommEvent) -> None:
        if event.work is None or event.op not in WAITED:
            return
        record: dict[str, Any] = {"event": event, "done": None}
        event.work.get_future().add_done_callback(lambda _: record.__setitem__("done", time.perf_counter()))
        events.append(record)

    with comm.observe(on_event):
        for i in range(args.warmup + args.steps):
            for row in rows if i % 2 == 0 else rows[::-1]:
                events.clear()
                rec = train_step(row, batches, world_size, events)
                if i >= args.warmup:
                    row.steps.append(rec)
    out = {"rank": rank, "rows": [{"name": r.name, "zero": r.zero, "prefetch": r.prefetch, "steps": r.steps,
                                   "n_params": sum(p.numel() for _, p in named_trainable(r.model)),
                                   "padded_numel": r.opt.numel, "bytes": persistent_bytes(r),
                                   "rule": rule_bytes(r, args),
                                   "units": sorted(r.opt.units.buckets) if r.opt.units is not None else []}
                                  for r in rows]}
    state.destroy()
    return out


def combine(args: argparse.Namespace, per_rank: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per configuration (rank 0's bytes; times: the slower rank per step, the median over steps)."""
    out = []
    d = args.dp
    for i, first in enumerate(per_rank[0]["rows"]):
        ranks = [p["rows"][i] for p in per_rank]
        phi = first["n_params"]
        sharded = first["zero"] == 3
        theory = {"params": PARAM_BYTES * phi / (d if sharded else 1), "grads": GRAD_BYTES * phi / (d if sharded else 1),
                  "state": STATE_BYTES * phi / d}
        b = first["bytes"]
        ratio = {k: b[k] / theory[k] for k in theory}
        ratio["total"] = sum(b.values()) / sum(theory.values())
        cfg = config_of(args, first["zero"], first["prefetch"])
        planned = comm_per_step(cfg, bucket_bytes=args.bucket_bytes)
        planner = {op: sum(ops.get(op, 0.0) for ops in planned.values()) for op in OPS}
        steps = [r["steps"] for r in ranks]  # [rank][step]
        n_steps, pooled = len(steps[0]), len(steps[0]) * len(steps)

        def mean_ms(key: str, steps: list[list[dict[str, Any]]] = steps, pooled: int = pooled) -> float:
            return 1e3 * sum(st[key] for rank_steps in steps for st in rank_steps) / pooled

        measured = {op: steps[0][-1]["bytes"].get(op, 0.0) for op in OPS}
        row: dict[str, Any] = {
            "name": first["name"], "zero": first["zero"], "prefetch": first["prefetch"], "n_params": phi,
            "padded_numel": first["padded_numel"], "units": first["units"], "bytes": b, "total_bytes": sum(b.values()),
            "theory_bytes": theory, "ratio": ratio,
            "memory_ok": all(abs(r - 1) <= TOLERANCE for r in ratio.values()),
            "planner_state_bytes": state_bytes(cfg, bucket_bytes=args.bucket_bytes).total,
            "ranks_differ": [j for j, r in enumerate(ranks) if r["bytes"] != b],
            "comm_bytes": measured, "planner_bytes": planner, "rule_bytes": first["rule"],
            "comm_ratio": {op: measured[op] / planner[op] if planner[op] else None for op in OPS},
            "comm_steady": all(st["bytes"] == steps[0][0]["bytes"] for rank_steps in steps for st in rank_steps),
            "calls": steps[0][-1]["calls"],
            "step_ms": 1e3 * statistics.median(max(rs[j]["step_s"] for rs in steps) for j in range(n_steps)),
            "step_ms_min": 1e3 * min(max(rs[j]["step_s"] for rs in steps) for j in range(n_steps)),
        }
        row["comm_ok"] = all(row["comm_ratio"][op] is not None and abs(row["comm_ratio"][op] - 1) < 1e-9 for op in OPS)
        for kind in WAITED:
            row[f"{kind}_ops"] = steps[0][-1][f"{kind}_ops"]
            for what in ("wait", "flight", "hidden"):
                row[f"{kind}_{what}_ms"] = mean_ms(f"{kind}_{what}_s")
            flight = row[f"{kind}_flight_ms"]
            row[f"{kind}_hidden"] = row[f"{kind}_hidden_ms"] / flight if flight else None
        out.append(row)
    base = out[0]["step_ms"]
    for row in out:
        row["vs_zero1"] = row["step_ms"] / base
    return out


def print_report(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    """The tables, the notes and the JSON line."""
    d, n = args.dp, rows[0]["n_params"]
    print(f"ZeRO-3 vs ZeRO-1 at dp={d} (gloo, 1 thread per rank): {args.arch} L={args.layers} h={args.hidden} "
          f"s={args.seq} b={args.batch} x {args.micro_batches} micro-batches, vocab {args.vocab}"
          f"{', tied' if args.tie else ''}, bf16 + fp32 masters; Φ = {n:,} parameters")
    print("\npersistent bytes per rank (MiB, between steps) against the theory")
    print(f"{'configuration':20} {'params':>8} {'grads':>8} {'state':>8} {'total':>8} {'theory':>8} {'formula':>18} "
          f"{'meas/theory':>11} {'planner':>8}")
    for r in rows:
        formula = "(2+4+12)Φ/d" if r["zero"] == 3 else "2Φ+4Φ+12Φ/d"
        flag = "" if r["memory_ok"] and not r["ranks_differ"] else "  OFF"
        b = r["bytes"]
        print(f"{r['name']:20} {mib(b['params']):>8} {mib(b['grads']):>8} {mib(b['state']):>8} "
              f"{mib(r['total_bytes']):>8} {mib(sum(r['theory_bytes'].values())):>8} {formula:>18} "
              f"{r['ratio']['total']:>11.5f} {mib(r['planner_state_bytes']):>8}{flag}")
    print("\nall-gather / reduce-scatter bytes per step per rank (MiB) against the planner (tools/planner/traffic.py)")
    print(f"{'configuration':20} {'AG meas':>9} {'AG plan':>9} {'AG rule':>9} {'RS meas':>9} {'RS plan':>9} "
          f"{'RS rule':>9} {'AG calls':>8} {'RS calls':>8}")
    for r in rows:
        m, p, h = r["comm_bytes"], r["planner_bytes"], r["rule_bytes"]
        flag = "" if r["comm_ok"] and r["comm_steady"] else "  OFF"
        print(f"{r['name']:20} {mib(m['all_gather'], 3):>9} {mib(p['all_gather'], 3):>9} {mib(h['all_gather'], 3):>9} "
              f"{mib(m['reduce_scatter'], 3):>9} {mib(p['reduce_scatter'], 3):>9} {mib(h['reduce_scatter'], 3):>9} "
              f"{r['calls'].get('all_gather', 0):>8} {r['calls'].get('reduce_scatter', 0):>8}{flag}")
    print(f"\nstep time (ms, median of {args.steps} steps after {args.warmup} warm-up, the slower rank) and the time "
          "ranks spent in wait() (ms per step per rank)")
    print(f"{'configuration':20} {'step':>7} {'min':>7} {'vs Z1':>6} {'AG wait':>8} {'AG flight':>9} {'AG hidden':>9} "
          f"{'RS wait':>8} {'AR wait':>8}")
    for r in rows:
        hidden = "-" if r["all_gather_hidden"] is None else f"{r['all_gather_hidden']:.1%}"
        print(f"{r['name']:20} {r['step_ms']:>7.1f} {r['step_ms_min']:>7.1f} {r['vs_zero1']:>6.2f} "
              f"{r['all_gather_wait_ms']:>8.1f} {r['all_gather_flight_ms']:>9.1f} {hidden:>9} "
              f"{r['reduce_scatter_wait_ms']:>8.1f} {r['all_reduce_wait_ms']:>8.1f}")
    print("AG wait = Σ of the all-gathers' wait() (exposed); AG flight = Σ issued -> done (work future callback); "
          "AG hidden = the part of the flight before its wait() began (compute ran meanwhile).")
    print("\nnotes:")
    for r in rows:
        off = [k for k, v in r["ratio"].items() if abs(v - 1) > TOLERANCE]
        if off:
            print(f"  {r['name']}: bytes off the theory by more than {TOLERANCE:.0%} in {', '.join(off)}")
        if r["total_bytes"] != r["planner_state_bytes"]:
            print(f"  {r['name']}: {r['total_bytes']:,} B held vs the planner's {r['planner_state_bytes']:,} B")
        if r["ranks_differ"]:
            print(f"  {r['name']}: ranks {r['ranks_differ']} hold other bytes than rank 0")
        if not r["comm_ok"]:
            print(f"  {r['name']}: measured comm bytes differ from the planner's: {r['comm_ratio']}")
        if not r["comm_steady"]:
            print(f"  {r['name']}: the comm bytes differ from step to step")
    on, off_ = rows[1], rows[2]
    print(f"  prefetch {on['prefetch']} vs 0: step {on['step_ms']:.1f} vs {off_['step_ms']:.1f} ms; all-gather wait "
          f"{on['all_gather_wait_ms']:.1f} vs {off_['all_gather_wait_ms']:.1f} ms per step per rank.")
    print(f"  ZeRO-3 holds {rows[1]['total_bytes'] / rows[0]['total_bytes']:.1%} of ZeRO-1's bytes per rank; its "
          f"all-gathers move {rows[1]['comm_bytes']['all_gather'] / rows[0]['comm_bytes']['all_gather']:.1f}x "
          "ZeRO-1's per step. Not counted: ZeRO-3's gathered units and fp32 staging buffers while a step runs "
          "(the planner's peak; docs/planner.md).")
    print_json("zero", config=vars(args), rows=rows)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Run the rows on ``--dp`` gloo ranks and print the report; returns the rows."""
    args = parse_args(argv)
    if args.dp < 2 or args.steps < 1 or args.micro_batches < 1 or args.warmup < 0 or args.prefetch < 1:
        raise SystemExit("--dp must be >= 2, --steps, --micro-batches and --prefetch >= 1, --warmup >= 0")
    rows = combine(args, run_distributed(rank_run, args.dp, args=args))
    print_report(args, rows)
    return rows


if __name__ == "__main__":
    main()
