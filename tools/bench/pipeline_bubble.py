"""Measured idle fraction of each pipeline stage under 1F1B, against the bubble theory (p−1)/(m+p−1).

For each pp = p (world = p gloo ranks, one thread each, tp = dp = 1) and each micro-batch count m,
every rank builds its stage of one GPT (``build_stage``) and runs full steps of
``forward_backward(..., "1f1b")``. The benchmark (only) instruments the stage's compute:

* forward: ``stage.forward`` is wrapped (instance attribute), and on the last stage ``loss_fn``;
* backward: ``torch.autograd.backward`` is wrapped in the rank process (``Tensor.backward``, which
  the last stage uses, goes through it too).

Each wrapped call records a busy interval (wall clock ``perf_counter``, system-wide on Linux, so
intervals of different ranks share one time axis, plus this thread's CPU time). A step starts
after a barrier; its window is [earliest start, latest end] over the ranks, and stage r's idle
fraction is ``1 − busy_r / window``: everything that is not compute (waiting for a neighbour and
the point-to-point copies themselves). The first ``--warmup`` steps are dropped; the median over
the other ``--steps`` is reported. The trace of ``ScheduleStats`` is checked against the intervals
(m forwards and m backwards per stage per step).

Theory (ALGORITHMS.md, "Pipeline bubble"): with equal per-stage forward/backward times and free
communication a 1F1B step lasts (m+p−1)·(t_f+t_b) and every stage computes m·(t_f+t_b) of it, so
every stage idles (p−1)/(m+p−1). Interleaved (p−1)/(v·m) and zero-bubble schedules are not
implemented in ``megatron_sp.pipeline`` and are not measured.

CPU note: the ranks share the machine's cores. With p ranks on fewer than p cores, compute
intervals that overlap in time are time-sliced, so a busy interval's wall time includes time the
rank was descheduled; ``cpu/wall`` (CPU time ÷ wall time inside the busy intervals) shows it
(≈ 1 when each rank has its own core).

Run from the repo root:  python tools/bench/pipeline_bubble.py [--pp 2,4] [--micro 4,8,16]
Prints a table and notes, then one JSON line with every number.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

try:
    import megatron_sp  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_sp import config
from megatron_sp.config.schema import ModelConfig
from megatron_sp.model.transformer import TensorParallel
from megatron_sp.mpu import ParallelDims, initialize
from megatron_sp.pipeline import ScheduleStats, build_stage, forward_backward
from megatron_sp.testing import run_distributed

VOCAB = 256  # byte tokenizer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pp", default="2,4", help="comma-separated pipeline sizes (world = pp)")
    p.add_argument("--micro", default="4,8,16", help="comma-separated micro-batch counts m (each >= pp)")
    p.add_argument("--arch", default="neox", help="neox or llama")
    p.add_argument("--layers", type=int, default=8, help="transformer layers (divisible by every pp)")
    p.add_argument("--hidden", type=int, default=256, help="hidden size h")
    p.add_argument("--heads", type=int, default=8, help="attention heads")
    p.add_argument("--seq", type=int, default=128, help="sequence length s")
    p.add_argument("--batch", type=int, default=2, help="micro-batch size b")
    p.add_argument("--warmup", type=int, default=1, help="steps dropped per (pp, m)")
    p.add_argument("--steps", type=int, default=3, help="steps measured per (pp, m); the median is reported")
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args(argv)


def model_config(args: argparse.Namespace) -> ModelConfig:
    """A finalized ModelConfig from the flags (derived sizes from the config loader)."""
    overrides = ["data.paths=[unused-by-the-benchmark]", "tokenizer.type=byte", f"model.arch={args.arch}",
                 f"model.num_layers={args.layers}", f"model.hidden_size={args.hidden}",
                 f"model.num_heads={args.heads}", f"model.seq_length={args.seq}"]
    cfg = config.load(overrides=overrides)
    config.set_vocab(cfg, VOCAB)
    return cfg.model


def micro_batches(args: argparse.Namespace, m: int) -> list[dict[str, torch.Tensor]]:
    """``m`` random micro-batches ``[b, s]`` (the same on every rank: one generator seed)."""
    g = torch.Generator().manual_seed(args.seed + m)
    pos = torch.arange(args.seq).unsqueeze(0).repeat(args.batch, 1)
    return [{"tokens": torch.randint(0, VOCAB, (args.batch, args.seq), generator=g),
             "labels": torch.randint(0, VOCAB, (args.batch, args.seq), generator=g),
             "loss_mask": torch.ones(args.batch, args.seq), "position_ids": pos} for _ in range(m)]


# ------------------------------------------------------------------------------------------------ measuring


class BusyRecorder:
    """Busy intervals ``(kind, wall_start, wall_end, cpu_seconds)`` of the wrapped compute calls."""

    def __init__(self) -> None:
        self.intervals: list[tuple[str, float, float, float]] = []
        self._depth = 0

    def wrap(self, kind: str, fn: Any) -> Any:
        def timed(*a: Any, **kw: Any) -> Any:
            if self._depth:  # nested call of a wrapped function: the outer interval covers it
                return fn(*a, **kw)
            self._depth += 1
            c0, t0 = time.thread_time(), time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                t1, c1 = time.perf_counter(), time.thread_time()
                self._depth -= 1
                self.intervals.append((kind, t0, t1, c1 - c0))
        return timed


def rank_run(rank: int, world_size: int, args: argparse.Namespace, micros: list[int]) -> list[dict[str, Any]]:
    """Every m on this rank: per measured step its window ends, busy intervals and event counts."""
    import torch.distributed as dist

    state = initialize(ParallelDims(pp=world_size))
    cfg = model_config(args)
    stage = build_stage(cfg, args.seed, state, TensorParallel(group=state.tp_group, size=1, rank=0)).train()
    rec = BusyRecorder()
    stage.forward = rec.wrap("F", stage.forward)  # instance attribute: nn.Module.__call__ finds it
    real_backward = torch.autograd.backward
    torch.autograd.backward = rec.wrap("B", real_backward)
    out = []
    try:
        for m in micros:
            mbs = micro_batches(args, m)
            tokens = float(sum(mb["loss_mask"].sum() for mb in mbs))
            loss_fn = rec.wrap("F", lambda t, mb, tokens=tokens: (t.float() * mb["loss_mask"]).sum() / tokens)
            steps = []
            for step in range(args.warmup + args.steps):
                for p in stage.parameters():
                    if p.grad is not None:
                        p.grad.zero_()
                rec.intervals = []
                stats = ScheduleStats()
                dist.barrier()
                t0 = time.perf_counter()
                forward_backward(stage, mbs, state, loss_fn, "1f1b", stats=stats)
                t1 = time.perf_counter()
                if step < args.warmup:
                    continue
                f_events = sum(1 for e in stats.events if e[0] == "F")
                b_events = sum(1 for e in stats.events if e[0] == "B")
                b_calls = sum(1 for k, *_ in rec.intervals if k == "B")
                if not (f_events == b_events == b_calls == m):
                    raise RuntimeError(f"rank {rank} m={m}: trace has {f_events} F / {b_events} B events and "
                                       f"{b_calls} timed backward calls, expected {m} each")
                steps.append({"t0": t0, "t1": t1, "intervals": list(rec.intervals)})
            out.append({"m": m, "steps": steps})
    finally:
        torch.autograd.backward = real_backward
    return out


# ------------------------------------------------------------------------------------------------ analysis


def theory(p: int, m: int) -> float:
    """1F1B bubble fraction (ALGORITHMS.md)."""
    return (p - 1) / (m + p - 1)


def analyse(p: int, m: int, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-stage idle fractions (median over steps) and the step's timings for one (p, m)."""
    n_steps = len(per_rank[0]["steps"])
    idle = [[] for _ in range(p)]
    walls, cpu, busy_wall = [], 0.0, 0.0
    f_ms = [[] for _ in range(p)]
    b_ms = [[] for _ in range(p)]
    for k in range(n_steps):
        steps = [per_rank[r]["steps"][k] for r in range(p)]
        window = max(s["t1"] for s in steps) - min(s["t0"] for s in steps)
        walls.append(window)
        for r, s in enumerate(steps):
            busy = sum(t1 - t0 for _, t0, t1, _ in s["intervals"])
            idle[r].append(1.0 - busy / window)
            cpu += sum(c for *_, c in s["intervals"])
            busy_wall += busy
            f_ms[r].append(1e3 * sum(t1 - t0 for kind, t0, t1, _ in s["intervals"] if kind == "F") / m)
            b_ms[r].append(1e3 * sum(t1 - t0 for kind, t0, t1, _ in s["intervals"] if kind == "B") / m)
    stage_idle = [statistics.median(v) for v in idle]
    mean_idle = statistics.fmean(stage_idle)
    th = theory(p, m)
    return {"pp": p, "m": m, "theory": th, "stage_idle": stage_idle, "mean_idle": mean_idle,
            "ratio": mean_idle / th, "step_ms": 1e3 * statistics.median(walls),
            "stage_fwd_ms": [statistics.median(v) for v in f_ms], "stage_bwd_ms": [statistics.median(v) for v in b_ms],
            "cpu_over_wall": cpu / busy_wall if busy_wall else float("nan")}


