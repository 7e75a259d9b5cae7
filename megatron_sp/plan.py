"""Per-rank memory and communication of a training layout, and the layouts that fit (``tools/plan.py``).

Everything here is computed from a finalized ``Config`` (vocabulary set) without building a model
or touching a device. The model follows OUR implementation, term by term, so ``tools/plan.py
--verify`` can put every line beside a measurement of the real training code:

Parameters, gradients, optimizer (exact)
    ``stage_parameters`` lists this pipeline stage's parameters in ``GPTModel.named_parameters``
    order with their per-TP-rank shapes (vocabulary padded to ``make_vocab_size_divisible_by · tp``,
    embedding on the first stage, final norm + output layer on the last, a tied output layer only
    where the embedding is not on the same stage, the QKV weight replicated when ``tp >
    num_kv_heads``). ``flat_layout`` replays ``DistributedOptimizer``'s bucketing (reverse order,
    buckets of ``bucket_bytes`` fp32 gradient, each padded to a multiple of dp·cp), so:
    parameters = padded numel × param dtype; gradients = padded numel × 4 (fp32 main grads, never
    sharded); optimizer = shard numel × (8 Adam moments + 4 fp32 master unless fp32), the shard
    being numel / (dp·cp) under ZeRO-1.

Activations (Korthikanti et al. 2022, Table 2, adapted)
    Table 2 counts bytes saved for backward per layer: ``sbh(34 + 5as/h)`` without parallelism,
    ``sbh(34/t + 5as/(ht))`` with TP + SP, ``2sbh`` with full recompute. ``layer_terms`` derives
    the same quantity for our layers term by term (its docstring lists the differences: GQA, SwiGLU,
    rotary, RMSNorm's fp32 intermediates, the CPU kernels, dropout masks in the activation dtype on
    CPU, no masks at dropout 0). ``s`` is this rank's ``seq_length / cp`` tokens (context
    parallelism splits the sequence), ``/t`` applies to the tensors between TP regions under SP.
    A stage's micro-batch adds the embedding, the rotary tables, the final norm, the output-layer
    input and the fp32 cross-entropy probabilities. ``schedule_peak`` walks the pipeline schedule's
    action table: F adds a (chunk, micro-batch)'s bytes, its backward (B, or I for zero-bubble)
    frees them; full/selective recompute add the recomputed layer/core on top during a backward.
    The micro-batches in flight are therefore ``min(pp − r, m)`` for 1F1B (``pp`` on stage 0),
    Megatron's ``(pp − r − 1)·2 + (v − 1)·pp + 1`` model chunks for interleaved, at most ``pp`` for
    zero-bubble and 1 for ``none``.

Buffers
    The sequence-parallel gather buffer (``mpu.memory``: one ``[s, b, h]`` tensor), the pipeline's
    receive buffers and held stage outputs, and the logits/cross-entropy transients (logits in the
    activation dtype plus an fp32 copy).

Communication per step per rank
    Bytes this rank sends, counted as ``mpu.comm`` counts them (all-reduce ``2(n−1)/n``,
    all-gather ``(n−1)/n`` of the output, reduce-scatter ``(n−1)/n`` of the input, all-to-all
    ``(n−1)/n``, ring exchange the whole message): TP per layer (SP: all-gather/reduce-scatter,
    plus the backward re-gather of ``tp_recompute_allgather``; else all-reduces), the embedding,
    output layer and cross entropy, the TP sum of sequence-parallel gradients; CP per docs/attention.md
    ("Communication per layer per rank") as our kernels send it; PP point-to-point activations and gradients; DP reduce-scatter +
    all-gather (ZeRO-1) or all-reduce of the flat fp32 gradients.

Measuring (``verify_rank``, ``SavedBytes``, ``LiveSavedBytes``, ``measure_state``)
    ``tools/plan.py --verify`` runs ``training.setup`` and ``training.train_step`` on gloo ranks and
    reads the optimizer's buffers, the storages autograd saves for one micro-batch per model chunk,
    the peak of saved storages alive at once during the real schedule (each saved tensor is counted
    from its save until autograd releases it), the gather buffer and the bytes every collective
    sends. On the layouts tried the activation and communication predictions equal the
    measurements (see ``tools/plan.py --verify``); what is not measured: zero-bubble's deferred
    weight-gradient inputs (held outside autograd after I), the buffers, transients inside kernels.

Step-time cost used to rank layouts (``estimate_step_time``)
    compute = the busiest stage's model FLOPs per step (6N + 6·L·h·s per token, attention over the
    causal half as ``model.flops_per_token``, + the recomputed forward) at ``peak_tflops``, divided
    by ``1 − bubble`` of the schedule; plus every TP, CP and PP byte at ``bandwidth`` (not
    overlapped), the ZeRO parameter all-gather, and the part of the gradient reduction that does not
    fit under the last micro-batch's backward. MFU = model FLOPs ÷ (step time × peak × devices) is
    at most 1 by construction: the step is never shorter than the busiest stage's compute at the peak.
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from .config.schema import Config
from .errors import ConfigError
from .model.gpt import parameter_parts
from .model.attention.kernels import MATH_ATTENTION_MAX_SCORES
from .model.transformer import arch_spec, head_dim, rotary_dim
from .pipeline.partition import stage_chunks
from .pipeline.schedules import Action, build_schedule, theory_bubble

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
"""Bytes of a parameter / activation element per ``train.precision``."""
GRAD_BYTES = 4
"""Main gradients are always fp32."""
DEFAULT_BUCKET_BYTES = 25 * 2**20
"""``DistributedOptimizer``'s default ``bucket_bytes``."""
DEFAULT_PEAK_TFLOPS = 312.0
"""Default per-device peak for the ranking: an A100's dense bf16 rate (pass your device's)."""
DEFAULT_BANDWIDTH_GBS = 100.0
"""Default per-rank bus bandwidth for the ranking, GB/s (pass your interconnect's)."""


# ------------------------------------------------------------------------------------------ dimensions


