"""The transformer layer of the GPT: norms, rotary embeddings, attention and MLP.

Activations are ``[s, b, h]`` (sequence first) so that sequence and context parallelism split dim 0.
``ModelConfig.arch`` picks ``neox`` or ``llama`` (``ArchSpec``). The fused QKV output dim is
``[num_kv_heads, num_heads // num_kv_heads + 2, head_dim]``. Parameter names, their TP split and the QKV
layout: docs/tensor_parallel.md. Kernels live in ``attention.kernels``.
"""
from __future__ import annotations

import contextlib
import functools
import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.hooks import RemovableHandle

from megatron_sp.config.schema import ModelConfig
from megatron_sp.model.attention.context_parallel import AttentionMeta, context_parallel_attention
from megatron_sp.model.attention.kernels import cached_attention, dot_product_attention
from megatron_sp.model.mla import LatentAttention
from megatron_sp.model.moe import MoE, expert_ffn, is_moe_layer
from megatron_sp.model.qk_norm import projection_norms, projection_rms_norm
from megatron_sp.model.rope import RopeScaling, apply_rotary
from megatron_sp.mpu.layers import ColumnParallelLinear, RowParallelLinear, linear, set_tp_attributes
from megatron_sp.mpu.mappings import copy_to_tp, gather_from_sp
from megatron_sp.mpu.parallel_state import ParallelContext
from megatron_sp.mpu.random import checkpoint

ARCHS = ("neox", "llama")


@dataclass(frozen=True)
class ArchSpec:
    """The architectural choices that differ between ``neox`` and ``llama``."""

    layernorm: bool  # LayerNorm with bias, else RMSNorm (weight only)
    bias: bool  # biases on every linear layer but the output layer
    parallel_residual: bool  # x + attn(n1(x)) + mlp(n2(x)), else x += attn(n1(x)); x += mlp(n2(x))
    swiglu: bool  # SwiGLU MLP (gate, up, down), else fc2(gelu(fc1(x)))


def arch_spec(arch: str) -> ArchSpec:
    """The ``ArchSpec`` of ``arch`` ('neox' or 'llama')."""
    if arch == "neox":
        return ArchSpec(layernorm=True, bias=True, parallel_residual=True, swiglu=False)
    if arch == "llama":
        return ArchSpec(layernorm=False, bias=False, parallel_residual=False, swiglu=True)
    raise ValueError(f"unknown model.arch {arch!r}; expected one of {ARCHS}")


# The pointwise regions of a layer, called through ``self.regions`` (``EAGER`` or ``compiled()``). No region
# communicates, draws random numbers or reads state beyond its arguments (docs/compile.md).


def rotary_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               r: int, d: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split the fused QKV output ``[s, b, g·(r+2)·d]`` into q ``[s, b, g·r, d]``, k and v ``[s, b, g, d]``,
    queries and keys rotated (cos/sin ``[s, b|1, rd]``). The formula autograd differentiates (and
    ``torch.compile`` fuses); eager runs ``_RotaryQKV``, the same values with a hand-written backward."""
    s, b = qkv.shape[0], qkv.shape[1]
    qkv = qkv.view(s, b, -1, r + 2, d)  # [s, b, g, r+2, d]
    cos = cos.to(qkv.dtype)[:, :, None, None, :]  # [s, b|1, 1, 1, rd]
    sin = sin.to(qkv.dtype)[:, :, None, None, :]
    qk, v = qkv.split([r + 1, 1], dim=3)  # [s, b, g, r+1, d], [s, b, g, 1, d]
    qk = apply_rotary(qk, cos, sin)  # queries and keys rotated together
    q, k = qk.split([r, 1], dim=3)
    # v is a view into the projection output: copy it so autograd does not keep all of qkv alive.
    return q.reshape(s, b, -1, d), k.squeeze(3), v.squeeze(3).contiguous()


def norm_rotary_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, r: int, d: int, q_weight: torch.Tensor,
                    k_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``rotary_qkv`` with per-head QK-norm (``model.qk_norm``, Qwen3): each query and key head RMS-normalised over
    its ``d`` dims (weights ``[d]``, shared by the heads) before the rotation."""
    s, b = qkv.shape[0], qkv.shape[1]
    qkv = qkv.view(s, b, -1, r + 2, d)  # [s, b, g, r+2, d]
    cos = cos.to(qkv.dtype)[:, :, None, :]  # [s, b|1, 1, rd]
    sin = sin.to(qkv.dtype)[:, :, None, :]
    q = F.rms_norm(qkv[:, :, :, :r].reshape(s, b, -1, d), (d,), q_weight, eps)  # [s, b, g·r, d]
    k = F.rms_norm(qkv[:, :, :, r], (d,), k_weight, eps)  # [s, b, g, d]
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), qkv[:, :, :, r + 1].contiguous()


