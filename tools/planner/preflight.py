"""Pre-flight: the planner's per-rank memory held against what the ranks of this host will have, before any data
is built or any rank starts (``train.py``, ``tools/generate.py``, ``tools/evaluate.py``; ``train.preflight=false``
skips it). For a training run (``training=True``) also the GPT dataset's sample index (memory while rank 0 builds
it, disk for its cache) and the estimated time of a step on this host. See docs/planner.md, "Pre-flight".

On CPU the local ranks share the host's available RAM (``MemAvailable``) and cores; on GPU each rank has one device.
A run that cannot fit is refused in one line with the figure and one command that fits here: the config's own with
another layout (and the demo's tokenizer and data when its own are missing), else ``configs/125M_cpu.yml``.
"""
from __future__ import annotations

import copy
import json
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from megatron_sp import device as device_mod
from megatron_sp.config import Config, set_vocab
from megatron_sp.errors import ConfigError, DataError, one_line

from .dims import ACHIEVABLE_MFU, DEFAULT_BANDWIDTH_GBS, DEFAULT_PEAK_TFLOPS
from .layouts import LayoutPlan, estimate_step_time, format_bytes, plan_layout, search

log = logging.getLogger("megatron_sp")

PROCESS_BYTES = 400 * 2**20
"""What a rank holds beyond the planner's tensors: the Python interpreter, torch's libraries and kernels, the
dataset's mapped pages and allocator slack. Measured: a demo rank peaks at 520–607 MiB RSS where the planner
counts 184 MiB."""
STEP_LIMIT_S = 600.0
"""A step estimated longer than this is warned about, and a suggested command must stay under it."""
INDEX_MEMORY = (64, 24)
"""Bytes rank 0 holds while it builds a GPT dataset's indices: per sample, per document of every epoch (the
int64 arrays and their temporaries, as ``data.check_index_memory`` counts them)."""
INDEX_DISK = (24, 8)
"""Bytes of the cached indices (.npy, int64): ``sample_idx`` + ``shuffle_idx`` per sample, ``doc_idx`` per
document of every epoch."""
DEMO_CORPUS = (1_060_000, 208)
"""Tokens and documents of the demo corpus (``data.build_demo``, 4 MB of Python) with its 4096-token tokenizer,
measured: what the index is planned over before the demo data is built."""
FALLBACK = "configs/125M_cpu.yml"
"""What the pre-flight names when nothing derived from the config fits this host."""


class PreflightError(ConfigError):
    """A run that does not fit this host: its one line keeps the whole suggested command (up to 1,200 characters,
    where other errors are cut at ``errors.MAX_LINE``), so that it can be copied."""

    def __str__(self) -> str:
        return one_line(Exception.__str__(self), 1200)


@dataclass
class Budget:
    """What one host gives the ranks of a run: on CPU its available RAM, shared by the local ranks; on GPU one
    device's memory per rank."""

    device: str  # "cpu" | "cuda"
    total: int  # bytes: the host's available RAM (CPU) or one device's memory (GPU)
    cores: int

    def per_rank(self, ranks: int) -> int:
        return self.total // max(1, ranks) if self.device == "cpu" else self.total


@dataclass
class IndexPlan:
    """The sample index a training run builds: samples, epochs over the corpus, rank 0's memory while it builds
    it, the disk its cache takes (0 where a cache of that size is there), and what was not counted."""

    samples: int = 0
    epochs: int = 0
    memory: int = 0
    disk: int = 0
    cache_dir: Path | None = None
    notes: list[str] = field(default_factory=list)


def plan_vocab(cfg: Config) -> tuple[int, str]:
    """The vocabulary size to plan with before the tokenizer is built, and where it came from."""
    tok = cfg.tokenizer
    if cfg.model.vocab_size:
        return cfg.model.vocab_size, "model.vocab_size"
    if tok.type == "byte":
        return 258, "the byte tokenizer"
    if tok.model and Path(tok.model).exists():
        from megatron_sp.data.tokenizer import build_tokenizer

        return build_tokenizer(tok).vocab_size, f"tokenizer {tok.model}"
    return tok.vocab_size, "tokenizer.vocab_size, no tokenizer file yet"


