"""Activation memory per transformer layer per rank, against Table 2 of Korthikanti et al. 2022.

Bytes autograd saves in one forward of one neox layer per tp × sequence parallel × recompute, each storage
attributed to a Table 2 term. Method: docs/activation_memory.md, "The benchmark against Table 2".
Run from the repo root:  python tools/bench/activation_memory.py [--dtype bf16] [--dropout 0.1] [--verbose] ...
"""
from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from common import DTYPES, build_layer, gpt_config, graph_nodes, ints, parser, per_rank, print_json, rope, world_group
from megatron_sp.config.schema import ModelConfig
from megatron_sp.model.attention.kernels import (MATH_ATTENTION_MAX_SCORES, block_kernel_runs, causal_block_rows,
                                                causal_block_scores)
from megatron_sp.model.transformer import SelfAttention, TransformerLayer, head_dim
from megatron_sp.mpu import ParallelContext
from megatron_sp.mpu.random import checkpoint, get_tracker, init_rng

RECOMPUTE = ("none", "selective", "full")
GOAL = 1.02  # measured/formula above this gets an explanatory note

EXPLAIN = {  # why a term exceeds its Table 2 share (the layer-input terms: ``explain``)
    "V": "v is a view into the fused QKV output [s, b, 3h/t], so autograd keeps the whole projection output "
         "(pre-rotary q and k too), 3x Table 2's V; a contiguous copy of v in SelfAttention.forward (before the "
         "selective checkpoint) would free the other 2sbh/t",
    "rotary cos/sin": "the [s, 1, rotary_dim] cos/sin tables saved by the rotary multiplies (one pair per model, "
                      "shared by every layer; not split by SP)",
    "LayerNorm mean/rstd": "[s, b, 1] mean and rstd of each norm, not in Table 2",
    "attention logsumexp": "the flash kernel's [b, n/t, s] fp32 row log-sum-exp, not in Table 2",
    "attention dropout mask": "CPU dropout multiplies by a mask in the activation dtype, not a 1-byte mask",
    "hidden dropout masks": "CPU dropout multiplies by a mask in the activation dtype, not a 1-byte mask",
    "QKV input": "recompute_allgather off: the gathered [s, b, h] input is saved, t x the shard",
    "fc1 input": "recompute_allgather off: the gathered [s, b, h] input is saved, t x the shard",
    "other": "not attributed: see --verbose",
}


def explain(name: str, above: bool, args: argparse.Namespace) -> str:
    """One line on why term ``name`` is above (or below) its Table 2 share."""
    if name in ("layer input", "LayerNorm inputs"):
        if above:
            return (f"the layer input x is {args.input_dtype} (GPTModel's residual stream stays fp32 under "
                    f"autocast); Table 2 counts it in 16 bits")
        return "parallel residual: attn_norm and mlp_norm read the same x, saved once (Table 2 counts two)"
    return EXPLAIN.get(name, "")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__, seq=256, batch=2, hidden=256, heads=8, seed=1234, verbose=False)
    p.add_argument("--tp", default="1,2,4", help="comma-separated TP sizes")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="bf16: torch.autocast, fp32 parameters")
    p.add_argument("--input-dtype", choices=sorted(DTYPES), default="fp32",
                   help="dtype of the layer input (GPTModel's residual stream is fp32 under bf16 autocast too)")
    p.add_argument("--dropout", type=float, default=0.0, help="hidden and attention dropout")
    p.add_argument("--no-recompute-allgather", action="store_true",
                   help="under SP, save the gathered QKV/fc1 input instead of the shard")
    return p.parse_args(argv)


@dataclass
class SavedStorage:
    """One storage autograd keeps for backward, and everything that refers to it."""

    nbytes: int
    shape: tuple[int, ...]
    dtype: str
    modules: set[str] = field(default_factory=set)  # running when it was saved (``layer``: the layer, ``-``: none)
    slots: set[str] = field(default_factory=set)  # autograd slots holding it, ``Node.slot``
    tags: set[str] = field(default_factory=set)  # param(-cast), input, cos, sin, q, k, v, ctx, core (in the kernel)
    category: str = ""


class _ParamCasts(TorchDispatchMode):
    """Records the storages of copies of parameters (autocast's bf16 weights) and keeps them alive,
    so that their addresses cannot be reused by activations during the forward."""

    def __init__(self, param_ptrs: set[int]) -> None:
        super().__init__()
        self.param_ptrs = param_ptrs
        self.ptrs: set[int] = set()
        self._keep: list[torch.Tensor] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if (func is torch.ops.aten._to_copy.default and torch.is_tensor(args[0])
                and args[0].untyped_storage().data_ptr() in self.param_ptrs):
            self.ptrs.add(out.untyped_storage().data_ptr())
            self._keep.append(out)
        return out


