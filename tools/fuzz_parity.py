#!/usr/bin/env python
"""The parity fuzzer: random (model features × layout) pairs, each trained 5 steps by train.py and held against the
1-rank run of the same model under the parity standard (docs/parity.md, "The parity fuzzer").

    python tools/fuzz_parity.py --seed 1 --count 12
    python tools/fuzz_parity.py --seed 1 --count 200 --draw-only

The space is data: ``FEATURES`` (model keys, shared with the reference run), ``LAYOUT`` (parallel keys and the
micro-batch) and ``RULES`` (what a drawn layout must satisfy, else it is drawn again); ``DIMS`` are derived so that
every layout of a model divides them, and ``EXCLUDED`` names the model/parallel keys left out, with the reason. A new
config key joins by one line in one of them (tests/unit/test_fuzz_space.py fails until it does).

Cases come in groups of ``--layouts-per-model`` layouts over one drawn model, so that they share its reference run.
A combination the config validation refuses (in-process, or train.py's exit 2) is listed as "refused" with its line,
not as a failure. Prints one row per case (features, layout, worst loss rel, step-1 grad norm rel, worst gradient,
verdict), the train.py command that reproduces each failing case, and a JSON line last; exits 1 if a case fails.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import random
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if importlib.util.find_spec("megatron_sp") is None:  # run from a checkout without installing the package
    sys.path.insert(0, str(ROOT))

from megatron_sp.errors import ConfigError, OneLineArgumentParser, UserError  # noqa: E402


@dataclass(frozen=True)
class Key:
    """A key of the space: drawn uniformly from ``choices`` (or ``choices(drawn)``) when ``when`` holds on what was
    drawn before it (table order, the model's features first), else left at its default. ``None`` leaves the key
    unset (derived)."""

    choices: tuple | Callable[[dict[str, Any]], tuple]
    when: Callable[[dict[str, Any]], bool] = lambda c: True


def _is(key: str, *values: Any) -> Callable[[dict[str, Any]], bool]:
    return lambda c: c.get(key) in values


def _moe(c: dict[str, Any]) -> bool:
    return c.get("model.num_experts", 0) > 0


def _mla(c: dict[str, Any]) -> bool:
    return c.get("model.kv_lora_rank", 0) > 0


def _gate_normalised_away(c: dict[str, Any]) -> bool:
    """A top-1 router whose gate the output does not depend on, so that its gradient from the LM loss is noise that
    differs between layouts: renormalised (the weight ``p/(p + 1e-20)`` is 1, a gradient of ~1e-20), or, without
    shared experts, under post-sublayer norms (``x + norm(p·E(x))`` sees ``p`` only through the norm's eps: rounding
    noise, which Adam turns into full-size steps). Such a model keeps its aux loss, a real router gradient."""
    return c.get("model.moe_top_k") == 1 and (c.get("model.moe_renormalize") is True or (
        c.get("model.norm_placement") == "post_sublayer" and not c.get("model.moe_shared_experts")))


def _more(key: str) -> Callable[[dict[str, Any]], bool]:
    return lambda c: c.get(key, 1) > 1


# The model's features: the reference run has them too. One line per key.
FEATURES: dict[str, Key] = {
    "model.arch": Key(("neox", "llama")),
    "model.kv_lora_rank": Key((0, 16), _is("model.arch", "llama")),  # DeepSeek's latent attention (MLA)
    "model.q_lora_rank": Key((0, 24), _mla),
    "model.qk_nope_head_dim": Key((8, 12), _mla),
    "model.qk_rope_head_dim": Key((4, 8), _mla),
    "model.v_head_dim": Key((12, 6), _mla),  # padded to nope + rope in the kernels
    "model.num_kv_heads": Key((None, 2, 1), lambda c: c.get("model.arch") == "llama" and not _mla(c)),  # GQA
    "model.tie_embeddings": Key((False, True)),
    "model.rotary_pct": Key((None, 0.5, 1.0)),
    "model.rotary_base": Key((10000.0, 500000.0)),
    "model.rope_scaling": Key(("none", "linear", "llama3", "yarn")),
    "model.rope_scaling_factor": Key((4.0, 8.0), lambda c: c.get("model.rope_scaling", "none") != "none"),
    "model.rope_original_max_positions": Key((16,), _is("model.rope_scaling", "llama3", "yarn")),
    "model.rope_mscale_all_dim": Key((0.0, 1.0), lambda c: _mla(c) and c.get("model.rope_scaling") == "yarn"),
    "model.head_dim": Key((None, 16), lambda c: not _mla(c)),  # decoupled from hidden/heads (Qwen3)
    "model.qkv_bias": Key((False, True), lambda c: c.get("model.arch") == "llama" and not _mla(c)),  # Qwen2
    "model.qk_norm": Key((False, True), lambda c: not _mla(c)),  # Qwen3: per-head weights summed over TP
    "model.qk_norm_scope": Key(("head", "projection"), _is("model.qk_norm", True)),  # OLMo-2: statistic over TP
    "model.norm_placement": Key(("pre", "post_sublayer")),  # OLMo-2: x + norm(f(x))
    "model.sliding_window": Key((None, 7, 40)),  # Mistral: every cp_algo, packed documents; 40: below s, above s/cp
    "model.norm_eps": Key((1e-5, 1e-6)),
    "model.init_std": Key((0.02, 0.05)),
    "model.scaled_init": Key((True, False)),
    "model.make_vocab_size_divisible_by": Key((32, 128)),
    "model.cpu_attention_max_scores": Key((None, 0)),  # 0: torch's flash kernel instead of the explicit scores
    "model.recompute": Key(("none", "selective", "full")),
    "train.label_smoothing": Key((0.0, 0.1)),
    "train.z_loss": Key((0.0, 1e-4)),
    "data.eod_mask_loss": Key((False, True)),
    "data.reset_attention_mask": Key((False, True)),  # either reset_* trains on short packed documents
    "data.reset_position_ids": Key((False, True)),
    "model.num_experts": Key((0, 4, 8)),
    "model.moe_top_k": Key((1, 2), _moe),
    "model.moe_shared_experts": Key((0, 1), _moe),
    "model.moe_layer_freq": Key((1, 2), _moe),
    "model.moe_first_dense_layers": Key((0, 1), _moe),
    "model.moe_router_score": Key(("softmax", "sigmoid"), _moe),
    "model.moe_renormalize": Key((None, True, False), _moe),  # transformers' norm_topk_prob
    "model.moe_router_groups": Key((1, 2), _moe),  # DeepSeek-V3 group-limited routing (2 or 4 experts a group)
    "model.moe_router_group_topk": Key((1, 2), _more("model.moe_router_groups")),
    "model.moe_routed_scaling": Key((1.0, 2.5), _moe),
    "model.moe_aux_loss_coeff": Key(lambda c: (0.01,) if _gate_normalised_away(c) else (0.01, 0.0), _moe),
    "model.moe_z_loss_coeff": Key((0.0, 1e-3), _moe),
    "model.moe_bias_update_rate": Key((0.0, 1e-2), _moe),
    "model.moe_capacity_factor": Key((None, 1.0, 1.5), _moe),
    "model.mtp_layers": Key((0, 1, 2)),  # DeepSeek-V3 multi-token prediction (after the MoE keys: its layers may be MoE)
    "model.mtp_loss_coeff": Key((0.1, 1.0), lambda c: c.get("model.mtp_layers", 0) > 0),
    "train.micro_batch_size": Key((1, 2)),  # the reference's (MoE: the aux loss counts loads per micro-batch)
    "train.optimizer": Key(("adamw", "muon")),
    "train.muon_nesterov": Key((True, False), _is("train.optimizer", "muon")),
    "train.muon_split_heads": Key((False, True), _is("train.optimizer", "muon")),
    "train.muon_update_scale": Key(("moonlight", "spectral"), _is("train.optimizer", "muon")),
}

# The layout: how the same model and global batch are split. One line per key.
LAYOUT: dict[str, Key] = {
    "parallel.tp": Key((1, 2, 4)),
    "parallel.sequence_parallel": Key((False, True), _more("parallel.tp")),
    "parallel.tp_recompute_allgather": Key((True, False), _is("parallel.sequence_parallel", True)),
    "parallel.pp": Key((1, 2, 4)),
    "parallel.pp_schedule": Key(("1f1b", "interleaved", "zero_bubble", "none"), _more("parallel.pp")),
    "parallel.virtual_stages": Key((2,), _is("parallel.pp_schedule", "interleaved")),
    "parallel.pp_partition": Key(("uniform", "balanced"), _more("parallel.pp")),
    "parallel.cp": Key((1, 2, 4)),
    "parallel.cp_algo": Key(("ring", "zigzag", "llama3", "ulysses", "usp"), _more("parallel.cp")),
    "parallel.cp_ulysses": Key((1, 2), _is("parallel.cp_algo", "usp")),
    "parallel.cp_heads_k_stride": Key((1, 2), _is("parallel.cp_algo", "llama3")),
    "parallel.cp_document_chunk": Key((128, 1), lambda c: c.get("parallel.cp_algo") in ("zigzag", "usp")
                                      and c.get("data.reset_attention_mask")),
    "parallel.dp": Key((1, 2, 3, 4)),
    "parallel.zero": Key((0, 1, 2, 3), _more("parallel.dp")),
    "parallel.zero3_prefetch": Key((1, 0, 2), _is("parallel.zero", 3)),
    "parallel.ep": Key((1, 2, 4), _moe),
    "parallel.expert_tp": Key(lambda c: (1, c["parallel.tp"]),
                              lambda c: _moe(c) and c["parallel.tp"] > 1 and not c.get("parallel.sequence_parallel")),
    "train.micro_batch_size": Key((1, 2), lambda c: not _moe(c)),  # dense: any split of the global batch
}


def _world(c: dict[str, Any]) -> int:
    return math.prod(c.get(f"parallel.{k}", 1) for k in ("tp", "pp", "cp", "dp"))


def _ep_fold(c: dict[str, Any]) -> int:
    """The ranks of a stage the experts fold over (docs/moe.md)."""
    sp = c.get("parallel.tp", 1) if c.get("parallel.sequence_parallel") else 1
    return c.get("parallel.cp", 1) * c.get("parallel.dp", 1) * sp


# What a drawn layout must satisfy (else it is drawn again): the keys' documented ranges, so that draws are spent on
# combinations that can run. What validation refuses beyond these is listed as "refused".
RULES: dict[str, Callable[[dict[str, Any]], bool]] = {
    "parallel.ep divides the ranks it folds over and model.num_experts":
        lambda c: _ep_fold(c) % c.get("parallel.ep", 1) == 0 and c.get("model.num_experts", 0) % c.get("parallel.ep", 1) == 0,
    "model.moe_capacity_factor needs parallel.cp=1 (docs/moe.md)":
        lambda c: c.get("model.moe_capacity_factor") is None or c.get("parallel.cp", 1) == 1,
}

# Derived by ``derive_dims`` so that every layout of the model divides them.
DIMS = ("model.num_layers", "model.hidden_size", "model.num_heads", "model.seq_length", "model.ffn_multiple_of",
        "model.moe_ffn_hidden_size", "train.global_batch_size")

# The model/parallel keys outside the space, and why.
EXCLUDED = {
    "model.hidden_dropout": "parity is defined at dropout 0 (masks depend on the TP layout)",
    "model.attention_dropout": "parity is defined at dropout 0 (masks depend on the TP layout)",
    "model.ffn_hidden_size": "derived from hidden_size (neox 4h, llama rounded to ffn_multiple_of)",
    "model.vocab_size": "derived from the tokenizer",
    **{f"model.rope_{k}": "a band parameter of llama3/yarn: the rotary tables only (tests/unit/test_hf_families.py)"
       for k in ("low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "attention_factor")},
    "model.padded_vocab_size": "derived from the tokenizer and make_vocab_size_divisible_by",
    "parallel.backend": "gloo on CPU", "parallel.device": "this machine's",
    "parallel.timeout_s": "no numerical effect", "parallel.world_size": "derived: tp·pp·cp·dp",
}

# Every run: the tiny byte-level model of tests/e2e/runs.py, 5 steps, every step logged, step-1 gradients dumped.
BASE = ["tokenizer.type=byte", "train.lr=1e-3", "train.min_lr=1e-4", "train.lr_warmup_iters=2",
        "train.lr_decay_iters=10", "train.seed=7", "logging.interval=1", "data.build_demo=false",
        "logging.peak_tflops=0.1", "train.preflight=false", "train.iters=5", "logging.dump_grads_step=1"]
MOE_METRICS = ("moe_aux_loss", "moe_z_loss", "moe_load_imbalance", "moe_dropped_tokens")


@dataclass
class Case:
    """One drawn case: ``model`` (features and dims: the reference run's overrides) and ``layout``."""

    index: int
    group: int
    model: dict[str, Any]
    layout: dict[str, Any]
    verdict: str = "pending"  # ok | FAIL | error | refused (| drawn: --draw-only)
    detail: str = ""
    report: Any = None
    seconds: float = 0.0

    @property
    def packed(self) -> bool:
        return bool(self.model.get("data.reset_attention_mask") or self.model.get("data.reset_position_ids"))

    def reference_overrides(self) -> list[str]:
        return overrides(self.model)

    def overrides(self) -> list[str]:
        return overrides({**self.model, **self.layout})

    @property
    def world(self) -> int:
        return _world(self.layout)


def _default(key: str) -> Any:
    from megatron_sp.config import Config

    section, name = key.split(".")
    return getattr(getattr(Config(), section), name)


def _text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def overrides(values: dict[str, Any]) -> list[str]:
    """``key=value`` for each value that is set and differs from the schema's default."""
    return [f"{k}={_text(v)}" for k, v in values.items() if v is not None and v != _default(k)]


def draw(space: dict[str, Key], rng: random.Random, given: dict[str, Any] | None = None) -> dict[str, Any]:
    """One draw of ``space``'s keys in table order (``given``: what an earlier draw fixed)."""
    out: dict[str, Any] = {}
    for key, spec in space.items():
        drawn = {**(given or {}), **out}
        if spec.when(drawn):
            out[key] = rng.choice(spec.choices(drawn) if callable(spec.choices) else spec.choices)
    return out


def draw_layout(features: dict[str, Any], rng: random.Random, max_world: int) -> dict[str, Any]:
    """A layout of 2..max_world ranks for ``features`` satisfying ``RULES`` (drawn again until it does)."""
    for _ in range(10_000):
        layout = draw(LAYOUT, rng, features)
        both = {**features, **layout}
        if 2 <= _world(layout) <= max_world and all(rule(both) for rule in RULES.values()):
            return layout
    raise ConfigError(f"--max-world {max_world}: no layout of the space fits; use --max-world 2 or more")


def derive_dims(features: dict[str, Any], layouts: list[dict[str, Any]]) -> dict[str, Any]:
    """The model's sizes, so that every layout divides them: layers ≥ pp·virtual stages, the sequence divisible by
    what CP (×2 zigzag) × TP (under SP) needs, the global batch a multiple of dp·micro-batch·pp (the reference's
    micro-batch too) and at least 8."""
    from megatron_sp.mpu.cp_layout import required_divisor

    stages = max(lay.get("parallel.pp", 1) * lay.get("parallel.virtual_stages", 1) for lay in layouts)
    seq = math.lcm(64, *(required_divisor(lay.get("parallel.cp_algo", "ring"), lay.get("parallel.cp", 1),
                                          lay["parallel.tp"], bool(lay.get("parallel.sequence_parallel")))
                         for lay in layouts))
    micro = features["train.micro_batch_size"]
    unit = math.lcm(micro, *(lay.get("parallel.dp", 1) * lay.get("train.micro_batch_size", micro) *
                             lay.get("parallel.pp", 1) for lay in layouts))
    dims = {"model.num_layers": max(2, stages), "model.hidden_size": 64, "model.num_heads": 4, "model.seq_length": seq,
            "train.global_batch_size": unit * math.ceil(8 / unit)}
    if features["model.arch"] == "llama":
        dims["model.ffn_multiple_of"] = 32
    if _moe(features):
        dims["model.moe_ffn_hidden_size"] = 64
    return dims


def draw_cases(seed: int, count: int, max_world: int = 4, per_model: int = 2) -> list[Case]:
    """``count`` cases from ``seed``: groups of ``per_model`` layouts over one drawn model."""
    rng, cases = random.Random(seed), []
    while len(cases) < count:
        features = draw(FEATURES, rng)
        layouts = [draw_layout(features, rng, max_world) for _ in range(min(per_model, count - len(cases)))]
        model = {**features, **derive_dims(features, layouts)}
        group = len(cases) // per_model
        cases += [Case(len(cases) + i, group, model, layout) for i, layout in enumerate(layouts)]
    return cases


_VOCAB: list[int] = []


def validate(args: list[str]) -> str | None:
    """The config validation's line refusing ``args`` (in-process, with the byte tokenizer's vocabulary), or None."""
    from megatron_sp import config as config_mod
    from megatron_sp.config.loader import apply_sections

    if not _VOCAB:
        from megatron_sp.config import TokenizerConfig
        from megatron_sp.data import build_tokenizer

        _VOCAB.append(build_tokenizer(TokenizerConfig(type="byte")).vocab_size)
    try:
        sections: dict[str, dict[str, str]] = {}  # one source: the loader's type lookups once per section
        for item in [*BASE, "data.paths=[fuzz]", *args]:
            dotted, value = item.split("=", 1)
            sections.setdefault(dotted.split(".")[0], {})[dotted.split(".")[1]] = value
        cfg = config_mod.Config()
        apply_sections(cfg, sections, "fuzz_parity")
        config_mod.set_vocab(cfg, _VOCAB[0])
        config_mod.finalize(cfg)
    except ConfigError as exc:
        return str(exc)
    return None


# ----------------------------------------------------------------------------- data and runs

def _dataset(work: Path, packed: bool) -> str:
    """The byte-level dataset of tests/e2e/runs.py (``packed``: short documents, several per sample), built once."""
    from megatron_sp.config import TokenizerConfig
    from megatron_sp.data import build_tokenizer
    from megatron_sp.data.corpus import make_demo_corpus
    from megatron_sp.data.preprocess import preprocess_jsonl

    directory = work / "data"
    prefix = directory / ("packed" if packed else "byte")
    if not Path(f"{prefix}_text_document.idx").is_file():
        directory.mkdir(parents=True, exist_ok=True)
        corpus = make_demo_corpus(directory / "corpus.jsonl", max_bytes=400_000)
        source = corpus
        if packed:
            lines = [line.strip() for row in corpus.read_text().splitlines() for line in json.loads(row)["text"].splitlines()]
            source = directory / "short.jsonl"
            source.write_text("".join(json.dumps({"text": line[:60]}) + "\n" for line in lines if len(line) >= 20))
        preprocess_jsonl([source], str(prefix), build_tokenizer(TokenizerConfig(type="byte")))
    return f"{prefix}_text_document"


def command(work: Path, data: str, run_dir: Path, args: list[str]) -> list[str]:
    """The train.py command line of a run."""
    return ["python", "train.py", *BASE, f"data.paths=[{data}]", f"data.cache_dir={work / 'data' / 'cache'}",
            f"logging.dir={run_dir}", *args]


def train(argv: list[str]) -> tuple[int, str]:
    """Run train.py (``argv`` from ``command``) on ``testing.train_ranks`` (its ``main`` on forked gloo ranks, as
    torchrun starts it, ~1 s of start-up instead of ~6): its exit code and its last error line."""
    from megatron_sp.testing import RankError, train_ranks

    try:
        ranks = train_ranks(argv[2:])
    except RankError as exc:
        return 1, str(exc).strip().splitlines()[-1][:400]
    code = next((c for c, _ in ranks if c), 0)
    lines = [line for _, out in ranks for line in out.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error")]
    return code, (errors or lines or [""])[-1][:400]


def judge(ref_dir: Path, got_dir: Path, case: Case):
    """``compare_runs`` under the parity standard, plus the layout's world size and, for MoE, the balancing losses,
    drops and loads (layout-independent too, like tests/e2e/test_layout_parity.py)."""
    from megatron_sp.parity import compare_runs

    report = compare_runs(ref_dir, got_dir)
    rows = [{int(r["step"]): r for r in map(json.loads, (d / "metrics.jsonl").read_text().splitlines())
             if "loss" in r} for d in (ref_dir, got_dir)]
    for step, got in rows[1].items():
        want = rows[0].get(step, {})
        if step == min(rows[1]) and got.get("world_size") != case.world:
            report.problems.append(f"ran on world size {got.get('world_size')}, not {case.world}")
        if want.get("moe_tokens_per_expert") != got.get("moe_tokens_per_expert"):
            report.problems.append(f"step {step}: moe_tokens_per_expert differ")
        for key in MOE_METRICS:
            a, b = want.get(key), got.get(key)
            if a is not None and (b is None or abs(a - b) > 1e-6 * abs(a) + 1e-12):
                report.problems.append(f"step {step}: {key} {b} vs {a}")
    return report


def run_cases(cases: list[Case], work: Path, show: Callable[[Case], None]) -> None:
    """Validate, train and judge every case (one reference run per model, shared); ``show`` each as it ends."""
    refs: dict[tuple[str, ...], tuple[int, str, Path]] = {}
    for case in cases:
        start = time.time()
        data = _dataset(work, case.packed)
        ref_args = case.reference_overrides()
        line = validate(ref_args) or validate(case.overrides())
        if line is None:
            key = (data, *ref_args)
            if key not in refs:
                ref_dir = work / "refs" / f"ref{len(refs)}"
                refs[key] = (*train(command(work, data, ref_dir, ref_args)), ref_dir)
            rc, last, ref_dir = refs[key]
            who = "reference run"
            if rc == 0:
                run_dir, who = work / "cases" / f"case{case.index}", "layout run"
                rc, last = train(command(work, data, run_dir, case.overrides()))
            if rc == 0:
                case.report = judge(ref_dir, run_dir, case)
                case.verdict = "ok" if case.report.ok else "FAIL"
                case.detail = "; ".join(case.report.problems)
            elif rc == 2:  # ConfigError: validation after the tokenizer or in the ranks
                line = f"{who}: {last}"
            else:
                case.verdict, case.detail = "error", f"{who}: exit {rc}: {last}"
        if case.verdict == "pending":
            case.verdict, case.detail = "refused", line or ""
        case.seconds = time.time() - start
        show(case)


# ----------------------------------------------------------------------------- report

def _short(args: list[str]) -> str:
    return " ".join(a.split(".", 1)[1] for a in args) or "-"


COLUMNS = ("case", "features", "layout", "loss rel", "gnorm rel", "worst grad", "verdict")


def row(case: Case) -> str:
    r = case.report
    numbers = (f"{r.worst_loss_rel:.1e}", f"{r.grad_norm_rel:.1e}", f"{r.worst_grad[0]} {r.worst_grad[1]:.1e}") \
        if r is not None else ("-", "-", "-")
    model = [a for a in overrides(case.model) if a.split("=")[0] not in DIMS]
    text = " | ".join([str(case.index), _short(model), _short(overrides(case.layout)), *numbers, case.verdict])
    return text + (f"\n    {case.detail}" if case.detail else "")


def as_json(case: Case) -> dict[str, Any]:
    r = case.report
    out = {"case": case.index, "group": case.group, "model": overrides(case.model), "layout": overrides(case.layout),
           "world": case.world, "verdict": case.verdict, "detail": case.detail, "seconds": round(case.seconds, 1)}
    if r is not None:
        out.update(loss_rel=r.worst_loss_rel, grad_norm_rel=r.grad_norm_rel, worst_grad=list(r.worst_grad))
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = OneLineArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0, help="seed of the draws (default: %(default)s)")
    parser.add_argument("--count", type=int, default=12, help="cases to draw (default: %(default)s)")
    parser.add_argument("--max-world", type=int, default=4, help="largest layout in ranks (default: %(default)s)")
    parser.add_argument("--layouts-per-model", type=int, default=2,
                        help="layouts drawn for each model, sharing its reference run (default: %(default)s)")
    parser.add_argument("--only", default="", metavar="I,J", help="run only these case numbers of the draw")
    parser.add_argument("--keep", metavar="DIR", help="write the data and runs here and keep them (default: a "
                                                      "temporary directory, kept only when a case fails)")
    parser.add_argument("--draw-only", action="store_true", help="draw and validate the cases, train nothing")
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    args = parser.parse_args(argv)
    for name in ("count", "max_world", "layouts_per_model"):
        if getattr(args, name) < (2 if name == "max_world" else 1):
            raise ConfigError(f"--{name.replace('_', '-')}: {getattr(args, name)} must be at least "
                              f"{2 if name == 'max_world' else 1}")
    try:
        args.only = {int(i) for i in args.only.split(",") if i.strip()}
    except ValueError:
        raise ConfigError(f"--only: '{args.only}' must be case numbers separated by commas, e.g. --only 3,7") from None
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        cases = draw_cases(args.seed, args.count, args.max_world, args.layouts_per_model)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    cases = [c for c in cases if not args.only or c.index in args.only]
    say = (lambda text: None) if args.json else (lambda text: print(text, flush=True))
    say(" | ".join(COLUMNS))
    if args.draw_only:
        for case in cases:
            line = validate(case.reference_overrides()) or validate(case.overrides())
            case.verdict, case.detail = ("drawn", "") if line is None else ("refused", line)
            say(row(case))
        work = None
    else:
        work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="fuzz_parity_"))
        work.mkdir(parents=True, exist_ok=True)
        run_cases(cases, work, lambda case: say(row(case)))
    failed = [c for c in cases if c.verdict in ("FAIL", "error")]
    for case in failed:
        data = str(work / "data" / ("packed" if case.packed else "byte")) + "_text_document"
        say(f"case {case.index} {case.verdict}; reproduce:\n  reference: "
            f"{shlex.join(command(work, data, work / 'refs' / 'REF', case.reference_overrides()))}\n  layout:    "
            f"{shlex.join(command(work, data, work / 'cases' / f'case{case.index}', case.overrides()))}")
    if work is not None and not args.keep:
        if failed:
            say(f"kept {work} (a case failed)")
        else:
            shutil.rmtree(work, ignore_errors=True)
    counts = {v: sum(c.verdict == v for c in cases) for v in ("ok", "FAIL", "error", "refused", "drawn")}
    print(json.dumps({"seed": args.seed, "count": args.count, "max_world": args.max_world, **counts,
                      "cases": [as_json(c) for c in cases]}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
