"""The plan of a layout (every stage), its step-time estimate, and the search over layouts (docs/planner.md)."""
from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from megatron_sp.config.schema import Config
from megatron_sp.errors import ConfigError
from megatron_sp.model.gpt import attended_keys, mlp_parameters, parameter_parts
from megatron_sp.pipeline.schedules import theory_bubble

from .activations import ChunkActivations, SchedulePeak, buffer_terms, chunk_activations, schedule_peak
from .dims import DEFAULT_BUCKET_BYTES, DEFAULT_PEAK_TFLOPS, PlanDims, dims_of, expert_fold, moe_layers_of, stage_layers
from .state import StateBytes, state_bytes
from .traffic import comm_per_step
from .zero import zero_buffers


@dataclass
class RankPlan:
    """Everything predicted for a rank of one pipeline stage."""

    pp_rank: int
    state: StateBytes
    chunks: list[ChunkActivations]
    schedule: SchedulePeak
    buffers: dict[str, int]
    comm: dict[str, dict[str, float]]
    flops: float

    @property
    def activations(self) -> int:
        return self.schedule.peak

    @property
    def per_micro_batch(self) -> int:
        """One micro-batch through every chunk of the stage, the batch-shared tensors included."""
        return sum(c.per_micro_batch for c in self.chunks) + sum(sum(c.shared.values()) for c in self.chunks)

    @property
    def total(self) -> int:
        return self.state.total + self.activations + sum(self.buffers.values())

    def comm_bytes(self, dim: str | None = None) -> float:
        dims = [dim] if dim else list(self.comm)
        return sum(sum(self.comm.get(k, {}).values()) for k in dims)


@dataclass
class LayoutPlan:
    """The plan of one layout: a ``RankPlan`` per pipeline stage and the step-time estimate."""

    cfg: Config
    dims: PlanDims
    stages: list[RankPlan]
    time: dict[str, float] = field(default_factory=dict)

    @property
    def worst(self) -> RankPlan:
        return max(self.stages, key=lambda r: r.total)

    @property
    def peak_bytes(self) -> int:
        return self.worst.total

    @property
    def layout(self) -> tuple[int, int, int, int]:
        return (self.dims.tp, self.dims.pp, self.dims.cp, self.dims.dp)


def stage_flops(cfg: Config, pp_rank: int, recompute: str | None = None, executed: bool = False) -> float:
    """Model FLOPs per step on one rank of stage ``pp_rank``: ``6·N_stage + 6·L_stage·h·s`` per token
    (``model.flops_per_token``: PaLM, attention over the causal half or the sliding window's band), N without the
    input embedding and, in MoE layers, the active parameters only (router E·h, top-k experts, shared experts),
    divided over TP and CP;
    ``recompute`` (default the config's) adds the recomputed forward: ``2·N + 2·L·h·s`` (full) or ``2·L·h·s``
    (selective). ``executed``: what the rank computes rather than its share of the model's FLOPs: without
    sequence parallelism every TP rank runs the router and the routed experts on all its tokens (replicated
    over tp), so their FLOPs are not divided by tp; under expert tensor parallelism only the router's."""
    D = dims_of(cfg)
    recompute = D.recompute if recompute is None else recompute
    parts = parameter_parts(cfg.model)
    chunks = stage_layers(cfg, pp_rank)
    last = pp_rank == D.pp - 1
    mtp = range(D.layers, D.layers + cfg.model.mtp_layers) if last else range(0)  # multi-token prediction's layers
    main, main_moe = sum(len(c) for c in chunks), sum(moe_layers_of(cfg, c) for c in chunks)
    n = (main - main_moe) * parts["layer"] + main_moe * parts.get("moe_layer_active", 0) + \
        (parts["final_norm"] + (1 + len(mtp)) * parts["output_layer"] + parts["mtp_active"] if last else 0)
    layers, moe = main + len(mtp), main_moe + moe_layers_of(cfg, mtp)
    keys = attended_keys(D.seq, cfg.model.sliding_window)  # as gpt.flops_per_token
    attention = 6 * layers * D.heads * (D.head_dim + (D.mla[3] or D.head_dim)) * keys
    per_token = 6 * n + attention
    if recompute == "full":
        per_token += 2 * n + attention / 3
    elif recompute == "selective":
        per_token += attention / 3
    tokens = D.global_batch // D.dp * D.seq // D.cp
    flops = tokens * per_token / D.tp
    if executed and moe and D.tp > 1 and not D.sp:  # router (+ k experts unless expert TP) per token on every TP rank
        replicated = D.experts * D.h + (D.top_k * mlp_parameters(cfg.model, D.moe_ffn) if D.etp == 1 else 0)
        flops += tokens * (8 if recompute == "full" else 6) * moe * replicated * (1 - 1 / D.tp)
    return flops


