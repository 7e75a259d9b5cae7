"""Generation: tokens/s and memory per rank of ``inference.generate_batch`` at 1 rank, tp2, pp2, tp2·pp2, against transformers.

Greedy decoding of the same random prompts (``--prompt-len`` tokens each, ``--new-tokens`` new ones, no EOD) by one
``GPTModel`` (fp32, initialised from the seed, so every layout holds its shards of the same weights) at each batch size
of ``--batches`` (batch b: the first b prompts). Time: a prefill run (``max_new_tokens=1``: the prompts' forward and the
first token) and a full run alternate (ABBA) for ``--reps`` rounds after ``--warmup``; prefill tokens/s = b·prompt /
prefill time, decode tokens/s = b·(new − 1) / (full − prefill time of the same round), medians over the rounds. Ours at 1
rank and transformers' ``generate`` on the exported model (``hf_names.build_hf_model``: the same weights, its tokens
checked equal first) alternate in this process with ``--threads`` threads; each multi-rank layout runs on its own gloo
ranks (``run_distributed``, one thread each: tp2·pp2 puts 4 ranks on 2 cores here), a round taking its slowest rank's
time. Memory per rank: the weights plus the most tensor bytes alive at once (``common.LiveBytes``) during the prefill and
during the decode of an untimed full run (KV cache included), and each rank process's peak resident set. The host is
shared: read the ratios, which one run measures side by side. Method and results: docs/generation.md.
Run from the repo root:  python tools/bench/generate.py [--quick] [--batches 1,8] [--layouts tp2,pp2,tp2pp2]
"""
from __future__ import annotations

import argparse
import itertools
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from common import LiveBytes, alternating, apply_quick, gpt_config, host_memory, ints, mib, names, opt, parser, print_json, wall_cpu
from megatron_sp import device
from megatron_sp.config import Config
from megatron_sp.model import GPTModel
from megatron_sp.model.inference import KVCache, generate_batch
from megatron_sp.mpu import ParallelContext, ParallelDims, comm, initialize
from megatron_sp.pipeline.partition import build_stage
from megatron_sp.testing import run_distributed

# common.py puts tools/ first on sys.path; the ranks import this file by its module name, ``generate``, which must not
# resolve to tools/generate.py (run_distributed's children take this process's sys.path)
sys.path.insert(0, str(Path(__file__).resolve().parent))

QUICK = {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "seq": 32, "vocab": 256, "prompt_len": 6,
         "new_tokens": 4, "warmup": 0, "reps": 1}
Run = Callable[[], list[list[int]]]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__, arch="llama", layers=8, hidden=512, heads=8, kv_heads=2, seq=512, vocab=4096, seed=1234,
               warmup=1, reps=3, verbose=False, system_malloc=False)
    p.add_argument("--quick", action="store_true", help="a tiny model, one round (the smoke test)")
    p.add_argument("--layouts", default="tp2,pp2,tp2pp2",
                   help="comma-separated multi-rank layouts tpXppY ('' for none); 1 rank and transformers always run")
    p.add_argument("--batches", default="1,8", help="comma-separated batch sizes (prompts decoded together)")
    p.add_argument("--prompt-len", type=int, default=64, help="tokens per prompt")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated per prompt")
    p.add_argument("--init-std", type=float, default=0.05,
                   help="weight init std: at 0.05 greedy continuations vary (at the config's 0.02 they repeat a few "
                        "tokens), so equal tokens is a real check")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads of the in-process runs (ours at 1 rank, transformers); each rank runs one")
    args = p.parse_args(argv)
    apply_quick(args, argv, QUICK)  # flags given with --quick keep their values
    args.batch_sizes = sorted(set(ints(args.batches)))
    args.dims = {name: layout_dims(name) for name in names(args.layouts)}
    if not args.batch_sizes or min(args.batch_sizes) < 1 or min(args.reps, args.threads) < 1 or args.warmup < 0:
        raise SystemExit("--batches, --reps and --threads must be >= 1, --warmup >= 0")
    if args.prompt_len < 2 or args.new_tokens < 2:
        raise SystemExit("--prompt-len and --new-tokens must be >= 2 (a prefill of several tokens, then decode steps)")
    if args.prompt_len + args.new_tokens - 1 > args.seq:
        raise SystemExit(f"--prompt-len {args.prompt_len} + --new-tokens {args.new_tokens} - 1 exceed --seq {args.seq}: "
                         "the sequences would stop at the context")
    return args


