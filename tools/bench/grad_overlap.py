"""How much of the data-parallel gradient reduction the DistributedOptimizer hides behind backward.

dp = 2 on gloo, ZeRO-1 off/on × small buckets / one bucket. Method and limits: docs/benchmarks.md.
Run from the repo root:  python tools/bench/grad_overlap.py [--bucket-bytes 1048576] [--steps 10] [--verbose]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from common import gpt_config, opt, parser, print_json
from megatron_sp.config import Config
from megatron_sp.model import GPTModel
from megatron_sp.mpu import ParallelContext, ParallelDims, ParallelState, comm, initialize
from megatron_sp.optim import DistributedOptimizer, named_trainable
from megatron_sp.testing import run_distributed

WORLD = 2
ONE_BUCKET = 1 << 50  # bucket_bytes larger than any model: one bucket
GRAD_PHASES = ("backward", "finish")  # ops launched here reduce gradients
# the asynchronous collectives of ``comm`` the optimizer calls (observed as their KINDS)
TRACED = ("reduce_scatter_async", "all_reduce_async", "all_gather_async")
KINDS = ("reduce_scatter", "all_reduce", "all_gather")
KIND_LABEL = {"reduce_scatter": "RS", "all_reduce": "AR", "all_gather": "AG"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__, arch="neox", layers=4, hidden=256, heads=8, seq=128, batch=4, vocab=4096, warmup=2, steps=10,
               seed=1234, verbose=False)
    p.add_argument("--bucket-bytes", type=int, default=2**20, help="the small-bucket configuration's bucket_bytes")
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"),
                   help="bf16: bf16 params (fp32 masters) under autocast, as the trainer")
    return p.parse_args(argv)


@dataclass
class Op:
    """One asynchronous collective the optimizer issued; times are ``perf_counter`` seconds."""

    kind: str  # one of KINDS
    phase: str  # backward | finish | step: where it was launched
    nbytes: int  # input bytes
    launch: float
    launched: float  # when the launch call returned (the RS clone runs on the caller's thread)
    event: Any  # comm's CommEvent: its Pending's wait() stamps wait_start / wait_end on it
    done: float | None = None  # the work's future completed (callback)

    @property
    def end(self) -> float:
        """Completion: the callback stamp, else (no callback ran) when ``wait()`` returned."""
        return min(t for t in (self.done, self.event.wait_end) if t is not None)


@dataclass
class Tracer:
    """Collects the ops of the current configuration; ``phase`` is set by the step loop."""

    phase: str = "idle"
    ops: list[Op] = field(default_factory=list)


TRACER = Tracer()


@contextmanager
def traced(tracer: Tracer) -> Iterator[None]:
    """Record the asynchronous collectives (``TRACED``) issued while the block runs, through ``comm.observe``."""

    def on_event(event: comm.CommEvent) -> None:
        if event.op not in KINDS or event.work is None:  # a blocking call, or not a gradient/parameter collective
            return
        op = Op(event.op, tracer.phase, event.tensor.numel() * event.tensor.element_size(), event.called,
                launched=event.issued, event=event)

        def done(_: Any, op: Op = op) -> None:
            op.done = time.perf_counter()
        event.work.get_future().add_done_callback(done)
        tracer.ops.append(op)

    with comm.observe(on_event):
        yield


def check_replica(group: Any, seed: int) -> bool:
    """Whether comm's asynchronous reduce-scatter (gloo: clone + async all-reduce + chunk copy, so that it
    has a future) returns exactly what gloo's own reduce-scatter (``comm.reduce_scatter``) does."""
    x = torch.randn(4096 * comm.group_size(group), generator=torch.Generator().manual_seed(seed + comm.group_rank(group)))
    ours = comm.reduce_scatter_async(x, group).wait()
    theirs = comm.reduce_scatter(x, group, 0)
    return bool(torch.equal(ours, theirs))


@dataclass
class Setup:
    """One configuration on this rank: its model copy, optimizer and per-step records."""

    name: str
    zero: int
    bucket_bytes: int
    model: torch.nn.Module
    opt: DistributedOptimizer
    steps: list[dict[str, Any]] = field(default_factory=list)


def make_setups(args: argparse.Namespace, cfg: Config, state: ParallelState) -> list[Setup]:
    """ZeRO off/on × small buckets/one bucket, each on its own model built from the same seed."""
    parallel = ParallelContext.from_state(state)
    setups = []
    for zero in (0, 1):
        for label, bucket_bytes in (("small buckets", args.bucket_bytes), ("one bucket", ONE_BUCKET)):
            model = GPTModel(cfg.model, seed=args.seed, parallel=parallel).train()
            opt = DistributedOptimizer(named_trainable(model), cfg.train, state, zero=zero, precision=args.precision,
                                       bucket_bytes=bucket_bytes)
            setups.append(Setup(f"zero={zero} {label}", zero, bucket_bytes, model, opt))
    return setups


