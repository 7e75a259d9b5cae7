"""Packed documents vs one unpacked sequence: the cost of a training step (forward + backward) on the same tokens.

The whole GPTModel on 1 rank and at each cp size under every ``--algos`` algorithm (and transformers' packed
path on 1 rank): time per step, activation bytes, live-bytes peak. Method and goals: docs/benchmarks.md.
Run from the repo root:  python tools/bench/packed.py [--seqs 2048,4096,8192] [--cp 1,2,4] [--algos zigzag,llama3]
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from common import LiveBytes, alternating, check_attention_args, gpt_config, cp_skip_reason, ints, mib, names, opt
from common import parser, print_json, ulysses_degree, wall_cpu
from context_parallel import SavedBytes, ctx_held_bytes
from megatron_sp.config.schema import Config
from megatron_sp.data import collate
from megatron_sp.data.tokenizer import ByteTokenizer
from megatron_sp.model.attention.context_parallel import ALGORITHMS
from megatron_sp.mpu.cp_layout import sequence_layout, shard_batch
from megatron_sp.model.gpt import GPTModel
from megatron_sp.model.hf_names import hf_config_dict
from megatron_sp.mpu import ParallelContext, comm
from megatron_sp.mpu.parallel_state import ParallelDims, initialize
from megatron_sp.mpu.random import get_tracker, init_rng
from megatron_sp.testing import run_distributed

TIME_GOAL = 1.10  # packed time per step should be at most this times unpacked's
MEMORY_GOAL = 1.05  # packed activation bytes should be at most this times unpacked's
BASELINE = "-"  # the algorithm label of the cp = 1 rows
VARIANTS = ("packed", "unpacked")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__, layers=2, hidden=128, heads=4, kv_heads=None, batch=1, arch="llama", reps=3, warmup=1,
               seed=1234)
    p.add_argument("--seqs", default="2048,4096,8192", help="comma-separated sequence lengths s")
    p.add_argument("--mean-doc", type=float, default=256.0, help="mean document length in tokens (exponential)")
    p.add_argument("--cp", default="1,2,4", help="comma-separated cp sizes (1 = one rank)")
    p.add_argument("--algos", default=",".join(ALGORITHMS), help=f"comma-separated, of {','.join(ALGORITHMS)}")
    p.add_argument("--cp-ulysses", type=int, default=2, help="usp: the Ulysses degree inside the cp group")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the 1-rank runs (cp > 1: 1 per rank)")
    p.add_argument("--hf", default="auto", choices=("auto", "off"),
                   help="compare with transformers' packed path on 1 rank (auto: when transformers imports)")
    return p.parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    check_attention_args(args, names(args.algos), ALGORITHMS)
    if any(n < 1 for n in ints(args.cp)) or args.mean_doc < 1 or args.reps < 1:
        raise SystemExit("cp sizes, --mean-doc and --reps must be >= 1")


def documents(args: argparse.Namespace, seq: int, eod: int) -> tuple[list[np.ndarray], list[int]]:
    """``batch`` samples of ``seq + 1`` tokens: documents of exponential lengths (each >= 1 token, the last
    one the EOD), random bytes inside; also every document length (the last one of a sample cut)."""
    rng = np.random.default_rng(args.seed)
    samples, lengths = [], []
    for _ in range(args.batch):
        parts, total = [], 0
        while total < seq + 1:
            n = max(1, math.ceil(rng.exponential(args.mean_doc)))
            doc = rng.integers(0, 256, size=n, dtype=np.int64)
            doc[-1] = eod
            parts.append(doc)
            lengths.append(min(n, seq + 1 - total))
            total += n
        samples.append(np.concatenate(parts)[:seq + 1])
    return samples, lengths


def batches(samples: list[np.ndarray], eod: int) -> dict[str, dict[str, torch.Tensor]]:
    """The same tokens collated packed (positions and attention reset per document) and unpacked."""
    return {"packed": collate(samples, eod, eod_mask_loss=False, reset_position_ids=True, reset_attention_mask=True),
            "unpacked": collate(samples, eod, eod_mask_loss=False)}


def step_memory(forward: Callable[[], torch.Tensor], zero: Callable[[], None], params: set[int]) -> dict[str, Any]:
    """Activation bytes (saved + ctx, as context_parallel.py) and the live-bytes peak of one forward + backward."""
    live = LiveBytes()
    saved = SavedBytes(params)
    with live:
        with saved.record():
            loss = forward()
        held = ctx_held_bytes(loss, set(saved.storages) | params)
        loss.backward()
    zero()
    return {"act": saved.nbytes + held, "saved": saved.nbytes, "ctx": held, "peak": live.peak, "sdpa_ops": live.sdpa}


def model_config(args: argparse.Namespace, seq: int, n: int, algo: str) -> Config:
    """A finalized Config of the flags at cp = n under ``algo`` (the byte tokenizer's vocabulary)."""
    return gpt_config(args, ByteTokenizer().vocab_size, f"parallel.cp={n}", f"parallel.cp_algo={algo}",
                      f"parallel.cp_ulysses={ulysses_degree(args, algo, n)}", world_size=n, seq_length=seq)


class Step:
    """One (sequence, algorithm) on this rank: the model (built as training builds it) and both batches' shards."""

    def __init__(self, args: argparse.Namespace, seq: int, algo: str, rank: int, n: int,
                 full: dict[str, dict[str, torch.Tensor]]) -> None:
        cfg = model_config(args, seq, n, algo)
        state = initialize(ParallelDims(cp=n, world_size=n, cp_ulysses=cfg.parallel.cp_ulysses))
        init_rng(get_tracker(), args.seed, state.tp_rank, state.pp_rank)
        self.model = GPTModel(cfg.model, args.seed, parallel=ParallelContext.from_state(state, cfg)).train()
        self.params = {q.untyped_storage().data_ptr() for q in self.model.parameters()}
        self.tokens = seq * args.batch  # the loss is a mean over the whole sample, as in training
        layout = sequence_layout(algo)
        self.batch = {v: shard_batch(b, n, rank, layout) if n > 1 else b for v, b in full.items()}

    def forward(self, variant: str) -> torch.Tensor:
        b = self.batch[variant]
        losses = self.model(b["tokens"], position_ids=b["position_ids"], labels=b["labels"],
                            token_index=b.get("token_index"), document_ids=b.get("document_ids"))  # [b, s/cp]
        return (losses * b["loss_mask"]).sum() / self.tokens

    def zero(self) -> None:
        self.model.zero_grad(set_to_none=True)


def time_steps(args: argparse.Namespace, forward: Callable[[str], torch.Tensor], zero: Callable[[], None],
               n: int) -> dict[str, dict[str, list[float]]]:
    """``{"wall"|"cpu": {variant: seconds of each timed step}}``, packed and unpacked alternating (ABBA)."""

    def run(variant: str) -> None:
        forward(variant).backward()
        zero()

    def step(variant: str) -> tuple[float, float]:
        if n > 1:
            comm.barrier()
        return wall_cpu(lambda: run(variant))

    times = alternating({v: lambda v=v: step(v) for v in VARIANTS}, args.warmup, args.reps)
    return {kind: {v: [t[i] for t in times[v]] for v in VARIANTS} for i, kind in enumerate(("wall", "cpu"))}


def measure(args: argparse.Namespace, seq: int, algo: str, rank: int, n: int,
            full: dict[str, dict[str, torch.Tensor]]) -> dict[str, Any]:
    step = Step(args, seq, algo, rank, n, full)
    memory = {v: step_memory(lambda v=v: step.forward(v), step.zero, step.params) for v in VARIANTS}
    return {"seq": seq, "algo": algo, "memory": memory, "times": time_steps(args, step.forward, step.zero, n)}


def hf_model(args: argparse.Namespace, seq: int) -> torch.nn.Module:
    """A transformers causal LM of our config (``hf_names.hf_config_dict``), randomly initialised, SDPA attention."""
    import transformers

    m = model_config(args, seq, 1, "ring").model
    kwargs = {k: v for k, v in hf_config_dict(m).items() if k not in ("architectures", "model_type")}
    config_cls, cls = ((transformers.LlamaConfig, transformers.LlamaForCausalLM) if m.arch == "llama"
                       else (transformers.GPTNeoXConfig, transformers.GPTNeoXForCausalLM))
    torch.manual_seed(args.seed)
    return cls._from_config(config_cls(**kwargs), attn_implementation="sdpa", dtype=torch.float32).train()


def hf_mask_path(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    """What transformers' mask code builds for these inputs: whether it detects packing from ``position_ids``
    (``masking_utils.find_packed_sequence_indices``) and the mask ``create_causal_mask`` hands to SDPA."""
    from transformers import masking_utils

    pos = batch["position_ids"]
    with torch.no_grad():
        embeds = model.get_input_embeddings()(batch["tokens"])
        packed = masking_utils.find_packed_sequence_indices(pos)
        mask = masking_utils.create_causal_mask(config=model.config, inputs_embeds=embeds, attention_mask=None,
                                                past_key_values=None, position_ids=pos)
    if mask is None:
        desc = "None (SDPA is_causal=True, no mask tensor)"
    elif isinstance(mask, torch.Tensor):
        desc = f"dense {mask.dtype} {list(mask.shape)} mask, {mask.numel() * mask.element_size():,} B"
    else:
        desc = type(mask).__name__
    return {"packing_detected": packed is not None, "documents": int(packed[:, -1].max()) + 1 if packed is not None
            else 1, "mask": desc}


def hf_measure(args: argparse.Namespace, seq: int, full: dict[str, dict[str, torch.Tensor]]) -> dict[str, Any]:
    """transformers on the same batches (packed: ``position_ids`` only, no ``document_ids``), 1 rank."""
    model = hf_model(args, seq)
    params = {q.untyped_storage().data_ptr() for q in model.parameters()}
    vocab = model.config.vocab_size

    def forward(variant: str) -> torch.Tensor:
        b = full[variant]
        logits = model(input_ids=b["tokens"], position_ids=b["position_ids"]).logits  # [b, s, V]
        losses = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab).float(), b["labels"].reshape(-1),
                                                   reduction="none")
        return (losses * b["loss_mask"].reshape(-1)).sum() / b["tokens"].numel()

    def zero() -> None:
        model.zero_grad(set_to_none=True)

    return {"seq": seq, "path": {v: hf_mask_path(model, full[v]) for v in VARIANTS},
            "memory": {v: step_memory(lambda v=v: forward(v), zero, params) for v in VARIANTS},
            "times": time_steps(args, forward, zero, 1)}