def layout_dims(name: str) -> tuple[int, int]:
    """``"tp2pp2"`` → ``(2, 2)``; SystemExit on anything else than tpXppY with a degree above 1."""
    match = re.fullmatch(r"(?:tp(\d+))?(?:pp(\d+))?", name)
    if match is None or not name:
        raise SystemExit(f"--layouts: {name!r} is not tpXppY (e.g. tp2, pp2, tp2pp2)")
    tp, pp = int(match[1] or 1), int(match[2] or 1)
    if min(tp, pp) < 1 or tp * pp == 1:
        raise SystemExit(f"--layouts: {name!r} needs more than one rank (1 rank always runs)")
    return tp, pp


def model_config(args: argparse.Namespace) -> Config:
    """The model of every layout: the flags at the init std, the vocabulary padded for the widest TP of ``--layouts``."""
    tp = max([1, *(t for t, _ in args.dims.values())])
    return gpt_config(args, None, f"model.init_std={args.init_std}", f"parallel.tp={tp}", world_size=tp,
                      num_kv_heads=args.kv_heads if args.arch == "llama" else None)


def make_prompts(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(args.seed)
    return torch.randint(0, vocab, (max(args.batch_sizes), args.prompt_len), generator=gen).tolist()


# ----------------------------------------------------------------------------- one run, its time, its memory

def ours_run(model: GPTModel, prompts: list[list[int]], new: int, state: Any = None) -> Run:
    """Our greedy generation of ``new`` tokens per prompt as a closure returning the new ids."""
    return lambda: [c.new_ids for c in generate_batch(model, prompts, new, None, state=state)]


def hf_run(hf: torch.nn.Module, prompts: list[list[int]], new: int, vocab: int, padded: int) -> Run:
    """transformers' greedy ``generate`` of exactly ``new`` tokens (no EOS; the padded vocabulary rows suppressed)."""
    ids = torch.tensor(prompts)
    extra = {"suppress_tokens": list(range(vocab, padded))} if padded > vocab else {}

    def run() -> list[list[int]]:
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new,
                              eos_token_id=None, pad_token_id=0, **extra)
        return out[:, ids.shape[1]:].tolist()
    return run


def timed(run: Run, sync: Callable[[], None] = lambda: None) -> Callable[[], tuple[float, float]]:
    """``run``'s wall and process-CPU seconds as a closure, after ``sync()`` (a barrier over the ranks)."""
    def step() -> tuple[float, float]:
        sync()
        return wall_cpu(run)
    return step


def weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return list(itertools.chain(model.parameters(), model.buffers()))


def phase_memory(model: torch.nn.Module, run: Run, decoding: Callable[[dict[str, Any]], bool]) -> dict[str, int | None]:
    """Bytes of ``model``'s rank during ``run()`` (untimed: ``LiveBytes`` intercepts every op): the weights, plus the
    most tensor bytes alive at once during the prefill and during the decode; the peak is read and restarted at the
    first forward whose keywords ``decoding`` calls a decode step. ``kv_cache_bytes``: the ``KVCache``s it was given."""
    held = weights(model)  # excluded from the live bytes: an op returning a view of one (``t()``) would count it
    live, prefill, caches = LiveBytes({t.untyped_storage().data_ptr() for t in held}), [], {}

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        if isinstance(kwargs.get("kv_cache"), KVCache):
            caches[id(kwargs["kv_cache"])] = kwargs["kv_cache"]
        if not prefill and decoding(kwargs):
            prefill.append(live.peak)
            live.peak = live.now
    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with live:
            run()
    finally:
        handle.remove()
    held_bytes = sum(t.numel() * t.element_size() for t in held)
    layers = [int(i) for i in getattr(model, "layers", {})]
    kv = sum(t.numel() * t.element_size() for c in caches.values() for i in layers
             for t in (c.layer(i).k, c.layer(i).v) if t is not None)
    first = prefill[0] if prefill else live.peak  # (no decode step: one new token)
    return {"weights_bytes": held_bytes, "prefill_peak_bytes": held_bytes + first, "decode_peak_bytes": held_bytes + live.peak,
            "kv_cache_bytes": kv if caches else None}


