#!/usr/bin/env python
"""Plan a layout: per-rank memory and communication of a config, and the (tp, pp, cp, dp) layouts that fit.

    python tools/plan.py --conf configs/410M.yml --devices 64 --memory 80GB
    python tools/plan.py --conf configs/410M.yml --devices 64 --memory 40GiB --vocab 50277 --device cuda \\
        model.recompute=selective --peak-tflops 312 --bandwidth 100
    python tools/plan.py --conf configs/demo.yml --devices 2
    python tools/plan.py --conf configs/demo.yml --verify parallel.dp=1 parallel.tp=2 parallel.sequence_parallel=true

Prints the device modelled, a layout per rank (the config's own when its world size is --devices, else the
best-ranked layout that fits, named), then every tp·pp·cp·dp = --devices layout the config loader accepts, each
with the first ZeRO / recompute / micro-batch setting that fits, fitting and fastest first, the config's own
marked; --verify measures the config on CPU gloo ranks. Overrides are bare ``key=value`` as for train.py.
See docs/planner.md.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
from collections import Counter
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if importlib.util.find_spec("megatron_sp") is None:  # run from a checkout without installing the package
    sys.path.insert(0, str(HERE.parent))
if str(HERE) not in sys.path:  # the planner package beside this script (also for --verify's ranks)
    sys.path.insert(0, str(HERE))

import planner as plan  # noqa: E402
from planner.layouts import ranking_peak  # noqa: E402
from megatron_sp import config as config_mod  # noqa: E402
from megatron_sp.config import Config  # noqa: E402
from megatron_sp.errors import OneLineArgumentParser, UserError  # noqa: E402

GOAL = 0.10  # --verify: |measured / predicted − 1| above this is flagged
MAX_DEVICES = 2**20  # a million devices: past the largest clusters, and the layout search stays under a minute


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = OneLineArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conf", action="append", default=[], required=True, metavar="FILE",
                   help="config file (YAML/JSON); repeat to merge, later wins")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="dotted config overrides as for train.py, e.g. model.num_layers=2 parallel.tp=2")
    p.add_argument("--set", action="append", nargs="+", default=[], metavar="KEY=VALUE",
                   help="deprecated: the same overrides after --set")
    p.add_argument("--devices", type=int, metavar="N", help="devices to lay out (tp·pp·cp·dp = N)")
    p.add_argument("--memory", metavar="SIZE",
                   help="memory per device: 80GB, 80GiB, 512MB, ... (default: on GPU this host's device's, on CPU this "
                        "host's available memory shared by the --devices ranks)")
    p.add_argument("--vocab", type=int, metavar="N",
                   help="vocabulary size (default: model.vocab_size, else the tokenizer's, else tokenizer.vocab_size)")
    p.add_argument("--device", choices=("cpu", "cuda"),
                   help="kernels (and, unless --peak-tflops, peak) to model (default: parallel.device): cuda = fused "
                        "attention, 1-byte dropout masks; cpu = this host's measured peak")
    p.add_argument("--peak-tflops", type=float, metavar="T",
                   help="per-device peak for the ranking (default: logging.peak_tflops, else on CPU this host's "
                        f"measured matmul peak, as train.py's MFU takes it, else {plan.DEFAULT_PEAK_TFLOPS:g})")
    p.add_argument("--bandwidth", type=float, default=plan.DEFAULT_BANDWIDTH_GBS, metavar="GB/s",
                   help="per-rank communication bandwidth for the ranking (default: %(default)g GB/s)")
    p.add_argument("--bucket-bytes", type=int, default=plan.DEFAULT_BUCKET_BYTES, metavar="B",
                   help="DistributedOptimizer bucket_bytes (default: %(default)d)")
    p.add_argument("--top", type=int, default=15, metavar="K", help="layouts shown in the table (default: %(default)s)")
    p.add_argument("--verify", action="store_true",
                   help="run the config for a few steps on CPU gloo ranks and print measured beside predicted")
    p.add_argument("--steps", type=int, default=2, metavar="N", help="--verify: training steps (default: %(default)s)")
    p.add_argument("--json", nargs="?", const="-", metavar="FILE",
                   help="also print the whole report (every layout, every stage) as one JSON line, or write it to FILE")
    args = p.parse_intermixed_args(argv)
    args.set = [item for group in args.set for item in group] + args.overrides
    if not args.verify and args.devices is None:
        p.error("--devices is required (or use --verify)")
    if args.devices is not None and not 1 <= args.devices <= MAX_DEVICES:
        p.error(f"--devices must be in 1..{MAX_DEVICES}, got {args.devices}")
    if args.memory is not None and (args.devices is None):
        p.error("--memory needs --devices")
    if args.vocab is not None and args.vocab < 1:
        p.error(f"--vocab must be >= 1, got {args.vocab}")
    if args.steps < 1 or args.top < 1 or args.bandwidth <= 0 or (args.peak_tflops is not None and args.peak_tflops <= 0):
        p.error("--steps, --top, --bandwidth and --peak-tflops must be positive")
    return args


def resolve_vocab(cfg: Config, given: int | None) -> tuple[int, str]:
    """The vocabulary size to plan with, and where it came from (``--vocab``, else as the pre-flight takes it)."""
    if given:
        return given, "--vocab"
    vocab, source = plan.plan_vocab(cfg)
    return vocab, source + ("; pass --vocab N" if source.endswith("no tokenizer file yet") else "")


def load_config(args: argparse.Namespace, extra: list[str], vocab: int | None) -> Config:
    """The finalized config of --conf + overrides + ``extra`` overrides (+ --device), vocabulary set."""
    device = [f"parallel.device={args.device}", "parallel.backend=none"] if args.device else []
    cfg = config_mod.load(args.conf, [*args.set, *device, *extra])
    if vocab is not None:
        config_mod.set_vocab(cfg, vocab)
    return cfg


B = plan.format_bytes


def describe(cfg: Config, vocab_source: str) -> list[str]:
    m, p, t = cfg.model, cfg.parallel, cfg.train
    D = plan.dims_of(cfg)
    kv = f", {m.num_kv_heads} kv heads" if m.num_kv_heads != m.num_heads else ""
    cp = f" ({p.cp_algo}{f', ulysses {p.cp_ulysses}' if p.cp_algo == 'usp' else ''})" if p.cp > 1 else ""
    sched = p.pp_schedule + (f", {p.virtual_stages} virtual stages" if p.virtual_stages > 1 else "")
    zero3 = f" (prefetch {p.zero3_prefetch})" if p.zero == 3 else ""
    lines = [f"model: {m.arch}, {m.num_layers} layers, hidden {m.hidden_size}, {m.num_heads} heads{kv}, ffn "
             f"{m.ffn_hidden_size}, seq {m.seq_length}, vocab {m.vocab_size} padded to {m.padded_vocab_size} "
             f"({vocab_source})",
             f"layout: tp {p.tp}{' + SP' if D.sp else ''}, pp {p.pp} ({sched}), cp {p.cp}{cp}, dp {p.dp} = world "
             f"{p.world_size}; {t.precision}, ZeRO-{p.zero}{zero3}, recompute {m.recompute}, micro-batch {t.micro_batch_size}"
             f" × {t.grad_accum_steps} per rank per step (global batch {t.global_batch_size}); kernels: "
             f"{D.device}, attention {plan.attention_kernel(D)}"]
    if D.experts:
        moe = plan.moe_layers_of(cfg, range(m.num_layers))
        shared = f", shared experts of width {D.shared_ffn}" if D.shared_ffn else ""
        etp = f", each split over expert_tp {D.etp} (ffn {D.expert_local_ffn} per TP rank)" if D.etp > 1 else ""
        lines.append(f"experts: {moe} of {m.num_layers} layers MoE, {D.experts} experts of ffn {D.moe_ffn}, top-{D.top_k}"
                     f"{shared}; ep {D.ep} ({D.experts // D.ep} experts per rank{etp}) × edp {D.edp} over the "
                     f"{plan.expert_fold(cfg)} ranks they fold over (dropless, balanced routing assumed)")
    return lines


def print_breakdown(lp: plan.LayoutPlan, memory: int | None) -> None:
    D = lp.dims
    shown = [lp.stages[r] for r in (range(D.pp) if D.pp <= 4 else (0, 1, D.pp - 2, D.pp - 1))]
    width = 14
    header = "".join(f"{f'stage {r.pp_rank}':>{width}}" for r in shown)
    master = " + fp32 master" if D.precision != "fp32" else ""
    shard = f", ZeRO-{D.zero} /{D.dp_cp}" if D.zero and D.dp_cp > 1 else ""
    shard += f", experts /{D.edp}" if shard and D.ep > 1 else ""
    rows: list[tuple[str, list[str]]] = [
        (f"parameters ({D.precision}{f' /{D.dp_cp}' if D.zero == 3 and D.dp_cp > 1 else ''})", [B(r.state.params) for r in shown]),
        (f"gradients (fp32 main grads{f' /{D.dp_cp}' if D.zero >= 2 and D.dp_cp > 1 else ''})", [B(r.state.grads) for r in shown]),
        (f"optimizer ({'Muon m + ' if lp.cfg.train.optimizer == 'muon' else ''}Adam m,v fp32{master}{shard})",
         [B(r.state.optim) for r in shown]),
        ("activations / micro-batch", [B(r.per_micro_batch) for r in shown]),
        ("  micro-batches in flight", [f"{r.schedule.in_flight_micro_batches:g}" for r in shown]),
        ("activations at peak (schedule)", [B(r.activations) for r in shown]),
    ]
    names = list(dict.fromkeys(k for r in shown for k in r.buffers))
    rows += [(name, [B(r.buffers.get(name, 0)) for r in shown]) for name in names]
    rows.append(("total", [B(r.total) for r in shown]))
    print(f"\n{'memory per rank':<41}{header}")
    for label, values in rows:
        print(f"  {label:<39}" + "".join(f"{v:>{width}}" for v in values))
    first = lp.stages[0]
    pad_rows = D.padded_vocab - D.vocab
    print(f"  (stage 0: {first.state.param_elements:,} parameters incl. {first.state.vocab_tables} vocabulary table(s) "
          f"padded by {pad_rows} rows ({B(first.state.vocab_tables * pad_rows * D.h // D.tp * D.e)}), + "
          f"{first.state.padded_elements - first.state.param_elements:,} bucket padding; in flight by the schedule "
          f"table, Megatron's count {plan.megatron_in_flight(D, 0):g})")
    print(f"  {kv_cache_line(lp, [r.pp_rank for r in shown])}")
    if memory is not None:
        worst = lp.worst
        verdict = "fits" if worst.total <= memory else "does NOT fit"
        print(f"  worst rank: stage {worst.pp_rank}, {B(worst.total)} of {B(memory)}: {verdict}")
    print(f"\n{'communication per step per rank (bytes sent)':<43}{header}")
    dims = {"tp": "TP", "cp": "CP", "pp": "PP p2p", "ep": "EP dispatch", "dp": "DP grads/params",
            "edp": "EDP expert grads/params", "other": "scalars"}
    for dim, label in dims.items():
        ops = sorted({op for r in shown for op in r.comm.get(dim, {})})
        for op in ops:
            print(f"  {label + ' ' + op:<43}" + "".join(f"{B(r.comm.get(dim, {}).get(op, 0)):>{width}}" for r in shown))
    if first.state.muon_flops:  # each weight's owner: balanced over dp·cp (the TP ranks of an owner compute alike)
        print(f"  {'Muon Newton–Schulz GFLOP / step (owner share)':<43}"
              + "".join(f"{r.state.muon_flops / D.dp_cp / 1e9:>{width}.2f}" for r in shown))
    chunk = first.chunks[0]
    dense = chunk.layers - chunk.moe_layers
    print(f"\none layer's activations per micro-batch (stage 0, {chunk.layers} layers on its first chunk"
          f"{f', {dense} dense' if chunk.moe_layers else ''}):")
    for name, value in chunk.per_layer.items():
        print(f"  {name:<39}{B(value):>{width}}")
    ours = sum(chunk.per_layer.values())
    paper, fused = plan.table2_layer_bytes(D), plan.table2_layer_bytes(D, scores=False)
    table2 = f"{B(paper)} (ratio {ours / paper:.2f})"
    if fused != paper:
        table2 += f", {B(fused)} without its 5as/h score term (ratio {ours / fused:.2f})"
    print(f"  {'sum (this model)':<39}{B(ours):>{width}}   Table 2: {table2}")
    if chunk.moe_layers:
        print(f"a MoE layer's ({chunk.moe_layers} on that chunk) MLP in place of the dense one (dropless, balanced):")
        for name, value in plan.moe_terms(D).items():
            print(f"  {name:<39}{B(value):>{width}}")
        print(f"  {'sum (the whole MoE layer)':<39}{B(sum(chunk.moe_per_layer.values())):>{width}}")
    extras = {k: v for c in first.chunks for k, v in {**c.extra, **c.shared}.items()}
    if extras:
        print("  outside the layers: " + ", ".join(f"{k} {B(v)}" for k, v in extras.items()))


def kv_cache_line(lp: plan.LayoutPlan, stages: list[int]) -> str:
    """The decode KV cache per token of one sequence (``planner.kv_cache_bytes_per_token``): all layers, and per
    pipeline stage of ``stages`` when pp > 1."""
    m, D = lp.cfg.model, lp.dims
    what = f"MLA: kv_lora_rank {m.kv_lora_rank} + qk_rope_head_dim {m.qk_rope_head_dim}" if m.kv_lora_rank else \
        f"k and v: 2 · {m.num_kv_heads} kv heads · head_dim {D.head_dim}"
    layers = {r: sum(len(c) for c in plan.stage_layers(lp.cfg, r)) for r in stages}
    per_stage = "; " + ", ".join(f"stage {r} {B(plan.kv_cache_bytes_per_token(m, D.e, n))}" for r, n in layers.items())
    return (f"decode KV cache (generation, not in the total): {B(plan.kv_cache_bytes_per_token(m, D.e))} per token per "
            f"sequence = {m.num_layers} layers × {plan.kv_cache_bytes_per_token(m, 1, 1)} values ({what}) × {D.e} B"
            f"{per_stage if D.pp > 1 else ''}")


def config_mark(layout: tuple[int, int, int, int], own: tuple[int, int, int, int]) -> str:
    """``*`` on the config's own layout, ``+`` on its tp, pp, cp at another dp (another device count)."""
    return "*" if layout == own else "+" if layout[:3] == own[:3] else ""