class SavedTensorRecorder:
    """Context manager: every tensor saved for backward inside it, by storage, with its context."""

    def __init__(self, layer: TransformerLayer) -> None:
        self.layer = layer
        self.storages: dict[int, SavedStorage] = {}
        self.param_ptrs = {p.untyped_storage().data_ptr() for p in layer.parameters()}
        self._tags: dict[int, set[str]] = {}
        self._keep: list[torch.Tensor] = []
        self._modules = ["-"]
        self._in_core = 0

    def tag(self, t: torch.Tensor, name: str) -> None:
        """Mark ``t``'s storage (kept alive until the recorder is dropped)."""
        self._tags.setdefault(t.untyped_storage().data_ptr(), set()).add(name)
        self._keep.append(t)

    def _leave(self, module: Any, args: Any, out: Any) -> None:  # a forward hook: returns None, keeping the output
        self._modules.pop()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        rec = self.storages.get(ptr)
        if rec is None:
            rec = self.storages[ptr] = SavedStorage(storage.nbytes(), tuple(t.shape), str(t.dtype).replace("torch.", ""))
        rec.modules.add(self._modules[-1])
        if self._in_core:
            rec.tags.add("core")
        return t

    def _recorded_kernel(self, kernel: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         dropout_p: float = 0.0) -> torch.Tensor:
        """A ``SelfAttention.register_kernel_hook`` hook: tags q, k, v and the output, and what the kernel saves as core."""
        for t, name in ((q, "q"), (k, "k"), (v, "v")):
            self.tag(t, name)
        self._in_core += 1
        try:
            out = kernel(q, k, v, dropout_p)
        finally:
            self._in_core -= 1
        self.tag(out, "ctx")
        return out

    @contextmanager
    def record(self) -> Iterator[None]:
        handles = []
        for name, module in self.layer.named_modules():
            label = name or "layer"
            handles.append(module.register_forward_pre_hook(lambda m, a, label=label: self._modules.append(label)))
            handles.append(module.register_forward_hook(self._leave))
            if isinstance(module, SelfAttention):
                handles.append(module.register_kernel_hook(self._recorded_kernel))
        casts = _ParamCasts(self.param_ptrs)
        try:
            with casts, torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                yield
        finally:
            for handle in handles:
                handle.remove()
        self._keep.extend(casts._keep)
        for ptr, rec in self.storages.items():
            rec.tags |= self._tags.get(ptr, set())
            rec.tags |= {"param"} if ptr in self.param_ptrs else set()
            rec.tags |= {"param-cast"} if ptr in casts.ptrs else set()

    def attribute_slots(self, out: torch.Tensor) -> None:
        """Name the autograd slots holding each saved storage by walking the graph of ``out``."""
        for node in graph_nodes(out):
            for slot, t in _saved_of(node):
                rec = self.storages.get(t.untyped_storage().data_ptr())
                if rec is not None:
                    rec.slots.add(f"{node.name()}.{slot}")