def host_budget(cfg: Config) -> Budget:
    cuda = cfg.parallel.device == "cuda"
    memory = device_mod.accelerator_memory_bytes() if cuda else device_mod.host_memory_available()
    return Budget("cuda" if cuda else "cpu", memory, device_mod.host_cores())


def host_peak(cfg: Config) -> tuple[float, str]:
    """FLOP/s of one device of this host for ``cfg`` and where it came from: ``logging.peak_tflops``; on GPU else
    ``DEFAULT_PEAK_TFLOPS``; on CPU the best matmul rate recorded here for the precision (``device.record_peak_flops``,
    what train.py's MFU divides by), measured now (``metrics.host_cpu_peaks``, about a second) when none is."""
    if cfg.logging.peak_tflops:
        return cfg.logging.peak_tflops * 1e12, "logging.peak_tflops"
    if cfg.parallel.device == "cuda":
        return DEFAULT_PEAK_TFLOPS * 1e12, "an A100's dense bf16 peak; set logging.peak_tflops for yours"
    import torch

    from megatron_sp import metrics

    recorded = device_mod.record_peak_flops(torch.bfloat16 if cfg.train.precision == "bf16" else torch.float32, 0.0)
    if recorded > 0:
        return recorded, "this host's recorded CPU matmul peak"
    return metrics.host_cpu_peaks(cfg.train.precision)[0], "this host's CPU matmul peak, measured now"


def rank_bytes(lp: LayoutPlan) -> int:
    """The planner's peak of the busiest rank plus what a process holds besides its tensors."""
    return lp.peak_bytes + PROCESS_BYTES


def input_overrides(cfg: Config) -> list[str]:
    """The overrides that point a run at the demo's tokenizer and data when its own are missing and not built by
    ``data.build_demo`` (the overrides ``data.ensure_demo_data`` names); [] when they are there or buildable."""
    from megatron_sp.data import DEMO_VOCAB
    from megatron_sp.data.blending import parse_blend
    from megatron_sp.data.indexed import data_file_paths

    tok, demo = cfg.tokenizer, Path(cfg.data.demo_dir)
    missing: list[Path | None] = []
    if tok.type != "byte" and not (tok.model and Path(tok.model).exists()):
        missing.append(Path(tok.model) if tok.model else None)
    try:
        prefixes = parse_blend(cfg.data.paths)[0]
    except ConfigError:  # no data.paths
        prefixes = []
    missing += [Path(p) for p in prefixes if not all(f.is_file() for f in data_file_paths(p))] or ([] if prefixes else [None])
    if not missing or cfg.data.build_demo and all(p is not None and p.resolve().is_relative_to(demo.resolve())
                                                  for p in missing):
        return []
    return [f"data.paths=[{demo / 'demo_text_document'}]", *(["tokenizer.type=sentencepiece"] if tok.type != "sentencepiece" else []),
            f"tokenizer.model={demo / 'tokenizer.model'}",
            *([f"tokenizer.vocab_size={DEMO_VOCAB}"] if tok.vocab_size != DEMO_VOCAB else []), "data.build_demo=true"]