def hf_available(args: argparse.Namespace) -> bool:
    if args.hf == "off":
        return False
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def rank_rows(rank: int, world_size: int, args: argparse.Namespace, plan: dict[int, list[str]],
              hf: bool) -> dict[str, Any]:
    """Every planned (sequence, algorithm) at cp = world_size on this rank; transformers too on 1 rank."""
    torch.set_num_threads(args.threads if world_size == 1 else 1)
    eod = ByteTokenizer().eod
    rows, hf_rows = [], []
    for seq, algos in plan.items():
        full = batches(documents(args, seq, eod)[0], eod)
        for algo in algos:
            rows.append(measure(args, seq, "ring" if algo == BASELINE else algo, rank, world_size, full))
            rows[-1]["algo"] = algo
        if hf and world_size == 1:
            hf_rows.append(hf_measure(args, seq, full))
    return {"rank": rank, "rows": rows, "hf": hf_rows}


def _median_of_max(per_rank: list[list[float]]) -> float:
    """The median over reps of the slowest rank's seconds."""
    return statistics.median(max(rep) for rep in zip(*per_rank))


def variant_columns(row: dict[str, Any], ranks: list[dict[str, Any]], sdpa: bool = False) -> dict[str, Any]:
    """``row`` with each variant's median step time (slowest rank), activation and peak bytes (largest rank)."""
    for v in VARIANTS:
        row[f"{v}_s"] = _median_of_max([r["times"]["wall"][v] for r in ranks])
        row[f"{v}_cpu_s"] = _median_of_max([r["times"]["cpu"][v] for r in ranks])
        row[f"{v}_bytes"] = max(r["memory"][v]["act"] for r in ranks)
        row[f"{v}_peak_bytes"] = max(r["memory"][v]["peak"] for r in ranks)
        if sdpa:
            row[f"{v}_sdpa_ops"] = ranks[0]["memory"][v]["sdpa_ops"]
    row["time_ratio"] = row["packed_s"] / row["unpacked_s"]
    return row