def config_note(cands: list[plan.Candidate], own: tuple[int, int, int, int]) -> str:
    """What the table's mark means, or why the config's layout is not in the table."""
    tp, pp, cp, dp = own
    devices = math.prod(cands[0].layout)
    same = next((c for c in cands if c.layout[:3] == own[:3]), None)
    if same is None:
        return f"the config's tp·pp·cp = {tp * pp * cp} does not divide {devices} devices: none of these is its layout"
    if same.plan is None:
        return f"the config's tp {tp}, pp {pp}, cp {cp} at {devices} devices is refused: {same.error.split(';')[0]}"
    if same.layout == own:
        return "* = the config's layout"
    return f"+ = the config's tp {tp}, pp {pp}, cp {cp} at dp {same.layout[3]} (the config: dp {dp}, world {tp * pp * cp * dp})"


def default_memory(cfg: Config, devices: int) -> tuple[int, str]:
    """Memory per device when --memory is not given, and what it is: on GPU (the modelled device) this host's
    device's, on CPU this host's available memory shared by the ``devices`` ranks (as train.py starts them)."""
    from megatron_sp import device as device_mod

    if cfg.parallel.device == "cuda":
        memory = device_mod.accelerator_memory_bytes()
        if memory <= 0:
            raise config_mod.loader.ConfigError("no GPU here to take the memory from: give --memory SIZE")
        return memory, "this host's GPU memory"
    memory = device_mod.host_memory_available() // devices
    if memory <= 0:
        raise config_mod.loader.ConfigError("this host does not say its available memory: give --memory SIZE")
    return memory, f"this host's available memory / {devices} rank{'s' if devices > 1 else ''}"


