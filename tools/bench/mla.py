"""Multi-head latent attention: our MLA attention sublayer against transformers' DeepseekV3Attention on the same
weights (forward + backward time), and the decode cache bytes per token of MLA against MHA of the same width.

Side by side in one run; every time is the median of alternating (ABBA) repetitions on a shared host, so read the
ratios. Method and results: docs/benchmarks.md.
1. attention: ``SelfAttention`` with ``model.kv_lora_rank`` > 0 (``model/mla.py``; 1 rank, CPU) built by
   ``TransformerLayer`` with the model's init, against ``DeepseekV3Attention`` (rope not interleaved) holding the same
   weights, run with transformers' "sdpa" and "eager" attention. Both get the same input (ours ``[s, b, h]``,
   transformers' ``[b, s, h]``) and output gradient, and rotary tables made outside the timed region. bf16: bf16
   parameters and inputs under bf16 autocast for both, as our trainer runs. Before timing, every variant's output,
   input gradient and weight gradients are checked against transformers' eager in fp64 on the same (rounded) weights.
2. cache: a ``GPTModel`` of the MLA config and its MHA twin (the same heads, ``head_dim = qk_nope + qk_rope``, one kv
   head per query head) prefill ``--cache-tokens`` tokens into a ``model.inference.KVCache``; the bytes its buffers
   hold per token per layer, measured and by formula: MLA ``kv_lora_rank + qk_rope_head_dim`` values, MHA
   ``2 · heads · head_dim``, and tools/planner's figure.
Run from the repo root:  python tools/bench/mla.py [--dtypes fp32,bf16] [--seq 1024 --batch 2 --hidden 1024 --heads 16]
"""
from __future__ import annotations

import argparse
import copy
from collections.abc import Callable
from typing import Any

import torch

from common import (DTYPES, alternating, build_layer, gpt_config, host_memory, names, parser, print_json, rope, wall_cpu,
                    wall_cpu_stats)
from planner.dims import kv_cache_bytes_per_token
from megatron_sp.config.schema import ModelConfig
from megatron_sp.model import GPTModel
from megatron_sp.model.inference import KVCache
from megatron_sp.model.transformer import SelfAttention
from megatron_sp.mpu import ParallelContext

VARIANTS = ("ours", "hf sdpa", "hf eager")
TOLERANCE = {"fp32": 1e-5, "bf16": 3e-2}  # max |Δ| / max |ref| of any checked tensor against fp64
HF_NAMES = {"mla.q_down": "q_a_proj", "mla.q_latent_norm": "q_a_layernorm", "mla.q_up": "q_b_proj",
            "mla.q_proj": "q_proj", "mla.kv_down": "kv_a_proj_with_mqa", "mla.kv_latent_norm": "kv_a_layernorm",
            "mla.kv_up": "kv_b_proj", "out": "o_proj"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__, hidden=1024, heads=16, seq=1024, batch=2, seed=1234, warmup=1, reps=3, system_malloc=False)
    p.add_argument("--kv-lora-rank", type=int, default=256, help="model.kv_lora_rank (the latent's size)")
    p.add_argument("--q-lora-rank", type=int, default=384, help="model.q_lora_rank (0: a full query projection)")
    p.add_argument("--nope", type=int, default=64, help="model.qk_nope_head_dim")
    p.add_argument("--rope", type=int, default=32, help="model.qk_rope_head_dim")
    p.add_argument("--v-dim", type=int, default=64, help="model.v_head_dim")
    p.add_argument("--dtypes", default="fp32,bf16", help=f"comma-separated, of {','.join(DTYPES)}")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1: on a shared 2-core host two threads "
                   "wait on each other and the ratios swing by ±30 %%)")
    p.add_argument("--cache-tokens", type=int, default=16, help="tokens prefilled into the KV cache of part 2")
    p.add_argument("--cache-layers", type=int, default=2, help="layers of the models of part 2")
    args = p.parse_args(argv)
    if any(d not in DTYPES for d in names(args.dtypes)):
        raise SystemExit(f"--dtypes: choose from {', '.join(DTYPES)}")
    if min(args.hidden, args.heads, args.seq, args.batch, args.kv_lora_rank, args.rope, args.v_dim, args.reps,
           args.cache_tokens, args.cache_layers) < 1 or min(args.q_lora_rank, args.nope, args.warmup) < 0:
        raise SystemExit("sizes, --reps, --cache-tokens and --cache-layers must be >= 1; --q-lora-rank, --nope and "
                         "--warmup >= 0")
    return args