def train_step(s: Setup, tokens: torch.Tensor, labels: torch.Tensor, bf16: bool) -> dict[str, Any]:
    """One traced step of ``s`` (``TRACER.ops`` empty at the start); returns its phase times and the ops it issued."""
    t0 = time.perf_counter()
    TRACER.phase = "zero_grad"
    s.opt.zero_grad()
    TRACER.phase = "forward"
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        token_losses = s.model(tokens, labels=labels)  # [b, s]
    loss = token_losses.float().sum() / (token_losses.numel() * WORLD)  # normalised by the global token count
    t_fwd = time.perf_counter()
    TRACER.phase = "backward"
    loss.backward()
    t_bwd = time.perf_counter()
    TRACER.phase = "finish"
    s.opt.finish_grad_sync()
    t_sync = time.perf_counter()
    TRACER.phase = "step"
    s.opt.step(lr=1e-4, clip=1.0)
    t_end = time.perf_counter()
    TRACER.phase = "idle"
    return {"t0": t0, "forward": t_fwd - t0, "backward": t_bwd - t_fwd, "finish": t_sync - t_bwd,
            "optimizer_step": t_end - t_sync, "step": t_end - t0, "backward_end": t_bwd, "ops": list(TRACER.ops)}


def union_length(spans: list[tuple[float, float]], cut: float) -> tuple[float, float]:
    """Total length of the union of ``spans`` and the part of it before ``cut``."""
    total = before = 0.0
    lo = hi = None
    for a, b in sorted(spans) + [(float("inf"), float("inf"))]:
        if hi is None or a > hi:
            if hi is not None:
                total += hi - lo
                before += max(0.0, min(hi, cut) - lo)
            lo, hi = a, b
        else:
            hi = max(hi, b)
    return total, before


def summarize_step(rec: dict[str, Any]) -> dict[str, Any]:
    """Per op kind: in-flight (launch call returned → done) and hidden reduction time of one step (seconds),
    the launch calls' own time (main thread), and the op timeline."""
    bwd_end, t0 = rec.pop("backward_end"), rec.pop("t0")
    out: dict[str, Any] = {k: v for k, v in rec.items() if k != "ops"}
    totals = {f"{kind}_{what}": 0.0 for kind in KINDS for what in ("time", "hidden")}
    totals.update(launch_time=0.0, hideable_time=0.0)
    timeline = []
    grad_spans, gather_spans = [], []
    for op in rec["ops"]:
        end = op.end
        stamps = {"launch": op.launch, "launched": op.launched, "done": op.done, "wait_start": op.event.wait_start,
                  "wait_end": op.event.wait_end}
        timeline.append({"kind": op.kind, "phase": op.phase, "nbytes": op.nbytes,
                         **{k: None if t is None else t - t0 for k, t in stamps.items()}, "backward_end": bwd_end - t0})
        if op.phase not in GRAD_PHASES:
            gather_spans.append((op.launch, end))
            continue
        grad_spans.append((op.launched, end))
        totals[f"{op.kind}_time"] += end - op.launched
        totals[f"{op.kind}_hidden"] += max(0.0, min(end, bwd_end) - op.launched)
        totals["launch_time"] += op.launched - op.launch
        if op.launched < bwd_end:
            totals["hideable_time"] += end - op.launched
    out.update(totals)
    out["wall_time"], out["wall_hidden"] = union_length(grad_spans, bwd_end)
    out["param_gather_wall"] = union_length(gather_spans, bwd_end)[0]
    out["grad_ops"] = sum(op.phase in GRAD_PHASES for op in rec["ops"])
    out["grad_kinds"] = sorted({op.kind for op in rec["ops"] if op.phase in GRAD_PHASES})
    out["missing_callbacks"] = sum(op.done is None for op in rec["ops"])
    out["timeline"] = timeline
    return out