@dataclass(frozen=True)
class PlanDims:
    """Every number the formulas read, from a finalized config (one place for the derivations):
    model shape, batch, layout and precision. (Not ``mpu.ParallelDims``, which only sizes the
    process groups.)"""

    arch: str
    layers: int
    h: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    rotary_dim: int
    vocab: int
    padded_vocab: int
    seq: int
    micro_batch: int
    micro_batches: int
    global_batch: int
    tp: int
    pp: int
    cp: int
    dp: int
    virtual_stages: int
    sp: bool
    recompute_allgather: bool
    recompute: str
    precision: str
    zero: int
    cp_algo: str
    cp_ulysses: int
    device: str
    hidden_dropout: float
    attention_dropout: float
    documents: bool
    tie: bool
    schedule: str
    partition: str

    @property
    def e(self) -> int:
        """Bytes of an activation element (the autocast / parameter dtype)."""
        return DTYPE_BYTES[self.precision]

    @property
    def s_local(self) -> int:
        """Tokens of a sample on this rank: ``seq / cp``."""
        return self.seq // self.cp

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch on this rank (``b · s/cp``), as the TP regions see them."""
        return self.micro_batch * self.s_local

    @property
    def shard_tokens(self) -> int:
        """Tokens between TP regions: ``/tp`` under sequence parallelism."""
        return self.tokens // self.tp if self.sp else self.tokens

    @property
    def kv_split(self) -> bool:
        """kv heads split over TP (else every rank holds the whole QKV weight: ``ReplicatedGroupQKV``)."""
        return self.kv_heads % self.tp == 0

    @property
    def local_heads(self) -> int:
        return self.heads // self.tp

    @property
    def local_kv(self) -> int:
        """kv heads a TP rank computes (1 when replicated: each rank uses one group)."""
        return self.kv_heads // self.tp if self.kv_split else 1

    @property
    def local_ffn(self) -> int:
        return self.ffn // self.tp

    @property
    def dp_cp(self) -> int:
        """The gradient-reduction group (and ZeRO-1 shard count)."""
        return self.dp * self.cp

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def mask_bytes(self) -> int:
        """A dropout mask element: CPU dropout multiplies by a mask in the activation dtype; CUDA keeps a bool."""
        return 1 if self.device == "cuda" else self.e


def dims_of(cfg: Config) -> PlanDims:
    """The ``PlanDims`` of a finalized config whose vocabulary is set (``config.set_vocab``)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    if m.padded_vocab_size is None or m.vocab_size is None:
        raise ValueError("the config's vocabulary is not set: call config.set_vocab(cfg, vocab_size) first")
    schedule = p.pp_schedule
    if p.pp == 1 and schedule in ("1f1b", "interleaved", "none") and p.virtual_stages == 1:
        schedule = "none"  # what forward_backward runs at pp == 1
    return PlanDims(arch=m.arch, layers=m.num_layers, h=m.hidden_size, heads=m.num_heads, kv_heads=m.num_kv_heads,
                head_dim=head_dim(m), ffn=m.ffn_hidden_size, rotary_dim=rotary_dim(m), vocab=m.vocab_size,
                padded_vocab=m.padded_vocab_size, seq=m.seq_length, micro_batch=t.micro_batch_size,
                micro_batches=t.grad_accum_steps, global_batch=t.global_batch_size, tp=p.tp, pp=p.pp, cp=p.cp,
                dp=p.dp, virtual_stages=p.virtual_stages, sp=p.sequence_parallel and p.tp > 1,
                recompute_allgather=p.tp_recompute_allgather, recompute=m.recompute, precision=t.precision,
                zero=p.zero, cp_algo=p.cp_algo, cp_ulysses=p.cp_ulysses if p.cp_algo == "usp" else 1,
                device=p.device or "cpu", hidden_dropout=m.hidden_dropout, attention_dropout=m.attention_dropout,
                documents=cfg.data.reset_attention_mask, tie=m.tie_embeddings, schedule=schedule,
                partition=p.pp_partition)


# ------------------------------------------------------------------------------------------ parameters