def mla_config(args: argparse.Namespace, layers: int = 1) -> ModelConfig:
    """DeepSeek-V3's norm eps 1e-6: transformers' latent norms always take theirs (``DeepseekV3RMSNorm``'s default)."""
    return gpt_config(args, 256, arch="llama", num_layers=layers, hidden_size=args.hidden, num_heads=args.heads,
                      kv_lora_rank=args.kv_lora_rank, q_lora_rank=args.q_lora_rank, qk_nope_head_dim=args.nope,
                      qk_rope_head_dim=args.rope, v_head_dim=args.v_dim, seq_length=args.seq, norm_eps=1e-6).model


def mha_config(args: argparse.Namespace, layers: int) -> ModelConfig:
    """The MHA twin of ``mla_config``: the same heads of ``head_dim = nope + rope``, as many kv heads."""
    return gpt_config(args, 256, arch="llama", num_layers=layers, hidden_size=args.hidden, num_heads=args.heads,
                      num_kv_heads=args.heads, head_dim=args.nope + args.rope, seq_length=args.seq).model


# ----------------------------------------------------------------------------- 1. the attention sublayer

def hf_attention(cfg: ModelConfig, ours: SelfAttention) -> tuple[torch.nn.Module, torch.nn.Module]:
    """transformers' ``DeepseekV3Attention`` of ``cfg`` holding ``ours``'s weights, and its rotary embedding."""
    import transformers
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    hf_cfg = transformers.DeepseekV3Config(
        hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_heads,
        q_lora_rank=cfg.q_lora_rank or None, kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim, rope_interleave=False,
        rms_norm_eps=cfg.norm_eps, max_position_embeddings=cfg.seq_length,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rotary_base})
    hf = DeepseekV3Attention(hf_cfg, layer_idx=0)
    theirs = dict(hf.named_parameters())
    with torch.no_grad():
        for name, p in ours.named_parameters():
            module, param = name.rsplit(".", 1)
            theirs[f"{HF_NAMES[module]}.{param}"].copy_(p)
    return hf.to(next(ours.parameters()).dtype).train(), DeepseekV3RotaryEmbedding(hf_cfg)


def grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weight gradients of ours or of transformers' attention, under our names."""
    if isinstance(module, SelfAttention):
        return {n: p.grad for n, p in module.named_parameters()}
    back = {hf: ours for ours, hf in HF_NAMES.items()}
    return {f"{back[n.rsplit('.', 1)[0]]}.{n.rsplit('.', 1)[1]}": p.grad for n, p in module.named_parameters()}


def max_rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """``max |got − want| / max |want|`` in fp64."""
    want = want.double()
    return ((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-300)).item()


