"""Bytes each rank sends per transformer layer (forward + backward), against the TP / TP+SP theory.

One forward and one backward of one ``TransformerLayer`` (neox and llama) on gloo ranks, for each
tp × sequence parallel × ``tp_recompute_allgather``; ``megatron_sp.mpu.comm.count()`` records
every collective with the bytes this rank sends under the ring algorithms (all-reduce
``2(t−1)/t·bytes``, all-gather ``(t−1)/t·output bytes``, reduce-scatter ``(t−1)/t·input bytes``).
Forward and backward are counted separately. fp32 activations; reported for rank 0.

Theory, for Megatron's layer structure (per rank, ``N = s·b·h`` elements of ``e`` bytes): one
fused column-parallel layer per block (fused QKV; fc1, or gate and up fused into one ``[2·ffn/t, h]``
layer for SwiGLU) and one row-parallel layer per block (attention out; fc2 / down).

* plain TP: forward 2 all-reduces (after out and fc2), backward 2 all-reduces (the input grads of
  QKV and fc1, Megatron's f); each ``2(t−1)/t·N·e``: ``8(t−1)/t·N·e`` in all.
* TP + SP: the same volume as all-gathers and reduce-scatters of ``(t−1)/t·N·e`` each: forward
  2 all-gathers (inputs of QKV and fc1) + 2 reduce-scatters (outputs of out and fc2); backward
  2 reduce-scatters (input grads of QKV and fc1) + 2 all-gathers (output grads of out and fc2).
* TP + SP + recompute_allgather: + 1 all-gather in backward per column layer (its input is
  gathered again for the weight grad): 2 more, ``10(t−1)/t·N·e``. The flag does nothing without SP.

Not counted (not per layer per micro-batch): the TP all-reduce of the grads of SP-tagged
parameters (norms, row-parallel biases), once per step in the trainer.

Run from the repo root:  python tools/bench/comm_volume.py [--tp 2,4] [--arch neox,llama] [--verbose]
Prints a table, notes on rows off their theory, then one JSON line with every number.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

try:
    import megatron_sp  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_sp import config
from megatron_sp.config.schema import ModelConfig
from megatron_sp.model.gpt import GPTModel
from megatron_sp.model.transformer import RotaryEmbedding, TensorParallel, TransformerLayer, rotary_dim
from megatron_sp.mpu import comm
from megatron_sp.mpu.random import get_tracker, init_rng
from megatron_sp.testing import run_distributed

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
RING_FACTOR = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1, "all_to_all": 1}
"""Bytes a rank sends per call of each collective on an N-byte tensor, in units of (t−1)/t·N."""
ELEMENT_BYTES = 4  # fp32


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="neox,llama", help="comma-separated: neox,llama")
    p.add_argument("--tp", default="2,4", help="comma-separated TP sizes (> 1)")
    p.add_argument("--seq", type=int, default=256, help="sequence length s")
    p.add_argument("--batch", type=int, default=2, help="micro-batch b")
    p.add_argument("--hidden", type=int, default=256, help="hidden size h")
    p.add_argument("--heads", type=int, default=8, help="attention heads")
    p.add_argument("--kv-heads", type=int, default=None, help="llama key/value heads (default: --heads)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--verbose", action="store_true", help="per-op breakdown (calls x bytes per call) of every row")
    return p.parse_args(argv)


def model_config(args: argparse.Namespace, arch: str) -> ModelConfig:
    """A finalized ModelConfig of ``arch`` from the flags (derived sizes from the config loader)."""
    overrides = ["data.paths=[unused-by-the-benchmark]", "tokenizer.type=byte", f"model.arch={arch}",
                 f"model.hidden_size={args.hidden}", f"model.num_heads={args.heads}", f"model.seq_length={args.seq}"]
    if arch == "llama" and args.kv_heads is not None:
        overrides.append(f"model.num_kv_heads={args.kv_heads}")
    cfg = config.load(overrides=overrides)
    config.set_vocab(cfg, 256)
    return cfg.model


def build_layer(cfg: ModelConfig, tp: TensorParallel, seed: int) -> TransformerLayer:
    """Layer 0 of a GPTModel with this rank's shards of the model's initial weights (the model's own init)."""
    stage = GPTModel(cfg, seed, layer_range=range(1), pre_process=False, post_process=False, tp=tp)
    return stage.layers["0"].train()


# ------------------------------------------------------------------------------------------------ theory


def theory(t: int, sp: bool, recompute_allgather: bool) -> dict[str, dict[str, int]]:
    """``{phase: {op: calls}}`` of Megatron's layer (see the module docstring); every call moves N elements."""
    if not sp:
        return {"forward": {"all_reduce": 2}, "backward": {"all_reduce": 2}}
    return {"forward": {"all_gather": 2, "reduce_scatter": 2},
            "backward": {"reduce_scatter": 2, "all_gather": 4 if recompute_allgather else 2}}


def structural_differences(cfg: ModelConfig, t: int, sp: bool, recompute_allgather: bool) -> list[dict[str, Any]]:
    """How this layer's collectives differ from the theory, from its structure: ``{phase, op, calls, why}``."""
    out = []
    # llama's gate and up run as one column-parallel matmul on their concatenated weights (one gather).
    if sp and recompute_allgather and cfg.num_kv_heads % t:
        out.append({"phase": "backward", "op": "all_gather", "calls": -1,
                    "why": "QKV is replicated per kv group (t > num_kv_heads: ReplicatedGroupQKV); it gathers with "
                           "gather_from_sp and keeps the gathered input, so it does not gather again in backward"})
    return out


# ------------------------------------------------------------------------------------------------ measuring


def measure(args: argparse.Namespace, cfg: ModelConfig, tp: TensorParallel) -> dict[str, Any]:
    """Collectives of one forward and one backward of one layer on this rank."""
    layer = build_layer(cfg, tp, args.seed)
    sp = tp.sequence_parallel and tp.size > 1
    s, b, h = args.seq, args.batch, args.hidden
    gen = torch.Generator().manual_seed(args.seed + tp.rank)
    x = torch.randn(s // tp.size if sp else s, b, h, generator=gen).requires_grad_()  # [s/t, b, h] or [s, b, h]
    cos, sin = RotaryEmbedding(rotary_dim(cfg), cfg.rotary_base)(None, s, x.device, torch.float32, torch.float32)
    with comm.count() as fwd:
        y = layer(x, cos, sin)
    grad = torch.randn(y.shape, generator=gen)
    with comm.count() as bwd:
        y.backward(grad)
    return {"forward": fwd.summary(), "backward": bwd.summary()}


def rank_rows(rank: int, world_size: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every (arch, sp, recompute_allgather) row for TP size ``world_size``, on this rank."""
    import torch.distributed as dist

    tracker = get_tracker()
    init_rng(tracker, args.seed, rank, 0)
    rows = []
    for arch in args.arch.split(","):
        cfg = model_config(args, arch)
        for sp in (False, True):
            for recompute_allgather in (False, True):
                tp = TensorParallel(group=dist.group.WORLD, size=world_size, rank=rank, sequence_parallel=sp,
                                    recompute_allgather=recompute_allgather, tracker=tracker)
                rows.append({"arch": arch, "tp": world_size, "sp": sp, "recompute_allgather": recompute_allgather,
                             **measure(args, cfg, tp)})
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


# ------------------------------------------------------------------------------------------------ report


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
    print(json.dumps({"bench": "comm_volume", "torch": torch.__version__, "config": vars(args), "rows": slim}))


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Measure every row and print the report; returns the rows."""
    args = parse_args(argv)
    sizes = [int(t) for t in args.tp.split(",")]
    for t in sizes:
        if t < 2 or args.heads % t or args.seq % t:
            raise SystemExit(f"--tp {t}: needs t > 1 dividing heads ({args.heads}) and seq ({args.seq})")
    rows: list[dict[str, Any]] = []
    for t in sizes:
        rows += run_distributed(rank_rows, t, args=args)[0]  # rank 0's numbers
    rows = [finish_row(args, r) for r in rows]
    print_report(args, rows)
    return rows


if __name__ == "__main__":
    main()