def finish_row(n: int, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """One JSON record from the per-rank results of one (sequence, cp, algorithm)."""
    row = variant_columns({"seq": ranks[0]["seq"], "cp": n, "algo": ranks[0]["algo"]}, ranks)
    row["cpu_ratio"] = row["packed_cpu_s"] / row["unpacked_cpu_s"]
    row["mem_ratio"] = row["packed_bytes"] / row["unpacked_bytes"]
    row["peak_ratio"] = row["packed_peak_bytes"] / row["unpacked_peak_bytes"]
    row["time_ok"] = row["time_ratio"] <= TIME_GOAL
    row["mem_ok"] = row["mem_ratio"] <= MEMORY_GOAL
    row["reps"] = {v: [max(rep) for rep in zip(*[r["times"]["wall"][v] for r in ranks])] for v in VARIANTS}
    return row


def finish_hf(result: dict[str, Any], ours: dict[str, Any] | None) -> dict[str, Any]:
    out = variant_columns({"seq": result["seq"], "path": result["path"]}, [result], sdpa=True)
    out["ours_packed_s"] = ours["packed_s"] if ours else None
    out["ours_over_hf"] = ours["packed_s"] / out["packed_s"] if ours else None
    out["ours_over_hf_cpu"] = ours["packed_cpu_s"] / out["packed_cpu_s"] if ours else None
    out["faster_than_hf"] = None if ours is None else ours["packed_s"] < out["packed_s"]
    return out


def print_report(args: argparse.Namespace, rows: list[dict[str, Any]], hf_rows: list[dict[str, Any]],
                 skipped: list[str], docs: dict[int, dict[str, float]], load: dict[str, list[float]]) -> None:
    g = args.kv_heads or args.heads
    print(f"packed vs unpacked training step, whole {args.arch} model: {args.layers} layers h={args.hidden} "
          f"heads={args.heads} kv_heads={g} b={args.batch}, byte tokenizer, fp32, forward + backward + loss; "
          f"cp=1: {args.threads} threads, cp>1: 1 thread per rank, {os.cpu_count()} cores "
          f"(load average before {load['before'][0]:.2f}, after {load['after'][0]:.2f})")
    print("documents: " + "; ".join(f"s={s}: {d['count']} docs, mean {d['mean']:.0f}, max {d['max']}"
                                     for s, d in docs.items()) + f" (exponential, mean {args.mean_doc:g}, "
          f"seed {args.seed})")
    print(f"\ntime per step: median of {args.reps} after {args.warmup} warm-up (under cp: slowest rank per rep; cpu ratio: "
          "the same with process CPU time); "
          "act = saved-for-backward + ctx-held bytes; peak = live bytes allocated during forward + backward")
    print(f"{'seq':>5} {'cp':>3} {'algo':8} {'packed ms':>10} {'unpack ms':>10} {'ratio':>6} {'ok':>3} "
          f"{'act MiB p':>10} {'act MiB u':>10} {'ratio':>6} {'ok':>3} {'peak MiB p':>10} {'peak MiB u':>10} "
          f"{'ratio':>6} {'cpu ratio':>9}")
    for r in rows:
        print(f"{r['seq']:>5} {r['cp']:>3} {r['algo']:8} {1e3 * r['packed_s']:>10.1f} {1e3 * r['unpacked_s']:>10.1f} "
              f"{r['time_ratio']:>6.3f} {'yes' if r['time_ok'] else 'NO':>3} {mib(r['packed_bytes']):>10} "
              f"{mib(r['unpacked_bytes']):>10} {r['mem_ratio']:>6.3f} {'yes' if r['mem_ok'] else 'NO':>3} "
              f"{mib(r['packed_peak_bytes']):>10} {mib(r['unpacked_peak_bytes']):>10} {r['peak_ratio']:>6.3f} "
              f"{r['cpu_ratio']:>9.3f}")
    if hf_rows:
        print(f"\ntransformers {args.arch} (sdpa), same tokens, 1 rank, {args.threads} threads: packed = position_ids "
              "restarting per document")
        print(f"{'seq':>5} {'ours p ms':>10} {'hf p ms':>10} {'hf u ms':>10} {'hf p/u':>7} {'ours/hf':>8} "
              f"{'faster':>6} {'cpu o/hf':>8} {'hf act p':>10} {'hf peak p':>10}  hf packed mask")
        for h in hf_rows:
            ours = "-" if h["ours_packed_s"] is None else f"{1e3 * h['ours_packed_s']:.1f}"
            ratio = opt(h["ours_over_hf"])
            faster = "-" if h["faster_than_hf"] is None else ("yes" if h["faster_than_hf"] else "NO")
            print(f"{h['seq']:>5} {ours:>10} {1e3 * h['packed_s']:>10.1f} {1e3 * h['unpacked_s']:>10.1f} "
                  f"{h['time_ratio']:>7.3f} {ratio:>8} {faster:>6} {opt(h['ours_over_hf_cpu']):>8} {mib(h['packed_bytes']):>10} "
                  f"{mib(h['packed_peak_bytes']):>10}  {h['path']['packed']['mask']}")
    print("\nnotes:")
    if hf_rows:
        h = hf_rows[0]["path"]
        print(f"  transformers: packing detected from position_ids: packed {h['packed']['packing_detected']}, "
              f"unpacked {h['unpacked']['packing_detected']}; unpacked mask: {h['unpacked']['mask']}; "
              f"SDPA ops per packed step: {hf_rows[0]['packed_sdpa_ops']}.")
    cores = os.cpu_count() or 1
    if args.threads > 1 and max(load["before"][0], load["after"][0]) > cores - args.threads + 0.5:
        print(f"  load average {load['before'][0]:.2f}/{load['after'][0]:.2f} on {cores} cores: other processes shared "
              f"the cores, and {args.threads}-thread steps then wait for descheduled threads at every parallel op; the "
              "packed path runs many more small ops, so its cp=1 time suffers most. Compare --threads 1.")
    misses = [r for r in rows if not (r["time_ok"] and r["mem_ok"])]
    for r in misses:
        print(f"  s={r['seq']} cp={r['cp']} {r['algo']}: time {r['time_ratio']:.3f} (goal {TIME_GOAL}), "
              f"activations {r['mem_ratio']:.3f} (goal {MEMORY_GOAL})")
    if not misses:
        print(f"  every row meets packed <= {TIME_GOAL}x time and <= {MEMORY_GOAL}x activation bytes.")
    for s in skipped:
        print(f"  skipped {s}")
    print_json("packed", config=vars(args), load=load, documents=docs, skipped=skipped, rows=rows, hf=hf_rows)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Measure every row (and transformers on 1 rank), print the report; returns the JSON record's rows."""
    args = parse_args(argv)
    check_args(args)
    load = {"before": list(os.getloadavg())}
    seqs, algos = ints(args.seqs), names(args.algos)
    eod = ByteTokenizer().eod
    docs = {}
    for s in seqs:
        lengths = documents(args, s, eod)[1]
        docs[s] = {"count": len(lengths), "mean": float(np.mean(lengths)), "max": int(max(lengths))}
    hf = hf_available(args)
    rows: list[dict[str, Any]] = []
    hf_raw: list[dict[str, Any]] = []
    skipped: list[str] = []
    for n in ints(args.cp):
        plan: dict[int, list[str]] = {}
        for s in seqs:
            why = {a: cp_skip_reason(args, a, n, s) for a in algos} if n > 1 else {}
            skipped += [f"s={s} cp={n} {a}: {w}" for a, w in why.items() if w]
            if run := [BASELINE] if n == 1 else [a for a, w in why.items() if not w]:
                plan[s] = run
        if not plan:
            continue
        per_rank = run_distributed(rank_rows, n, args=args, plan=plan, hf=hf, timeout_s=3600.0)
        for i in range(len(per_rank[0]["rows"])):
            rows.append(finish_row(n, [r["rows"][i] for r in per_rank]))
        hf_raw += per_rank[0]["hf"]
    ours = {r["seq"]: r for r in rows if r["cp"] == 1}
    hf_rows = [finish_hf(h, ours.get(h["seq"])) for h in hf_raw]
    load["after"] = list(os.getloadavg())
    print_report(args, rows, hf_rows, skipped, docs, load)
    return {"rows": rows, "hf": hf_rows, "skipped": skipped}


if __name__ == "__main__":
    main()
