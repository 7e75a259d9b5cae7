"""Bytes each rank sends per transformer layer (forward + backward), against the TP / TP+SP theory.

Theory and what is not counted: docs/benchmarks.md.
Run from the repo root:  python tools/bench/comm_volume.py [--tp 2,4] [--arch neox,llama] [--verbose]
"""
from __future__ import annotations

import argparse
from typing import Any

import torch

from common import build_layer, gpt_config, ints, parser, print_json, rope, world_group
from megatron_sp.config.schema import ModelConfig
from megatron_sp.mpu import ParallelContext, comm
from megatron_sp.mpu.random import get_tracker, init_rng
from megatron_sp.testing import run_distributed

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
# bytes a rank sends per call of each collective on an N-byte tensor, in units of (t−1)/t·N
RING_FACTOR = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1, "all_to_all": 1}
ELEMENT_BYTES = 4  # fp32


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__, seq=256, batch=2, hidden=256, heads=8, kv_heads=None, seed=1234, verbose=False)
    p.add_argument("--arch", default="neox,llama", help="comma-separated: neox,llama")
    p.add_argument("--tp", default="2,4", help="comma-separated TP sizes (> 1)")
    return p.parse_args(argv)


def model_config(args: argparse.Namespace, arch: str) -> ModelConfig:
    """A finalized ModelConfig of ``arch`` from the flags (derived sizes from the config loader)."""
    return gpt_config(args, 256, arch=arch, num_kv_heads=args.kv_heads if arch == "llama" else None).model


def theory(t: int, sp: bool, recompute_allgather: bool) -> dict[str, dict[str, int]]:
    """``{phase: {op: calls}}`` of Megatron's layer (docs/benchmarks.md); every call moves N elements."""
    if not sp:
        return {"forward": {"all_reduce": 2}, "backward": {"all_reduce": 2}}
    return {"forward": {"all_gather": 2, "reduce_scatter": 2},
            "backward": {"reduce_scatter": 2, "all_gather": 4 if recompute_allgather else 2}}


def structural_differences(cfg: ModelConfig, t: int, sp: bool, recompute_allgather: bool) -> list[dict[str, Any]]:
    """How this layer's collectives differ from the theory, from its structure: ``{phase, op, calls, why}``."""
    if not (sp and recompute_allgather and cfg.num_kv_heads % t):
        return []
    return [{"phase": "backward", "op": "all_gather", "calls": -1,
             "why": "QKV is replicated per kv group (t > num_kv_heads: ReplicatedGroupQKV); it gathers with "
                    "gather_from_sp and keeps the gathered input, so it does not gather again in backward"}]


