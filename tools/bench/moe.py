"""Mixture of experts: our MoE block against transformers' Mixtral block, a MoE step against its dense twin, ep2 against ep1.

Side by side in one run; every time is the median of alternating (ABBA) repetitions, and the host is shared, so
read the ratios. Method and results: docs/moe.md.
1. block: forward + backward of ``model.moe.MoE`` (built by ``TransformerLayer``: llama SwiGLU experts, softmax
   top-k, aux loss off since Mixtral's block has none) against transformers' ``MixtralSparseMoeBlock`` holding the same
   weights (through ``hf_names``' Mixtral export), with transformers' "eager" experts (a Python loop over experts) and
   "grouped_mm" (the default ``MixtralForCausalLM`` picks since transformers 5); ours with the grouped GEMM and with
   the loop backend. bf16: bf16 parameters under bf16 autocast for both, as our trainer runs. Every variant is first
   checked against an fp64 reference (output, input gradient, router and expert gradients).
2. step: one training step (forward, backward, AdamW through our ``DistributedOptimizer``, as throughput.py times
   it) of a MoE ``GPTModel`` against the dense model with the same active parameters (dense ffn = top_k · moe_ffn).
3. and 4. on 2 gloo ranks (dp2, one thread each): ``training.train_step`` of the same MoE model and global batch at
   ep1 and ep2, alternating: the step times, the first losses (equal), and at ep2 the bytes each rank passes to the
   dispatcher's all-to-alls (``comm.all_to_all_uneven``, every row including its own block, forward and backward),
   against tools/planner's ``traffic.moe_all_to_all_bytes``.
Run from the repo root:  python tools/bench/moe.py [--quick] [--dtypes fp32,bf16] [--block-cases 8x2x1408,64x2x176]
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from common import (DTYPES, alternating, apply_quick, build_layer, gpt_config, host_memory, names, parser, print_json, wall_cpu,
                    wall_cpu_stats)
from megatron_sp import training
from megatron_sp.config import Config
from megatron_sp.model import GPTModel, count_parameters
from megatron_sp.model.hf_names import check_mixtral, hf_config_dict, to_hf_state_dict
from megatron_sp.model.moe import MoE, route
from megatron_sp.mpu import ParallelContext, ParallelDims, comm, initialize
from megatron_sp.mpu.random import get_tracker, init_rng
from megatron_sp.optim import DistributedOptimizer, named_trainable
from megatron_sp.optim.grad_scaler import DynamicLossScaler
from megatron_sp.testing import run_distributed

LR = 1e-4
EP_WORLD = 2
BLOCK_VARIANTS = ("ours grouped", "ours loop", "hf eager", "hf grouped_mm")
TOLERANCE = {"fp32": 1e-5, "bf16": 3e-2}  # max relative (Frobenius) error of any checked tensor against fp64
QUICK = {"block_hidden": 64, "block_tokens": 256, "block_cases": "8x2x64,64x2x16", "layers": 1, "hidden": 64, "heads": 4,
         "seq": 32, "batch": 4, "vocab": 256, "moe_ffn": 64, "warmup": 0, "reps": 1, "steps": 1, "threads": 1}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__, layers=2, hidden=256, heads=4, seq=256, batch=4, vocab=2048, seed=1234, warmup=1, reps=3, steps=5,
               system_malloc=False)
    p.add_argument("--quick", action="store_true", help="tiny sizes, one repetition (the smoke test)")
    p.add_argument("--dtypes", default="fp32,bf16", help=f"comma-separated, of {','.join(DTYPES)}")
    p.add_argument("--threads", type=int, default=2, help="torch threads of parts 1 and 2 (the ep ranks use one each)")
    p.add_argument("--block-hidden", type=int, default=512, help="h of the block comparison")
    p.add_argument("--block-tokens", type=int, default=4096, help="tokens T = s·b of the block comparison (b = 8)")
    p.add_argument("--block-cases", default="8x2x1408,64x2x176",
                   help="comma-separated ExKxF: experts, top-k, expert ffn of the block comparison")
    p.add_argument("--experts", type=int, default=8, help="experts of the step / ep model")
    p.add_argument("--top-k", type=int, default=2, help="top-k of the step / ep model")
    p.add_argument("--moe-ffn", type=int, default=512, help="expert ffn of the step / ep model (dense twin: top_k · this)")
    p.add_argument("--micro-batches", type=int, default=2, help="ep part: micro-batches per rank (of --batch sequences)")
    p.add_argument("--skip", default="", help="comma-separated parts to leave out: block,step,ep")
    args = p.parse_args(argv)
    apply_quick(args, argv, QUICK)  # flags given with --quick keep their values
    try:
        args.cases = [tuple(int(n) for n in case.split("x")) for case in names(args.block_cases)]
    except ValueError:
        args.cases = [()]
    if not args.cases or any(len(c) != 3 or min(c) < 1 or c[1] > c[0] for c in args.cases):
        raise SystemExit("--block-cases: ExKxF with 1 <= K <= E, e.g. 8x2x1408")
    if any(d not in DTYPES for d in names(args.dtypes)):
        raise SystemExit(f"--dtypes: choose from {', '.join(DTYPES)}")
    if args.block_tokens % 8 or args.batch % args.micro_batches or min(args.reps, args.steps) < 1 or args.warmup < 0:
        raise SystemExit("--block-tokens must be a multiple of 8, --micro-batches must divide --batch, --reps and --steps "
                         ">= 1, --warmup >= 0")
    return args


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``‖got − want‖ / ‖want‖`` in fp64."""
    want = want.double()
    return ((got.double() - want).norm() / want.norm().clamp_min(1e-300)).item()