def attention_case(args: argparse.Namespace, dtype_name: str) -> list[dict[str, Any]]:
    """One row per variant: errors against fp64, time, speedups."""
    cfg = mla_config(args)
    dtype, bf16 = DTYPES[dtype_name], dtype_name == "bf16"
    ours: SelfAttention = build_layer(cfg, ParallelContext(), args.seed).attention.to(dtype)
    hf, hf_rope = hf_attention(cfg, ours)
    gen = torch.Generator().manual_seed(args.seed)
    x, dout = (torch.randn(args.seq, args.batch, args.hidden, generator=gen).to(dtype) for _ in range(2))  # [s, b, h]
    x_bsh, dout_bsh = x.transpose(0, 1).contiguous(), dout.transpose(0, 1).contiguous()
    cos, sin = rope(cfg, args.seq, dtype)  # [s, 1, rope]
    positions = torch.arange(args.seq).expand(args.batch, args.seq)

    def run_hf(module: torch.nn.Module, impl: str, xb: torch.Tensor, db: torch.Tensor) -> tuple[torch.Tensor, ...]:
        module.config._attn_implementation = impl
        leaf = xb.detach().requires_grad_(True)
        module.zero_grad(set_to_none=True)
        mask = causal[xb.dtype] if impl == "eager" else None  # sdpa: is_causal, as transformers' models call it
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16 and xb.dtype != torch.float64):
            y = module(leaf, hf_tables[xb.dtype], mask)[0]
        y.backward(db)
        return y.transpose(0, 1), leaf.grad.transpose(0, 1)

    def run_ours() -> tuple[torch.Tensor, ...]:
        leaf = x.detach().requires_grad_(True)
        ours.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            y = ours(leaf, cos, sin)
        y.backward(dout)
        return y, leaf.grad

    hf_tables = {t: hf_rope(torch.empty(0, dtype=t), positions) for t in (dtype, torch.float64)}
    causal = {t: torch.full((args.seq, args.seq), torch.finfo(t).min, dtype=t).triu(1)[None, None]
              for t in (dtype, torch.float64)}  # [1, 1, s, s]: the additive mask transformers gives eager
    ref = copy.deepcopy(hf).double()
    want_out, want_dx = run_hf(ref, "eager", x_bsh.double(), dout_bsh.double())
    want = {"out": want_out, "dx": want_dx, **grads(ref)}
    del ref
    runs: dict[str, Callable[[], tuple[torch.Tensor, ...]]] = {
        "ours": run_ours, **{f"hf {impl}": (lambda impl=impl: run_hf(hf, impl, x_bsh, dout_bsh))
                             for impl in ("sdpa", "eager")}}
    rows = []
    for name, run in runs.items():
        out, dx = run()
        errors = {"out": max_rel(out, want["out"]), "dx": max_rel(dx, want["dx"]),
                  **{k: max_rel(g, want[k]) for k, g in grads(ours if name == "ours" else hf).items()}}
        worst = max(errors.values())
        if worst > TOLERANCE[dtype_name]:
            raise SystemExit(f"{name} {dtype_name}: max relative error {worst:.1e} against fp64 above "
                             f"{TOLERANCE[dtype_name]:.0e}: {errors}")
        rows.append({"dtype": dtype_name, "impl": name, "errors": errors, "max_rel_error": worst})
    times = alternating({name: lambda run=run: wall_cpu(run) for name, run in runs.items()}, args.warmup, args.reps)
    for row in rows:
        row.update(wall_cpu_stats(times[row["impl"]]))
    by = {r["impl"]: r for r in rows}
    for row in rows:
        for impl in ("hf sdpa", "hf eager"):
            key = impl.replace(" ", "_")
            row[f"speedup_vs_{key}"] = by[impl]["s"] / row["s"]  # medians
            row[f"best_speedup_vs_{key}"] = by[impl]["best_s"] / row["best_s"]  # the least disturbed runs
    return rows


# ----------------------------------------------------------------------------- 2. the decode cache

def cache_bytes(cfg: ModelConfig, dtype: torch.dtype, tokens: int, seed: int) -> dict[str, Any]:
    """Bytes per token per layer that a ``KVCache`` of exactly ``tokens`` holds after ``GPTModel`` prefilled them
    (one sequence), every layer's ``k`` and ``v`` buffers counted; and the shape of layer 0's."""
    model = GPTModel(cfg, seed=seed).to(dtype).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(seed))
    cache = KVCache(tokens)
    with torch.no_grad():
        model(ids, kv_cache=cache)
    layers = [cache.layer(i) for i in range(cfg.num_layers)]
    total = sum(t.numel() * t.element_size() for layer in layers for t in (layer.k, layer.v))
    return {"bytes_per_token_per_layer": total / (tokens * cfg.num_layers),
            "k_per_token": list(layers[0].k.shape[2:]), "v_per_token": list(layers[0].v.shape[2:])}


def cache_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Per dtype: MLA's and MHA's measured cache bytes, their ratio, the formula and the planner's figures."""
    mla, mha = mla_config(args, args.cache_layers), mha_config(args, args.cache_layers)
    rows = []
    for dtype_name in names(args.dtypes):
        dtype = DTYPES[dtype_name]
        size = torch.empty(0, dtype=dtype).element_size()
        got = {name: cache_bytes(cfg, dtype, args.cache_tokens, args.seed) for name, cfg in (("mla", mla), ("mha", mha))}
        formula = (args.kv_lora_rank + args.rope) / (2 * args.heads * (args.nope + args.rope))
        rows.append({"dtype": dtype_name, "mla": got["mla"], "mha": got["mha"],
                     "mla_formula_bytes": (args.kv_lora_rank + args.rope) * size,
                     "mha_formula_bytes": 2 * args.heads * (args.nope + args.rope) * size,
                     "mla_planner_bytes": kv_cache_bytes_per_token(mla, size, layers=1),
                     "mha_planner_bytes": kv_cache_bytes_per_token(mha, size, layers=1),
                     "ratio": got["mla"]["bytes_per_token_per_layer"] / got["mha"]["bytes_per_token_per_layer"],
                     "formula_ratio": formula})
    return rows