def ours_decoding(kwargs: dict[str, Any]) -> bool:
    cache = kwargs.get("kv_cache")
    return cache is not None and cache.length > 0  # (every micro-batch of a pipeline is prefilled first)


def hf_decoding(kwargs: dict[str, Any]) -> bool:
    return kwargs["input_ids"].shape[1] == 1  # one new token per sequence (the prompts have >= 2)


# ----------------------------------------------------------------------------- the runs

def one_rank(args: argparse.Namespace, cfg: Config, prompts: list[list[int]]) -> dict[int, dict[str, Any]]:
    """Per batch size, ours at 1 rank and transformers in this process, alternating: tokens, times, memory."""
    from megatron_sp.model.hf_names import build_hf_model

    model = GPTModel(cfg.model, seed=args.seed).eval()
    hf = build_hf_model(cfg.model, model.state_dict())
    out = {}
    for b in args.batch_sizes:
        batch = prompts[:b]
        runs = {"ours": {n: ours_run(model, batch, new) for n, new in (("prefill", 1), ("full", args.new_tokens))},
                "transformers": {n: hf_run(hf, batch, new, cfg.model.vocab_size, cfg.model.padded_vocab_size)
                                 for n, new in (("prefill", 1), ("full", args.new_tokens))}}
        tokens = {impl: r["full"]() for impl, r in runs.items()}
        memory = {"ours": phase_memory(model, runs["ours"]["full"], ours_decoding),
                  "transformers": phase_memory(hf, runs["transformers"]["full"], hf_decoding)}
        times = alternating({f"{impl} {phase}": timed(run) for impl, r in runs.items() for phase, run in r.items()},
                            args.warmup, args.reps)
        out[b] = {impl: {"tokens": [tokens[impl]], "memory": [memory[impl]],
                         "prefill": times[f"{impl} prefill"], "full": times[f"{impl} full"]} for impl in runs}
    return out


def layout_rank(rank: int, world_size: int, args: argparse.Namespace, tp: int, pp: int,
                prompts: list[list[int]]) -> dict[str, Any]:
    """This rank of a tp × pp layout: its stage of the model, then per batch size its tokens, memory and times."""
    torch.set_num_threads(1)
    host_memory(args)
    state = initialize(ParallelDims(tp=tp, pp=pp, world_size=world_size))
    model = build_stage(model_config(args).model, args.seed, state, ParallelContext.from_state(state)).eval()
    out: dict[str, Any] = {"rank": rank, "tp_rank": state.tp_rank, "pp_rank": state.pp_rank, "batches": {}}
    for b in args.batch_sizes:
        runs = {n: ours_run(model, prompts[:b], new, state) for n, new in (("prefill", 1), ("full", args.new_tokens))}
        tokens = runs["full"]()
        memory = phase_memory(model, runs["full"], ours_decoding)
        times = alternating({n: timed(run, comm.barrier) for n, run in runs.items()}, args.warmup, args.reps)
        out["batches"][b] = {"tokens": tokens, "memory": memory, **times}
    out["rss_peak_bytes"] = device.memory_bytes(torch.device("cpu"))  # this rank's process (torch's runtime included)
    state.destroy()
    return out