# ----------------------------------------------------------------------------- 1. the MoE block against Mixtral's

def block_config(args: argparse.Namespace, experts: int, top_k: int, ffn: int) -> Config:
    """One llama MoE layer of h = ``--block-hidden`` (softmax router, aux loss off: Mixtral's block has none)."""
    return gpt_config(args, 256, arch="llama", num_layers=1, hidden_size=args.block_hidden, num_experts=experts,
                      moe_top_k=top_k, moe_ffn_hidden_size=ffn, moe_aux_loss_coeff=0.0)


def mixtral_block(cfg: Config, ours: MoE) -> torch.nn.Module:
    """transformers' ``MixtralSparseMoeBlock`` of ``cfg`` (``hf_config_dict``) with ``ours``'s weights, taken through
    our Mixtral export (``to_hf_state_dict``: per expert w1 = gate, w3 = up, w2 = down) and stacked as transformers 5
    loads them (``gate_up_proj[e] = [w1; w3]``, ``down_proj[e] = w2``)."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    m = cfg.model
    check_mixtral(m)
    kwargs = {k: v for k, v in hf_config_dict(m).items() if k not in ("architectures", "model_type")}
    block = MixtralSparseMoeBlock(MixtralConfig(**kwargs)).to(ours.router.weight.dtype)
    exported = to_hf_state_dict({f"layers.0.mlp.{n}": p.detach() for n, p in ours.named_parameters()}, m)
    prefix = "model.layers.0.block_sparse_moe."
    with torch.no_grad():
        block.gate.weight.copy_(exported[prefix + "gate.weight"])
        for e in range(m.num_experts):
            w = {n: exported[f"{prefix}experts.{e}.{n}.weight"] for n in ("w1", "w2", "w3")}
            block.experts.gate_up_proj[e].copy_(torch.cat([w["w1"], w["w3"]]))
            block.experts.down_proj[e].copy_(w["w2"])
    return block.train()


def block_grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The router and expert weight gradients of our MoE or of Mixtral's block, under our names."""
    if isinstance(module, MoE):
        ex = module.experts
        return {"router": module.router.weight.grad, "gate": ex.gate.weight.grad, "up": ex.up.weight.grad,
                "down": ex.down.weight.grad}
    f = module.experts.down_proj.shape[-1]
    gate_up = module.experts.gate_up_proj.grad  # [E, 2f, h]
    return {"router": module.gate.weight.grad, "gate": gate_up[:, :f], "up": gate_up[:, f:],
            "down": module.experts.down_proj.grad}