def _unrotate_into(out: torch.Tensor, dy: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """``out = ∂(apply_rotary)/∂x applied to dy``: ``dy·cos``, then each half adds the other half's ``dy·sin`` (the
    swap is its own transpose); ``dy`` on the rest. The products and sums of autograd's backward, so its bits."""
    rd = cos.shape[-1]
    h = rd // 2
    torch.mul(dy[..., :rd], cos, out=out[..., :rd])
    out[..., :h].add_(dy[..., h:rd] * sin[..., h:])
    out[..., h:rd].add_(dy[..., :h] * sin[..., :h])
    if rd != dy.shape[-1]:
        out[..., rd:] = dy[..., rd:]


class _RotaryQKV(torch.autograd.Function):
    """``rotary_qkv`` whose backward writes dq, dk and dv into one ``[s, b, g, r+2, d]`` gradient (autograd of
    the formula concatenates twice) and whose forward rotates q and k apart (no copy of q to reshape it)."""

    @staticmethod
    def forward(ctx, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, r: int,
                d: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s, b = qkv.shape[0], qkv.shape[1]
        qkv = qkv.view(s, b, -1, r + 2, d)
        cos = cos.to(qkv.dtype)[:, :, None, None, :]  # [s, b|1, 1, 1, rd]
        sin = sin.to(qkv.dtype)[:, :, None, None, :]
        ctx.save_for_backward(cos, sin)
        ctx.r = r
        q = apply_rotary(qkv[:, :, :, :r], cos, sin)  # [s, b, g, r, d], contiguous
        k = apply_rotary(qkv[:, :, :, r], cos[:, :, 0], sin[:, :, 0])  # [s, b, g, d]
        return q.reshape(s, b, -1, d), k, qkv[:, :, :, r + 1].contiguous()

    @staticmethod
    def backward(ctx, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        cos, sin = ctx.saved_tensors
        r = ctx.r
        s, b, g, d = dk.shape
        grad = torch.empty(s, b, g, r + 2, d, dtype=dk.dtype, device=dk.device)
        _unrotate_into(grad[:, :, :, :r], dq.view(s, b, g, r, d), cos, sin)
        _unrotate_into(grad[:, :, :, r], dk, cos[:, :, 0], sin[:, :, 0])
        grad[:, :, :, r + 1] = dv
        return grad.view(s, b, -1), None, None, None, None


def _rotary_qkv_eager(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      r: int, d: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _RotaryQKV.apply(qkv, cos, sin, r, d)


def norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """LayerNorm (with ``bias``) or RMSNorm (``bias`` None) over the last dim."""
    if bias is not None:
        return F.layer_norm(x, x.shape[-1:], weight, bias, eps)
    return F.rms_norm(x, x.shape[-1:], weight, eps)


def add_norm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual ``x + y`` and its norm (a sequential-residual layer's second half begins so)."""
    x = x + y
    return x, norm(x, weight, bias, eps)


def add3(x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """``x + y + z``: the parallel residual."""
    return x + y + z


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) · up`` of the concatenated ``[..., 2·f]`` gate and up projections → ``[..., f]``: the formula
    autograd differentiates (and ``torch.compile`` fuses); eager runs ``_SwiGLU``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class _SwiGLU(torch.autograd.Function):
    """``swiglu`` saving only its input (autograd of the formula also saves ``silu(gate)``, ``f`` values per
    token) and writing d(gate), d(up) into one ``[..., 2·f]`` gradient (no concatenation); the backward runs
    autograd's own ops (``silu_backward``, products), so its bits are autograd's."""

    @staticmethod
    def forward(ctx, gate_up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate_up)
        return swiglu(gate_up)

    @staticmethod
    def backward(ctx, dout: torch.Tensor) -> torch.Tensor:
        (gate_up,) = ctx.saved_tensors
        gate, up = gate_up.chunk(2, dim=-1)
        grad = torch.empty_like(gate_up)
        d_gate, d_up = grad.chunk(2, dim=-1)
        torch.mul(dout, F.silu(gate), out=d_up)
        torch.ops.aten.silu_backward.grad_input(dout * up, gate, grad_input=d_gate)
        return grad


def _swiglu_eager(gate_up: torch.Tensor) -> torch.Tensor:
    return _SwiGLU.apply(gate_up)


@dataclass(frozen=True)
class Regions:
    """The pointwise regions a layer calls (eager or compiled)."""

    rotary_qkv: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = rotary_qkv
    norm_rotary_qkv: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = norm_rotary_qkv
    norm: Callable[..., torch.Tensor] = norm
    add_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]] = add_norm
    add3: Callable[..., torch.Tensor] = add3
    swiglu: Callable[..., torch.Tensor] = swiglu


FORMULAS = Regions()
EAGER = Regions(rotary_qkv=_rotary_qkv_eager, swiglu=_swiglu_eager)


@functools.cache
def compiled() -> Regions:
    """The regions' formulas through ``torch.compile`` (inductor; shapes static until one changes, then dynamic)."""
    return Regions(**{f.name: torch.compile(getattr(FORMULAS, f.name)) for f in fields(Regions)})


def compile_cache_dir() -> str:
    """Where inductor caches compiled kernels for later runs (``TORCHINDUCTOR_CACHE_DIR``)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_cache_dir

    return inductor_cache_dir()


def hidden_dropout(x: torch.Tensor, p: float, training: bool, parallel: ParallelContext) -> torch.Tensor:
    """Dropout on a hidden state: ``[s/t, b, h]`` shards under SP draw from the TP-different stream."""
    if p <= 0 or not training:
        return x
    with parallel.sharded_rng() if parallel.sp else contextlib.nullcontext():
        return F.dropout(x, p, True)


def check_model_config(cfg: ModelConfig) -> None:
    """Raise ValueError unless ``cfg`` is finalized (the config's ``finalize`` checks its shapes)."""
    arch_spec(cfg.arch)
    derived = ("num_kv_heads", "ffn_hidden_size", "rotary_pct", "padded_vocab_size")
    missing = [name for name in derived if getattr(cfg, name) is None]
    if missing:
        raise ValueError(f"ModelConfig is not finalized, {', '.join(missing)} unset: run the config loader's "
                         "finalize() first")


def head_dim(cfg: ModelConfig) -> int:
    """Dims per attention head (``model.head_dim``, derived hidden_size / num_heads)."""
    return cfg.head_dim or cfg.hidden_size // cfg.num_heads


def rotary_dim(cfg: ModelConfig) -> int:
    """Leading dims of each head that receive rotary embeddings (GPT-NeoX's ``int(d * rotary_pct)``; MLA:
    ``qk_rope_head_dim``)."""
    return cfg.qk_rope_head_dim if cfg.kv_lora_rank else int(head_dim(cfg) * cfg.rotary_pct)


def make_norm(cfg: ModelConfig, parallel: ParallelContext | None = None) -> nn.Module:
    """LayerNorm (neox) or RMSNorm (llama) over the hidden dim. Under SP a norm sees s/t of the tokens,
    so its parameters are tagged ``sequence_parallel`` (grads summed over TP after backward)."""
    norm_class = nn.LayerNorm if arch_spec(cfg.arch).layernorm else nn.RMSNorm
    norm: nn.Module = norm_class(cfg.hidden_size, eps=cfg.norm_eps)
    sp = parallel is not None and parallel.sp
    for param in norm.parameters():
        set_tp_attributes(param, False, -1, sequence_parallel=sp)
    return norm


def norm_args(norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None, float]:
    """(weight, bias or None, eps) of a ``make_norm`` module: the arguments of ``Regions.norm``."""
    return norm.weight, getattr(norm, "bias", None), norm.eps


class RotaryEmbedding(nn.Module):
    """cos/sin tables of the rotary angles ``position · base^(-2i/rotary_dim)``, i < rotary_dim/2: ``cat(cos, cos)``
    and the signed ``cat(-sin, sin)`` (rotate-half). Angles in fp32 (fp64 for an fp64 model), cast to the
    compute dtype; tables of the default positions ``arange(s)`` are cached per (length, device, dtypes)."""

    def __init__(self, rotary_dim: int, base: float, scaling: RopeScaling | None = None) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        self.base = base
        self.scaling = scaling or RopeScaling()  # model.rope_scaling: the frequencies, and a factor on cos/sin (yarn)
        self._cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def inv_freq(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """``base^(-2i/rotary_dim)`` for i < rotary_dim/2, scaled by ``scaling``. # [rotary_dim/2]"""
        exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.int64, device=device).to(dtype) / self.rotary_dim
        if self.scaling.kind == "none":
            return 1.0 / (self.base ** exponents)
        return self.scaling.inv_freq(self.base ** exponents, self.base, self.rotary_dim)

    def forward(self, position_ids: torch.Tensor | None, seq_len: int, device: torch.device,
                angle_dtype: torch.dtype, out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin), each ``[s, b, rd]`` (``[s, 1, rd]`` when ``position_ids [b, s]`` is None)."""
        if position_ids is None:
            key = (seq_len, device, angle_dtype, out_dtype)
            cached = self._cache.get(key)
            if cached is None:
                with torch.inference_mode(False):  # a table made under inference mode could not train later
                    positions = torch.arange(seq_len, device=device)[:, None]  # [s, 1]
                    cached = self._tables(positions, angle_dtype, out_dtype)
                self._cache[key] = cached
            return cached
        return self._tables(position_ids.t(), angle_dtype, out_dtype)  # positions [s, b]

    def _tables(self, positions: torch.Tensor, angle_dtype: torch.dtype,
                out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.to(angle_dtype)[..., None] * self.inv_freq(positions.device, angle_dtype)  # [s, b, rd/2]
        cos, sin = angles.cos(), angles.sin()
        if (factor := self.scaling.cos_sin_factor()) != 1.0:
            cos, sin = cos * factor, sin * factor
        return torch.cat([cos, cos], dim=-1).to(out_dtype), torch.cat([-sin, sin], dim=-1).to(out_dtype)  # [s, b, rd]


class ReplicatedGroupQKV(nn.Module):
    """The fused QKV projection when tp > num_kv_heads: rank ``j`` computes query-head slice ``j % (t/g)`` of kv
    group ``j // (t/g)`` plus the group's key and value. The full weight is replicated and tagged
    ``sequence_parallel`` (grad summed over TP). Trade-off: t× the QKV weight and optimizer memory, for a
    parameter identical to the unsharded model's (checkpoints stay layout-free)."""

    def __init__(self, cfg: ModelConfig, parallel: ParallelContext, bias: bool) -> None:
        super().__init__()
        g, n, d = cfg.num_kv_heads, cfg.num_heads, head_dim(cfg)
        self.parallel = parallel
        self.groups, self.q_per_kv, self.head_dim = g, n // g, d
        self.ranks_per_group = parallel.tp_size // g
        self.group_index, self.sub = divmod(parallel.tp_rank, self.ranks_per_group)
        self.local_q = self.q_per_kv // self.ranks_per_group
        width = g * (self.q_per_kv + 2) * d
        self.weight = nn.Parameter(torch.empty(width, cfg.hidden_size))
        self.bias = nn.Parameter(torch.empty(width)) if bias else None
        for param in self.parameters():
            set_tp_attributes(param, False, -1, sequence_parallel=True)

    def _rows(self, t: torch.Tensor) -> torch.Tensor:
        grouped = t.view(self.groups, self.q_per_kv + 2, self.head_dim, *t.shape[1:])[self.group_index]
        q = grouped[self.sub * self.local_q:(self.sub + 1) * self.local_q]
        return torch.cat([q, grouped[self.q_per_kv:]], dim=0).flatten(0, 1)  # [(r'+2)·d, ...]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[s/t, b, h]`` (SP) or ``[s, b, h]`` → ``[s, b, (r'+2)·d]`` for this rank's heads."""
        group = self.parallel.tp_group
        x_full = gather_from_sp(x, group) if self.parallel.sequence_parallel else copy_to_tp(x, group)  # [s, b, h]
        bias = self._rows(self.bias) if self.bias is not None else None
        return linear(x_full, self._rows(self.weight), bias)  # weight grad deferrable (zero-bubble W)


class LayerKV(Protocol):
    """What a layer needs of its KV cache (``model.inference.LayerKVCache``; the model does not import it)."""

    pad: torch.Tensor | None  # [b]: left-padding keys of each sequence (None: no padding)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ...  # store the new k/v [s, b, g, d]; return cached + new [past + s, b, g, d]

    def fill(self, k: torch.Tensor, v: torch.Tensor, meta: AttentionMeta) -> None:
        ...  # CP prefill: store every cp rank's k/v [s/cp, b, g, d] (gathered) in position order


KernelHook = Callable[..., torch.Tensor]
"""``hook(kernel, q, k, v, dropout_p) -> output``: see ``SelfAttention.register_kernel_hook``."""


class SelfAttention(nn.Module):
    """Fused QKV projection, rotary, causal attention, row-parallel output; ``n/t`` query heads per TP
    rank: whole kv groups (column-parallel QKV) or part of one group (``ReplicatedGroupQKV``)."""

    def __init__(self, cfg: ModelConfig, parallel: ParallelContext | None = None) -> None:
        super().__init__()
        parallel = parallel or ParallelContext()
        self.parallel = parallel
        bias = arch_spec(cfg.arch).bias
        g, n, d = cfg.num_kv_heads, cfg.num_heads, head_dim(cfg)
        self.head_dim = d
        self.qkv: nn.Module | None = None
        self.mla = LatentAttention(cfg, parallel) if cfg.kv_lora_rank else None  # DeepSeek's latent attention
        if self.mla is not None:
            self.q_per_kv = 1
        elif g % parallel.tp_size == 0:
            self.q_per_kv = n // g
            self.qkv = ColumnParallelLinear(cfg.hidden_size, g * (self.q_per_kv + 2) * d, bias=bias or cfg.qkv_bias,
                                            group=parallel.tp_group, sequence_parallel=parallel.sequence_parallel,
                                            recompute_allgather=parallel.recompute_allgather)
        else:
            self.qkv = ReplicatedGroupQKV(cfg, parallel, bias or cfg.qkv_bias)
            self.q_per_kv = self.qkv.local_q
        # QK-norm per head: one [d] weight each for all query / key heads; a rank sees its heads only, so their grads
        # are summed over TP with or without SP (tagged ``sequence_parallel``). Over the projection: ``qk_norm``.
        self.q_norm = self.k_norm = None
        self.projection_qk_norm = cfg.qk_norm and cfg.qk_norm_scope == "projection"
        if self.projection_qk_norm:
            self.q_norm, self.k_norm = projection_norms(cfg, parallel, isinstance(self.qkv, ReplicatedGroupQKV))
        elif cfg.qk_norm:
            self.q_norm, self.k_norm = nn.RMSNorm(d, eps=cfg.norm_eps), nn.RMSNorm(d, eps=cfg.norm_eps)
            for param in (self.q_norm.weight, self.k_norm.weight):
                set_tp_attributes(param, False, -1, sequence_parallel=True)
        self.out = RowParallelLinear(n * (cfg.v_head_dim if self.mla else d), cfg.hidden_size, bias=bias, group=parallel.tp_group,
                                     sequence_parallel=parallel.sequence_parallel, input_is_parallel=True)
        self.dropout_p = cfg.attention_dropout
        self.window = cfg.sliding_window  # decoding; training gets it in the AttentionMeta
        self.regions = EAGER  # pointwise work: EAGER or compiled()
        self.max_scores = cfg.cpu_attention_max_scores  # the CPU block kernel's bound (None: the kernels' default)
        self.attention_fn: Callable[..., torch.Tensor] = functools.partial(dot_product_attention,
                                                                           max_scores=self.max_scores)
        self._kernel_hooks: OrderedDict[int, KernelHook] = OrderedDict()  # weak-referenceable, for RemovableHandle

    def register_kernel_hook(self, hook: KernelHook) -> RemovableHandle:
        """Wrap this layer's ``attention_fn`` calls: ``hook(kernel, q, k, v, dropout_p)`` returns the output
        (normally ``kernel(q, k, v, dropout_p)``); later hooks wrap earlier ones. Not called on the
        context-parallel / packed-document path."""
        handle = RemovableHandle(self._kernel_hooks)
        self._kernel_hooks[handle.id] = hook
        return handle

    def _kernel(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: float) -> torch.Tensor:
        call = self.attention_fn
        for hook in self._kernel_hooks.values():
            call = functools.partial(hook, call)
        return call(q, k, v, p)

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMeta | None = None) -> torch.Tensor:
        """The attention core on local heads; its dropout draws from the TP-different stream. With ``meta``
        (CP or packed documents) masks come from the tokens' global indices and document ids."""
        p = self.dropout_p if self.training else 0.0
        if meta is not None:
            if p > 0:
                raise ValueError("attention dropout with context parallelism or packed documents is not available: "
                                 "set model.attention_dropout=0")
            return context_parallel_attention(q, k, v, meta)
        with self.parallel.sharded_rng() if p > 0 else contextlib.nullcontext():
            return self._kernel(q, k, v, p if p > 0 else 0.0)

    def _projection_norm_rotary_qkv(self, qkv: torch.Tensor, cos: torch.Tensor,
                                    sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``rotary_qkv`` after OLMo-2's QK-norm over the whole q and k projections (``qk_norm.projection_rms_norm``:
        it communicates, so it is no region)."""
        s, b, r, d, group = qkv.shape[0], qkv.shape[1], self.q_per_kv, self.head_dim, self.parallel.tp_group
        grouped = qkv.view(s, b, -1, r + 2, d)  # [s, b, g_local, r+2, d]
        k_weight = self.k_norm.weight
        if isinstance(self.qkv, ReplicatedGroupQKV):  # the whole [g·d] weight: this rank's group
            k_weight = k_weight.view(-1, d)[self.qkv.group_index]
        q = projection_rms_norm(grouped[:, :, :, :r].reshape(s, b, -1), self.q_norm.weight, self.q_norm.eps, group)
        k = projection_rms_norm(grouped[:, :, :, r].reshape(s, b, -1), k_weight, self.k_norm.eps, group)
        cos, sin = cos.to(qkv.dtype)[:, :, None, :], sin.to(qkv.dtype)[:, :, None, :]  # [s, b|1, 1, rd]
        return (apply_rotary(q.view(s, b, -1, d), cos, sin), apply_rotary(k.view(s, b, -1, d), cos, sin),
                grouped[:, :, :, r + 1].contiguous())

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMeta | None = None, kv_cache: LayerKV | None = None) -> torch.Tensor:
        """x ``[s/t, b, h]`` (SP) or ``[s, b, h]``, cos/sin ``[s, b|1, rd/2]`` → same shape as x.

        Under CP ``s`` is this rank's ``s/cp`` tokens (``meta`` says which). With ``kv_cache``
        (inference, no SP or CP) the tokens follow the cached ones and attend over all of them."""
        if self.mla is not None:  # the cache keeps the latents and the shared rotary keys: [s, b, 1, r] each
            q, latent, k_rope = self.mla(x, cos, sin)
            if kv_cache is not None and meta is not None:
                kv_cache.fill(latent[:, :, None], k_rope[:, :, None], meta)
            elif kv_cache is not None:
                latent, k_rope = (t[:, :, 0] for t in kv_cache.append(latent[:, :, None], k_rope[:, :, None]))
                return self._decode(q, *self.mla.expand(latent, k_rope), kv_cache)
            return self._attend(q, *self.mla.expand(latent, k_rope), meta, None)
        qkv = self.qkv(x)  # [s, b, local (r+2)·d·groups]
        if self.projection_qk_norm:
            q, k, v = self._projection_norm_rotary_qkv(qkv, cos, sin)
        elif self.q_norm is not None and self.k_norm is not None:
            q, k, v = self.regions.norm_rotary_qkv(qkv, cos, sin, self.q_per_kv, self.head_dim, self.q_norm.weight,
                                                   self.k_norm.weight, self.q_norm.eps)
        else:
            q, k, v = self.regions.rotary_qkv(qkv, cos, sin, self.q_per_kv, self.head_dim)  # [s, b, n/t | g_local, d]
        return self._attend(q, k, v, meta, kv_cache)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMeta | None,
                kv_cache: LayerKV | None) -> torch.Tensor:
        """The attention of q ``[s, b, n/t, d]`` over k/v (and the cache), then the output projection."""
        if kv_cache is not None and meta is not None:  # CP prefill: cache the whole sequence, attend as in training
            kv_cache.fill(k, v, meta)
        elif kv_cache is not None:
            return self._decode(q, *kv_cache.append(k, v), kv_cache)  # k/v: [past + s, b, g, d]
        if self.parallel.recompute == "selective" and self.training and torch.is_grad_enabled():
            ctx = checkpoint(self.core, q, k, v, meta, tracker=self.parallel.tracker)  # [s, b, n/t, d]
        else:
            ctx = self.core(q, k, v, meta)  # [s, b, n/t, d]
        return self.out(self._context(ctx))  # [s/t, b, h] (SP) or [s, b, h]

    def _decode(self, q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, kv_cache: LayerKV) -> torch.Tensor:
        """New tokens' queries over every cached key and value, then the output projection."""
        return self.out(self._context(cached_attention(q, k_all, v_all, self.max_scores, kv_cache.pad, self.window)))

    def _context(self, ctx: torch.Tensor) -> torch.Tensor:
        """``[s, b, n/t, d]`` → ``[s, b, n/t·d]`` (MLA: the values' own dims, the zero padding cut)."""
        if self.mla is not None:
            ctx = ctx[..., :self.mla.v_dim]
        return ctx.reshape(ctx.shape[0], ctx.shape[1], -1)


class MLP(nn.Module):
    """neox: ``fc2(gelu(fc1(x)))`` (erf GeLU); llama: ``down(silu(gate(x)) * up(x))``. Column-parallel
    fc1/gate/up (``ffn/t`` per rank), row-parallel fc2/down; ``ffn_hidden_size`` (default the config's): a MoE
    layer's shared experts."""

    def __init__(self, cfg: ModelConfig, parallel: ParallelContext | None = None, ffn_hidden_size: int | None = None) -> None:
        super().__init__()
        parallel = parallel or ParallelContext()
        spec = arch_spec(cfg.arch)
        self.swiglu = spec.swiglu
        self.regions = EAGER
        h, f = cfg.hidden_size, ffn_hidden_size or cfg.ffn_hidden_size
        group, sp = parallel.tp_group, parallel.sequence_parallel
        col = {"group": group, "sequence_parallel": sp, "recompute_allgather": parallel.recompute_allgather}
        row = {"group": group, "sequence_parallel": sp, "input_is_parallel": True}
        if self.swiglu:
            self.gate = ColumnParallelLinear(h, f, bias=spec.bias, **col)
            self.up = ColumnParallelLinear(h, f, bias=spec.bias, **col)
            self.down = RowParallelLinear(f, h, bias=spec.bias, **row)
        else:
            self.fc1 = ColumnParallelLinear(h, f, bias=spec.bias, **col)
            self.fc2 = RowParallelLinear(f, h, bias=spec.bias, **row)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[s/t, b, h]`` (SP) or ``[s, b, h]`` → same shape."""
        if self.swiglu and not self.training and not torch.is_grad_enabled() and not self.gate.sequence_parallel:
            # inference: concatenating the weights would copy 2·ffn/t·h values per call, more than a decode step's
            # few tokens read (no input all-gather or gradient all-reduce to share here); the same values
            return self.down(F.silu(self.gate(x)) * self.up(x))
        if self.swiglu:
            # gate and up share one input all-gather (SP) / all-reduce of the input grad (TP):
            # one column-parallel matmul on their concatenated local weights.
            weight = torch.cat([self.gate.weight, self.up.weight])  # [2·ffn/t, h]
            bias = torch.cat([self.gate.bias, self.up.bias]) if self.gate.bias is not None else None
            return self.down(self.regions.swiglu(self.gate(x, weight=weight, bias=bias)))  # [s, b, 2·ffn/t] inside
        return self.fc2(F.gelu(self.fc1(x)))  # [s, b, ffn/t] inside


class TransformerLayer(nn.Module):
    """Transformer layer with parallel (neox) or sequential (llama) residual, its norms before the sublayers or on
    their outputs (``model.norm_placement``, OLMo-2: ``x + norm(attn(x))``); its ``mlp`` is the dense ``MLP``, or
    ``moe.MoE`` in the layers ``moe.is_moe_layer`` picks (with its shared experts as an ``MLP``)."""

    def __init__(self, cfg: ModelConfig, layer_number: int, parallel: ParallelContext | None = None) -> None:
        super().__init__()
        parallel = parallel or ParallelContext()
        self.parallel = parallel
        self.layer_number = layer_number
        self.parallel_residual = arch_spec(cfg.arch).parallel_residual
        self.post_norm = cfg.norm_placement == "post_sublayer"
        self.hidden_dropout = cfg.hidden_dropout
        self.regions = EAGER
        self.attn_norm = make_norm(cfg, parallel)
        self.attention = SelfAttention(cfg, parallel)
        self.mlp_norm = make_norm(cfg, parallel)
        self.mlp: nn.Module
        if is_moe_layer(cfg, layer_number):
            shared = MLP(cfg, parallel, cfg.moe_shared_experts * expert_ffn(cfg)) if cfg.moe_shared_experts else None
            self.mlp = MoE(cfg, arch_spec(cfg.arch), EAGER, shared, parallel)
        else:
            self.mlp = MLP(cfg, parallel)

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        return hidden_dropout(x, self.hidden_dropout, self.training, self.parallel)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMeta | None = None, kv_cache: LayerKV | None = None) -> torch.Tensor:
        """x ``[s/t, b, h]`` (SP) or ``[s, b, h]`` → same shape (``meta``, ``kv_cache``: see ``SelfAttention``)."""
        fn, n1, n2 = self.regions, norm_args(self.attn_norm), norm_args(self.mlp_norm)
        if self.post_norm:  # attn_norm / mlp_norm normalise the sublayers' outputs
            attn = self._dropout(fn.norm(self.attention(x, cos, sin, meta, kv_cache), *n1))
            if self.parallel_residual:
                return fn.add3(x, attn, self._dropout(fn.norm(self.mlp(x), *n2)))
            x = x + attn
            return x + self._dropout(fn.norm(self.mlp(x), *n2))
        attn = self._dropout(self.attention(fn.norm(x, *n1), cos, sin, meta, kv_cache))
        if self.parallel_residual:
            mlp = self._dropout(self.mlp(fn.norm(x, *n2)))
            return fn.add3(x, attn, mlp)
        x, h = fn.add_norm(x, attn, *n2)
        return x + self._dropout(self.mlp(h))

    def set_regions(self, regions: Regions) -> None:
        """Run this layer's pointwise regions (``EAGER`` or ``compiled()``) with ``regions``."""
        self.regions = self.attention.regions = self.mlp.regions = regions


def scaled_init_std(cfg: ModelConfig) -> float:
    """Init std of the output projections: ``init_std / sqrt(2 · num_layers)`` when ``scaled_init``."""
    return cfg.init_std / math.sqrt(2.0 * cfg.num_layers) if cfg.scaled_init else cfg.init_std