# ----------------------------------------------------------------------------- report

def print_attention(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(f"1. MLA attention sublayer forward + backward, s {args.seq}, b {args.batch}, h {args.hidden}, heads "
          f"{args.heads}, kv_lora {args.kv_lora_rank}, q_lora {args.q_lora_rank}, nope/rope/v {args.nope}/{args.rope}/"
          f"{args.v_dim}; {args.threads} threads, median (best) of {args.reps}, ratios of medians (of bests); error: "
          "max |Δ| / max |ref| against fp64 (output, input and weight gradients)")
    head = ("dtype", "impl", "ms", "best ms", "cpu ms", "× hf sdpa", "× hf eager", "max rel err")
    print(" | ".join(f"{h:>12}" for h in head))
    for r in rows:
        cells = (r["dtype"], r["impl"], f"{r['s'] * 1e3:.0f}", f"{r['best_s'] * 1e3:.0f}", f"{r['cpu_s'] * 1e3:.0f}",
                 f"{r['speedup_vs_hf_sdpa']:.2f} ({r['best_speedup_vs_hf_sdpa']:.2f})",
                 f"{r['speedup_vs_hf_eager']:.2f} ({r['best_speedup_vs_hf_eager']:.2f})", f"{r['max_rel_error']:.1e}")
        print(" | ".join(f"{c:>12}" for c in cells))


def print_cache(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(f"\n2. decode KV cache bytes per token per layer ({args.cache_layers}-layer GPTModel, {args.cache_tokens} "
          f"prefilled tokens): MLA (kv_lora {args.kv_lora_rank} + rope {args.rope}) against MHA ({args.heads} heads × "
          f"{args.nope + args.rope}, k and v); measured / formula / planner")
    head = ("dtype", "MLA bytes", "MHA bytes", "MLA/MHA", "formula", "planner MLA", "planner MHA")
    print(" | ".join(f"{h:>12}" for h in head))
    for r in rows:
        cells = (r["dtype"], f"{r['mla']['bytes_per_token_per_layer']:,.0f}", f"{r['mha']['bytes_per_token_per_layer']:,.0f}",
                 f"{r['ratio']:.5f}", f"{r['formula_ratio']:.5f}", f"{r['mla_planner_bytes']:,.0f}",
                 f"{r['mha_planner_bytes']:,.0f}")
        print(" | ".join(f"{c:>12}" for c in cells))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    host_memory(args)
    try:
        attention = [r for d in names(args.dtypes) for r in attention_case(args, d)]
        cache = cache_rows(args)
    finally:
        torch.set_num_threads(threads)
    print_attention(attention, args)
    print_cache(cache, args)
    goals = {f"{r['dtype']}_vs_{impl}{best}": r[f"{best[1:]}_speedup_vs_{impl}" if best else f"speedup_vs_{impl}"]
             for r in attention if r["impl"] == "ours" for impl in ("hf_sdpa", "hf_eager") for best in ("", "_best")}
    goals.update({f"{r['dtype']}_cache_ratio": r["ratio"] for r in cache})
    checks = {"cache_ratio_equals_formula": all(r["ratio"] == r["formula_ratio"] for r in cache),
              "cache_equals_planner": all(r[f"{m}_planner_bytes"] == r[m]["bytes_per_token_per_layer"]
                                          for r in cache for m in ("mla", "mha"))}
    print("\ngoals (issue 41: ours >= 1.0x transformers; cache ratio (kv_lora + rope) / (2 · heads · head_dim)): "
          + ", ".join(f"{k} {v:.3f}" for k, v in goals.items()))
    print(f"checks: {checks}")
    result = {"config": vars(args), "checks": checks, "goals": goals, "attention": attention, "cache": cache}
    print_json("mla", **result)
    return result


if __name__ == "__main__":
    main()