def layout(args: argparse.Namespace, tp: int, pp: int, prompts: list[list[int]]) -> dict[int, dict[str, Any]]:
    """Per batch size, every rank's tokens and memory, and each round's wall and CPU seconds of the slowest rank."""
    ranks = run_distributed(layout_rank, tp * pp, args=args, tp=tp, pp=pp, prompts=prompts)
    out = {}
    for b in args.batch_sizes:
        per = [r["batches"][b] for r in ranks]
        out[b] = {"tokens": [r["tokens"] for r in per],
                  "memory": [{"rank": r["rank"], "tp_rank": r["tp_rank"], "pp_rank": r["pp_rank"], **p["memory"],
                              "rss_peak_bytes": r["rss_peak_bytes"]} for r, p in zip(ranks, per)],
                  **{phase: [tuple(max(p[phase][i][k] for p in per) for k in (0, 1)) for i in range(args.reps)]
                     for phase in ("prefill", "full")}}  # (wall, cpu) of the slowest rank
    return out


# ----------------------------------------------------------------------------- report

def row(args: argparse.Namespace, impl: str, name: str, tp: int, pp: int, b: int, got: dict[str, Any],
        want: list[list[int]]) -> dict[str, Any]:
    """One (implementation, layout, batch) record: times, tokens/s, memory per rank, tokens against ``want``."""
    prefill, full = [w for w, _ in got["prefill"]], [w for w, _ in got["full"]]
    decode = [f - p for p, f in zip(prefill, full)]  # the same round's pair
    decode_cpu = [f - p for (_, p), (_, f) in zip(got["prefill"], got["full"])]
    steps = args.new_tokens - 1
    r: dict[str, Any] = {"impl": impl, "layout": name, "tp": tp, "pp": pp, "world": tp * pp, "batch": b,
                         "threads_per_rank": args.threads if tp * pp == 1 else 1,
                         "prefill_s": statistics.median(prefill), "prefill_best_s": min(prefill),
                         "full_s": statistics.median(full), "decode_s": statistics.median(decode),
                         "decode_best_s": min(decode), "prefill_cpu_s": statistics.median(c for _, c in got["prefill"]),
                         "decode_cpu_s": statistics.median(decode_cpu)}
    r["prefill_tokens_per_s"] = b * args.prompt_len / r["prefill_s"]
    for key in ("", "_best"):  # a decode time at or below 0 (timing noise on a tiny model) has no rate
        r[f"decode{key}_tokens_per_s"] = b * steps / r[f"decode{key}_s"] if r[f"decode{key}_s"] > 0 else None
    r["decode_step_ms"], r["decode_step_cpu_ms"] = r["decode_s"] / steps * 1e3, r["decode_cpu_s"] / steps * 1e3
    r["memory"] = got["memory"]
    for key in ("prefill_peak_bytes", "decode_peak_bytes", "weights_bytes"):
        r[f"max_{key}"] = max(m[key] for m in got["memory"])
    r["tokens_equal"] = all(t == want for t in got["tokens"])  # every rank's tokens equal the reference
    return r


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Each row's decode and prefill rates over transformers' and over ours at 1 rank, at its batch size."""
    base = {(r["impl"], r["layout"], r["batch"]): r for r in rows}
    for r in rows:
        for ref, key in ((base["transformers", "1", r["batch"]], "transformers"), (base["ours", "1", r["batch"]], "1rank")):
            for phase in ("decode", "decode_best", "prefill"):
                r[f"{phase}_vs_{key}"] = ratio(r[f"{phase}_tokens_per_s"], ref[f"{phase}_tokens_per_s"])


def print_table(args: argparse.Namespace, cfg: Config, rows: list[dict[str, Any]]) -> None:
    m = cfg.model
    print(f"generation, {m.arch} L {m.num_layers} h {m.hidden_size} heads {m.num_heads}/{m.num_kv_heads} kv, vocab "
          f"{m.vocab_size}, seq {m.seq_length}, fp32, greedy; prompts {args.prompt_len} tokens, {args.new_tokens} new; "
          f"1 rank and transformers: {args.threads} thread(s) in this process, layouts: 1 thread per rank; median of "
          f"{args.reps} rounds; decode = full run − prefill run; cpu: process CPU of the slowest rank; ratios of rates "
          "(decode: median, best); memory: max over ranks of weights + peak live tensors")
    head = ("impl", "layout", "b", "prefill ms", "prefill tok/s", "decode ms/step", "cpu ms/step", "decode tok/s",
            "× transformers", "× 1 rank", "prefill × tf", "prefill MiB", "decode MiB", "KV MiB", "tokens")
    print(" | ".join(f"{h:>14}" for h in head))
    for r in rows:
        kv = [x["kv_cache_bytes"] for x in r["memory"] if x["kv_cache_bytes"] is not None]
        cells = (r["impl"], r["layout"], r["batch"], f"{r['prefill_s'] * 1e3:.1f}", f"{r['prefill_tokens_per_s']:.0f}",
                 f"{r['decode_step_ms']:.2f}", f"{r['decode_step_cpu_ms']:.2f}", opt(r["decode_tokens_per_s"], ".0f"),
                 f"{opt(r['decode_vs_transformers'], '.2f')} ({opt(r['decode_best_vs_transformers'], '.2f')})",
                 f"{opt(r['decode_vs_1rank'], '.2f')} ({opt(r['decode_best_vs_1rank'], '.2f')})",
                 opt(r["prefill_vs_transformers"], ".2f"), mib(r["max_prefill_peak_bytes"], 1),
                 mib(r["max_decode_peak_bytes"], 1), mib(max(kv), 1) if kv else "-", "equal" if r["tokens_equal"] else "DIFFER")
        print(" | ".join(f"{c:>14}" for c in cells))
    print("\nmemory per rank, MiB (weights / prefill peak / decode peak / KV cache / process peak RSS):")
    for r in rows:
        if r["world"] > 1 or args.verbose:
            print(f"  {r['impl']} {r['layout']} b {r['batch']}: " + "; ".join(
                f"rank {x.get('rank', 0)} {mib(x['weights_bytes'], 1)} / {mib(x['prefill_peak_bytes'], 1)} / "
                f"{mib(x['decode_peak_bytes'], 1)} / {'-' if x['kv_cache_bytes'] is None else mib(x['kv_cache_bytes'], 1)}"
                f" / {mib(x['rss_peak_bytes'], 0) if x.get('rss_peak_bytes') else '-'}" for x in r["memory"]))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    cfg = model_config(args)
    prompts = make_prompts(args, cfg.model.vocab_size)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    host_memory(args)
    try:
        single = one_rank(args, cfg, prompts)
    finally:
        torch.set_num_threads(threads)
    multi = {name: layout(args, tp, pp, prompts) for name, (tp, pp) in args.dims.items()}
    rows = []
    for b in args.batch_sizes:
        want = single[b]["ours"]["tokens"][0]
        rows += [row(args, impl, "1", 1, 1, b, single[b][impl], want) for impl in ("transformers", "ours")]
        rows += [row(args, "ours", name, *args.dims[name], b, multi[name][b], want) for name in multi]
    add_ratios(rows)
    print_table(args, cfg, rows)
    smallest = single[args.batch_sizes[0]]["ours"]["tokens"][0]
    checks = {"tokens_equal_transformers": all(r["tokens_equal"] for r in rows if r["impl"] == "transformers"),
              "tokens_equal_across_layouts": all(r["tokens_equal"] for r in rows if r["impl"] == "ours"),
              "batch_independent": all(single[b]["ours"]["tokens"][0][:len(smallest)] == smallest
                                       for b in args.batch_sizes)}
    goals = {f"b{r['batch']}_{phase}_vs_transformers": r[f"{phase}_vs_transformers"] for r in rows
             if r["impl"] == "ours" and r["layout"] == "1" for phase in ("decode", "decode_best", "prefill")}
    print("\ngoal (issues 34, 39: decode and prefill at least transformers' speed): "
          + ", ".join(f"{k} {opt(v, '.2f')}" for k, v in goals.items()))
    print(f"checks: {checks}")
    config = {k: v for k, v in vars(args).items() if k not in ("dims", "batch_sizes")}
    config["transformers"] = __import__("transformers").__version__
    result = {"config": config, "checks": checks, "goals": goals, "rows": rows}
    print_json("generate", **result)
    return result


if __name__ == "__main__":
    main()
