"""Bytes saved for backward per layer, chunk and schedule peak, and the buffers beside them (docs/activation_memory.md)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from megatron_sp.config.schema import Config
from megatron_sp.model.attention.kernels import block_kernel_runs, causal_block_rows, causal_block_scores
from megatron_sp.model.transformer import arch_spec
from megatron_sp.mpu.layers import CHUNK_ELEMENTS
from megatron_sp.optim.reducer import PRECISIONS
from megatron_sp.pipeline.schedules import build_schedule

from .dims import PlanDims, dims_of, moe_layers_of, stage_layers


def attention_kernel(D: PlanDims) -> str:
    """``cp`` (context-parallel / packed-document kernels), ``math`` (CPU block-causal explicit scores, 16/32-bit,
    small), ``sdpa_math`` (CPU SDPA with dropout) or ``flash`` (CPU flash SDPA; flash-attn / SDPA on CUDA)."""
    if D.cp > 1 or D.documents:
        return "cp"
    if D.device == "cuda":
        return "flash"
    if block_kernel_runs(PRECISIONS[D.precision], D.micro_batch, D.local_heads, D.s_local, D.cpu_attention_max_scores):
        return "math"
    if D.attention_dropout > 0:
        return "sdpa_math"
    return "flash"


def cp_algo_of(D: PlanDims) -> str:
    """The context-parallel algorithm that runs (``local`` at cp 1; usp of Ulysses degree 1 is zigzag)."""
    if D.cp == 1:
        return "local"
    if D.cp_algo == "usp" and D.cp_ulysses == 1:
        return "zigzag"
    return D.cp_algo


def ulysses_kv(D: PlanDims, degree: int) -> int:
    """kv heads per rank sent through the Ulysses all-to-all (repeated up to ``degree`` when fewer)."""
    return D.local_kv if D.local_kv % degree == 0 else degree


def attention_terms(D: PlanDims, recompute: str | None = None) -> dict[str, int]:
    """Bytes the attention block saves per layer per micro-batch, by term (docs/activation_memory.md)."""
    recompute = D.recompute if recompute is None else recompute
    e, tok, b, s = D.e, D.tokens, D.micro_batch, D.s_local
    n_l, g_l, d = D.local_heads, D.local_kv, D.head_dim
    inputs = {"q,k (rotated)": tok * (n_l + g_l) * d * e, "v": tok * g_l * d * e}
    out = tok * n_l * d * e
    lse = b * n_l * s * 4
    if recompute == "selective":
        return _nonzero({**inputs, "attention output": out})
    kernel = attention_kernel(D)
    if kernel == "flash":
        return _nonzero({**inputs, "attention output": out, "log-sum-exp": lse})
    scores = b * n_l * s * s * e
    if kernel == "math":
        rows = causal_block_rows(PRECISIONS[D.precision])
        kept = b * n_l * causal_block_scores(s, rows) * e  # the probabilities of the causal blocks, about half of s²
        terms = {"q,k (rotated)": inputs["q,k (rotated)"], "q copy": tok * n_l * d * e if n_l > g_l else 0,
                 "v": inputs["v"], "attention probs": kept}
        if D.attention_dropout > 0:
            terms["attention dropout output"] = kept  # its zeros are the mask: no mask of its own
        return _nonzero({**terms, "attention output": out})
    if kernel == "sdpa_math":
        v = inputs["v"] if n_l == g_l else tok * n_l * d * e  # GQA: k, v expanded to every query head
        return _nonzero({"q (scaled)": tok * n_l * d * e, "k (scaled)": tok * n_l * d * e, "v": v, "attention probs": scores,
                         "attention dropout mask": b * n_l * s * s * D.mask_bytes, "attention dropout output": scores,
                         "attention output": out})
    algo = cp_algo_of(D)
    acc = tok * n_l * d * 4  # the fp32 output accumulator
    if algo in ("ulysses", "usp"):
        degree = D.cp if algo == "ulysses" else D.cp_ulysses
        kv = ulysses_kv(D, degree)
        # Ulysses and USP hold their output once (backward moves it back by an all-to-all)
        return _nonzero({"q (all-to-all)": tok * n_l * d * e, "k,v (all-to-all)": 2 * tok * kv * d * e,
                         "log-sum-exp": lse, "attention output": out})
    return _nonzero({**inputs, "fp32 output accumulator": acc, "log-sum-exp": lse,
                     "attention output": out if e != 4 else 0})


def _nonzero(terms: dict[str, int]) -> dict[str, int]:
    return {k: v for k, v in terms.items() if v}


def layer_terms(D: PlanDims, recompute: str | None = None, moe: bool = False) -> dict[str, int]:
    """Bytes one layer saves for backward per micro-batch on one rank, by term: Korthikanti et al.'s
    Table 2 adapted to our layers (docs/activation_memory.md); ``moe``: a MoE layer (``moe_terms`` for its MLP)."""
    recompute = D.recompute if recompute is None else recompute
    e, h = D.e, D.h
    x = D.shard_tokens * h
    if recompute == "full":
        return {"layer input": x * e}
    spec = arch_spec(D.arch)
    gathered = D.shard_tokens if D.sp and D.recompute_allgather else D.tokens
    terms: dict[str, int] = {}
    if spec.layernorm:
        if D.device == "cuda" and e == 2:  # CUDA autocast runs layer_norm in fp32: each norm saves an fp32 copy
            terms |= {"norm inputs": 2 * x * 4, "norm statistics": 2 * 2 * D.shard_tokens * 4}
        else:
            terms |= {"norm inputs": x * e, "norm statistics": 2 * 2 * D.shard_tokens * e}
    else:
        terms |= {"norm inputs": 2 * 2 * x * 4, "norm statistics": 2 * D.shard_tokens * 4}
    if D.kv_split:
        terms["QKV input"] = gathered * h * e
    else:
        terms["QKV input"] = D.tokens * h * e
        terms["replicated QKV weight rows"] = (D.local_heads + 2) * D.head_dim * h * e
    terms |= attention_terms(D, recompute)
    if D.mla[0]:
        terms |= mla_terms(D)
    terms |= moe_terms(D) if moe else mlp_terms(D, D.local_ffn)
    if D.hidden_dropout > 0:
        terms["dropout masks"] = 2 * x * D.mask_bytes
    return terms


def mla_terms(D: PlanDims) -> dict[str, int]:
    """What latent attention saves beyond the kernel's terms (which count q, k and the zero-padded v at nope + rope
    dims): each latent's norm input (fp32 statistics) on this rank's tokens and the up projection's input (gathered
    unless SP recomputes the all-gather), the queries' and the shared key's rotary inputs; its output projection takes
    ``v_head_dim`` of the padded output (``attention output`` counts the padded width)."""
    kv_lora, q_lora, rope, v = D.mla
    gathered = D.shard_tokens if D.sp and D.recompute_allgather else D.tokens
    latents = (kv_lora + q_lora) * D.e
    return _nonzero({"MLA latent norm inputs": D.shard_tokens * latents + 4 * D.shard_tokens * (2 if q_lora else 1),
                     "MLA up-projection inputs": gathered * latents,
                     "MLA rotary inputs": D.tokens * (D.local_heads + 1) * rope * D.e,
                     "MLA output width": -D.tokens * D.local_heads * (D.head_dim - v) * D.e})


def mlp_terms(D: PlanDims, local_ffn: int, prefix: str = "", input_held: bool = False) -> dict[str, int]:
    """What the dense MLP of width ``local_ffn`` per TP rank saves (``prefix``: a MoE layer's shared experts;
    ``input_held``: its input is a tensor already counted)."""
    gathered = D.shard_tokens if D.sp and D.recompute_allgather else D.tokens
    f = D.tokens * local_ffn * D.e
    terms = {f"{prefix}MLP input": 0 if input_held else gathered * D.h * D.e}
    if arch_spec(D.arch).swiglu:
        terms |= {f"{prefix}gate/up output": 2 * f, f"{prefix}down input": f,
                  f"{prefix}gate/up weight copy": 2 * local_ffn * D.h * D.e}
    else:
        terms |= {f"{prefix}GeLU input": f, f"{prefix}fc2 input": f}
    return _nonzero(terms)


def moe_terms(D: PlanDims) -> dict[str, int]:
    """What a MoE MLP (``model.moe.MoE``) saves per micro-batch on one rank, from its forward as autograd sees it.

    T = ``shard_tokens`` tokens are routed here (b·s/cp; /tp under sequence parallelism, else every TP rank routes
    the same T), R = T·k (token, slot) rows are dispatched. Dropless and balanced: this rank's E/ep experts are
    taken to receive R rows under ep (the mean over the ep group; a skewed router gives one rank more: --verify's
    largest rank saves a few per cent more early in training), and a capacity factor's dropped rows are not
    subtracted. Router (fp32): its input (the fp32 copy under bf16, else the MoE input itself), the weight's fp32
    copy under bf16, logits and scores ``[T, E]``; top-k experts (int64), when renormalising (``moe_renormalize``,
    unset: k > 1) the selection scores and their sum; logsumexp (z-loss) and, for sigmoid, the probabilities' sum; the loads ``[E]`` of
    the balancing loss. Dispatcher: the row gather's index and the combine's sort order (int64 ``[R]``; under ep
    also the received rows' permutation). Experts: the dispatched rows ``[R, h]`` (the grouped GEMM's input), the
    gate/up output ``[R, 2f]`` (the SwiGLU input) and the down input ``[R, f]`` (GeLU: its input and fc2's),
    SwiGLU's concatenated gate/up weights ``[E/ep, 2f, h]``, with biases the int64 index each
    ``repeat_interleave`` keeps; under expert tensor parallelism f is ``moe_ffn / tp`` (the rows stay ``[R, h]``: the
    TP all-reduces of the output rows and of the tokens' gradient save nothing). Combine: the expert outputs
    ``[R, h]`` each ``index_copy`` keeps as its source (under ep two: before and after the all-to-all back); the
    weighted sum, in the experts' dtype, keeps the scattered outputs ``[R, h]`` and the combine weights cast to that
    dtype ``[T, k]`` (the fp32 weights themselves in fp32). No routing bias in use (``Router.bias_in_use``): no
    biased top-k; with one, its indices are the experts, the same tensor. The shared experts save what a dense
    tensor-parallel MLP of their width does. Left out: the grouped GEMM's int32 offsets ``[E/ep]``."""
    e, h, T, E, k = D.e, D.h, D.shard_tokens, D.experts, D.top_k
    R, f, local = T * k, D.expert_local_ffn, D.experts // D.ep
    spec = arch_spec(D.arch)
    topk = T * k * 8 + (T * k * 4 + T * 4 if D.renorm else 0)  # experts; scores and their sum when renormalising
    terms = {"router input (fp32)": T * h * 4, "router weight copy (fp32)": E * h * 4 if e != 4 else 0,
             "router logits + scores (fp32)": 2 * T * E * 4, "router top-k (experts; scores, sum)": topk,
             "router losses (lse, sums, loads)": T * 4 * (1 + D.sigmoid) + E * 4,
             "dispatch indices (int64)": R * 8 * (2 + (D.ep > 1)), "dispatched rows": R * h * e}
    if spec.swiglu:
        terms |= {"expert gate/up output": R * 2 * f * e, "expert down input": R * f * e,
                  "expert gate/up weight copy": local * 2 * f * h * e}
    else:
        terms |= {"expert GeLU input": R * f * e, "expert fc2 input": R * f * e}
    if spec.bias:
        terms["expert bias indices (int64)"] = 2 * R * 8
    terms |= {"expert output rows": R * h * e * (1 + (D.ep > 1)), "combine rows": R * h * e, "combine weights": T * k * e}
    if D.shared_ffn:  # its input is the router's when that is the MoE input itself (fp32, no gather)
        same = e == 4 and not (D.sp and not D.recompute_allgather)
        terms |= mlp_terms(D, D.shared_ffn // D.tp, "shared ", input_held=same)
    return _nonzero(terms)


def table2_layer_bytes(D: PlanDims, scores: bool = True) -> int:
    """Table 2 of Korthikanti et al. as printed (``ffn = 4h``, 16-bit terms × ``e/2``, ``s = seq/cp``), to compare
    with ``layer_terms``; ``scores=False`` drops ``5as/h`` (a fused kernel stores no ``s × s`` scores)."""
    s, b, h, a, t = D.s_local, D.micro_batch, D.h, D.heads, D.tp
    scale = D.e / 2
    if D.recompute == "full":
        return int(2 * s * b * h / (t if D.sp else 1) * scale)
    score = 0 if D.recompute == "selective" or not scores else 5 * a * s / (h * t)
    coeff = 34 / t + score if D.sp else 10 + 24 / t + score
    return int(s * b * h * coeff * scale)


@dataclass
class ChunkActivations:
    """Bytes one model chunk of a stage saves for one micro-batch."""

    layers: int
    per_layer: dict[str, int]  # a dense layer's terms (``layers − moe_layers`` of them)
    extra: dict[str, int]  # embedding, rotary tables, final norm, output layer, cross entropy (where held)
    shared: dict[str, int]  # shared by every micro-batch of the step (slices of this rank's batch): counted once
    transient: int  # extra bytes while one of its layers runs backward (the recomputed layer or attention core)
    freed: int = 0  # freed before the transient appears: the head's and, under selective, the last layer's MLP
    moe_layers: int = 0  # of ``layers``, those with a MoE MLP ...
    moe_per_layer: dict[str, int] = field(default_factory=dict)  # ... and their terms

    @property
    def per_micro_batch(self) -> int:
        """Layers × per-layer terms + the extras (``shared`` not included)."""
        dense = self.layers - self.moe_layers
        return dense * sum(self.per_layer.values()) + self.moe_layers * sum(self.moe_per_layer.values()) + \
            sum(self.extra.values())


def chunk_activations(cfg: Config, pp_rank: int, chunk: int) -> ChunkActivations:
    """The bytes model chunk ``chunk`` of pipeline rank ``pp_rank`` saves per micro-batch."""
    D = dims_of(cfg)
    chunks = stage_layers(cfg, pp_rank)
    first = pp_rank == 0 and chunk == 0
    last = pp_rank == D.pp - 1 and chunk == len(chunks) - 1
    e, tok, h = D.e, D.tokens, D.h
    rank_samples = D.global_batch // D.dp
    extra: dict[str, int] = {"rotary cos/sin": 2 * tok * D.rotary_dim * e}
    shared: dict[str, int] = {}
    if first:
        if D.tp == 1:
            shared["token ids (embedding)"] = rank_samples * D.s_local * 8
        else:
            extra["embedding local ids + mask"] = tok * 9
        if D.hidden_dropout > 0:
            extra["embedding dropout mask"] = D.shard_tokens * h * D.mask_bytes
    if last:
        spec = arch_spec(D.arch)
        x = D.shard_tokens * h
        if not spec.layernorm:
            extra["final norm"] = 2 * x * 4 + D.shard_tokens * 4
        elif D.device == "cuda" and e == 2:
            extra["final norm"] = x * 4 + 2 * D.shard_tokens * 4
        else:
            extra["final norm"] = x * e + 2 * D.shard_tokens * e
        gathered = D.shard_tokens if D.sp and D.recompute_allgather else tok
        extra["output layer input"] = gathered * h * e
        # the logits themselves (no fp32 copy) + max, Σexp (fp32), target index (int64), two flags
        extra["cross entropy (logits, per-token)"] = tok * (D.padded_vocab // D.tp) * e + tok * 18
        shared["loss mask"] = rank_samples * D.s_local * 4
        head = sum(extra[k] for k in ("final norm", "output layer input", "cross entropy (logits, per-token)"))
        mtp = range(D.layers, D.layers + cfg.model.mtp_layers)  # each module: ids, enorm + hnorm, eh_proj input,
        extra["multi-token prediction"] = sum(  # its layer, its head (final norm, output layer, cross entropy)
            tok * 9 + 2 * extra["final norm"] + gathered * 2 * h * e + head +
            sum(layer_terms(D, moe=moe_layers_of(cfg, range(i, i + 1)) > 0).values()) for i in mtp)
    layers = chunks[chunk]
    moe = moe_layers_of(cfg, layers)
    kinds = [k for k, n in ((False, len(layers) - moe), (True, moe)) if n]  # dense and/or MoE layers here
    transient = 0
    if D.recompute == "full":  # the recomputed layer; its input is already held (the norm may save it itself)
        norm_saves_input = (arch_spec(D.arch).layernorm and not (D.device == "cuda" and e == 2)) or \
            (not arch_spec(D.arch).layernorm and e == 4)
        transient = max((sum(layer_terms(D, "none", k).values()) for k in kinds), default=0) - \
            (D.shard_tokens * h * e if norm_saves_input else 0)
    elif D.recompute == "selective":
        none, sel = attention_terms(D, "none"), attention_terms(D, "selective")
        transient = sum(none.values()) - sum(sel.values()) + sel.get("attention output", 0)
    freed = sum(v for k, v in extra.items() if k in ("final norm", "output layer input", "cross entropy (logits, per-token)"))
    if D.recompute == "selective" and layers:  # backward of the chunk's last layer frees its MLP before the core reruns
        moe_last = moe_layers_of(cfg, range(layers[-1], layers[-1] + 1)) > 0
        freed += sum((moe_terms(D) if moe_last else mlp_terms(D, D.local_ffn)).values())
    return ChunkActivations(layers=len(layers), per_layer=layer_terms(D), extra=extra, shared=shared,
                            transient=transient, freed=freed, moe_layers=moe,
                            moe_per_layer=layer_terms(D, moe=True) if moe else {})


@dataclass
class SchedulePeak:
    """Peak saved-activation bytes of a rank under its schedule."""

    peak: int
    in_flight: int  # most (chunk, micro-batch) pairs holding activations at once (weight grads not done)
    in_flight_micro_batches: float  # ``in_flight`` in whole-stage micro-batches (``/ virtual_stages``)


def schedule_peak(cfg: Config, pp_rank: int, chunks: Sequence[ChunkActivations] | None = None) -> SchedulePeak:
    """Walk rank ``pp_rank``'s action table: F adds the chunk's bytes, B (or I) frees them, a backward adds
    the chunk's transient once ``freed`` is gone; shared tensors count once (docs/activation_memory.md)."""
    D = dims_of(cfg)
    if chunks is None:
        chunks = [chunk_activations(cfg, pp_rank, c) for c in range(D.virtual_stages)]
    live = peak = count = most = 0
    for a in build_schedule(D.schedule, D.pp, D.micro_batches, D.virtual_stages)[pp_rank]:
        c = chunks[a.chunk]
        if a.kind == "F":
            live += c.per_micro_batch
            count += 1
            peak, most = max(peak, live), max(most, count)
        elif a.kind in ("B", "I"):
            if c.transient:  # the last layer (or its attention core) recomputes once ``freed`` is freed
                peak = max(peak, live - c.freed + c.transient)
            live -= c.per_micro_batch
            count -= a.kind == "B"
        else:
            count -= 1
    shared = sum(sum(c.shared.values()) for c in chunks)
    return SchedulePeak(peak=peak + shared, in_flight=most, in_flight_micro_batches=most / D.virtual_stages)


def megatron_in_flight(D: PlanDims, pp_rank: int) -> float:
    """The textbook micro-batches in flight on ``pp_rank`` (for display beside the table walk)."""
    m, p, v = D.micro_batches, D.pp, D.virtual_stages
    if D.schedule == "none":
        return 1
    if D.schedule == "interleaved":
        return min((p - pp_rank - 1) * 2 + (v - 1) * p + 1, m * v) / v
    return min(p - pp_rank if D.schedule == "1f1b" else p, m)


def buffer_terms(cfg: Config, pp_rank: int, in_flight: int) -> dict[str, int]:
    """Bytes held outside the saved activations: the SP gather buffer, pipeline buffers, logits/CE transients."""
    D = dims_of(cfg)
    out: dict[str, int] = {}
    if D.sp and D.recompute_allgather:
        out["SP gather buffer (mpu.memory)"] = D.tokens * D.h * D.e
    if D.pp > 1:
        stage_io = D.shard_tokens * D.h * D.e
        links = (pp_rank > 0 or D.virtual_stages > 1) + (pp_rank < D.pp - 1 or D.virtual_stages > 1)
        held = in_flight if (pp_rank < D.pp - 1 or D.virtual_stages > 1) else 0
        out["pipeline receive buffers + held outputs"] = (links + held) * stage_io
    if pp_rank == D.pp - 1:
        v_local = D.padded_vocab // D.tp
        logits = D.tokens * v_local
        if D.compiled:  # no fp32 chunk; a slice that is mostly padding has its real columns' gradient made apart
            reals = [min(v_local, max(0, D.vocab - r * v_local)) for r in range(D.tp)]
            forward = 0
            extra = max((D.tokens * real * D.e for real in reals if 0 < 2 * real < v_local), default=0)
        else:  # the one fp32 chunk the eager cross entropy works in (in bf16 also beside the gradient)
            forward = min(logits, CHUNK_ELEMENTS) * 4
            extra = forward if D.e != 4 else 0
        # the logits themselves count as saved activations; backward adds their gradient and `extra`
        out["logits + cross-entropy transients"] = max(forward, logits * D.e + extra)
    return out