def index_plan(cfg: Config) -> IndexPlan:
    """The sample index of ``training.split_samples(cfg)`` over each split of ``data.paths``: token and document
    counts from the .idx when it is there, from ``DEMO_CORPUS`` when ``data.build_demo`` builds it, else not
    counted (a note says so); a blend's datasets share the samples by weight (else by tokens)."""
    from megatron_sp.data.blending import normalize, parse_blend
    from megatron_sp.data.gpt_dataset import parse_split, split_documents
    from megatron_sp.data.indexed import IndexedDataset, data_file_paths
    from megatron_sp.training import split_samples

    out = IndexPlan()
    if cfg.data.packing == "position_ids":  # one pre-packed document per sample: no sample index is built
        return out
    prefixes, weights = parse_blend(cfg.data.paths)
    seq, ratios = cfg.model.seq_length, parse_split(cfg.data.split)
    corpora: list[tuple[int, ...] | None] = []  # per prefix: the tokens of each split, then its documents
    for prefix in prefixes:
        if all(f.is_file() for f in data_file_paths(prefix)):
            try:
                indexed = IndexedDataset(prefix)
                docs = split_documents(indexed.num_documents, cfg.data.split)
                corpora.append((*(int(indexed.document_sizes[d].sum()) for d in docs), *(d.size for d in docs)))
                continue
            except DataError:
                pass  # a malformed .idx: the data checks after the pre-flight say so
        elif cfg.data.build_demo:
            tokens, docs = DEMO_CORPUS
            corpora.append((*(int(tokens * r) for r in ratios), *(round(docs * r) for r in ratios)))
            out.notes.append(f"{prefix} not built yet: planned as the demo corpus ({tokens:,} tokens)")
            continue
        corpora.append(None)
        out.notes.append(f"{prefix} not there: its index is not counted")
    shares = normalize(weights) if weights else [1 / len(prefixes)] * len(prefixes)
    for split, samples in enumerate(split_samples(cfg)[:2]):
        for prefix, share, corpus in zip(prefixes, shares, corpora):
            if corpus is None or not samples or not corpus[split]:
                continue
            n = int(samples * share) + 1
            epochs = -(-(n * seq + 1) // corpus[split])
            entries = epochs * corpus[3 + split]
            out.samples, out.epochs = out.samples + n, max(out.epochs, epochs)
            cache = Path(cfg.data.cache_dir) if cfg.data.cache_dir else Path(prefix).parent
            out.cache_dir = out.cache_dir or cache
            if not _cached(cache, Path(prefix).name, ("train", "valid")[split], n - 1, seq):
                out.memory += INDEX_MEMORY[0] * n + INDEX_MEMORY[1] * entries
                out.disk += INDEX_DISK[0] * n + INDEX_DISK[1] * entries
    return out


def _cached(cache: Path, stem: str, split: str, samples: int, seq: int) -> bool:
    """Whether ``cache`` holds a GPT dataset index of about ``samples`` samples of ``stem``'s ``split``."""
    for path in cache.glob(f"{stem}_{split}_*_description.json") if cache.is_dir() else ():
        try:
            d = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(d, dict) and d.get("seq_length") == seq and abs(int(d.get("num_samples", -9)) - samples) <= 1:
            return True
    return False


def _free_disk(path: Path) -> int:
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return 0


def misfit(cfg: Config, need: int, budget: Budget, ranks: int, index: IndexPlan | None) -> str | None:
    """Why a run whose ranks each need ``need`` bytes (and whose rank 0 builds ``index``) does not fit this host;
    None when it does."""
    p = cfg.parallel
    s = "s" if ranks > 1 else ""
    if budget.total > 0 and need > budget.per_rank(ranks):
        layout = f"tp{p.tp} pp{p.pp} cp{p.cp} dp{p.dp}"
        if budget.device == "cpu":
            sized = f": it is sized for {p.world_size} GPUs" if p.world_size > 1 else ""
            return (f"this layout ({layout}) needs ~{format_bytes(need)} per rank × {ranks} rank{s} = "
                    f"{format_bytes(need * ranks)}, and this host has {format_bytes(budget.total)} available{sized}")
        return f"this layout ({layout}) needs ~{format_bytes(need)} per rank, and each GPU has {format_bytes(budget.total)}"
    if index is None or not index.samples:
        return None
    what = (f"the data index of {index.samples:,} samples (train.iters {cfg.train.iters} × train.global_batch_size "
            f"{cfg.train.global_batch_size}, + validation; {index.epochs:,} epochs of the corpus)")
    host = budget.total if budget.device == "cpu" else device_mod.host_memory_available()
    ranks_bytes = need * ranks if budget.device == "cpu" else 0
    if host > 0 and index.memory + ranks_bytes > host:
        beside = f" beside the ranks' {format_bytes(ranks_bytes)}" if ranks_bytes else ""
        return (f"{what} needs ~{format_bytes(index.memory)} of memory while rank 0 builds it{beside}, and this host has "
                f"{format_bytes(host)} available: lower train.iters or train.global_batch_size")
    free = _free_disk(index.cache_dir) if index.cache_dir and index.disk else index.disk
    if index.disk > free:
        return (f"{what} needs ~{format_bytes(index.disk)} of disk in {index.cache_dir}, which has {format_bytes(free)} "
                "free: lower train.iters or train.global_batch_size, or set data.cache_dir")
    return None


def step_seconds(lp: LayoutPlan, peak: float, ranks: int) -> float:
    """The estimated step time of ``lp`` with each of ``ranks`` ranks of this host at its share of ``peak`` (CPU;
    on GPU each has ``peak``), at the ``ACHIEVABLE_MFU`` ceiling."""
    device = lp.dims.device
    per_rank = peak / ranks if device == "cpu" else peak
    return estimate_step_time(lp, per_rank / 1e12, DEFAULT_BANDWIDTH_GBS, ACHIEVABLE_MFU[device])["step_s"]


def check(cfg: Config, build: Callable[[list[str]], Config], local_ranks: int, *, training: bool = False,
          command: str | None = None) -> str:
    """Refuse (``ConfigError``) a layout whose planned memory does not fit this host; return the memory note for a
    rank killed later ('planned ~N GiB per rank × R ranks, host ...'). ``build(overrides)``: the config with more
    dotted overrides, finalized (the suggestions are built with it). ``training``: also the data index (memory,
    disk) and the step time (logged; warned past ``STEP_LIMIT_S``). ``command``: the command line the user ran
    (``python train.py --conf ...``), which the suggestion extends."""
    vocab, source = plan_vocab(cfg)
    lp = plan_layout(_with_vocab(copy.deepcopy(cfg), vocab))  # the tokenizer sets the run's own vocabulary later
    need = rank_bytes(lp)
    budget = host_budget(cfg)
    index = index_plan(cfg) if training else None
    note = (f"planned ~{format_bytes(need)} per rank × {local_ranks} rank{'s' if local_ranks > 1 else ''} on this "
            f"host, which had {format_bytes(budget.total)} available" if budget.device == "cpu" else
            f"planned ~{format_bytes(need)} per rank on a {format_bytes(budget.total)} GPU")
    problem = misfit(cfg, need, budget, local_ranks, index)
    if problem is None:
        if budget.device == "cpu" and local_ranks > budget.cores:
            log.warning("%d local ranks share %d cores: each rank gets a fraction of a core and steps are slow",
                        local_ranks, budget.cores)
        if training:
            _report_step_time(cfg, lp, local_ranks, index)
        return note
    vocab_note = "" if source.startswith(("tokenizer ", "model.", "the byte")) or not problem.startswith("this layout") \
        else f" (vocabulary {vocab} from {source})"
    raise PreflightError(f"{problem}{vocab_note}; {suggest(cfg, build, budget, training, command)}"
                      "; or set train.preflight=false to start anyway")


def _report_step_time(cfg: Config, lp: LayoutPlan, ranks: int, index: IndexPlan | None) -> None:
    peak, source = host_peak(cfg)
    seconds = step_seconds(lp, peak, ranks)
    flops = max(r.flops for r in lp.stages)
    t = cfg.train
    notes = "; ".join(index.notes) if index and index.notes else ""
    log.info("pre-flight: a step ~%s on this host (%.3g TFLOP on the busiest rank at %.0f %% of %.4g TFLOP/s per %s, "
             "%s), %d steps ~%s%s", _duration(seconds), flops / 1e12, 100 * ACHIEVABLE_MFU[lp.dims.device],
             peak / 1e12, "host" if lp.dims.device == "cpu" else "GPU", source, t.iters, _duration(seconds * t.iters),
             f"; {notes}" if notes else "")
    if seconds > STEP_LIMIT_S:
        log.warning("a step would take ~%s on this host: train.global_batch_size %d × %d tokens on %d rank%s; lower "
                    "train.global_batch_size (or the model), or try `python train.py --conf %s`; train.iters %d would "
                    "take ~%s", _duration(seconds), t.global_batch_size, cfg.model.seq_length, ranks,
                    "s" if ranks > 1 else "", FALLBACK, t.iters, _duration(seconds * t.iters))


def _duration(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.3g} {unit}"
    return f"{seconds:.3g} s"


def _with_vocab(cfg: Config, vocab: int) -> Config:
    if cfg.model.padded_vocab_size is None:
        set_vocab(cfg, vocab)
    return cfg


def suggest(cfg: Config, build: Callable[[list[str]], Config], budget: Budget, training: bool = False,
            command: str | None = None) -> str:
    """One command that fits ``budget``: the fastest layout (by the planner's search, with ZeRO, recompute and
    micro-batch size) on CPU of at most one rank per core (then one rank), on GPU of the same ranks; for a training
    run with the demo's tokenizer and data when the config's are missing, and only if its data index fits and a
    step stays under ``STEP_LIMIT_S``; else ``FALLBACK`` (training) or what to change."""
    world = cfg.parallel.world_size
    on = "this CPU" if budget.device == "cpu" else "these GPUs"
    worlds = sorted({min(world, budget.cores), 1}, reverse=True) if budget.device == "cpu" else [world]
    inputs = input_overrides(cfg) if training else []
    peak, _ = host_peak(cfg)
    try:
        vocab = plan_vocab(build(inputs))[0]
    except ConfigError:
        worlds = []
    for ranks in worlds:
        per_rank = peak / ranks if budget.device == "cpu" else peak
        cands = search(lambda extra: _with_vocab(build([*inputs, *extra]), vocab), cfg, ranks,
                       budget.per_rank(ranks) - PROCESS_BYTES, per_rank / 1e12, DEFAULT_BANDWIDTH_GBS, knobs=True)
        for c in (c for c in cands if c.fits and c.plan is not None):
            assert c.plan is not None
            if training and (misfit(c.plan.cfg, rank_bytes(c.plan), budget, ranks, index_plan(c.plan.cfg))
                             or step_seconds(c.plan, peak, ranks) > STEP_LIMIT_S):
                continue
            args = [*_layout_args(cfg, c.layout), *_changed(cfg, c.knobs), *inputs]
            line = f"{command} {' '.join(args)}" if command else " ".join(args)
            return f"on {on} try `{line}` (~{format_bytes(rank_bytes(c.plan))} per rank)"
    if training:
        return (f"nothing derived from this config fits {on} with a step under {_duration(STEP_LIMIT_S)}: try "
                f"`python train.py --conf {FALLBACK}`")
    return f"no layout of {max(worlds, default=1)} or fewer ranks fits on {on}: use more memory or a smaller model"


def _changed(cfg: Config, knobs: list[str]) -> list[str]:
    """The knob overrides (``key=value``) whose value differs from ``cfg``'s."""
    now = {"model.recompute": cfg.model.recompute, "train.micro_batch_size": str(cfg.train.micro_batch_size),
           "parallel.zero": str(cfg.parallel.zero)}
    return [k for k in knobs if now.get(k.split("=")[0]) != k.split("=")[1]]


def _layout_args(cfg: Config, layout: tuple[int, int, int, int]) -> list[str]:
    """The overrides a user types to move ``cfg`` to ``layout`` (only the keys that change)."""
    p = cfg.parallel
    now = {"tp": p.tp, "pp": p.pp, "cp": p.cp, "dp": p.dp}
    out = [f"parallel.{k}={v}" for k, v in zip(("tp", "pp", "cp", "dp"), layout, strict=True) if now[k] != v]
    if p.sequence_parallel and layout[0] == 1:
        out.append("parallel.sequence_parallel=false")
    if p.expert_tp > 1 and layout[0] != p.tp:  # experts split over tp follow it (layout_overrides)
        out.append(f"parallel.expert_tp={layout[0]}")
    return out


def local_ranks(cfg: Config) -> int:
    """The ranks that will share this host: torchrun's local world size, else the whole run (train.py starts them)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", cfg.parallel.world_size))