def print_layouts(cands: list[plan.Candidate], top: int, memory: int, own: tuple[int, int, int, int] | None = None,
                  efficiency: float = 1.0) -> None:
    """The ranking table; ``own`` (the config's tp, pp, cp, dp) is marked, and shown below the table when ranked lower."""
    valid = [c for c in cands if c.plan is not None]
    fits = [c for c in valid if c.fits]
    refused = [c for c in cands if c.plan is None]
    print(f"\nlayouts: {len(cands)} of tp·pp·cp·dp; {len(refused)} refused by the config checks, {len(valid)} valid, "
          f"{len(fits)} fit in {B(memory)}")
    print(f"  {'#':>3} {'tp':>3} {'pp':>3} {'cp':>3} {'dp':>4} {'peak/rank':>11} {'fits':>5} {'step s':>9} {'tokens/s':>11} "
          f"{'MFU':>6} {'bubble':>7} {'comm/step':>11} {'zero':>4} {'recompute':>9} {'mbs':>4} config")

    def row(i: int, c: plan.Candidate) -> None:
        assert c.plan is not None
        t = c.plan.time
        comm = max(r.comm_bytes() for r in c.plan.stages)
        mark = config_mark(c.layout, own) if own else ""
        D = c.plan.dims
        print(f"  {i:>3} {c.layout[0]:>3} {c.layout[1]:>3} {c.layout[2]:>3} {c.layout[3]:>4} {B(c.plan.peak_bytes):>11} "
              f"{'yes' if c.fits else 'no':>5} {t['step_s']:>9.3f} {t['tokens_per_s']:>11,.0f} {100 * t['mfu']:>5.1f}% "
              f"{100 * t['bubble']:>6.1f}% {B(comm):>11} {D.zero:>4} {D.recompute:>9} {D.micro_batch:>4} {mark}".rstrip())
    for i, c in enumerate(valid[:top], 1):
        row(i, c)
    if len(valid) > top:
        print(f"  ... {len(valid) - top} more")
    mine = [(i, c) for i, c in enumerate(valid, 1) if own and config_mark(c.layout, own)]
    if mine and mine[0][0] > top:
        row(*mine[0])
    if own and cands:
        print(f"  ({config_note(cands, own)})")
    print(f"  (step time, tokens/s and MFU take every FLOP at {100 * efficiency:.0f} % of the peak, the achievable MFU "
          "assumed (docs/planner.md; small models reach less), and every byte at the bandwidth: they rank layouts; "
          "zero, recompute, mbs: the first setting that fits, from none/the config's micro-batch up)")
    for reason, n in Counter(c.error.split(";")[0] for c in refused).most_common(4):
        print(f"  refused ×{n}: {reason}")