def _saved_of(node: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """(slot, tensor) of every tensor a graph node saved: ``_saved_*`` attributes, or ``saved_tensors``
    of a custom autograd Function (slots ``saved[i]``)."""
    custom = ["saved_tensors"] if hasattr(node, "saved_tensors") else []
    for attr in [a for a in dir(node) if a.startswith("_saved_")] + custom:
        try:
            value = getattr(node, attr)
        except RuntimeError:  # freed, or not a tensor-convertible value
            continue
        values = value if isinstance(value, (tuple, list)) else (value,)
        slot = "saved" if attr == "saved_tensors" else attr[7:]
        for i, t in enumerate(values):
            if torch.is_tensor(t):
                yield (slot if len(values) == 1 and attr != "saved_tensors" else f"{slot}[{i}]"), t


BLOCK_SLOT = "_BlockCausalAttentionBackward.saved["
"""Slots of the CPU block-causal explicit-scores kernel (``kernels._BlockCausalAttention``)."""

LINEAR_INPUTS = {"attention.qkv": "QKV input", "mlp.fc1": "fc1 input", "attention.out": "out-proj input",
                 "mlp.fc2": "fc2 input"}


def categorize(rec: SavedStorage, ctx: dict[str, Any]) -> str:
    """The Table 2 term (or the named extra) a saved storage belongs to; first matching rule wins."""
    if "param" in rec.tags:
        return "parameter"
    if "param-cast" in rec.tags:
        return "parameter cast"
    if "input" in rec.tags:
        return "layer input" if ctx["recompute"] == "full" else "LayerNorm inputs"
    if rec.tags & {"cos", "sin"}:
        return "rotary cos/sin"
    if any(slot.startswith("NativeLayerNormBackward0.result") for slot in rec.slots):
        return "LayerNorm mean/rstd"
    if any(slot.startswith("NativeLayerNormBackward0.input") for slot in rec.slots):
        return "LayerNorm inputs"
    for module, category in LINEAR_INPUTS.items():
        if module in rec.modules:
            return category
    if any(slot.startswith("GeluBackward0") for slot in rec.slots):
        return "GeLU input"
    if rec.tags & {"q", "k"}:
        return "Q, K"
    if "v" in rec.tags:
        return "V"
    if "core" in rec.tags:
        s, d = ctx["s"], ctx["head_dim"]
        block = [int(slot[len(BLOCK_SLOT):-1]) for slot in rec.slots if slot.startswith(BLOCK_SLOT)]
        if block and block[0] >= 3:  # the block kernel saves q, k, v, then each block's probs (and dropped probs)
            return "attention dropout output" if ctx["dropout"] > 0 and (block[0] - 3) % 2 else "attention probs"
        if rec.shape[-2:] == (s, s):
            if any("Softmax" in slot for slot in rec.slots):
                return "attention probs"
            if any(slot.startswith(("MulBackward0.other", "NativeDropoutBackward0.result1")) for slot in rec.slots):
                return "attention dropout mask"
            return "attention dropout output"
        if rec.shape[-1] == d or rec.shape[-2:] == (d, s):
            return "Q, K"  # copies made by the kernel (e.g. the math SDPA scales q and k)
        if len(rec.shape) == 3 and rec.shape[-1] == s:
            return "attention logsumexp"
    if "layer" in rec.modules and any(slot.startswith(("MulBackward0.other", "NativeDropoutBackward0.result1"))
                                      for slot in rec.slots):
        return "hidden dropout masks"
    return "other"


def scores_stored(args: argparse.Namespace, t: int, recompute: str) -> bool:
    """Whether the attention kernel keeps the [b, n/t, s, s] scores (docs/activation_memory.md)."""
    if recompute != "none":
        return False
    return explicit_kernel(args, t) or args.dropout > 0


def explicit_kernel(args: argparse.Namespace, t: int) -> bool:
    """Whether the layer runs the CPU block-causal explicit-scores kernel (else SDPA)."""
    return block_kernel_runs(DTYPES[args.dtype], args.batch, args.heads // t, args.seq)


def table2(args: argparse.Namespace, cfg: ModelConfig, t: int, sp: bool, recompute: str) -> tuple[str, dict[str, float]]:
    """(Table 2 terms as text, expected bytes per term) for one row, in the dtype used."""
    s, b, h, a = args.seq, args.batch, args.hidden, args.heads
    e = torch.tensor([], dtype=DTYPES[args.dtype]).element_size() / 2  # bytes per element / 2 bytes
    n = s * b * h
    rep = t if sp else 1
    if recompute == "full":
        return ("2/t" if sp else "2"), {"layer input": 2 * e * n / rep}
    f = cfg.ffn_hidden_size / h
    masks = args.dropout > 0
    terms = {"LayerNorm inputs": 4 * e * n / rep, "QKV input": 2 * e * n / rep, "Q, K": 4 * e * n / t,
             "V": 2 * e * n / t, "out-proj input": 2 * e * n / t, "fc1 input": 2 * e * n / rep,
             "GeLU input": 2 * f * e * n / t, "fc2 input": 2 * f * e * n / t}
    if masks:
        terms["hidden dropout masks"] = 2 * n / rep
    replicated = 8 + (2 if masks else 0)
    sharded = 8 + 4 * f
    score_coef, share = 0, ""
    if scores_stored(args, t, recompute):
        scores = a * s * s * b / t
        if explicit_kernel(args, t):  # the causal blocks only, about half of s²; dropout's zeros are its mask
            fraction = causal_block_scores(s, causal_block_rows(DTYPES[args.dtype])) / s ** 2
            share = f"·{fraction:.3g}" if fraction < 1 else ""
            terms["attention probs"] = 2 * e * scores * fraction
            score_coef = 2
            if args.dropout > 0:
                terms["attention dropout output"] = 2 * e * scores * fraction
                score_coef = 4
        else:  # CPU SDPA with dropout: its math kernel
            terms["attention probs"] = 2 * e * scores
            terms["attention dropout mask"] = scores
            terms["attention dropout output"] = 2 * e * scores
            score_coef = 5
    score = f"+{score_coef}{share}as/ht" if score_coef else ""
    text = f"{replicated + sharded:g}/t{score}" if sp else f"{replicated}+{sharded:g}/t{score}"
    return text, terms


def measure(args: argparse.Namespace, cfg: ModelConfig, parallel: ParallelContext) -> dict[str, Any]:
    """One forward of one layer under the recorder: the row's numbers and its saved storages."""
    layer = build_layer(cfg, parallel, args.seed)
    t, sp, recompute = parallel.tp_size, parallel.sp, parallel.recompute
    s, b, h = args.seq, args.batch, args.hidden
    gen = torch.Generator().manual_seed(args.seed + parallel.tp_rank)
    x = torch.randn(s // t if sp else s, b, h, generator=gen).to(DTYPES[args.input_dtype]).requires_grad_()
    cos, sin = rope(cfg, s, DTYPES[args.dtype])
    recorder = SavedTensorRecorder(layer)
    for tensor, name in ((x, "input"), (cos, "cos"), (sin, "sin")):
        recorder.tag(tensor, name)
    with recorder.record(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.dtype == "bf16"):
        if recompute == "full":
            y = checkpoint(layer, x, cos, sin, tracker=parallel.tracker)  # what GPTModel does per layer
        else:
            y = layer(x, cos, sin)
    recorder.attribute_slots(y)
    ctx = {"recompute": recompute, "s": s, "head_dim": head_dim(cfg), "dropout": args.dropout}
    measured: dict[str, float] = {}
    excluded: dict[str, float] = {}
    for rec in recorder.storages.values():
        rec.category = categorize(rec, ctx)
        bucket = excluded if rec.category in ("parameter", "parameter cast") else measured
        bucket[rec.category] = bucket.get(rec.category, 0) + rec.nbytes
    terms_text, expected = table2(args, cfg, t, sp, recompute)
    total, formula = sum(measured.values()), sum(expected.values())
    terms = {name: {"measured": measured.get(name, 0), "formula": expected.get(name, 0)}
             for name in [*expected, *(m for m in measured if m not in expected)]}
    storages = sorted(recorder.storages.values(), key=lambda r: -r.nbytes)
    return {"tp": t, "sp": sp, "recompute": recompute, "measured_bytes": total, "formula_bytes": formula,
            "ratio": total / formula, "table2_terms": terms_text, "scores_expected": scores_stored(args, t, recompute),
            "scores_stored": "attention probs" in measured, "parameter_bytes": excluded.get("parameter", 0),
            "parameter_cast_bytes": excluded.get("parameter cast", 0), "terms": terms,
            "storages": [{**asdict(r), "modules": sorted(r.modules), "slots": sorted(r.slots), "tags": sorted(r.tags)}
                         for r in storages]}


def rank_rows(rank: int, world_size: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every row for TP size ``world_size``, on this rank (the default group is the TP group)."""
    group = world_group(world_size)
    cfg = gpt_config(args, 256, arch="neox", hidden_dropout=args.dropout, attention_dropout=args.dropout).model
    tracker = get_tracker()
    init_rng(tracker, args.seed, rank, 0)
    rows = []
    for sp in (False, True) if world_size > 1 else (False,):  # SP needs t > 1
        for recompute in RECOMPUTE:
            parallel = ParallelContext(tp_group=group, sequence_parallel=sp, recompute=recompute, tracker=tracker,
                                       recompute_allgather=not args.no_recompute_allgather)
            rows.append(measure(args, cfg, parallel))
    return rows


def _kib(n: float) -> str:
    return f"{n / 1024:,.1f} KiB"


def term_differences(row: dict[str, Any]) -> list[tuple[float, str]]:
    """(measured − formula bytes, term) of every term off its Table 2 share, the largest excess first."""
    diffs = [(v["measured"] - v["formula"], name) for name, v in row["terms"].items() if v["measured"] != v["formula"]]
    return sorted(diffs, key=lambda d: -d[0])


def row_note(row: dict[str, Any]) -> str:
    """One line: the row's excess over its formula, term by term (above, then below their share)."""
    parts = [f"{name} {'+' if diff > 0 else '-'}{_kib(abs(diff))}" for diff, name in term_differences(row)]
    label = f"tp={row['tp']} sp={'on' if row['sp'] else 'off'} {row['recompute']}"
    return f"  {label:24} {row['ratio']:.3f} (+{_kib(row['measured_bytes'] - row['formula_bytes'])}): {', '.join(parts)}"


def print_report(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    """The table, the notes under it, the verbose breakdown, and the JSON line."""
    s, b, h, a = args.seq, args.batch, args.hidden, args.heads
    print(f"activation bytes saved for backward per layer per rank: neox, s={s} b={b} h={h} a={a} ffn=4h, "
          f"{args.dtype}{' autocast' if args.dtype == 'bf16' else ''}, input {args.input_dtype}, dropout {args.dropout}, "
          f"recompute_allgather {'off' if args.no_recompute_allgather else 'on'}")
    print(f"{'tp':>3} {'sp':>3} {'recompute':>9} {'measured B':>12} {'formula B':>12} {'meas/form':>9}  Table 2 sbh·(…)")
    for r in rows:
        flag = "  *" if r["ratio"] > GOAL else ""
        print(f"{r['tp']:>3} {'on' if r['sp'] else 'off':>3} {r['recompute']:>9} {r['measured_bytes']:>12,.0f} "
              f"{r['formula_bytes']:>12,.0f} {r['ratio']:>9.3f}  {r['table2_terms']}{flag}")
    e = torch.tensor([], dtype=DTYPES[args.dtype]).element_size()
    kept = causal_block_scores(s, causal_block_rows(DTYPES[args.dtype])) / s ** 2
    print(f"\nformula: Table 2 in {e}-byte activations (16-bit terms x{e / 2:g}; masks 1 byte/element); "
          + ("no dropout masks (dropout 0: 34 -> 32, 5as/h -> 2as/h). " if args.dropout == 0 else "")
          + (f"score term where the kernel stores scores: bf16 and fp32 run the block-causal explicit-scores "
             f"kernel while b·(n/t)·s² <= MATH_ATTENTION_MAX_SCORES = {MATH_ATTENTION_MAX_SCORES} (here "
             f"{b * a * s * s} / t), which keeps the probabilities of its causal blocks "
             f"({kept:.3g} of s²; with dropout the dropped copy too, whose zeros are the mask); beyond that bound "
             "dropout > 0 makes CPU SDPA fall back to its math kernel (5as/h); "
             "selective/full recompute store none.")
          + " full recompute keeps the layer input: 2sbh, 2sbh/t under SP (the input is the [s/t, b, h] shard).")
    mismatched = [r for r in rows if r["scores_expected"] != r["scores_stored"]]
    for r in mismatched:
        print(f"WARNING tp={r['tp']} sp={r['sp']} {r['recompute']}: scores stored={r['scores_stored']}, the formula "
              f"assumed {r['scores_expected']}")
    casts = max(r["parameter_cast_bytes"] for r in rows)
    if casts:
        print(f"not counted: autocast's bf16 copies of the weights saved for backward (up to {_kib(casts)} per "
              "layer per rank): parameters, not activations.")
    over = [r for r in rows if r["ratio"] > GOAL]
    print(f"\nnotes: {len(over)} of {len(rows)} rows above {GOAL} (marked *)"
          + ("; each term off its Table 2 share, excess first:" if over else "."))
    for r in over:
        print(row_note(r))
    if over:
        print("  why:")
        seen = dict.fromkeys((name, diff > 0) for r in over for diff, name in term_differences(r))
        for name, above in seen:
            print(f"    {name} ({'above' if above else 'below'}): {explain(name, above, args)}")
    if args.verbose:
        for r in rows:
            print(f"\n-- tp={r['tp']} sp={'on' if r['sp'] else 'off'} {r['recompute']}: saved storages "
                  "(bytes, category, shape of the first saved view, dtype, modules, autograd slots)")
            for st in r["storages"]:
                print(f"  {st['nbytes']:>10,} {st['category']:22} {str(tuple(st['shape'])):22} {st['dtype']:9} "
                      f"{','.join(st['modules'])} | {', '.join(st['slots'])}")
    out = [{k: v for k, v in r.items() if k != "storages" or args.verbose} for r in rows]
    print_json("activation_memory", config=vars(args), rows=out)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Measure every row and print the report; returns the rows."""
    args = parse_args(argv)
    sizes = ints(args.tp)
    for t in sizes:
        if args.heads % t or args.seq % t:
            raise SystemExit(f"--tp {t}: heads ({args.heads}) and seq ({args.seq}) must be divisible by it")
    rows = [row for t in sizes for row in per_rank(rank_rows, t, args=args)[0]]  # rank 0's numbers
    print_report(args, rows)
    return rows


if __name__ == "__main__":
    main()
