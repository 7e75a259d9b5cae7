"""Context-parallel attention at a fixed total sequence: memory, work balance, bytes and time per layer per rank.

Per ``parallel.cp_algo`` and cp size, one layer on gloo ranks against cp = 1; then the longest sequence that
fits a per-rank activation budget. Method, goals and the expected bytes: docs/benchmarks.md.
Run from the repo root:  python tools/bench/context_parallel.py [--seq 2048] [--cp 1,2,4] [--algos ring,zigzag]
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from fractions import Fraction
from typing import Any

import torch

from common import alternating, check_attention_args, cp_skip_reason, ints, mib, names, opt, parser, print_json
from common import gpt_config, graph_nodes, ulysses_degree, world_group
from planner.measure import SavedBytes
from megatron_sp.model.attention import kernels
from megatron_sp.model.attention.context_parallel import ALGORITHMS, AttentionMeta
from megatron_sp.mpu.cp_layout import required_divisor, sequence_layout, shard_batch
from megatron_sp.model.gpt import GPTModel
from megatron_sp.mpu import ParallelContext, comm
from megatron_sp.mpu.parallel_state import ParallelDims, initialize
from megatron_sp.mpu.random import get_tracker, init_rng
from megatron_sp.testing import run_distributed

ELEMENT_BYTES = 4  # q, k, v (and the activations) are fp32 here
ACC_BYTES = 4  # dK,dV accumulators and the lse travel in fp32 (``kernels.compute_dtype``)
INDEX_BYTES = 8  # token indices are int64
MEMORY_GOAL = 1.05  # per-rank activation bytes at cp = N should be at most this / N of cp = 1's
BALANCE_GOAL = 1.1  # zigzag's attention work max/min over ranks should be at most this
BASELINE = "-"  # the algorithm label of the cp = 1 rows (no context parallelism)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__, seq=2048, batch=1, hidden=256, heads=8, kv_heads=None, arch="neox", reps=5, warmup=1,
               seed=1234, verbose=False)
    p.add_argument("--cp", default="1,2,4", help="comma-separated cp sizes (1 = the baseline)")
    p.add_argument("--algos", default=",".join(ALGORITHMS), help=f"comma-separated, of {','.join(ALGORITHMS)}")
    p.add_argument("--heads-k-stride", type=int, default=1, help="llama3: kv heads per all-gather")
    p.add_argument("--cp-ulysses", type=int, default=2, help="usp: the Ulysses degree inside the cp group")
    p.add_argument("--mean-doc", type=float, default=0.0,
                   help="packed documents of exponential lengths with this mean (tokens); 0: one document per sample")
    p.add_argument("--long-algo", default="zigzag", help="algorithm of the longest-sequence search ('' to skip it)")
    p.add_argument("--long-cp", default="1,4", help="cp sizes of the longest-sequence search; the first sets the budget")
    p.add_argument("--budget-mib", type=float, default=None,
                   help="per-rank activation budget (default: the first --long-cp size's bytes at --seq)")
    return p.parse_args(argv)


def check_args(args: argparse.Namespace) -> list[str]:
    """Raise SystemExit on flags that cannot run; return the (cp, algo) combinations skipped, with why."""
    check_attention_args(args, names(args.algos) + ([args.long_algo] if args.long_algo else []), ALGORITHMS)
    sizes = ints(args.cp) + (ints(args.long_cp) if args.long_algo else [])
    if any(n < 1 for n in sizes):
        raise SystemExit("cp sizes must be >= 1")
    skipped = [f"{algo} cp={n}: {why}" for n in ints(args.cp) if n > 1 for algo in names(args.algos)
               if (why := cp_skip_reason(args, algo, n, args.seq))]
    for n in ints(args.long_cp) if args.long_algo else []:
        why = cp_skip_reason(args, args.long_algo, n, args.seq)
        if why:
            raise SystemExit(f"--long-algo {args.long_algo} at cp={n}: {why}")
    return skipped


def documents(args: argparse.Namespace, seq: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``--mean-doc`` > 0: (document ids, positions inside the document), ``[seq]`` each, seeded; else None."""
    if args.mean_doc <= 0:
        return None
    gen = torch.Generator().manual_seed(args.seed)
    starts, t = [], 0
    while t < seq:
        starts.append(t)
        t += max(1, math.ceil(torch.empty(1).exponential_(1 / args.mean_doc, generator=gen).item()))
    doc = torch.zeros(seq, dtype=torch.int64)
    doc[torch.tensor(starts[1:], dtype=torch.int64)] = 1
    doc = doc.cumsum(0)
    return doc, torch.arange(seq) - torch.tensor(starts)[doc]