def plan_json(lp: plan.LayoutPlan) -> dict[str, Any]:
    moe = {"ep": lp.dims.ep, "expert_tp": lp.dims.etp} if lp.dims.experts else {}
    return {"layout": dict(zip(("tp", "pp", "cp", "dp"), lp.layout, strict=True)) | moe,
            "peak_bytes": lp.peak_bytes, "kv_cache_bytes_per_token": plan.kv_cache_bytes_per_token(lp.cfg.model, lp.dims.e),
            "stages": [{"pp_rank": r.pp_rank, "params": r.state.params, "grads": r.state.grads, "optim": r.state.optim,
                        "activations_per_micro_batch": r.per_micro_batch, "in_flight": r.schedule.in_flight,
                        "activations_peak": r.activations, "buffers": r.buffers, "total": r.total, "comm": r.comm}
                       for r in lp.stages], **({"time": lp.time} if lp.time else {})}


def layout_json(c: plan.Candidate) -> dict[str, Any]:
    """One ranked layout, compact: degrees, fit, worst rank's bytes, time estimate, bytes sent by the busiest rank."""
    assert c.plan is not None
    D = c.plan.dims
    return {**dict(zip(("tp", "pp", "cp", "dp"), c.layout, strict=True)), "zero": D.zero, "recompute": D.recompute,
            "micro_batch_size": D.micro_batch, "fits": c.fits, "peak_bytes": c.plan.peak_bytes,
            **c.plan.time, "comm_bytes": max(r.comm_bytes() for r in c.plan.stages)}