@dataclass(frozen=True)
class ParamSpec:
    """One parameter as a TP rank holds it: name, local shape, and the attributes the optimizer reads."""

    name: str
    shape: tuple[int, ...]
    sequence_parallel: bool = False
    """Its gradient is summed over TP after backward (norms and row biases under SP, a replicated QKV)."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _layer_parameters(D: PlanDims, i: int) -> list[ParamSpec]:
    spec = arch_spec(D.arch)
    t, h, d, f = D.tp, D.h, D.head_dim, D.ffn
    pre = f"layers.{i}."

    def norm(name: str) -> list[ParamSpec]:
        out = [ParamSpec(f"{pre}{name}.weight", (h,), D.sp)]
        return out + [ParamSpec(f"{pre}{name}.bias", (h,), D.sp)] if spec.layernorm else out

    qkv_rows = D.kv_heads * (D.heads // D.kv_heads + 2) * d
    if D.kv_split:
        qkv = [ParamSpec(f"{pre}attention.qkv.weight", (qkv_rows // t, h))]
        qkv += [ParamSpec(f"{pre}attention.qkv.bias", (qkv_rows // t,))] if spec.bias else []
    else:  # ReplicatedGroupQKV: the whole weight on every TP rank, its grad summed over TP
        qkv = [ParamSpec(f"{pre}attention.qkv.weight", (qkv_rows, h), True)]
        qkv += [ParamSpec(f"{pre}attention.qkv.bias", (qkv_rows,), True)] if spec.bias else []
    out = [ParamSpec(f"{pre}attention.out.weight", (h, D.heads * d // t))]
    out += [ParamSpec(f"{pre}attention.out.bias", (h,), D.sp)] if spec.bias else []
    mlp: list[ParamSpec] = []
    if spec.swiglu:
        for name in ("gate", "up"):
            mlp += [ParamSpec(f"{pre}mlp.{name}.weight", (f // t, h))]
            mlp += [ParamSpec(f"{pre}mlp.{name}.bias", (f // t,))] if spec.bias else []
        mlp += [ParamSpec(f"{pre}mlp.down.weight", (h, f // t))]
        mlp += [ParamSpec(f"{pre}mlp.down.bias", (h,), D.sp)] if spec.bias else []
    else:
        mlp += [ParamSpec(f"{pre}mlp.fc1.weight", (f // t, h))]
        mlp += [ParamSpec(f"{pre}mlp.fc1.bias", (f // t,))] if spec.bias else []
        mlp += [ParamSpec(f"{pre}mlp.fc2.weight", (h, f // t))]
        mlp += [ParamSpec(f"{pre}mlp.fc2.bias", (h,), D.sp)] if spec.bias else []
    return norm("attn_norm") + qkv + out + norm("mlp_norm") + mlp


def stage_layers(cfg: Config, pp_rank: int) -> list[range]:
    """The layer ranges of pipeline rank ``pp_rank``'s model chunks (the pipeline's own split)."""
    p = cfg.parallel
    return stage_chunks(cfg.model, p.pp, pp_rank, p.virtual_stages, p.pp_partition)


def stage_parameters(cfg: Config, pp_rank: int = 0) -> list[ParamSpec]:
    """This stage's parameters in ``GPTModel.named_parameters`` order, with one TP rank's shapes."""
    D = dims_of(cfg)
    first, last = pp_rank == 0, pp_rank == D.pp - 1
    rows = D.padded_vocab // D.tp
    params: list[ParamSpec] = []
    if first:
        params.append(ParamSpec("embedding.weight", (rows, D.h)))
    for chunk in stage_layers(cfg, pp_rank):
        for i in chunk:
            params += _layer_parameters(D, i)
    if last:
        params.append(ParamSpec("final_norm.weight", (D.h,), D.sp))
        if arch_spec(D.arch).layernorm:
            params.append(ParamSpec("final_norm.bias", (D.h,), D.sp))
        if not (D.tie and first):  # tied on the same stage: the output layer multiplies by the embedding
            params.append(ParamSpec("output_layer.weight", (rows, D.h)))
    return params


@dataclass
class FlatLayout:
    """``DistributedOptimizer``'s flat-buffer layout of a parameter list (see its module docstring)."""

    numel: int
    """Elements of the flat buffers, bucket padding included."""
    shard_numel: int
    """Elements this rank owns (numel / dp·cp under ZeRO-1, else numel)."""
    params: int
    """Elements of the parameters themselves."""
    buckets: list[tuple[int, int]] = field(default_factory=list)
    """(start, padded numel) per bucket."""
    offsets: list[tuple[int, int, int]] = field(default_factory=list)
    """(start, numel, bucket) per parameter, in the given (named_parameters) order."""

    def owned(self, index: int, dp_rank: int, dp_cp: int, sharded: bool) -> int:
        """Elements of parameter ``index`` that data-parallel rank ``dp_rank`` owns."""
        start, numel, bucket = self.offsets[index]
        if not sharded:
            return numel
        b_start, b_numel = self.buckets[bucket]
        chunk = b_numel // dp_cp
        lo, hi = b_start + dp_rank * chunk, b_start + (dp_rank + 1) * chunk
        return max(0, min(start + numel, hi) - max(start, lo))


