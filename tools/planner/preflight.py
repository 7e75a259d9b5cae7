"""Pre-flight: the planner's per-rank memory held against what the ranks of this host will have, before any data
is built or any rank starts (``train.py``; ``train.preflight=false`` skips it). See docs/planner.md, "Pre-flight".

On CPU the local ranks share the host's available RAM (``MemAvailable``); on GPU each rank has one device.
A layout that cannot fit is refused in one line with the figure and the first layout that fits on this host.
"""
from __future__ import annotations

import copy
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from megatron_sp import device as device_mod
from megatron_sp.config import Config, set_vocab
from megatron_sp.errors import ConfigError

from .dims import DEFAULT_BANDWIDTH_GBS, DEFAULT_PEAK_TFLOPS
from .layouts import LayoutPlan, estimate_step_time, factorizations, format_bytes, layout_overrides, plan_layout

log = logging.getLogger("megatron_sp")

PROCESS_BYTES = 400 * 2**20
"""What a rank holds beyond the planner's tensors: the Python interpreter, torch's libraries and kernels, the
dataset's mapped pages and allocator slack. Measured: a demo rank peaks at 520–607 MiB RSS where the planner
counts 184 MiB."""

@dataclass
class Budget:
    """What one host gives the ranks of a run: on CPU its available RAM, shared by the local ranks; on GPU one
    device's memory per rank."""

    device: str  # "cpu" | "cuda"
    total: int  # bytes: the host's available RAM (CPU) or one device's memory (GPU)
    cores: int

    def per_rank(self, ranks: int) -> int:
        return self.total // max(1, ranks) if self.device == "cpu" else self.total


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


def rank_bytes(lp: LayoutPlan) -> int:
    """The planner's peak of the busiest rank plus what a process holds besides its tensors."""
    return lp.peak_bytes + PROCESS_BYTES


def check(cfg: Config, build: Callable[[list[str]], Config], local_ranks: int) -> str:
    """Refuse (``ConfigError``) a layout whose planned memory does not fit this host; return the memory note for a
    rank killed later ('planned ~N GiB per rank × R ranks, host ...'). ``build(overrides)``: the config with more
    dotted overrides, finalized (the suggestions are built with it)."""
    vocab, source = plan_vocab(cfg)
    planned = _with_vocab(copy.deepcopy(cfg), vocab)  # the tokenizer sets the run's own vocabulary later
    need = rank_bytes(plan_layout(planned))
    budget = host_budget(cfg)
    where = "this host" if budget.device == "cpu" else "each GPU"
    note = (f"planned ~{format_bytes(need)} per rank × {local_ranks} rank{'s' if local_ranks > 1 else ''} on this "
            f"host, which had {format_bytes(budget.total)} available" if budget.device == "cpu" else
            f"planned ~{format_bytes(need)} per rank on a {format_bytes(budget.total)} GPU")
    if budget.total <= 0 or need <= budget.per_rank(local_ranks):
        if budget.device == "cpu" and local_ranks > budget.cores:
            log.warning("%d local ranks share %d cores: each rank gets a fraction of a core and steps are slow",
                        local_ranks, budget.cores)
        return note
    p = cfg.parallel
    layout = f"tp{p.tp} pp{p.pp} cp{p.cp} dp{p.dp}"
    if budget.device == "cpu":
        figure = (f"~{format_bytes(need)} per rank × {local_ranks} rank{'s' if local_ranks > 1 else ''} = "
                  f"{format_bytes(need * local_ranks)}, and {where} has {format_bytes(budget.total)} available")
        sized = f": it is sized for {p.world_size} GPUs" if p.world_size > 1 else ""
    else:
        figure, sized = f"~{format_bytes(need)} per rank, and {where} has {format_bytes(budget.total)}", ""
    vocab_note = "" if source.startswith(("tokenizer ", "model.", "the byte")) else f" (vocabulary {vocab} from {source})"
    raise ConfigError(f"this layout ({layout}) needs {figure}{sized}{vocab_note}; {suggest(cfg, build, budget, vocab)}"
                      "; or set train.preflight=false to start anyway")


def _with_vocab(cfg: Config, vocab: int) -> Config:
    if cfg.model.padded_vocab_size is None:
        set_vocab(cfg, vocab)
    return cfg


def suggest(cfg: Config, build: Callable[[list[str]], Config], budget: Budget, vocab: int) -> str:
    """The first layout that fits ``budget``: on CPU with at most one rank per core (then one rank), on GPU with
    the same ranks; each layout as configured, then with micro-batch 1, then also with full recompute."""
    world = cfg.parallel.world_size
    on = "this CPU" if budget.device == "cpu" else "these GPUs"
    worlds = sorted({min(world, budget.cores), 1}, reverse=True) if budget.device == "cpu" else [world]
    shrinks = ([], ["train.micro_batch_size=1"], ["train.micro_batch_size=1", "model.recompute=full"])
    for ranks in worlds:
        for shrink in shrinks[:1] if cfg.train.micro_batch_size == 1 and cfg.model.recompute == "full" else shrinks:
            fitting = []  # (estimated step seconds, bytes per rank, layout)
            for layout in factorizations(ranks):
                try:
                    lp = plan_layout(_with_vocab(build([*layout_overrides(cfg, *layout), *shrink]), vocab))
                except ConfigError:
                    continue
                need = rank_bytes(lp)
                if need <= budget.per_rank(ranks):
                    fitting.append((estimate_step_time(lp, DEFAULT_PEAK_TFLOPS, DEFAULT_BANDWIDTH_GBS)["step_s"], need, layout))
            if fitting:
                _, need, layout = min(fitting)
                return f"on {on} try `{' '.join([*_layout_args(cfg, layout), *shrink])}` (~{format_bytes(need)} per rank)"
    return f"no layout of {worlds[0]} or fewer ranks fits on {on}: use more memory or a smaller model"


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