def print_verify(rows: list[dict[str, Any]]) -> None:
    print(f"\n--verify: measured on CPU gloo ranks (largest over each stage's ranks) beside predicted; goal within "
          f"{100 * GOAL:.0f}%")
    print(f"  {'stage':>5} {'quantity':<34} {'predicted':>14} {'measured':>14} {'ratio':>7}")
    for r in rows:
        fmt = (lambda v: f"{v:g}") if r["quantity"] == "micro-batches in flight" else (lambda v: f"{v:,.0f}")
        flag = "  *" if abs(r["ratio"] - 1) > GOAL else ""
        print(f"  {r['stage']:>5} {r['quantity']:<34} {fmt(r['predicted']):>14} {fmt(r['measured']):>14} "
              f"{r['ratio']:>7.3f}{flag}")
    off = [r for r in rows if abs(r["ratio"] - 1) > GOAL]
    print(f"  {len(rows) - len(off)} of {len(rows)} within {100 * GOAL:.0f}%" + ("" if not off else "; * = outside"))


def device_line(args: argparse.Namespace, cfg: Config) -> str:
    """Which device's kernels (and, unless given, peak) the plan models, and why."""
    device = cfg.parallel.device
    if args.device:
        return f"device modelled: {device} (--device {args.device})"
    own = config_mod.load(args.conf, args.set, finalize_config=False).parallel.device
    why = "parallel.device of the config" if own else "parallel.device unset: " + (
        "a GPU is visible here" if device == "cuda" else "no GPU visible here")
    return f"device modelled: {device} ({why}); --device cpu|cuda models the other one's kernels and peak"