def block_fwd_bwd(module: torch.nn.Module, x: torch.Tensor, dout: torch.Tensor,
                  bf16: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Output and input gradient ``[s, b, h]`` of one forward + backward (Mixtral's block takes ``[b, s, h]``)."""
    hf = not isinstance(module, MoE)
    leaf = (x.transpose(0, 1).contiguous() if hf else x).detach().requires_grad_(True)
    module.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        y = module(leaf)
    y.backward(dout.transpose(0, 1).contiguous() if hf else dout)
    return (y.transpose(0, 1), leaf.grad.transpose(0, 1)) if hf else (y, leaf.grad)


def routing(module: torch.nn.Module, x: torch.Tensor, bf16: bool) -> torch.Tensor:
    """The sorted top-k experts ``[T, k]`` each token of ``x [s, b, h]`` (rows in our order) gets from ``module``'s
    router, as its forward computes them (ours: fp32 logits; Mixtral's: logits in the autocast dtype)."""
    tokens = x.reshape(-1, x.shape[-1])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        if isinstance(module, MoE):
            experts = route(module.router(tokens), module.top_k, module.score)[0]
        else:
            experts = module.gate(tokens)[2]
    return experts.sort(dim=-1).values


def block_case(args: argparse.Namespace, experts: int, top_k: int, ffn: int, dtype_name: str) -> list[dict[str, Any]]:
    """One row per variant: errors against fp64, time, speedups. A token whose top-k experts differ from the fp64
    reference's (a near tie, rounded the other way: Mixtral's router runs in bf16 under bf16) is left out of the
    output and input-gradient errors, and counted in ``routing_agreement``; the weight gradients, sums over every
    token, are checked only when every token agrees."""
    cfg = block_config(args, experts, top_k, ffn)
    dtype, bf16 = DTYPES[dtype_name], dtype_name == "bf16"
    ours: MoE = build_layer(cfg.model, ParallelContext(), args.seed).mlp.to(dtype)
    hf = mixtral_block(cfg, ours)
    gen = torch.Generator().manual_seed(args.seed)
    shape = (args.block_tokens // 8, 8, args.block_hidden)  # [s, b, h]
    x, dout = (torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
    ref = copy.deepcopy(ours).double()  # fp64 runs the loop; the same (rounded) weights and inputs
    want_out, want_dx = block_fwd_bwd(ref, x.double(), dout.double(), bf16=False)
    want = {"out": want_out, "dx": want_dx, **block_grads(ref)}
    want_experts = routing(ref, x.double(), bf16=False)
    del ref

    def run(name: str) -> tuple[torch.Tensor, torch.Tensor]:
        if name.startswith("ours"):
            ours.experts.backend = name.split()[1]
            return block_fwd_bwd(ours, x, dout, bf16)
        hf.experts.config._experts_implementation = name.split()[1]
        return block_fwd_bwd(hf, x, dout, bf16)

    rows = []
    for name in BLOCK_VARIANTS:
        module = ours if name.startswith("ours") else hf
        out, dx = run(name)
        agree = (routing(module, x, bf16) == want_experts).all(dim=-1).view(shape[:2])  # [s, b]
        errors = {k: rel_error(got[agree], want[k][agree]) for k, got in (("out", out), ("dx", dx))}
        grads = {k: rel_error(g, want[k]) for k, g in block_grads(module).items()}
        share = agree.double().mean().item()
        checked = {**errors, **grads} if share == 1.0 else errors
        correct = max(checked.values()) <= TOLERANCE[dtype_name] and share >= (1.0 if dtype_name == "fp32" else 0.9)
        rows.append({"experts": experts, "top_k": top_k, "moe_ffn": ffn, "hidden": args.block_hidden,
                     "tokens": args.block_tokens, "dtype": dtype_name, "impl": name, "routing_agreement": share,
                     "errors": {**errors, **grads}, "max_rel_error": max(checked.values()), "correct": correct})
    times = alternating({name: lambda name=name: wall_cpu(lambda: run(name)) for name in BLOCK_VARIANTS},
                        args.warmup, args.reps)
    for row in rows:
        row.update(wall_cpu_stats(times[row["impl"]]))
    by = {r["impl"]: r for r in rows}
    for row in rows:
        for key, other in (("hf_eager", "hf eager"), ("hf_grouped_mm", "hf grouped_mm"), ("ours_loop", "ours loop")):
            row[f"speedup_vs_{key}"] = by[other]["s"] / row["s"]  # medians
            row[f"best_speedup_vs_{key}"] = by[other]["best_s"] / row["best_s"]  # the least disturbed runs
    return rows


# ----------------------------------------------------------------------------- 2. a MoE step against its dense twin

def step_configs(args: argparse.Namespace, *overrides: str, world_size: int | None = None) -> dict[str, Config]:
    """``{"moe": the MoE model, "dense": the dense model with the same active parameters}`` (llama)."""
    moe = gpt_config(args, None, *overrides, world_size=world_size, arch="llama", num_experts=args.experts,
                     moe_top_k=args.top_k, moe_ffn_hidden_size=args.moe_ffn)
    if world_size is not None:
        return {"moe": moe}
    return {"moe": moe, "dense": gpt_config(args, None, arch="llama", ffn_hidden_size=args.top_k * args.moe_ffn)}


def make_step(cfg: Config, dtype_name: str, tokens: torch.Tensor,
              labels: torch.Tensor) -> Callable[[], tuple[float, float, float]]:
    """One training step as throughput.py runs ours (autocast for bf16; ``DistributedOptimizer``, bf16 parameters with
    fp32 masters): returns (forward + backward seconds, whole step seconds, whole step process-CPU seconds)."""
    model = GPTModel(cfg.model, seed=cfg.train.seed).train()
    bf16 = dtype_name == "bf16"
    opt = DistributedOptimizer(named_trainable(model), cfg.train, None, precision=dtype_name)

    def step() -> tuple[float, float, float]:
        t0, c0 = time.perf_counter(), time.process_time()
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(tokens, labels=labels).float().mean()
        loss.backward()
        t1 = time.perf_counter()
        opt.step(LR, cfg.train.clip_grad)
        return t1 - t0, time.perf_counter() - t0, time.process_time() - c0

    return step


def step_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Per dtype: the MoE and the dense step, alternating."""
    cfgs = step_configs(args)
    gen = torch.Generator().manual_seed(args.seed)
    data = torch.randint(0, cfgs["moe"].model.vocab_size, (args.batch, args.seq + 1), generator=gen)
    tokens, labels = data[:, :-1].contiguous(), data[:, 1:].contiguous()  # [b, s]
    rows = []
    for dtype_name in names(args.dtypes):
        steps = {name: make_step(cfg, dtype_name, tokens, labels) for name, cfg in cfgs.items()}
        times = alternating(steps, args.warmup + 1, args.steps)
        row: dict[str, Any] = {"dtype": dtype_name, "tokens_per_step": args.batch * args.seq}
        for name, cfg in cfgs.items():
            row[f"{name}_active_params"] = count_parameters(cfg.model, active=True)
            row[f"{name}_params"] = count_parameters(cfg.model)
            row[f"{name}_fwd_bwd_s"] = statistics.median(t[0] for t in times[name])
            row[f"{name}_step_s"] = statistics.median(t[1] for t in times[name])
            row[f"{name}_step_best_s"] = min(t[1] for t in times[name])
            row[f"{name}_step_cpu_s"] = statistics.median(t[2] for t in times[name])
        row["fwd_bwd_ratio"] = row["moe_fwd_bwd_s"] / row["dense_fwd_bwd_s"]
        row["step_ratio"] = row["moe_step_s"] / row["dense_step_s"]
        row["step_best_ratio"] = row["moe_step_best_s"] / row["dense_step_best_s"]
        row["step_cpu_ratio"] = row["moe_step_cpu_s"] / row["dense_step_cpu_s"]  # less sensitive to a shared core
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------- 3. and 4. expert parallelism

def ep_config(args: argparse.Namespace, ep: int, dtype_name: str) -> Config:
    """The step model on ``EP_WORLD`` ranks (dp2) at ``ep``: ``--micro-batches`` micro-batches of ``--batch`` sequences
    per rank."""
    micro = args.batch // args.micro_batches
    return step_configs(args, f"parallel.ep={ep}", f"train.precision={dtype_name}", f"train.micro_batch_size={micro}",
                        f"train.global_batch_size={EP_WORLD * args.batch}", world_size=EP_WORLD)["moe"]


class FixedBatch:
    """A stand-in for the read-ahead loader ``next_train_batch`` reads: always at the run's sample, always ``batch``."""

    def __init__(self, rt: training.Runtime, batch: dict[str, torch.Tensor]) -> None:
        self.rt, self.batch = rt, batch

    @property
    def next_sample(self) -> int:
        return self.rt.consumed_samples

    def __next__(self) -> dict[str, torch.Tensor]:
        return self.batch

    def close(self) -> None:
        pass


@contextmanager
def counted_rows(book: dict[str, dict[str, int]]) -> Iterator[None]:
    """Add every row exchange of the dispatcher (``comm.all_to_all_uneven``: an ``all_to_all`` of floating-point rows,
    seen through ``comm.observe``) to ``book[phase]``: calls, rows and bytes of its whole input (this rank's own block
    included); the phase is backward while autograd runs a node."""
    def seen(event: comm.CommEvent) -> None:
        t = event.tensor
        if event.op != "all_to_all" or not isinstance(t, torch.Tensor) or not t.is_floating_point():
            return  # (the expert counts exchange is int64)
        entry = book["backward" if torch._C._current_autograd_node() is not None else "forward"]
        entry["calls"] += 1
        entry["rows"] += t.shape[0]
        entry["bytes"] += t.numel() * t.element_size()
        book["element_bytes"] = {"calls": 0, "rows": 0, "bytes": t.element_size()}

    with comm.observe(seen):
        yield


def ep_runtime(args: argparse.Namespace, ep: int, dtype_name: str, batch: dict[str, torch.Tensor]) -> training.Runtime:
    """This rank's ``training.Runtime`` at ``ep`` as ``training.setup`` builds it, fed ``batch`` every step."""
    cfg = ep_config(args, ep, dtype_name)
    p = cfg.parallel
    state = initialize(ParallelDims(dp=p.dp, ep=p.ep, world_size=p.world_size))  # type: ignore[arg-type]
    init_rng(get_tracker(), cfg.train.seed, state.tp_rank, state.pp_rank)
    model, opt = training.build_model(cfg, state, torch.device("cpu"), compiled=False)
    rt = training.Runtime(cfg, state, torch.device("cpu"), model, opt, None, None, None, DynamicLossScaler(enabled=False))
    rt.train_loader = FixedBatch(rt, batch)
    return rt


def ep_rank(rank: int, world_size: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Per dtype on this rank: ep1 and ep2 steps alternating (times, first losses), then one counted ep2 step."""
    gen = torch.Generator().manual_seed(args.seed + 1 + rank)  # each data-parallel rank its own sequences
    data = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)
    batch = {"tokens": data[:, :-1].contiguous(), "labels": data[:, 1:].contiguous(),
             "loss_mask": torch.ones(args.batch, args.seq)}
    out = []
    for dtype_name in names(args.dtypes):
        runs = {f"ep{ep}": ep_runtime(args, ep, dtype_name, batch) for ep in (1, 2)}
        first = {name: training.train_step(rt)["loss"] for name, rt in runs.items()}

        def timed(rt: training.Runtime) -> float:
            comm.barrier()
            t0 = time.perf_counter()
            training.train_step(rt)
            return time.perf_counter() - t0

        times = alternating({name: lambda rt=rt: timed(rt) for name, rt in runs.items()}, args.warmup, args.steps)
        book = {phase: {"calls": 0, "rows": 0, "bytes": 0} for phase in ("forward", "backward")}
        with counted_rows(book), comm.count() as counter:
            training.train_step(runs["ep2"])
        out.append({"dtype": dtype_name, "rank": rank, "first_loss": first, "times": times, "rows": book,
                    "all_to_all_sent_bytes": counter.bytes.get("all_to_all", 0.0)})
        for rt in runs.values():
            rt.state.destroy()
    return out


def planner_bytes(cfg: Config) -> int | None:
    """tools/planner's figure for ``cfg`` (None while ``traffic.moe_all_to_all_bytes`` does not exist)."""
    from planner import traffic

    fn = getattr(traffic, "moe_all_to_all_bytes", None)
    return None if fn is None else int(fn(cfg, pp_rank=0))


def ep_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Per dtype: step times of the slower rank, loss parity ep2 = ep1, all-to-all bytes against the planner."""
    per_rank = run_distributed(ep_rank, EP_WORLD, args=args)
    rows = []
    for i, dtype_name in enumerate(names(args.dtypes)):
        ranks = [r[i] for r in per_rank]
        row: dict[str, Any] = {"dtype": dtype_name, "world": EP_WORLD, "global_batch": EP_WORLD * args.batch,
                               "micro_batches_per_rank": args.micro_batches}
        for name in ("ep1", "ep2"):
            slowest = [max(r["times"][name][j] for r in ranks) for j in range(args.steps)]
            row[f"{name}_step_s"], row[f"{name}_best_s"] = statistics.median(slowest), min(slowest)
        row["ep2_over_ep1"] = row["ep2_step_s"] / row["ep1_step_s"]
        row["ep2_over_ep1_best"] = row["ep2_best_s"] / row["ep1_best_s"]
        losses = {name: ranks[0]["first_loss"][name] for name in ("ep1", "ep2")}
        row["first_loss"] = losses
        row["loss_rel_diff"] = abs(losses["ep2"] - losses["ep1"]) / abs(losses["ep1"])
        row["loss_matches"] = row["loss_rel_diff"] <= (5e-6 if dtype_name == "fp32" else 1e-2)
        measured = [r["rows"]["forward"]["bytes"] + r["rows"]["backward"]["bytes"] for r in ranks]
        row["a2a_rows"] = [{phase: r["rows"][phase] for phase in ("forward", "backward")} for r in ranks]
        row["a2a_element_bytes"] = ranks[0]["rows"].get("element_bytes", {}).get("bytes")
        row["a2a_bytes_per_rank"] = measured
        row["a2a_bytes_mean"] = statistics.fmean(measured)
        row["a2a_sent_to_others_bytes"] = [r["all_to_all_sent_bytes"] for r in ranks]  # comm.count(): counts + rows
        row["planner_bytes"] = planner_bytes(ep_config(args, 2, dtype_name))
        # dropless: the ep group's ranks together pass every assignment's row 4 times (dispatch, combine, both ways);
        # a rank's own share depends on the routing, the mean over the group does not
        row["a2a_matches_planner"] = None if row["planner_bytes"] is None else row["a2a_bytes_mean"] == row["planner_bytes"]
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------- report

def print_block(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(f"1. MoE block forward + backward, T {args.block_tokens} tokens, h {args.block_hidden}, llama SwiGLU, softmax "
          f"top-k; {args.threads} threads, median (best) of {args.reps}, ratios of medians (of bests). routed = tokens whose "
          "top-k equals the fp64 reference's; error = max relative error against fp64 (out and dx on those tokens; grads "
          "when all agree)")
    head = ("E", "k", "ffn", "dtype", "impl", "ms", "best ms", "cpu ms", "× hf eager", "× hf grouped", "routed",
            "max rel err", "ok")
    print(" | ".join(f"{h:>14}" for h in head))
    for r in rows:
        cells = (r["experts"], r["top_k"], r["moe_ffn"], r["dtype"], r["impl"], f"{r['s'] * 1e3:.0f}",
                 f"{r['best_s'] * 1e3:.0f}", f"{r['cpu_s'] * 1e3:.0f}",
                 f"{r['speedup_vs_hf_eager']:.2f} ({r['best_speedup_vs_hf_eager']:.2f})",
                 f"{r['speedup_vs_hf_grouped_mm']:.2f} ({r['best_speedup_vs_hf_grouped_mm']:.2f})",
                 f"{r['routing_agreement']:.2%}", f"{r['max_rel_error']:.1e}",
                 "yes" if r["correct"] else "NO")
        print(" | ".join(f"{c:>14}" for c in cells))


def print_steps(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(f"\n2. training step, llama L {args.layers} h {args.hidden} s {args.seq} b {args.batch}: MoE (E {args.experts}, "
          f"top-{args.top_k}, ffn {args.moe_ffn}) against dense (ffn {args.top_k * args.moe_ffn}); median of {args.steps}, "
          "ratio of medians (of bests), cpu: of process-CPU medians")
    head = ("dtype", "active MoE", "active dense", "MoE fb ms", "dense fb ms", "fb ratio", "MoE step", "dense step",
            "ratio", "cpu ratio")
    print(" | ".join(f"{h:>13}" for h in head))
    for r in rows:
        cells = (r["dtype"], f"{r['moe_active_params']:,}", f"{r['dense_active_params']:,}", f"{r['moe_fwd_bwd_s'] * 1e3:.1f}",
                 f"{r['dense_fwd_bwd_s'] * 1e3:.1f}", f"{r['fwd_bwd_ratio']:.2f}", f"{r['moe_step_s'] * 1e3:.1f}",
                 f"{r['dense_step_s'] * 1e3:.1f}", f"{r['step_ratio']:.2f} ({r['step_best_ratio']:.2f})",
                 f"{r['step_cpu_ratio']:.2f}")
        print(" | ".join(f"{c:>13}" for c in cells))


def print_ep(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(f"\n3-4. {EP_WORLD} gloo ranks (dp{EP_WORLD}, 1 thread each), training.train_step, global batch "
          f"{EP_WORLD * args.batch} × {args.seq}, {args.micro_batches} micro-batches per rank; slower rank, median of "
          f"{args.steps}, ratio of medians (of bests); a2a = bytes passed to the row all-to-alls per step (own block included)")
    head = ("dtype", "ep1 ms", "ep2 ms", "ep2/ep1", "loss diff", "a2a rank 0", "a2a rank 1", "a2a mean", "planner", "equal")
    print(" | ".join(f"{h:>14}" for h in head))
    for r in rows:
        per = r["a2a_bytes_per_rank"]
        cells = (r["dtype"], f"{r['ep1_step_s'] * 1e3:.1f}", f"{r['ep2_step_s'] * 1e3:.1f}",
                 f"{r['ep2_over_ep1']:.2f} ({r['ep2_over_ep1_best']:.2f})",
                 f"{r['loss_rel_diff']:.1e}", f"{per[0]:,}", f"{per[-1]:,}", f"{r['a2a_bytes_mean']:,.0f}",
                 "-" if r["planner_bytes"] is None else f"{r['planner_bytes']:,}",
                 {None: "-", True: "yes", False: "NO"}[r["a2a_matches_planner"]])
        print(" | ".join(f"{c:>14}" for c in cells))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    skip = set(names(args.skip))
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    host_memory(args)
    try:
        block = [r for e, k, f in args.cases for d in names(args.dtypes) for r in block_case(args, e, k, f, d)] \
            if "block" not in skip else []
        steps = step_rows(args) if "step" not in skip else []
    finally:
        torch.set_num_threads(threads)
    ep = ep_rows(args) if "ep" not in skip else []
    if block:
        print_block(block, args)
    if steps:
        print_steps(steps, args)
    if ep:
        print_ep(ep, args)
    checks = {"block_matches_fp64": all(r["correct"] for r in block) if block else None,
              "ep_loss_matches_ep1": all(r["loss_matches"] for r in ep) if ep else None,
              "a2a_matches_planner": None if not ep or any(r["a2a_matches_planner"] is None for r in ep)
              else all(r["a2a_matches_planner"] for r in ep)}
    goals = {f"E{r['experts']}_{r['dtype']}_{name}{best}": r[f"{best[1:]}_{key}" if best else key]
             for r in block if r["impl"] == "ours grouped" for best in ("", "_best")
             for name, key in (("vs_hf_eager", "speedup_vs_hf_eager"), ("vs_hf_grouped_mm", "speedup_vs_hf_grouped_mm"),
                               ("grouped_vs_loop", "speedup_vs_ours_loop"))}
    goals.update({f"{r['dtype']}_moe_{name}_over_dense": r[f"{name}_ratio"] for r in steps
                  for name in ("step", "step_best", "step_cpu", "fwd_bwd")})
    goals.update({f"{r['dtype']}_ep2_over_ep1{best}": r[f"ep2_over_ep1{best}"] for r in ep for best in ("", "_best")})
    print("\ngoals (issue 33: block >= 2x transformers, MoE step <= 1.3x dense): " + ", ".join(
        f"{k} {v:.2f}" for k, v in goals.items()))
    print(f"checks: {checks}")
    config = {k: v for k, v in vars(args).items() if k != "cases"}
    result = {"config": config, "checks": checks, "goals": goals, "block": block, "step": steps, "ep": ep}
    print_json("moe", **result)
    return result


if __name__ == "__main__":
    main()