def measure(args: argparse.Namespace, cfg: ModelConfig, parallel: ParallelContext) -> dict[str, Any]:
    """Collectives of one forward and one backward of one layer on this rank."""
    layer = build_layer(cfg, parallel, args.seed)
    s, b, h = args.seq, args.batch, args.hidden
    gen = torch.Generator().manual_seed(args.seed + parallel.tp_rank)
    x = torch.randn(s // parallel.tp_size if parallel.sp else s, b, h, generator=gen).requires_grad_()  # [s/t, b, h] or [s, b, h]
    cos, sin = rope(cfg, s)
    with comm.count() as fwd:
        y = layer(x, cos, sin)
    grad = torch.randn(y.shape, generator=gen)
    with comm.count() as bwd:
        y.backward(grad)
    return {"forward": fwd.summary(), "backward": bwd.summary()}


def rank_rows(rank: int, world_size: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every (arch, sp, recompute_allgather) row for TP size ``world_size``, on this rank."""
    tracker = get_tracker()
    init_rng(tracker, args.seed, rank, 0)
    rows = []
    for arch in args.arch.split(","):
        cfg = model_config(args, arch)
        for sp in (False, True):
            for recompute_allgather in (False, True):
                parallel = ParallelContext(tp_group=world_group(world_size), sequence_parallel=sp,
                                           recompute_allgather=recompute_allgather, tracker=tracker)
                rows.append({"arch": arch, "tp": world_size, "sp": sp, "recompute_allgather": recompute_allgather,
                             **measure(args, cfg, parallel)})
    return rows


def finish_row(args: argparse.Namespace, row: dict[str, Any]) -> dict[str, Any]:
    """Add the totals, the theory, the ratio and the per-op differences to a measured row."""
    ring = (row["tp"] - 1) / row["tp"] * args.seq * args.batch * args.hidden * ELEMENT_BYTES
    th = theory(row["tp"], row["sp"], row["recompute_allgather"])
    row["forward_bytes"] = sum(v["bytes"] for v in row["forward"].values())
    row["backward_bytes"] = sum(v["bytes"] for v in row["backward"].values())
    row["total_bytes"] = row["forward_bytes"] + row["backward_bytes"]
    row["theory"] = {phase: {op: {"calls": calls, "bytes": calls * RING_FACTOR[op] * ring} for op, calls in ops.items()}
                     for phase, ops in th.items()}
    row["theory_bytes"] = sum(v["bytes"] for ops in row["theory"].values() for v in ops.values())
    row["ratio"] = row["total_bytes"] / row["theory_bytes"]
    known = structural_differences(model_config(args, row["arch"]), row["tp"], row["sp"], row["recompute_allgather"])
    row["differences"] = [{**d, "bytes": d["calls"] * RING_FACTOR[d["op"]] * ring} for d in known]
    unexplained = []
    for phase in ("forward", "backward"):
        for op in OPS:
            got = row[phase].get(op, {"calls": 0, "bytes": 0.0})
            want_calls = th[phase].get(op, 0) + sum(d["calls"] for d in known if (d["phase"], d["op"]) == (phase, op))
            want_bytes = want_calls * RING_FACTOR[op] * ring
            if got["calls"] != want_calls or abs(got["bytes"] - want_bytes) > 0.5:
                unexplained.append({"phase": phase, "op": op, "calls": got["calls"], "expected_calls": want_calls,
                                    "bytes": got["bytes"], "expected_bytes": want_bytes})
    row["unexplained"] = unexplained
    return row


def _ops(summary: dict[str, dict[str, float]]) -> str:
    return ", ".join(f"{op} {v['calls']} x {v['bytes'] / v['calls']:,.0f}" for op, v in sorted(summary.items())) or "-"


def print_report(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    """The table, the notes, the verbose breakdown and the JSON line."""
    onoff = {True: "on", False: "off"}
    print(f"bytes sent per rank per layer (forward + backward), s={args.seq} b={args.batch} h={args.hidden} "
          f"heads={args.heads}, fp32; theory: Megatron's structure (one fused column layer per block)")
    print(f"{'arch':5} {'tp':>3} {'sp':>3} {'rag':>3} {'forward B':>12} {'backward B':>12} {'total B':>12} "
          f"{'theory B':>12} {'ratio':>6}")
    for r in rows:
        print(f"{r['arch']:5} {r['tp']:>3} {onoff[r['sp']]:>3} {onoff[r['recompute_allgather']]:>3} "
              f"{r['forward_bytes']:>12,.0f} {r['backward_bytes']:>12,.0f} {r['total_bytes']:>12,.0f} "
              f"{r['theory_bytes']:>12,.0f} {r['ratio']:>6.3f}{'  *' if r['differences'] or r['unexplained'] else ''}")
    print("rag = tp_recompute_allgather (acts only under SP). Theory per rank, N = s·b·h·4 B: TP 8(t-1)/t·N; "
          "TP+SP 8(t-1)/t·N; TP+SP+rag 10(t-1)/t·N.")
    off = [r for r in rows if r["differences"] or r["unexplained"]]
    print(f"\nnotes: {len(off)} of {len(rows)} rows differ from the theory (marked *)" + (":" if off else "."))
    for r in off:
        print(f"{r['arch']} tp={r['tp']} sp={onoff[r['sp']]} rag={onoff[r['recompute_allgather']]}: "
              f"{r['ratio']:.3f}")
        for d in r["differences"]:
            print(f"    {d['phase']:8} {d['op']:14} {d['calls']:+d} call(s), {d['bytes']:+,.0f} B: {d['why']}")
        for u in r["unexplained"]:
            print(f"    UNEXPLAINED {u['phase']} {u['op']}: {u['calls']} calls / {u['bytes']:,.0f} B, the layer structure "
                  f"gives {u['expected_calls']} / {u['expected_bytes']:,.0f} B")
    if args.verbose:
        print("\nper-op breakdown (calls x bytes per call), measured | theory:")
        for r in rows:
            print(f"{r['arch']:5} tp={r['tp']} sp={onoff[r['sp']]:3} rag={onoff[r['recompute_allgather']]:3}")
            for phase in ("forward", "backward"):
                print(f"    {phase:8} {_ops(r[phase])}  |  {_ops(r['theory'][phase])}")
    slim = [{**r, "differences": [{k: v for k, v in d.items() if k != "why"} for d in r["differences"]]} for r in rows]
    print_json("comm_volume", config=vars(args), rows=slim)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Measure every row and print the report; returns the rows."""
    args = parse_args(argv)
    sizes = ints(args.tp)
    for t in sizes:
        if t < 2 or args.heads % t or args.seq % t:
            raise SystemExit(f"--tp {t}: needs t > 1 dividing heads ({args.heads}) and seq ({args.seq})")
    rows = [finish_row(args, row) for t in sizes for row in run_distributed(rank_rows, t, args=args)[0]]  # rank 0's
    print_report(args, rows)
    return rows


if __name__ == "__main__":
    main()