def breakdown_layout(own: plan.LayoutPlan, cands: list[plan.Candidate], devices: int) -> tuple[plan.LayoutPlan | None, str]:
    """The layout whose breakdown to print, and a line saying which it is: the config's own when its world size is
    ``devices``, else the best-ranked layout of ``devices`` that fits (else the best-ranked valid one)."""
    t, pp, cp, dp = own.layout
    if own.dims.world == devices:
        return own, f"the config's layout (tp {t}, pp {pp}, cp {cp}, dp {dp} = {devices} devices):"
    mine = f"the config's own layout, tp {t}·pp {pp}·cp {cp}·dp {dp}, has {own.dims.world} ranks, not {devices}"
    valid = [c for c in cands if c.plan is not None]
    best = next((c for c in valid if c.fits), valid[0] if valid else None)
    if best is None or best.plan is None:
        return None, f"no layout: every layout of {devices} devices is refused by the config checks ({mine})"
    layout = ", ".join(f"{k} {v}" for k, v in zip(("tp", "pp", "cp", "dp"), best.layout, strict=True))
    rank = "the best-ranked layout that fits" if best.fits else "the best-ranked layout (none fits)"
    return best.plan, f"{layout}: {rank} at --devices {devices} ({mine})"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        report: dict[str, Any] = {"tool": "plan"}
        if args.verify:
            lp, rows = plan.run_verify(args.conf, args.set, args.steps, args.bucket_bytes)
            print("\n".join(describe(lp.cfg, "tokenizer")))
            print_breakdown(lp, None)
            print_verify(rows)
            report |= {"config_layout": plan_json(lp), "verify": rows}
        if args.devices is not None:
            base = load_config(args, [], None)
            memory, memory_source = (plan.parse_memory(args.memory), "--memory") if args.memory else \
                default_memory(base, args.devices)
            vocab, source = resolve_vocab(base, args.vocab)
            config_mod.set_vocab(base, vocab)
            cpu = base.parallel.device != "cuda"
            peak, peak_source = ranking_peak(base, args.peak_tflops, args.devices if cpu else 1)
            efficiency = plan.ACHIEVABLE_MFU["cpu" if cpu else "cuda"]
            own = plan.plan_layout(base, args.bucket_bytes)
            own.time = plan.estimate_step_time(own, peak, args.bandwidth, efficiency)
            cands = plan.search(lambda extra: load_config(args, extra, vocab), base, args.devices, memory, peak,
                                args.bandwidth, args.bucket_bytes, efficiency=efficiency, knobs=True)
            if not args.verify:
                print("\n".join(describe(base, source)))
                print(device_line(args, base))
                shown, why = breakdown_layout(own, cands, args.devices)
                print(f"\nbreakdown of {why}")
                if shown is not None:
                    if shown is not own:
                        print(describe(shown.cfg, source)[1])
                    print_breakdown(shown, memory)
                report["config_layout"] = plan_json(own)
                report["breakdown_layout"] = {**dict(zip(("tp", "pp", "cp", "dp"), shown.layout, strict=True)),
                                              "why": why} if shown is not None else None
            print(f"\nranking: estimated step time = busiest stage's FLOPs at {100 * efficiency:.0f} % of the peak ÷ "
                  f"(1 − bubble) + exposed communication at {args.bandwidth:g} GB/s (docs/planner.md)\n"
                  f"peak per device: {peak:.4g} TFLOP/s ({peak_source}{'' if args.peak_tflops else '; --peak-tflops sets it'})"
                  f"\nmemory per device: {B(memory)} ({memory_source})")
            print_layouts(cands, args.top, memory, own.layout, efficiency)
            report |= {"devices": args.devices, "memory_bytes": memory, "memory_source": memory_source,
                       "efficiency": efficiency, "peak_tflops": peak, "peak_source": peak_source,
                       "bandwidth_gbs": args.bandwidth, "vocab": vocab,
                       "layouts": [{**layout_json(c), "config": config_mark(c.layout, own.layout)}
                                   for c in cands if c.plan is not None],
                       "refused": [{"layout": c.layout, "error": c.error} for c in cands if c.plan is None]}
        if args.json == "-":
            print(json.dumps(report, default=float))
        elif args.json:
            try:
                Path(args.json).write_text(json.dumps(report, default=float) + "\n")
            except OSError as exc:
                print(f"error: --json {args.json}: {exc.strerror or exc}", file=sys.stderr)
                return 2
            print(f"\nJSON report written to {args.json}")
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