def rank_run(rank: int, world_size: int, args: argparse.Namespace) -> dict[str, Any]:
    """Train every configuration in turn on this rank; returns the per-step summaries."""
    state = initialize(ParallelDims(dp=world_size))
    cfg = gpt_config(args)
    replica_ok = check_replica(state.dp_cp_group, args.seed)
    setups = make_setups(args, cfg, state)
    gen = torch.Generator().manual_seed(args.seed + rank)  # each data-parallel rank its own batch
    data = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)
    tokens, labels = data[:, :-1].contiguous(), data[:, 1:].contiguous()  # [b, s]
    with traced(TRACER):
        for i in range(args.warmup + args.steps):
            for s in setups:  # configurations alternate step by step
                rec = train_step(s, tokens, labels, args.precision == "bf16")
                if i >= args.warmup:
                    s.steps.append(rec)
                TRACER.ops.clear()
    # Callbacks run on gloo's threads; every op has been waited, so they have all had their chance.
    return {"rank": rank, "replica_matches_gloo": replica_ok,
            "configs": [{"name": s.name, "zero": s.zero, "bucket_bytes": s.bucket_bytes,
                         "buckets": len(s.opt._buckets), "steps": [summarize_step(r) for r in s.steps]}
                        for s in setups]}


def combine(per_rank: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per configuration: phase times (median over steps of the slower rank), fractions pooled over ranks and steps."""
    rows = []
    for i, first in enumerate(per_rank[0]["configs"]):
        steps = [r["configs"][i]["steps"] for r in per_rank]  # [rank][step]
        n_steps, per_step = len(steps[0]), len(steps[0]) * len(per_rank)

        def slowest(key: str, steps: list[list[dict[str, Any]]] = steps, n_steps: int = n_steps) -> list[float]:
            return [max(rank_steps[j][key] for rank_steps in steps) for j in range(n_steps)]

        def pooled(key: str, steps: list[list[dict[str, Any]]] = steps) -> float:
            return sum(st[key] for rank_steps in steps for st in rank_steps)

        row = {k: first[k] for k in ("name", "zero", "bucket_bytes", "buckets")}
        row.update({f"{k}_ms": 1e3 * statistics.median(slowest(k))
                    for k in ("step", "forward", "backward", "finish", "optimizer_step")})
        row["step_ms_min"] = 1e3 * min(slowest("step"))
        row["grad_kinds"] = steps[0][0]["grad_kinds"]
        row["grad_ops_per_step"] = steps[0][0]["grad_ops"]
        total = sum(pooled(f"{k}_time") for k in KINDS)
        for kind in KINDS:
            t = pooled(f"{kind}_time")
            row[f"{kind}_ms"] = 1e3 * t / per_step  # mean in-flight time per rank per step
            row[f"{kind}_hidden"] = pooled(f"{kind}_hidden") / t if t else None
        row["comm_ms"] = 1e3 * total / per_step
        row["hidden"] = sum(pooled(f"{k}_hidden") for k in KINDS) / total if total else 0.0
        row["wall_ms"] = 1e3 * pooled("wall_time") / per_step
        row["wall_hidden"] = pooled("wall_hidden") / pooled("wall_time") if pooled("wall_time") else 0.0
        row["hideable"] = pooled("hideable_time") / total if total else 0.0
        row["hidden_ms"] = 1e3 * sum(pooled(f"{k}_hidden") for k in KINDS) / per_step
        row["launch_ms"] = 1e3 * pooled("launch_time") / per_step
        row["param_gather_ms"] = 1e3 * pooled("param_gather_wall") / per_step
        row["missing_callbacks"] = int(pooled("missing_callbacks"))
        row["per_rank_hidden"] = [
            sum(st[f"{k}_hidden"] for st in rank_steps for k in KINDS)
            / max(1e-12, sum(st[f"{k}_time"] for st in rank_steps for k in KINDS)) for rank_steps in steps]
        row["last_step_timeline_rank0"] = steps[0][-1]["timeline"]
        rows.append(row)
    return rows


def print_report(args: argparse.Namespace, per_rank: list[dict[str, Any]], rows: list[dict[str, Any]]) -> None:
    """The table, the notes, the verbose timeline and the JSON line."""
    print(f"gradient-reduction overlap at dp={WORLD} (gloo, {args.arch} L={args.layers} h={args.hidden} s={args.seq} "
          f"b={args.batch}/rank, {args.precision}, {rows[0]['buckets']} buckets of <= ~{args.bucket_bytes:,} B vs one); "
          f"ms: median over {args.steps} steps of the slower rank")
    print(f"{'configuration':22} {'grad collectives':>22} {'step':>7} {'fwd':>6} {'bwd':>6} {'finish':>6} {'opt':>6} "
          f"{'launch':>6} {'Σ flight':>8} {'hidden':>7} {'wall':>6} {'hidden':>7} {'bound':>6}")
    for r in rows:
        kinds = "+".join(f"{r['grad_ops_per_step'] // max(1, len(r['grad_kinds']))} {KIND_LABEL[k]}" for k in r["grad_kinds"])
        print(f"{r['name']:22} {kinds:>22} {r['step_ms']:>7.1f} {r['forward_ms']:>6.1f} {r['backward_ms']:>6.1f} "
              f"{r['finish_ms']:>6.1f} {r['optimizer_step_ms']:>6.1f} {r['launch_ms']:>6.1f} {r['comm_ms']:>8.1f} "
              f"{r['hidden']:>7.1%} {r['wall_ms']:>6.1f} {r['wall_hidden']:>7.1%} {r['hideable']:>6.1%}")
    print("Σ flight = Σ over the step's gradient collectives of [launch call returned, done] (ms per rank per step; "
          "done = the work's future callback); hidden = Σ of their parts before backward ends ÷ Σ flight. wall = the "
          "union of those intervals (concurrent collectives counted once), hidden = its part before backward ends. "
          "bound = the share of Σ flight of collectives launched before backward ends (the rest cannot overlap). "
          "launch = time inside the launch calls (main thread). finish = backward end -> finish_grad_sync return "
          "(the exposed reduction). fwd/bwd/finish/opt: phase medians, so they need not add up to step.")

    print("\nnotes:")
    by = {(r["zero"], r["bucket_bytes"] == ONE_BUCKET): r for r in rows}
    for zero in (0, 1):
        small, one = by.get((zero, False)), by.get((zero, True))
        if small and one:
            kinds = ", ".join(f"{KIND_LABEL[k]} {opt(small[f'{k}_hidden'], '.1%')}" for k in small["grad_kinds"])
            print(f"  zero={zero}: step {small['step_ms']:.1f} ms with small buckets vs {one['step_ms']:.1f} ms with one "
                  f"({one['step_ms'] / small['step_ms']:.3f}x); exposed finish {small['finish_ms']:.1f} vs "
                  f"{one['finish_ms']:.1f} ms; backward {small['backward_ms']:.1f} vs {one['backward_ms']:.1f} ms; "
                  f"hidden {small['hidden_ms']:.1f} of {small['comm_ms']:.1f} ms in flight ({kinds}).")
    for r in rows:
        if r["param_gather_ms"]:
            print(f"  {r['name']}: ZeRO parameter all-gathers in step: {r['param_gather_ms']:.1f} ms wall per rank "
                  "(waited at once, so not overlapped; not counted above).")
    print("  per-rank hidden fractions: " + "; ".join(
        f"{r['name']} " + "/".join(f"{h:.1%}" for h in r["per_rank_hidden"]) for r in rows))
    ok = all(p["replica_matches_gloo"] for p in per_rank)
    print(f"  timed reduce-scatter == library reduce-scatter (bitwise): {'yes' if ok else 'NO'}; ops without a "
          f"completion callback: {sum(r['missing_callbacks'] for r in rows)} (wait() return used); GIL switch interval "
          f"{sys.getswitchinterval() * 1e3:.1f} ms (the most a callback stamp lags completion while the main thread runs "
          "Python).")
    if args.verbose:
        for r in rows:
            tl = r["last_step_timeline_rank0"]
            print(f"\n-- {r['name']}: rank 0, last timed step, ms from step start (backward ends at "
                  f"{tl[0]['backward_end'] * 1e3 if tl else 0:.1f})")
            for op in tl:
                def ms(t: float | None) -> str:
                    return "-" if t is None else f"{t * 1e3:.1f}"
                print(f"  {op['kind']:14} {op['phase']:8} {op['nbytes']:>10,} B  launch {ms(op['launch'])}..{ms(op['launched'])}"
                      f"  done {ms(op['done'])}  wait {ms(op['wait_start'])}..{ms(op['wait_end'])}")
    slim = [{k: v for k, v in r.items() if k != "last_step_timeline_rank0" or args.verbose} for r in rows]
    print_json("grad_overlap", world=WORLD, config=vars(args), traced=list(TRACED), replica_matches_gloo=ok, rows=slim)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Run the dp=2 training on gloo ranks and print the report; returns the rows."""
    args = parse_args(argv)
    if args.steps < 1 or args.bucket_bytes < 1:
        raise SystemExit("--steps and --bucket-bytes must be positive")
    per_rank = run_distributed(rank_run, WORLD, args=args)
    rows = combine(per_rank)
    print_report(args, per_rank, rows)
    return rows


if __name__ == "__main__":
    main()