class WorkCounter:
    """An observer of ``kernels.attention_forward``/``attention_backward`` (``kernels.observe(counter.add)``): per
    phase, the calls per block kind and the attention work ``b · heads · visible (query, key) pairs``."""

    def __init__(self) -> None:
        self.calls: dict[str, dict[str, int]] = {"forward": {}, "backward": {}}
        self.work = {"forward": 0, "backward": 0}

    def add(self, phase: str, q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
             q_doc: torch.Tensor | None, k_doc: torch.Tensor | None, kind: str | None) -> None:
        kind = kind or kernels.classify(q_pos, k_pos, q_doc, k_doc)
        sq, sk, b, heads = q.shape[0], k.shape[0], q.shape[1], q.shape[2]
        pairs = {"empty": 0, "full": sq * sk, "causal": sq * (sq + 1) // 2}.get(kind)
        if pairs is None:  # masked: count the mask, over the whole micro-batch
            self.work[phase] += heads * int(kernels.visible(q_pos, k_pos, q_doc, k_doc).sum())
        else:
            self.work[phase] += b * heads * pairs
        self.calls[phase][kind] = self.calls[phase].get(kind, 0) + 1


def ctx_held_bytes(out: torch.Tensor, counted: set[int]) -> int:
    """Bytes of tensors that autograd Functions of ``out``'s graph keep as plain ``ctx`` attributes (not
    through ``save_for_backward``, so invisible to the saved-tensor hooks), storages in ``counted`` skipped."""
    found: dict[int, int] = {}
    for node in graph_nodes(out):
        for value in getattr(node, "__dict__", {}).values():
            if isinstance(value, AttentionMeta):
                value = value.positions + (value.documents or [])
            for t in value if isinstance(value, (list, tuple)) else [value]:
                if torch.is_tensor(t) and t.untyped_storage().data_ptr() not in counted:
                    found[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(found.values())


class LayerRun:
    """One transformer layer stage on this cp rank with its shard of a seeded full input and output grad."""

    def __init__(self, args: argparse.Namespace, algo: str, seq: int, rank: int, n: int, group: Any) -> None:
        tracker = get_tracker()
        init_rng(tracker, args.seed, 0, 0)  # dropout is 0: the streams only have to exist
        groups = {}
        if n > 1:  # usp needs its Ulysses and ring sub-groups
            state = initialize(ParallelDims(cp=n, world_size=n, cp_ulysses=ulysses_degree(args, algo, n)))
            groups = {"cp_ulysses_group": state.groups.get("cp_ulysses"), "cp_ring_group": state.groups.get("cp_ring")}
        parallel = ParallelContext(cp_group=group, cp_algo=algo, cp_heads_k_stride=args.heads_k_stride, tracker=tracker,
                                   **groups)
        self.stage = GPTModel(gpt_config(args, 256, seq_length=seq).model, args.seed, layer_range=range(1), pre_process=False,
                              post_process=False, parallel=parallel).train()
        self.layout = sequence_layout(algo) if n > 1 else "contiguous"
        gen = torch.Generator().manual_seed(args.seed)
        x_full = torch.randn(seq, args.batch, args.hidden, generator=gen)  # [s, b, h]
        grad_full = torch.randn(seq, args.batch, args.hidden, generator=gen)
        packed = documents(args, seq)
        full = {"x": x_full.transpose(0, 1), "grad": grad_full.transpose(0, 1)}  # [b, s, h]
        if packed is not None:  # the zigzag layout then zigzags each document on its own, as in training
            full.update({k: t.unsqueeze(0).expand(args.batch, -1) for k, t in zip(("document_ids", "position_ids"), packed)})
        part = shard_batch(full, n, rank, self.layout) if n > 1 else {**full, "token_index": torch.arange(seq).expand(args.batch, -1)}
        self.x = part["x"].transpose(0, 1).contiguous().requires_grad_()  # [s/cp, b, h]
        self.grad = part["grad"].transpose(0, 1).contiguous()
        self.token_index = part["token_index"].contiguous()  # [b, s/cp]
        self.position_ids = part.get("position_ids", self.token_index).contiguous()
        self.document_ids = part["document_ids"].contiguous() if packed is not None else None
        self.param_ptrs = {p.untyped_storage().data_ptr() for p in self.stage.parameters()}

    def forward(self) -> torch.Tensor:
        return self.stage(None, position_ids=self.position_ids, hidden_states=self.x, token_index=self.token_index,
                          document_ids=self.document_ids)

    def backward(self, y: torch.Tensor) -> None:
        y.backward(self.grad)
        self.stage.zero_grad(set_to_none=True)
        self.x.grad = None

    def activation_bytes(self) -> dict[str, int]:
        """Saved-tensor and ctx-held bytes of one forward (the graph is dropped afterwards)."""
        saved = SavedBytes(self.param_ptrs)
        with saved.record():
            y = self.forward()
        held = ctx_held_bytes(y, set(saved.storages) | self.param_ptrs)
        return {"saved": saved.nbytes, "ctx": held, "total": saved.nbytes + held}


def measure(args: argparse.Namespace, algo: str, rank: int, n: int, group: Any) -> dict[str, Any]:
    """Everything of one (algorithm, cp size) on this rank."""
    run = LayerRun(args, algo, args.seq, rank, n, group)
    meta_bytes: dict[str, dict[str, float]] = {}
    if n > 1:
        with comm.count() as meta_count:
            AttentionMeta.build(run.token_index, run.document_ids, algo, group, args.heads_k_stride)
        meta_bytes = meta_count.summary()
    memory = run.activation_bytes()
    counter = WorkCounter()
    with kernels.observe(counter.add):
        with comm.count() as fwd:
            y = run.forward()
        with comm.count() as bwd:
            run.backward(y)
    forward = _minus(fwd.summary(), meta_bytes)

    def step() -> dict[str, float]:
        if n > 1:
            comm.barrier()
        w0, t0 = time.perf_counter(), time.thread_time()
        y = run.forward()
        w1 = time.perf_counter()
        run.backward(y)
        w2, t2 = time.perf_counter(), time.thread_time()
        return {"fwd_wall": w1 - w0, "bwd_wall": w2 - w1, "wall": w2 - w0, "thread": t2 - t0}

    reps = alternating({"layer": step}, args.warmup, args.reps)["layer"]
    return {"rank": rank, "memory": memory, "calls": counter.calls, "work": counter.work, "meta_comm": meta_bytes,
            "comm": {"forward": forward, "backward": bwd.summary()},
            "time_ms": {k: 1e3 * statistics.median(r[k] for r in reps) for k in reps[0]}}


def _minus(summary: dict[str, dict[str, float]], other: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """``summary`` without ``other``'s calls and bytes (ops left with no call dropped)."""
    out = {}
    for op, v in summary.items():
        o = other.get(op, {"calls": 0, "bytes": 0.0})
        if v["calls"] - o["calls"]:
            out[op] = {"calls": v["calls"] - o["calls"], "bytes": v["bytes"] - o["bytes"]}
    return out


def rank_rows(rank: int, world_size: int, args: argparse.Namespace, algos: list[str]) -> list[dict[str, Any]]:
    """``measure`` of every algorithm in ``algos`` at cp = world_size, on this rank (one launch for all)."""
    group = world_group(world_size, comm.LOCAL)
    return [{"algo": algo, **measure(args, algo, rank, world_size, group)} for algo in algos]


def rank_memory(rank: int, world_size: int, args: argparse.Namespace, algo: str, seqs: list[int]) -> list[int]:
    """This rank's activation bytes (saved + ctx-held) of one forward at each total sequence in ``seqs``."""
    group = world_group(world_size, comm.LOCAL)
    return [LayerRun(args, algo, s, rank, world_size, group).activation_bytes()["total"] for s in seqs]


def expected_bytes(args: argparse.Namespace, algo: str, n: int, s: int) -> dict[str, dict[str, int]]:
    """``{phase: {op: bytes}}`` this implementation sends per layer per rank (docs/benchmarks.md's table)."""
    if n == 1:
        return {"forward": {}, "backward": {}}
    b, heads, g = args.batch, args.heads, args.kv_heads or args.heads
    d = args.hidden // heads
    e, a = ELEMENT_BYTES, ACC_BYTES
    kv = 2 * s * b * g * d  # elements of K and V over the whole sequence
    share = Fraction(n - 1, n)
    if algo in ("ring", "zigzag"):
        out = {"forward": {"p2p": share * kv * e}, "backward": {"p2p": share * kv * e + kv * a}}
    elif algo == "llama3":
        out = {"forward": {"all_gather": share * kv * e},
               "backward": {"all_gather": share * kv * e, "reduce_scatter": share * kv * a}}
    elif algo in ("ulysses", "usp"):  # usp: Ulysses of degree u over s·u/n tokens, a ring of n/u inside
        u = n if algo == "ulysses" else ulysses_degree(args, algo, n)
        g_sent = g if g % u == 0 else u  # kv heads repeated up to u when u % g == 0
        tokens = Fraction(s * u, n)  # the Ulysses group's tokens
        each_way = Fraction(u - 1, u * u) * (2 * tokens * b * heads * d + 2 * tokens * b * g_sent * d) * e
        output_back = Fraction(u - 1, u * u) * tokens * b * heads * d * e  # backward moves the saved output back
        out = {"forward": {"all_to_all": each_way}, "backward": {"all_to_all": each_way + output_back}}
        if u < n:
            r, ring_kv = n // u, 2 * s * b * Fraction(g_sent, u) * d
            out["forward"]["p2p"] = Fraction(r - 1, r) * ring_kv * e
            out["backward"]["p2p"] = Fraction(r - 1, r) * ring_kv * e + ring_kv * a
    else:
        raise ValueError(algo)
    for ops in out.values():
        for op, value in ops.items():
            if value.denominator != 1:
                raise ValueError(f"{algo} cp={n}: {op} bytes {value} not whole (sizes not divisible)")
            ops[op] = int(value)
    return out  # type: ignore[return-value]


def table_bytes(args: argparse.Namespace, algo: str, n: int, s: int) -> dict[str, float]:
    """docs/attention.md's per-layer per-rank numbers, in elements × element size: ``{forward, backward}``."""
    if n == 1:
        return {"forward": 0.0, "backward": 0.0}
    b, h, e = args.batch, args.hidden, ELEMENT_BYTES
    h_kv = (args.kv_heads or args.heads) * (h // args.heads)
    ring = 2 * s * b * h_kv * (n - 1) / n * e
    if algo in ("ring", "zigzag", "llama3"):
        return {"forward": ring, "backward": 2 * ring}  # ring/zigzag: "same + dK,dV"
    u = n if algo == "ulysses" else ulysses_degree(args, algo, n)
    ulysses = (2 * s * b * h + 2 * s * b * h_kv) * (u - 1) / (u * n) * e  # over the Ulysses group's s·u/N tokens
    inner = 2 * s * b * h_kv / u * (n // u - 1) / (n // u) * e  # usp: the ring of N/u on h_kv/u
    return {"forward": ulysses + inner, "backward": ulysses + 2 * inner}


def finish_row(args: argparse.Namespace, n: int, algo: str, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """One table row from the per-rank results of (algorithm, cp = n)."""
    s = args.seq
    mem = [r["memory"]["total"] for r in ranks]
    row: dict[str, Any] = {"cp": n, "algo": algo, "act_bytes": max(mem), "act_bytes_min": min(mem),
                           "act_saved": max(r["memory"]["saved"] for r in ranks),
                           "act_ctx": max(r["memory"]["ctx"] for r in ranks)}
    packed = documents(args, s)
    lengths = torch.bincount(packed[0]).tolist() if packed is not None else [s]
    total = args.batch * args.heads * sum(d * (d + 1) // 2 for d in lengths)  # visible (query, key) pairs, all heads
    if n == 1:
        work = [total]
        row["fwd_calls"] = [1]
    else:
        work = [r["work"]["forward"] for r in ranks]
        row["fwd_calls"] = [sum(r["calls"]["forward"].values()) for r in ranks]
        row["calls_by_kind"] = [r["calls"]["forward"] for r in ranks]
        row["backward_work_equal"] = all(r["work"]["backward"] == r["work"]["forward"] for r in ranks)
    row.update({"work": work, "work_total": sum(work), "work_causal": total, "balance": max(work) / min(work),
                "max_over_ideal": max(work) * n / total})
    comms = [r["comm"] for r in ranks]
    row["comm"] = comms[0]
    row["comm_same_on_all_ranks"] = all(_rounded(c) == _rounded(comms[0]) for c in comms)
    row["forward_bytes"] = round(sum(v["bytes"] for v in comms[0]["forward"].values()))
    row["backward_bytes"] = round(sum(v["bytes"] for v in comms[0]["backward"].values()))
    row["expected"] = expected_bytes(args, algo, n, s)
    row["matches_expected"] = row["comm_same_on_all_ranks"] and _rounded(comms[0]) == row["expected"]
    row["table"] = table_bytes(args, algo, n, s)
    row["meta_bytes"] = round(sum(v["bytes"] for v in ranks[0]["meta_comm"].values()))
    ids = 1 if packed is None else 2  # AttentionMeta all-gathers the token indices (and the document ids)
    row["meta_bytes_expected"] = ids * (n - 1) * args.batch * s * INDEX_BYTES // n
    for phase in ("forward", "backward"):
        row[f"{phase}_vs_table"] = row[f"{phase}_bytes"] / row["table"][phase] if row["table"][phase] else None
    table_total = row["table"]["forward"] + row["table"]["backward"]
    row["total_vs_table"] = (row["forward_bytes"] + row["backward_bytes"]) / table_total if table_total else None
    times = [r["time_ms"] for r in ranks]
    thread = [t["thread"] for t in times]
    row["time_ms"] = {**{k: max(t[k] for t in times) for k in ("wall", "fwd_wall", "bwd_wall")},
                      "thread_max": max(thread), "thread_min": min(thread), "thread_sum": sum(thread)}
    row["per_rank"] = [{"rank": r["rank"], "memory": r["memory"], "work": r["work"], "calls": r["calls"],
                        "time_ms": r["time_ms"]} for r in ranks]
    return row


def _rounded(comm_summary: dict[str, dict[str, dict[str, float]]]) -> dict[str, dict[str, int]]:
    return {phase: {op: round(v["bytes"]) for op, v in ops.items()} for phase, ops in comm_summary.items()}


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Activation bytes over cp = 1's (when measured) and the goal ``1.05/N`` beside it; the CPU time summed
    over ranks over cp = 1's (1.0 = splitting costs nothing)."""
    base = next((r["act_bytes"] for r in rows if r["cp"] == 1), None)
    base_cpu = next((r["time_ms"]["thread_sum"] for r in rows if r["cp"] == 1), None)
    for r in rows:
        r["cpu_vs_cp1"] = r["time_ms"]["thread_sum"] / base_cpu if base_cpu else None
        r["act_ratio"] = r["act_bytes"] / base if base else None
        r["act_goal"] = MEMORY_GOAL / r["cp"]
        r["act_ok"] = None if base is None else r["act_ratio"] <= r["act_goal"]


def longest_sequence(args: argparse.Namespace) -> dict[str, Any]:
    """The longest total sequence whose per-rank activation bytes fit the budget, per ``--long-cp`` size."""
    algo, sizes = args.long_algo, ints(args.long_cp)
    s1, s2 = args.seq, 2 * args.seq
    fits: dict[int, dict[str, Any]] = {}
    measured: dict[int, dict[int, int]] = {}

    def bytes_at(n: int, seqs: list[int]) -> None:
        todo = [s for s in seqs if s not in measured.setdefault(n, {})]
        if todo:
            per_rank = run_distributed(rank_memory, n, args=args, algo=algo, seqs=todo)
            for i, s in enumerate(todo):
                measured[n][s] = max(r[i] for r in per_rank)

    for n in sizes:
        bytes_at(n, [s1, s2])
    budget = int(args.budget_mib * 2 ** 20) if args.budget_mib else measured[sizes[0]][s1]
    for n in sizes:
        div = required_divisor(algo, n)
        slope = Fraction(measured[n][s2] - measured[n][s1], s2 - s1)
        intercept = measured[n][s1] - slope * s1
        predicted = max(div, math.floor((budget - intercept) / slope) // div * div)
        s = predicted
        for _ in range(8):  # the line is exact in practice; step if it is not
            bytes_at(n, [s, s + div])
            if measured[n][s] > budget and s > div:
                s -= div
            elif measured[n][s + div] <= budget:
                s += div
            else:
                break
        fits[n] = {"cp": n, "predicted": predicted, "longest": s, "bytes_at_longest": measured[n][s],
                   "bytes_at_next": measured[n][s + div], "next": s + div, "divisor": div,
                   "bytes_per_token": float(slope), "fixed_bytes": float(intercept),
                   "confirmed": measured[n][s] <= budget < measured[n][s + div]}
    base = fits[sizes[0]]["longest"]
    for f in fits.values():
        f["vs_first"] = f["longest"] / base
    return {"algo": algo, "budget_bytes": budget, "budget_from": "--budget-mib" if args.budget_mib else
            f"cp={sizes[0]} at seq {s1}", "rows": list(fits.values()),
            "measured": {str(n): {str(s): v for s, v in sorted(m.items())} for n, m in measured.items()}}


def print_report(args: argparse.Namespace, rows: list[dict[str, Any]], long: dict[str, Any] | None,
                 skipped: list[str], load: dict[str, list[float]]) -> None:
    """The tables, the notes and the JSON line."""
    g = args.kv_heads or args.heads
    print(f"context parallelism, one {args.arch} layer, s={args.seq} (total, fixed) b={args.batch} h={args.hidden} "
          f"heads={args.heads} kv_heads={g}, fp32, 1 thread per rank on {os.cpu_count()} cores"
          + (f", packed documents of mean length {args.mean_doc:g}" if args.mean_doc > 0 else "") + " "
          f"(load average before {load['before'][0]:.2f}, after {load['after'][0]:.2f})")
    print("\nmemory and attention work per rank (max over ranks; work = b·heads·visible (q,k) pairs of forward)")
    print(f"{'cp':>3} {'algo':8} {'act MiB':>9} {'ratio':>6} {'goal':>6} {'ok':>3} {'work max':>12} {'max/min':>8} "
          f"{'max/ideal':>9} {'fwd calls':>10}")
    for r in rows:
        calls = f"{min(r['fwd_calls'])}-{max(r['fwd_calls'])}" if r["cp"] > 1 else "1 sdpa"
        ok = "-" if r["act_ok"] is None else ("yes" if r["act_ok"] else "NO")
        print(f"{r['cp']:>3} {r['algo']:8} {mib(r['act_bytes']):>9} {opt(r['act_ratio']):>6} {r['act_goal']:>6.3f} "
              f"{ok:>3} {max(r['work']):>12,} {r['balance']:>8.3f} {r['max_over_ideal']:>9.3f} {calls:>10}")
    print("\nbytes sent per layer per rank (fp32 q/k/v; the per-micro-batch token-index all-gather not included)")
    print(f"{'cp':>3} {'algo':8} {'forward B':>12} {'backward B':>12} {'ours exp.':>9} {'table fwd B':>12} "
          f"{'table bwd B':>12} {'fwd/tab':>7} {'bwd/tab':>7} {'tot/tab':>7}")
    for r in rows:
        if r["cp"] == 1:
            continue
        print(f"{r['cp']:>3} {r['algo']:8} {r['forward_bytes']:>12,} {r['backward_bytes']:>12,} "
              f"{'exact' if r['matches_expected'] else 'DIFF':>9} {r['table']['forward']:>12,.0f} "
              f"{r['table']['backward']:>12,.0f} {opt(r['forward_vs_table']):>7} {opt(r['backward_vs_table']):>7} "
              f"{opt(r['total_vs_table']):>7}")
    print(f"\ntime per layer, forward + backward, median of {args.reps} (wall: slowest rank; thread: CPU time of each "
          "rank's compute thread; sum/cp1: summed over ranks, over cp=1's)")
    print(f"{'cp':>3} {'algo':8} {'fwd ms':>9} {'bwd ms':>9} {'wall ms':>9} {'thread max':>10} {'thread min':>10} "
          f"{'thr max/min':>11} {'sum/cp1':>7}")
    for r in rows:
        t = r["time_ms"]
        print(f"{r['cp']:>3} {r['algo']:8} {t['fwd_wall']:>9.1f} {t['bwd_wall']:>9.1f} {t['wall']:>9.1f} "
              f"{t['thread_max']:>10.1f} {t['thread_min']:>10.1f} {t['thread_max'] / t['thread_min']:>11.2f} "
              f"{opt(r['cpu_vs_cp1'], '.2f'):>7}")
    if long:
        print(f"\nlongest sequence, {long['algo']}, per-rank activation budget {mib(long['budget_bytes'])} MiB "
              f"({long['budget_from']})")
        print(f"{'cp':>3} {'longest s':>10} {'x first':>8} {'MiB at s':>9} {'next s':>8} {'MiB at next':>11} "
              f"{'B/token':>9} {'fixed B':>9} {'confirmed':>9}")
        for f in long["rows"]:
            print(f"{f['cp']:>3} {f['longest']:>10,} {f['vs_first']:>8.3f} {mib(f['bytes_at_longest']):>9} "
                  f"{f['next']:>8,} {mib(f['bytes_at_next']):>11} {f['bytes_per_token']:>9,.1f} "
                  f"{f['fixed_bytes']:>9,.0f} {'yes' if f['confirmed'] else 'NO':>9}")
    print_notes(args, rows, skipped)
    if args.verbose:
        print("\nper rank: activation bytes (saved + ctx), forward work, forward calls by kind, thread ms")
        for r in rows:
            for p in r["per_rank"]:
                print(f"  cp={r['cp']} {r['algo']:8} rank {p['rank']}: {p['memory']['saved']:,} + {p['memory']['ctx']:,} B, "
                      f"work {p['work']['forward']:,}, calls {p['calls']['forward']}, thread {p['time_ms']['thread']:.1f}")
            if r["cp"] > 1:
                for phase in ("forward", "backward"):
                    ops = ", ".join(f"{op} {v['calls']} x {v['bytes'] / v['calls']:,.0f}" for op, v in r["comm"][phase].items())
                    print(f"    {phase:8} {ops}  | ours expected {r['expected'][phase]}")
    slim = [{k: v for k, v in r.items() if k != "per_rank" or args.verbose} for r in rows]
    print_json("context_parallel", config=vars(args), load=load, skipped=skipped, rows=slim, long_context=long)


def print_notes(args: argparse.Namespace, rows: list[dict[str, Any]], skipped: list[str]) -> None:
    """What the numbers mean where they differ from the goals or the table."""
    g = args.kv_heads or args.heads
    cores = os.cpu_count() or 1
    print("\nnotes:")
    print("  ours = the exact bytes of this implementation (docs/benchmarks.md); 'exact' = measured op by op equal to it.")
    print("  ring/zigzag backward: K,V go round again ((N-1)/N·KV·e) and each block's fp32 dK,dV accumulator makes N hops "
          "(KV·4, not (N-1)/N·KV·e): backward/table = (1 + N/(N-1)·4/e)/2 = 1.5 at N=2, 1.167 at N=4 in fp32.")
    print("  llama3 backward: the dK,dV reduce-scatter is fp32 (4 B/element); equal to the table in fp32, "
          "(2 + 4)/(2·2) = 1.5x of it under bf16 inputs.")
    print("  ulysses/usp: the lse is not sent (context_parallel_attention needs only out); usp = Ulysses of degree "
          f"--cp-ulysses {args.cp_ulysses} over its group's tokens + a ring of N/u on heads/u" +
          ("" if all(g % n == 0 for n in {r["cp"] for r in rows if r["algo"] == "ulysses"})
           else "; kv heads repeated to N before the all-to-all where g % N != 0"))
    print("  per micro-batch, not per layer: AttentionMeta.build all-gathers the int64 token indices, (N-1)/N·b·s·8 B: "
          + ", ".join(sorted({f"cp={r['cp']} {r['meta_bytes']:,} B" for r in rows if r["cp"] > 1})) + ".")
    if any(r["cp"] > cores for r in rows):
        print(f"  cp sizes above {cores} cores time-slice: wall time includes waiting for a core; thread time is the "
              "rank's own compute.")
    for r in rows:
        problems = []
        if r["act_ok"] is False:
            problems.append(f"activations {r['act_ratio']:.3f} of cp=1 > goal {r['act_goal']:.3f}")
        if r["algo"] == "zigzag" and r["balance"] > BALANCE_GOAL:
            problems.append(f"work balance {r['balance']:.3f} > {BALANCE_GOAL}")
        if r["work_total"] != r["work_causal"]:
            problems.append(f"work summed over ranks {r['work_total']:,} != causal total {r['work_causal']:,}")
        if r["cp"] > 1 and not r["matches_expected"]:
            problems.append(f"bytes {_rounded(r['comm'])} != ours expected {r['expected']}")
        if r["cp"] > 1 and r["meta_bytes"] != r["meta_bytes_expected"]:
            problems.append(f"token-index all-gather {r['meta_bytes']} != {r['meta_bytes_expected']}")
        if r["cp"] > 1 and not r["backward_work_equal"]:
            problems.append("backward kernel work differs from forward")
        if problems:
            print(f"  cp={r['cp']} {r['algo']}: " + "; ".join(problems))
    for s in skipped:
        print(f"  skipped {s}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Measure every row (and the longest sequences), print the report; returns the JSON record."""
    args = parse_args(argv)
    skipped = check_args(args)
    load = {"before": list(os.getloadavg())}
    algos = names(args.algos)
    rows: list[dict[str, Any]] = []
    for n in ints(args.cp):
        run = [BASELINE] if n == 1 else [a for a in algos if not cp_skip_reason(args, a, n, args.seq)]
        if not run:
            continue
        per_rank = run_distributed(rank_rows, n, args=args, algos=["ring" if a == BASELINE else a for a in run])
        for i, algo in enumerate(run):
            rows.append(finish_row(args, n, algo, [rank_result[i] for rank_result in per_rank]))
    add_ratios(rows)
    long = longest_sequence(args) if args.long_algo else None
    load["after"] = list(os.getloadavg())
    print_report(args, rows, long, skipped, load)
    return {"rows": rows, "long_context": long, "skipped": skipped}


if __name__ == "__main__":
    main()