# ------------------------------------------------------------------------------------------------ report


def print_report(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    """The table, the notes and the JSON line."""
    cores = os.cpu_count() or 1
    print(f"1F1B idle fraction per stage: {args.arch}, {args.layers} layers, h={args.hidden} heads={args.heads} "
          f"s={args.seq} b={args.batch}, fp32, gloo, 1 thread/rank, {cores} cores; median of {args.steps} steps "
          f"after {args.warmup} warm-up")
    print(f"{'pp':>3} {'m':>3} {'theory':>7} {'mean idle':>9} {'ratio':>6} {'per-stage idle':<28} "
          f"{'step ms':>8} {'F ms/mb':>8} {'B ms/mb':>8} {'cpu/wall':>8}")
    for r in rows:
        per = " ".join(f"{x:.3f}" for x in r["stage_idle"])
        fwd = statistics.fmean(r["stage_fwd_ms"])
        bwd = statistics.fmean(r["stage_bwd_ms"])
        print(f"{r['pp']:>3} {r['m']:>3} {r['theory']:>7.3f} {r['mean_idle']:>9.3f} {r['ratio']:>6.2f} {per:<28} "
              f"{r['step_ms']:>8.0f} {fwd:>8.1f} {bwd:>8.1f} {r['cpu_over_wall']:>8.2f}")
    print("theory = (p-1)/(m+p-1); idle = 1 - busy/step window (busy = forward incl. loss, backward); "
          "ratio = mean idle / theory;\nF/B ms/mb = wall time per micro-batch averaged over stages; "
          "cpu/wall = CPU time / wall time inside the busy intervals.")
    print("\nnotes:")
    crowded = sorted({r["pp"] for r in rows if r["pp"] > cores})
    if crowded:
        print(f"- pp {', '.join(map(str, crowded))} runs more ranks than the {cores} cores: stages computing at the "
              f"same time are time-sliced, so their busy intervals stretch (cpu/wall < 1) and hide waiting; in "
              f"the steady state all stages compute at once and idle time disappears into the slowdown, while "
              f"warm-up/cool-down run alone at full speed. Those rows do not measure the pipeline bubble cleanly; "
              f"pp <= {cores} is the clean case.")
    loaded = [r for r in rows if r["pp"] <= cores and r["cpu_over_wall"] < 0.9]
    if loaded:
        print(f"- cpu/wall < 0.9 in {len(loaded)} row(s) with pp <= {cores} cores: something else was using the CPU "
              f"(load average before the run {args.load_before:.2f}); those idle fractions are distorted too.")
    print("- idle also includes the point-to-point copies (not overlapped with compute) and per-stage imbalance "
          "(the first stage holds the embedding, the last the output layer and the loss).")
    print("- interleaved 1F1B ((p-1)/(v*m)) and zero-bubble schedules: not implemented in megatron_sp.pipeline, "
          "not measured.")
    print(json.dumps({"bench": "pipeline_bubble", "torch": torch.__version__, "cores": cores, "config": vars(args),
                      "not_measured": ["interleaved", "zero_bubble"], "rows": rows}))


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Measure every (pp, m) and print the report; returns the rows."""
    args = parse_args(argv)
    pps = [int(x) for x in args.pp.split(",")]
    micros = [int(x) for x in args.micro.split(",")]
    for p in pps:
        if p < 2 or args.layers % p:
            raise SystemExit(f"--pp {p}: needs p > 1 dividing --layers ({args.layers})")
    if args.steps < 1 or args.warmup < 0:
        raise SystemExit("--steps must be >= 1 and --warmup >= 0")
    args.load_before = os.getloadavg()[0]
    rows = []
    for p in pps:
        ms = [m for m in micros if m >= p]  # 1F1B needs m >= p (check_micro_batches)
        per_rank = run_distributed(rank_run, p, args=args, micros=ms)
        rows += [analyse(p, m, [per_rank[r][i] for r in range(p)]) for i, m in enumerate(ms)]
    print_report(args, rows)
    return rows


if __name__ == "__main__":
    main()