def plan_layout(cfg: Config, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> LayoutPlan:
    """Predict every pipeline stage of a finalized config (vocabulary set)."""
    D = dims_of(cfg)
    stages = []
    for r in range(D.pp):
        chunks = [chunk_activations(cfg, r, c) for c in range(D.virtual_stages)]
        peak = schedule_peak(cfg, r, chunks)
        buffers = buffer_terms(cfg, r, peak.in_flight) | zero_buffers(cfg, r, bucket_bytes)  # ZeRO-2/3 temporaries
        stages.append(RankPlan(pp_rank=r, state=state_bytes(cfg, r, bucket_bytes), chunks=chunks, schedule=peak,
                               buffers=buffers, comm=comm_per_step(cfg, r, bucket_bytes),
                               flops=stage_flops(cfg, r, executed=True)))
    return LayoutPlan(cfg=cfg, dims=D, stages=stages)


def estimate_step_time(lp: LayoutPlan, peak_tflops: float, bandwidth_gbs: float,
                       efficiency: float = 1.0) -> dict[str, float]:
    """Seconds per step: compute at ``efficiency`` × the peak (``dims.ACHIEVABLE_MFU``: the MFU ceiling) ÷
    (1 − bubble) + exposed communication (docs/planner.md)."""
    D = lp.dims
    peak, bw = peak_tflops * 1e12, bandwidth_gbs * 1e9
    compute_peak = peak * efficiency
    bubble = theory_bubble(D.schedule, D.pp, D.micro_batches, D.virtual_stages) if D.pp > 1 else 0.0
    busiest = max(lp.stages, key=lambda r: r.flops)
    compute = busiest.flops / compute_peak / (1 - bubble)
    exposed = 0.0
    for r in lp.stages:
        own = sum(r.comm_bytes(k) for k in ("tp", "cp", "pp", "ep")) / bw  # on the critical path
        dp = [r.comm.get(k, {}) for k in ("dp", "edp")]  # the gradient reductions overlap backward
        gather = sum(d.get("all_gather", 0.0) for d in dp) / bw
        reduce = sum(d.get("reduce_scatter", 0.0) + d.get("all_reduce", 0.0) for d in dp) / bw
        last_backward = 2 / 3 * r.flops / compute_peak / max(D.micro_batches, 1)
        exposed = max(exposed, own + gather + max(0.0, reduce - last_backward))
    step = compute + exposed
    model_flops = sum(stage_flops(lp.cfg, r.pp_rank, "none") for r in lp.stages) * D.tp * D.cp * D.dp
    return {"step_s": step, "compute_s": compute, "comm_s": exposed, "bubble": bubble,
            "tokens_per_s": D.global_batch * D.seq / step, "mfu": model_flops / (step * peak * D.world)}


def ranking_peak(cfg: Config, given: float | None = None, ranks: int = 1) -> tuple[float, str]:
    """The per-device peak TFLOP/s to rank layouts by, and where it came from: ``given`` (``--peak-tflops``),
    else ``logging.peak_tflops``, else on CPU (``parallel.device``) this host's dense-matmul peak for
    ``train.precision`` — the MFU denominator of train.py (``device.cpu_peak_flops``: measured now, the best
    of this host kept in its cache) — shared by the ``ranks`` ranks train.py starts on this host, else
    ``DEFAULT_PEAK_TFLOPS``, an A100's."""
    if given:
        return given, "--peak-tflops"
    if cfg.logging.peak_tflops:
        return cfg.logging.peak_tflops, "logging.peak_tflops"
    if (cfg.parallel.device or "cpu") == "cpu":
        from megatron_sp import device, metrics

        precision = cfg.train.precision
        best, now, fp32 = metrics.host_cpu_peaks(precision)
        shared = f", shared by the {ranks} ranks on this host" if ranks > 1 else ""
        if not metrics.native_bf16(best, fp32):
            return fp32 / 1e12 / ranks, ("this host's CPU fp32 matmul peak (its bf16 is not native), as train.py's "
                                         f"MFU takes it{shared}")
        return best / 1e12 / ranks, (f"this host's CPU {precision} matmul peak, as train.py's MFU takes it: the best "
                                     f"seen here, measured now {now / 1e9:.1f} GFLOP/s, cache {device.peak_cache_path()}"
                                     f"{shared}")
    return DEFAULT_PEAK_TFLOPS, "the default: an A100's dense bf16 peak"


def factorizations(devices: int) -> list[tuple[int, int, int, int]]:
    """Every (tp, pp, cp, dp) with tp·pp·cp·dp = devices."""
    small = [k for k in range(1, math.isqrt(devices) + 1) if devices % k == 0]
    divisors = sorted(set(small + [devices // k for k in small]))
    out = []
    for tp in divisors:
        for pp in divisors:
            for cp in divisors:
                if devices % (tp * pp * cp) == 0:
                    out.append((tp, pp, cp, devices // (tp * pp * cp)))
    return out


def layout_overrides(base: Config, tp: int, pp: int, cp: int, dp: int) -> list[str]:
    """Dotted overrides that move ``base``'s parallel section to (tp, pp, cp, dp), keeping its choices
    where they still apply: sequence parallelism only at tp > 1, an interleaved schedule (and its
    virtual stages) only at pp > 1 (else 1f1b), the cp algorithm as given, expert tensor parallelism (it is 1
    or tp, without SP) at the new tp when the config splits its experts over tp > 1, else 1."""
    p = base.parallel
    sp = p.sequence_parallel and tp > 1
    schedule, virtual = p.pp_schedule, p.virtual_stages
    if pp == 1 and schedule == "interleaved":
        schedule, virtual = "1f1b", 1
    out = [f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.cp={cp}", f"parallel.dp={dp}",
           f"parallel.sequence_parallel={str(sp).lower()}", f"parallel.pp_schedule={schedule}",
           f"parallel.virtual_stages={virtual}", "parallel.world_size=none",
           f"parallel.expert_tp={tp if p.expert_tp > 1 and not sp else 1}"]
    if p.cp_algo == "usp" and (cp == 1 or cp % p.cp_ulysses):
        out += ["parallel.cp_algo=zigzag", "parallel.cp_ulysses=1"]
    return out


@dataclass
class Candidate:
    """One (tp, pp, cp, dp) of the search: its plan and time, or why it cannot run."""

    layout: tuple[int, int, int, int]
    plan: LayoutPlan | None = None
    error: str = ""
    fits: bool = False
    knobs: list[str] = field(default_factory=list)  # the ZeRO / recompute / micro-batch overrides searched (``knobs``)


RECOMPUTE = ("none", "selective", "full")


def knob_variants(cfg: Config) -> list[list[str]]:
    """The ZeRO, recompute and micro-batch settings ``search(knobs=True)`` tries for a layout of ``cfg``, cheapest in
    time first: recompute none → selective → full (each adds forward FLOPs), then the micro-batch as configured,
    then 1 (bigger GEMMs run closer to the peak, which the estimate does not model), then ZeRO 0 → 1 (its parameter
    all-gather is exposed); only when none of those fits, the same order with ZeRO 2 → 3 (a reduce-scatter every
    micro-batch; ZeRO-3 also gathers the parameters in every micro-batch's forward and backward). ZeRO only where
    dp·cp > 1. The leanest, last, is planned first (``_candidate``)."""
    p, t = cfg.parallel, cfg.train
    sizes = sorted({t.micro_batch_size, 1}, reverse=True)
    stages = ((0, 1), (2, 3)) if p.dp * p.cp > 1 else ((p.zero,),)
    return [[f"model.recompute={r}", f"train.micro_batch_size={b}", f"parallel.zero={z}"]
            for zeros in stages for r in RECOMPUTE for b in sizes for z in zeros]


def search(build: Callable[[list[str]], Config], base: Config, devices: int, memory_bytes: int,
           peak_tflops: float, bandwidth_gbs: float, bucket_bytes: int = DEFAULT_BUCKET_BYTES, *,
           efficiency: float = 1.0, knobs: bool = False) -> list[Candidate]:
    """Every layout of ``devices`` ranks: ``build(overrides)`` makes the finalized config (raising
    ``ConfigError`` when the config loader's checks refuse it; a MoE layout whose expert fold ``parallel.ep``
    does not divide is refused too). ``knobs``: each layout with the first of ``knob_variants`` that fits
    ``memory_bytes`` (none fits: the last, the leanest, is shown). Returns the candidates ranked: those that fit
    first, by estimated step time, then those that do not fit, then the refused ones."""
    out = [_candidate(build, base, layout, memory_bytes, bucket_bytes, knob_variants(base) if knobs else [[]])
           for layout in factorizations(devices)]
    for cand in out:
        if cand.plan is not None:
            cand.plan.time = estimate_step_time(cand.plan, peak_tflops, bandwidth_gbs, efficiency)

    def key(c: Candidate) -> tuple[Any, ...]:
        if c.plan is None:
            return (2, 0.0, 0, c.layout)
        return (0 if c.fits else 1, c.plan.time["step_s"], c.plan.peak_bytes, c.layout)
    return sorted(out, key=key)


def _candidate(build: Callable[[list[str]], Config], base: Config, layout: tuple[int, int, int, int],
               memory_bytes: int, bucket_bytes: int, variants: list[list[str]]) -> Candidate:
    """``layout`` with the first of ``variants`` that fits (the leanest, tried first, fits when any does)."""
    cand = Candidate(layout)
    for knobs in [variants[-1], *variants[:-1]] if len(variants) > 1 else variants:
        try:
            cfg = build([*layout_overrides(base, *layout), *knobs])
        except ConfigError as exc:
            cand.error = cand.error or str(exc)
            continue
        fold = expert_fold(cfg)
        if cfg.model.num_experts and fold % cfg.parallel.ep:  # parallel.ep stays as configured
            cand.error = f"parallel.ep {cfg.parallel.ep} does not divide the {fold} ranks the experts fold over"
            return cand
        lp = plan_layout(cfg, bucket_bytes)
        fits = lp.peak_bytes <= memory_bytes
        if cand.plan is None or fits:
            cand.plan, cand.fits, cand.knobs, cand.error = lp, fits, knobs, ""
        if fits and knobs is not variants[-1] or not fits and knobs is variants[-1]:
            break  # the first that fits in the order; or the leanest does not: none does
    return cand


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_memory(text: str) -> int:
    """Bytes from ``80GB``, ``80 GiB``, ``512MB``, ``1.5TiB`` or a plain number of bytes (GB = 10⁹, GiB = 2³⁰)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text or "")
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS:
        raise ConfigError(f"--memory '{text}' is not a memory size; write e.g. 80GB, 80GiB or 512MB")
    value = int(float(match.group(1)) * _UNITS[unit])
    if value < 2**20:  # "0.5B" was read as 0 bytes
        raise ConfigError(f"--memory '{text}' is {value} bytes; give the memory of one device with its unit, "
                          "e.g. 80GB, 80GiB or 512MB")
    return value


def format_bytes(n: float) -> str:
    """``1.23 GiB`` style (binary units)."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"