def flat_layout(numels: Sequence[int], dp_cp: int, zero: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> FlatLayout:
    """Replay ``DistributedOptimizer._layout``: reverse order, close a bucket once its fp32 gradient
    reaches ``bucket_bytes``, pad each bucket to a multiple of ``dp_cp``."""
    offsets: list[tuple[int, int, int] | None] = [None] * len(numels)
    buckets: list[tuple[int, int]] = []
    offset, start, size = 0, 0, 0
    open_bucket = False
    for index in reversed(range(len(numels))):
        if not open_bucket:
            start, size, open_bucket = offset, 0, True
        offsets[index] = (offset, numels[index], len(buckets))
        size += numels[index]
        offset += numels[index]
        if size * GRAD_BYTES >= bucket_bytes:
            pad = -size % dp_cp
            buckets.append((start, size + pad))
            offset += pad
            open_bucket = False
    if open_bucket:
        buckets.append((start, size + (-size % dp_cp)))
    numel = sum(n for _, n in buckets)
    sharded = zero == 1 and dp_cp > 1
    return FlatLayout(numel=numel, shard_numel=numel // dp_cp if sharded else numel, params=sum(numels),
                      buckets=buckets, offsets=[o for o in offsets if o is not None])


@dataclass
class StateBytes:
    """Per-rank bytes of the parameters, fp32 main gradients and optimizer state (exact)."""

    params: int
    grads: int
    optim: int
    param_elements: int
    padded_elements: int
    shard_elements: int
    vocab_tables: int
    """Vocabulary tables (embedding, output layer) on this stage: each has ``padded_vocab − vocab`` padding rows."""
    param_dtype: str
    master: bool

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optim


def state_bytes(cfg: Config, pp_rank: int = 0, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> StateBytes:
    """Parameters (param dtype), gradients (fp32) and optimizer state (Adam moments + fp32 masters unless
    fp32, sharded over dp·cp under ZeRO-1) held by a rank of pipeline stage ``pp_rank``: the sizes of
    ``DistributedOptimizer``'s ``param_buffer``, ``grad_buffer``, ``exp_avg``/``exp_avg_sq`` and ``_master_local``."""
    D = dims_of(cfg)
    params = stage_parameters(cfg, pp_rank)
    layout = flat_layout([p.numel for p in params], D.dp_cp, D.zero, bucket_bytes)
    master = D.precision != "fp32"
    return StateBytes(params=layout.numel * D.e, grads=layout.numel * GRAD_BYTES,
                      optim=layout.shard_numel * (8 + (4 if master else 0)), param_elements=layout.params,
                      padded_elements=layout.numel, shard_elements=layout.shard_numel,
                      vocab_tables=sum(p.name in ("embedding.weight", "output_layer.weight") for p in params),
                      param_dtype=D.precision, master=master)


# ------------------------------------------------------------------------------------------ activations


def attention_kernel(D: PlanDims) -> str:
    """Which attention path runs: ``cp`` (context-parallel / packed-document kernels), ``math`` (CPU
    explicit scores in bf16/fp16 up to ``MATH_ATTENTION_MAX_SCORES``), ``sdpa_math`` (CPU SDPA with
    dropout falls back to its math kernel), or ``flash`` (CPU flash SDPA; flash-attn / SDPA on CUDA)."""
    if D.cp > 1 or D.documents:
        return "cp"
    if D.device == "cuda":
        return "flash"
    if D.e == 2 and D.micro_batch * D.local_heads * D.s_local ** 2 <= MATH_ATTENTION_MAX_SCORES:
        return "math"
    if D.attention_dropout > 0:
        return "sdpa_math"
    return "flash"


def _cp_algo(D: PlanDims) -> str:
    if D.cp == 1:
        return "local"
    if D.cp_algo == "usp" and D.cp_ulysses == 1:
        return "zigzag"
    return D.cp_algo


def _ulysses_kv(D: PlanDims, degree: int) -> int:
    """kv heads per rank sent through the Ulysses all-to-all (repeated up to ``degree`` when fewer)."""
    return D.local_kv if D.local_kv % degree == 0 else degree


def attention_terms(D: PlanDims, recompute: str | None = None) -> dict[str, int]:
    """Bytes the attention block saves for backward per layer per micro-batch (from the QKV output
    to the output projection's input), by term.

    ``qk``: the rotated q and k share one tensor ``[s, b, g, r+1, d]``; a separate q copy exists
    when a group holds several query heads and the rank several groups (the reshape cannot be a
    view); ``v`` is a contiguous copy. Flash kernels keep their output (which the output projection
    saves too) and an fp32 log-sum-exp; the CPU explicit-scores kernel the ``[b, n, s, s]``
    probabilities (×3 with attention dropout: mask and dropped copy); context-parallel kernels an
    fp32 output accumulator and log-sum-exp. Selective recompute keeps q, k, v and the output.
    """
    recompute = D.recompute if recompute is None else recompute
    e, tok, b, s = D.e, D.tokens, D.micro_batch, D.s_local
    n_l, g_l, d = D.local_heads, D.local_kv, D.head_dim
    q_extra = n_l > g_l > 1  # q.reshape copies when a rank holds several groups of several heads
    inputs = {"q,k (rotated)": tok * (n_l + g_l) * d * e, "q copy": tok * n_l * d * e if q_extra else 0,
              "v": tok * g_l * d * e}
    out = tok * n_l * d * e
    lse = b * n_l * s * 4
    if recompute == "selective":
        return _nonzero({**inputs, "attention output": out})
    kernel = attention_kernel(D)
    if kernel == "flash":
        return _nonzero({**inputs, "attention output": out, "log-sum-exp": lse})
    scores = b * n_l * s * s * e
    if kernel == "math":
        terms = {"q,k (rotated)": inputs["q,k (rotated)"], "q copy": tok * n_l * d * e if n_l > g_l else 0,
                 "v": inputs["v"], "attention probs": scores}
        if D.attention_dropout > 0:
            terms |= {"attention dropout mask": b * n_l * s * s * D.mask_bytes, "attention dropout output": scores}
        return _nonzero({**terms, "attention output": out})
    if kernel == "sdpa_math":
        v = inputs["v"] if n_l == g_l else tok * n_l * d * e  # GQA: k, v expanded to every query head
        return _nonzero({"q (scaled)": tok * n_l * d * e, "k (scaled)": tok * n_l * d * e, "v": v, "attention probs": scores,
                         "attention dropout mask": b * n_l * s * s * D.mask_bytes, "attention dropout output": scores,
                         "attention output": out})
    algo = _cp_algo(D)
    acc = tok * n_l * d * 4  # the fp32 output accumulator
    if algo in ("ulysses", "usp"):
        degree = D.cp if algo == "ulysses" else D.cp_ulysses
        kv = _ulysses_kv(D, degree)
        return _nonzero({"q (all-to-all)": tok * n_l * d * e, "k,v (all-to-all)": 2 * tok * kv * d * e,
                         "fp32 output accumulator": acc, "log-sum-exp": lse, "attention output": out})
    return _nonzero({**inputs, "fp32 output accumulator": acc, "log-sum-exp": lse,
                     "attention output": out if e != 4 else 0})


def _nonzero(terms: dict[str, int]) -> dict[str, int]:
    return {k: v for k, v in terms.items() if v}


def layer_terms(D: PlanDims, recompute: str | None = None) -> dict[str, int]:
    """Bytes one transformer layer saves for backward per micro-batch on one rank, by term.

    Table 2's terms, adapted: ``x`` below is ``[s/t, b, h]`` under SP else ``[s, b, h]``.

    * norms: neox (parallel residual) saves the one input both LayerNorms read, plus mean/rstd in
      the activation dtype; llama's RMSNorm (two per layer, sequential residual) keeps its input
      and the normalised value in fp32 plus an fp32 rstd — 4-byte terms even in bf16;
    * linear inputs: QKV and MLP inputs are ``x`` (the shard under SP with
      ``tp_recompute_allgather``, the gathered ``[s, b, h]`` otherwise); a replicated QKV
      (tp > kv heads) saves the gathered input and its weight-row slice;
    * attention: ``attention_terms``;
    * MLP: neox saves fc1's output and the GeLU output (``2·s·b·ffn/t``); llama the gate/up output
      ``2·ffn/t``, SiLU(gate) and the product (``4·s·b·ffn/t``) plus the concatenated gate/up
      weight (``2·ffn/t·h`` parameters per layer per micro-batch);
    * dropout (``hidden_dropout > 0``): two masks of ``x``, in the activation dtype on CPU;
    * full recompute: the layer input only.
    """
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
    terms["MLP input"] = gathered * h * e
    f = D.tokens * D.local_ffn * e
    if spec.swiglu:
        terms |= {"gate/up output": 2 * f, "SiLU output": f, "down input": f,
                  "gate/up weight copy": 2 * D.local_ffn * h * e}
    else:
        terms |= {"GeLU input": f, "fc2 input": f}
    if D.hidden_dropout > 0:
        terms["dropout masks"] = 2 * x * D.mask_bytes
    return terms


def table2_layer_bytes(D: PlanDims, scores: bool = True) -> int:
    """Table 2 of Korthikanti et al. for this layout as printed in the paper (``ffn = 4h``, 16-bit
    activations scaled by ``e/2``, ``s = seq/cp``, masks 1 byte), for comparison with ``layer_terms``;
    ``scores=False`` drops the ``5as/h`` term (a fused attention kernel stores no ``s × s`` scores)."""
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
    per_layer: dict[str, int]
    extra: dict[str, int]
    """Embedding, rotary tables, final norm, output layer and cross entropy (on the chunks that hold them)."""
    shared: dict[str, int]
    """Tensors shared by every micro-batch of the step (slices of this rank's batch): counted once."""
    transient: int
    """Extra bytes while one of its layers runs backward (the recomputed layer or attention core)."""
    freed: int = 0
    """Bytes freed before the transient appears: the head's (final norm, output layer, cross entropy) and,
    under selective recompute, the last layer's MLP tensors (its backward runs before the attention's)."""

    @property
    def per_micro_batch(self) -> int:
        """Layers × per-layer terms + the extras (``shared`` not included)."""
        return self.layers * sum(self.per_layer.values()) + sum(self.extra.values())


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
        extra["cross entropy (fp32 probs, targets)"] = tok * (D.padded_vocab // D.tp) * 4 + tok * 10
        shared["loss mask"] = rank_samples * D.s_local * 4
    per_layer = layer_terms(D)
    transient = 0
    if D.recompute == "full":  # the recomputed layer; its input is already held (the norm may save it itself)
        norm_saves_input = (arch_spec(D.arch).layernorm and not (D.device == "cuda" and e == 2)) or \
            (not arch_spec(D.arch).layernorm and e == 4)
        transient = sum(layer_terms(D, "none").values()) - (D.shard_tokens * h * e if norm_saves_input else 0)
    elif D.recompute == "selective":
        none, sel = attention_terms(D, "none"), attention_terms(D, "selective")
        transient = sum(none.values()) - sum(sel.values()) + sel.get("attention output", 0)
    freed = sum(v for k, v in extra.items() if k in ("final norm", "output layer input", "cross entropy (fp32 probs, targets)"))
    if D.recompute == "selective":
        mlp = ("MLP input", "GeLU input", "fc2 input", "gate/up output", "SiLU output", "down input", "gate/up weight copy")
        freed += sum(v for k, v in per_layer.items() if k in mlp)
    return ChunkActivations(layers=len(chunks[chunk]), per_layer=per_layer, extra=extra, shared=shared,
                            transient=transient, freed=freed)


def _table(D: PlanDims) -> list[list[Action]]:
    return build_schedule(D.schedule, D.pp, D.micro_batches, D.virtual_stages)


@dataclass
class SchedulePeak:
    """Peak saved-activation bytes of a rank under its schedule."""

    peak: int
    in_flight: int
    """Most (chunk, micro-batch) pairs holding activations at once (forwarded, weight grads not done)."""
    in_flight_micro_batches: float
    """``in_flight`` in whole-stage micro-batches (``in_flight / virtual_stages``)."""


def schedule_peak(cfg: Config, pp_rank: int, chunks: Sequence[ChunkActivations] | None = None) -> SchedulePeak:
    """Walk rank ``pp_rank``'s action table: F adds the chunk's bytes, B (or I) frees them; a backward
    adds the chunk's transient (recomputed layer or core) once the tensors backward frees first are
    gone (``ChunkActivations.freed``). Shared tensors are added once."""
    D = dims_of(cfg)
    if chunks is None:
        chunks = [chunk_activations(cfg, pp_rank, c) for c in range(D.virtual_stages)]
    live = peak = count = most = 0
    for a in _table(D)[pp_rank]:
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
        cast = D.e != 4 or D.padded_vocab > D.vocab  # an fp32 copy (bf16) or a clone hiding the padded rows
        forward = D.e + (4 if cast else 0)
        backward = 4 + (D.e if D.e != 4 else 0)
        out["logits + cross-entropy transients"] = D.tokens * (D.padded_vocab // D.tp) * max(forward, backward)
    return out


# ------------------------------------------------------------------------------------------ communication


def _add(book: dict[str, dict[str, float]], dim: str, op: str, nbytes: float) -> None:
    if nbytes > 0:
        ops = book.setdefault(dim, {})
        ops[op] = ops.get(op, 0.0) + nbytes


def comm_per_step(cfg: Config, pp_rank: int = 0, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> dict[str, dict[str, float]]:
    """``{dimension: {op: bytes}}`` this rank sends per step (dimension ``tp | cp | pp | dp | other``).

    Ops are ``mpu.comm``'s names (``all_reduce``, ``all_gather``, ``reduce_scatter``,
    ``all_to_all``, ``p2p`` for ring exchanges, ``broadcast``) plus ``send`` for pipeline point-to-point;
    ``other`` holds the step's scalars (loss, gradient norm). Start-up and first-step-only
    collectives (ZeRO's ownership check) are not included.
    """
    D = dims_of(cfg)
    book: dict[str, dict[str, float]] = {}
    m, t, e = D.micro_batches, D.tp, D.e
    chunks = stage_layers(cfg, pp_rank)
    n_layers = sum(len(c) for c in chunks)
    first, last = pp_rank == 0, pp_rank == D.pp - 1
    forwards = 2 if D.recompute == "full" else 1  # full recompute repeats each layer's forward in backward

    if t > 1:
        act = D.tokens * D.h * e  # a gathered [s, b, h] activation
        ag = rs = (t - 1) / t * act
        ar = 2 * (t - 1) / t * act
        if D.sp:
            regather = (2 - (not D.kv_split)) if D.recompute_allgather else 0
            _add(book, "tp", "all_gather", m * n_layers * ag * (2 * forwards + 2 + regather))
            _add(book, "tp", "reduce_scatter", m * n_layers * rs * (2 * forwards + 2))
        else:
            _add(book, "tp", "all_reduce", m * n_layers * ar * (2 * forwards + 2))
        if first:
            _add(book, "tp", "reduce_scatter" if D.sp else "all_reduce", m * (rs if D.sp else ar))
            _add(book, "tp", "all_gather", m * ag if D.sp else 0)
        if last:
            if D.sp:
                _add(book, "tp", "all_gather", m * ag * (1 + D.recompute_allgather))
                _add(book, "tp", "reduce_scatter", m * rs)
            else:
                _add(book, "tp", "all_reduce", m * ar)
            _add(book, "tp", "all_reduce", m * 2 * (t - 1) / t * D.tokens * 3 * 4)  # CE max and sums, fp32
        params = stage_parameters(cfg, pp_rank)
        layout = flat_layout([p.numel for p in params], D.dp_cp, D.zero, bucket_bytes)
        sharded = D.zero == 1 and D.dp_cp > 1
        synced = sum(layout.owned(i, 0, D.dp_cp, sharded) for i, p in enumerate(params) if p.sequence_parallel)
        _add(book, "tp", "all_reduce", 2 * (t - 1) / t * synced * GRAD_BYTES)

    if D.cp > 1 and n_layers:
        algo, N = _cp_algo(D), D.cp
        d, g, tok = D.head_dim, D.local_kv, D.tokens
        kv = 2 * tok * g * d  # this rank's K and V elements
        repeats = 2 if D.recompute in ("full", "selective") else 1  # the core's forward runs again in backward
        per_layer: dict[str, float] = {}

        def ring(n: int, block: int) -> None:
            if n > 1:
                per_layer["p2p"] = per_layer.get("p2p", 0) + (n - 1) * block * e * (repeats + 1) + n * block * 4

        def ulysses(n: int) -> None:
            each = (n - 1) / n * (2 * tok * D.local_heads * d + 2 * tok * _ulysses_kv(D, n) * d) * e
            per_layer["all_to_all"] = per_layer.get("all_to_all", 0) + each * (repeats + 1)

        if algo in ("ring", "zigzag"):
            ring(N, kv)
        elif algo == "llama3":
            per_layer["all_gather"] = (N - 1) * kv * e * (repeats + 1)
            per_layer["reduce_scatter"] = (N - 1) * kv * 4
        elif algo == "ulysses":
            ulysses(N)
        else:  # usp: Ulysses of degree u inside a ring over cp / u
            u = D.cp_ulysses
            ulysses(u)
            ring(N // u, 2 * tok * _ulysses_kv(D, u) * d)
            per_layer["all_to_all"] += (u - 1) / u * D.micro_batch * D.local_heads * D.s_local * 4 * repeats
        for op, nbytes in per_layer.items():
            _add(book, "cp", op, m * n_layers * nbytes)
        ids = 3 if D.documents else 1  # token indices (and document ids), int64, per chunk forward
        _add(book, "cp", "all_gather", m * len(chunks) * (N - 1) * D.micro_batch * D.s_local * 8 * ids)

    if D.pp > 1:
        last_stage = D.pp * D.virtual_stages - 1
        stages = [c * D.pp + pp_rank for c in range(D.virtual_stages)]
        sends = sum(s < last_stage for s in stages) + sum(s > 0 for s in stages)
        _add(book, "pp", "send", m * sends * D.shard_tokens * D.h * e)

    if D.dp_cp > 1:
        layout = flat_layout([p.numel for p in stage_parameters(cfg, pp_rank)], D.dp_cp, D.zero, bucket_bytes)
        n = D.dp_cp
        if D.zero:
            _add(book, "dp", "reduce_scatter", (n - 1) / n * layout.numel * GRAD_BYTES)
            _add(book, "dp", "all_gather", (n - 1) / n * layout.numel * e)
        else:
            _add(book, "dp", "all_reduce", 2 * (n - 1) / n * layout.numel * GRAD_BYTES)
    # the scalars: the loss over the pipeline (fp64), the squared grad norm over ZeRO shards and over tp·pp
    # (fp64: the norm is accumulated in fp64), the step's token count and loss over dp·cp (fp64, training._global_sum)
    scalars = 0.0
    if D.pp > 1:
        scalars += 2 * (D.pp - 1) / D.pp * 8
    if D.zero and D.dp_cp > 1:
        scalars += 2 * (D.dp_cp - 1) / D.dp_cp * 8
    if D.tp * D.pp > 1:
        scalars += 2 * (D.tp * D.pp - 1) / (D.tp * D.pp) * 8
    if D.dp_cp > 1:
        scalars += 2 * 2 * (D.dp_cp - 1) / D.dp_cp * 8
    world = D.tp * D.pp * D.cp * D.dp
    if D.schedule == "zero_bubble" and D.pp > 1:  # agree_costs: 8 fp64 sums all-reduced, then broadcast
        scalars += 2 * (world - 1) / world * 8 * 8
        _add(book, "other", "broadcast", (world - 1) / world * 8 * 8)
    _add(book, "other", "all_reduce", scalars)
    if D.tie and D.pp > 1 and (first or last):
        emb = D.padded_vocab // t * D.h * GRAD_BYTES
        if D.zero and D.dp_cp > 1:  # the two stages own different parts: assembled over dp·cp first
            _add(book, "dp", "all_reduce", 2 * (D.dp_cp - 1) / D.dp_cp * emb)
        _add(book, "dp", "all_reduce", emb)  # the embedding group (2 ranks): 2·(1/2)·bytes
    return book


# ------------------------------------------------------------------------------------------ the plan


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


def stage_flops(cfg: Config, pp_rank: int, recompute: str | None = None) -> float:
    """Model FLOPs per step on one rank of stage ``pp_rank``: ``6·N_stage + 6·L_stage·h·s`` per token
    (``model.flops_per_token``: PaLM, attention over the causal half), N without the input embedding,
    divided over TP and CP; ``recompute`` (default the config's) adds the recomputed forward:
    ``2·N + 2·L·h·s`` (full) or ``2·L·h·s`` (selective)."""
    D = dims_of(cfg)
    recompute = D.recompute if recompute is None else recompute
    parts = parameter_parts(cfg.model)
    layers = sum(len(c) for c in stage_layers(cfg, pp_rank))
    n = layers * parts["layer"] + (parts["final_norm"] + parts["output_layer"] if pp_rank == D.pp - 1 else 0)
    attention = 6 * layers * D.heads * D.head_dim * D.seq
    per_token = 6 * n + attention
    if recompute == "full":
        per_token += 2 * n + attention / 3
    elif recompute == "selective":
        per_token += attention / 3
    tokens = D.global_batch // D.dp * D.seq // D.cp
    return tokens * per_token / D.tp


def plan_layout(cfg: Config, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> LayoutPlan:
    """Predict every pipeline stage of a finalized config (vocabulary set)."""
    D = dims_of(cfg)
    stages = []
    for r in range(D.pp):
        chunks = [chunk_activations(cfg, r, c) for c in range(D.virtual_stages)]
        peak = schedule_peak(cfg, r, chunks)
        stages.append(RankPlan(pp_rank=r, state=state_bytes(cfg, r, bucket_bytes), chunks=chunks, schedule=peak,
                               buffers=buffer_terms(cfg, r, peak.in_flight), comm=comm_per_step(cfg, r, bucket_bytes),
                               flops=stage_flops(cfg, r)))
    return LayoutPlan(cfg=cfg, dims=D, stages=stages)


def estimate_step_time(lp: LayoutPlan, peak_tflops: float, bandwidth_gbs: float) -> dict[str, float]:
    """Seconds per step (see the module docstring): compute / (1 − bubble) + exposed communication."""
    D = lp.dims
    peak, bw = peak_tflops * 1e12, bandwidth_gbs * 1e9
    bubble = theory_bubble(D.schedule, D.pp, D.micro_batches, D.virtual_stages) if D.pp > 1 else 0.0
    busiest = max(lp.stages, key=lambda r: r.flops)
    compute = busiest.flops / peak / (1 - bubble)
    exposed = 0.0
    for r in lp.stages:
        own = sum(r.comm_bytes(k) for k in ("tp", "cp", "pp")) / bw
        dp = r.comm.get("dp", {})
        gather = dp.get("all_gather", 0.0) / bw
        reduce = (dp.get("reduce_scatter", 0.0) + dp.get("all_reduce", 0.0)) / bw
        last_backward = 2 / 3 * r.flops / peak / max(D.micro_batches, 1)
        exposed = max(exposed, own + gather + max(0.0, reduce - last_backward))
    step = compute + exposed
    model_flops = sum(stage_flops(lp.cfg, r.pp_rank, "none") for r in lp.stages) * D.tp * D.cp * D.dp
    return {"step_s": step, "compute_s": compute, "comm_s": exposed, "bubble": bubble,
            "tokens_per_s": D.global_batch * D.seq / step, "mfu": model_flops / (step * peak * D.world)}


# ------------------------------------------------------------------------------------------ layouts


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
    virtual stages) only at pp > 1 (else 1f1b), the cp algorithm as given."""
    p = base.parallel
    sp = p.sequence_parallel and tp > 1
    schedule, virtual = p.pp_schedule, p.virtual_stages
    if pp == 1 and schedule == "interleaved":
        schedule, virtual = "1f1b", 1
    out = [f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.cp={cp}", f"parallel.dp={dp}",
           f"parallel.sequence_parallel={str(sp).lower()}", f"parallel.pp_schedule={schedule}",
           f"parallel.virtual_stages={virtual}", "parallel.world_size=none"]
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


def search(build: Callable[[list[str]], Config], base: Config, devices: int, memory_bytes: int,
           peak_tflops: float, bandwidth_gbs: float, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[Candidate]:
    """Every layout of ``devices`` ranks: ``build(overrides)`` makes the finalized config (raising
    ``ConfigError`` when the config loader's checks refuse it); returns the candidates ranked: those
    that fit first, by estimated step time, then those that do not fit, then the refused ones."""
    out = []
    for layout in factorizations(devices):
        cand = Candidate(layout)
        try:
            cfg = build(layout_overrides(base, *layout))
        except ConfigError as exc:
            cand.error = str(exc)
            out.append(cand)
            continue
        cand.plan = plan_layout(cfg, bucket_bytes)
        cand.plan.time = estimate_step_time(cand.plan, peak_tflops, bandwidth_gbs)
        cand.fits = cand.plan.peak_bytes <= memory_bytes
        out.append(cand)

    def key(c: Candidate) -> tuple[Any, ...]:
        if c.plan is None:
            return (2, 0.0, 0, c.layout)
        return (0 if c.fits else 1, c.plan.time["step_s"], c.plan.peak_bytes, c.layout)
    return sorted(out, key=key)


# ------------------------------------------------------------------------------------------ parsing

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


# ------------------------------------------------------------------------------------------ measuring
# What ``tools/plan.py --verify`` and the tests compare the predictions with. Only used there: the
# training code is run as it is, instrumented from the outside.


class SavedBytes:
    """Bytes of the distinct storages autograd saves inside ``record()``, without ``exclude`` (parameters)."""

    def __init__(self, exclude: set[int]) -> None:
        self.exclude = exclude
        self.storages: dict[int, int] = {}

    def _pack(self, t: Any) -> Any:
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.exclude and storage.nbytes():
            self.storages[storage.data_ptr()] = storage.nbytes()
        return t

    def record(self) -> Any:
        import torch

        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    @property
    def nbytes(self) -> int:
        return sum(self.storages.values())


class _Packed:
    """A saved tensor held by ``LiveSavedBytes``: releasing it (autograd frees the saved variable) is counted."""

    __slots__ = ("owner", "ptr", "tensor")

    def __init__(self, tensor: Any, ptr: int, owner: LiveSavedBytes) -> None:
        self.tensor, self.ptr, self.owner = tensor, ptr, owner

    def __del__(self) -> None:
        self.owner._release(self.ptr)


class LiveSavedBytes:
    """The peak bytes of saved-for-backward storages alive at once inside ``record()``.

    Each saved tensor is wrapped in a handle whose release (autograd frees a graph's saved
    variables as its backward runs) decrements a per-storage count; a storage counts from its
    first save until its last handle is released. Storages in ``exclude`` (parameters) are not
    counted. Tensors kept alive by other references after autograd released them (zero-bubble's
    deferred weight gradients) are not seen.
    """

    def __init__(self, exclude: set[int]) -> None:
        self.exclude = exclude
        self.refs: dict[int, int] = {}
        self.sizes: dict[int, int] = {}
        self.live = 0
        self.peak = 0

    def _pack(self, t: Any) -> Any:
        storage = t.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if ptr in self.exclude or not nbytes:
            return t
        if not self.refs.get(ptr):
            self.sizes[ptr] = nbytes
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        self.refs[ptr] = self.refs.get(ptr, 0) + 1
        return _Packed(t, ptr, self)

    @staticmethod
    def _unpack(packed: Any) -> Any:
        return packed.tensor if isinstance(packed, _Packed) else packed

    def _release(self, ptr: int) -> None:
        self.refs[ptr] -= 1
        if not self.refs[ptr]:
            del self.refs[ptr]
            self.live -= self.sizes.pop(ptr)

    def record(self) -> Any:
        import torch

        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)


def measure_state(optimizer: Any, model: Any) -> dict[str, int]:
    """Bytes of the parameters (``param_buffer`` and any parameter storage outside it), the fp32 main
    gradients (``grad_buffer``) and the optimizer state (Adam moments, fp32 masters) a rank holds."""
    seen = {optimizer.param_buffer.untyped_storage().data_ptr()}
    params = optimizer.param_buffer.untyped_storage().nbytes()
    for p in model.parameters():
        storage = p.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            params += storage.nbytes()
    optim = optimizer.exp_avg.untyped_storage().nbytes() + optimizer.exp_avg_sq.untyped_storage().nbytes()
    master = getattr(optimizer, "_master_local", None)
    if master is not None:
        optim += master.untyped_storage().nbytes()
    return {"params": params, "grads": optimizer.grad_buffer.untyped_storage().nbytes(), "optim": optim}


def parameter_exclusions(optimizer: Any, model: Any) -> set[int]:
    """Storage addresses of the parameters (not activations)."""
    return {optimizer.param_buffer.untyped_storage().data_ptr(), *(p.untyped_storage().data_ptr()
                                                                   for p in model.parameters())}


def probe_chunk(rt: Any, micro_batch: dict[str, Any], chunk: int, denom: float) -> int:
    """Saved bytes of one micro-batch's forward through model chunk ``chunk`` of this rank's stage, the
    way the pipeline executor runs it (a stage without the embedding gets a random input of the
    activation's shape and dtype; the last chunk applies the training loss). The graph is dropped."""
    import torch

    from . import training
    from .pipeline import activation_shape

    stage, st = rt.model, rt.state
    v = len(stage.layer_chunks)
    virtual = chunk * st.pp_size + st.pp_rank
    last = virtual == st.pp_size * v - 1
    x = None
    if virtual > 0:
        dtype = next(stage.parameters()).dtype
        x = torch.randn(activation_shape(stage, micro_batch), dtype=dtype, device=rt.device).requires_grad_()
    saved = SavedBytes(parameter_exclusions(rt.optimizer, stage))
    with saved.record(), training._autocast(rt.cfg, rt.device):
        out = stage(micro_batch["tokens"] if virtual == 0 else None, position_ids=micro_batch.get("position_ids"),
                    labels=micro_batch["labels"] if last else None, hidden_states=x, chunk=chunk,
                    token_index=micro_batch.get("token_index"), document_ids=micro_batch.get("document_ids"))
        if last:
            out = (out.float() * micro_batch["loss_mask"]).sum() / denom
    del out
    return saved.nbytes


def verify_rank(rank: int, world_size: int, conf_files: list[str], overrides: list[str], steps: int) -> dict[str, Any]:
    """On a ``run_distributed`` rank: build the run with ``megatron_sp.training.setup`` and measure what
    ``plan_layout`` predicts — exact parameter/gradient/optimizer bytes from the real optimizer, one
    micro-batch's saved bytes per model chunk, and over ``steps`` real ``train_step`` calls the peak of
    live saved bytes under the schedule, the executor's peak micro-batches in flight, the gather
    buffer, and the bytes sent per collective and pipeline send (``mpu.comm`` counters). Measured through the
    supported hooks (``pipeline.schedules.observe``, ``comm.count``); nothing is replaced."""
    import torch

    from . import config as config_mod
    from . import training
    from .mpu import comm
    from .mpu.memory import default_gather_buffer
    from .pipeline import schedules

    cfg = config_mod.load(conf_files, overrides, world_size=world_size)
    rt = training.setup(cfg)
    st = rt.state
    result: dict[str, Any] = {"rank": rank, "pp_rank": st.pp_rank, "tp_rank": st.tp_rank, "cp_rank": st.cp_rank,
                              "dp_rank": st.dp_rank, "state": measure_state(rt.optimizer, rt.model)}

    batch = training.rank_batch(rt, rt.train_ds, 0)
    micro = cfg.train.micro_batch_size
    first_mb = {k: v[:micro] for k, v in batch.items()}
    result["chunks"] = [probe_chunk(rt, first_mb, c, float(batch["loss_mask"].numel()))
                        for c in range(len(rt.model.layer_chunks))]

    peaks: list[int] = []
    in_flight: list[int] = []
    exclude = parameter_exclusions(rt.optimizer, rt.model)

    @contextmanager
    def around_schedule(stats: schedules.ScheduleStats) -> Iterator[None]:  # each step's forward_backward
        live = LiveSavedBytes(exclude)
        with live.record():
            yield
        peaks.append(live.peak)
        in_flight.append(stats.peak_in_flight)

    with schedules.observe(around_schedule):
        for _ in range(steps):
            with comm.count() as counter:
                training.train_step(rt)
    result["peak"] = max(peaks)
    result["in_flight"] = max(in_flight) if in_flight else 0
    result["gather_buffer"] = default_gather_buffer().nbytes
    result["comm"] = {op: v["bytes"] for op, v in counter.summary().items()}  # the last step (sends included)
    loader = getattr(rt, "train_loader", None)
    if loader is not None:
        loader.close()
    rt.state.destroy()
    del rt
    torch.set_num_threads(1)
    return result
