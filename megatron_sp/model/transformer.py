"""The transformer layer of the GPT: norms, rotary embeddings, attention and MLP.

Activations inside the transformer are ``[s, b, h]`` (sequence first) so that sequence and
context parallelism split dim 0. Two architectures are selected by ``ModelConfig.arch``:

* ``neox`` (GPT-NeoX / Pythia): LayerNorm with bias, rotary on the first ``rotary_pct`` of each
  head's dims, parallel residual ``x + attn(ln1(x)) + mlp(ln2(x))``, exact (erf) GeLU MLP,
  biases on every linear.
* ``llama``: RMSNorm (weight only), rotary on the full head, sequential residual, SwiGLU MLP,
  grouped-query attention with ``num_kv_heads`` key/value heads, no biases.

Parameter names inside one layer (the model prefixes them with ``layers.<global index>.``);
HF export (``megatron_sp.model.hf_names``) maps them, tensor parallelism slices them:

=============================  =======================  ============================  ============
name                           neox                     llama                         TP split
=============================  =======================  ============================  ============
``attn_norm.weight`` (.bias)   LayerNorm                RMSNorm (no bias)             replicated
``attention.qkv.weight`` (.b)  fused QKV, bias          fused QKV, no bias            column
``attention.out.weight`` (.b)  attention output         attention output              row
``mlp_norm.weight`` (.bias)    LayerNorm                RMSNorm (no bias)             replicated
``mlp.fc1.weight`` (.bias)     h -> ffn                 --                            column
``mlp.fc2.weight`` (.bias)     ffn -> h                 --                            row
``mlp.gate.weight``            --                       h -> ffn (SiLU branch)        column
``mlp.up.weight``              --                       h -> ffn (linear branch)      column
``mlp.down.weight``            --                       ffn -> h                      row
=============================  =======================  ============================  ============

The fused QKV output dim is laid out ``[num_kv_heads, num_heads // num_kv_heads + 2, head_dim]``:
for each key/value group, its query heads, then its key head, then its value head. With
``num_kv_heads == num_heads`` (neox) this is exactly GPT-NeoX's ``[heads, 3, head_dim]``, so HF
conversion is a reshape, and a contiguous slice of the output rows is a whole number of groups
(tensor parallelism needs ``num_kv_heads % tp == 0``). The forward pass infers the number of
local groups from the projection's output width, so a column-parallel ``qkv`` just works.

No kernels live here: the attention kernel is ``attention.kernels.dot_product_attention``, held in
``SelfAttention.attention_fn`` (context parallelism and packed documents call
``context_parallel_attention`` instead). ``SelfAttention.register_kernel_hook`` wraps one layer's
kernel call, e.g. to see q, k, v and the output (the activation-memory benchmark); nothing needs
to replace the attribute. Decoding with a KV cache (``model.inference``) passes each layer its
cache (``LayerKV``) and attends with ``attention.kernels.cached_attention``.
"""
from __future__ import annotations

import contextlib
import functools
import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.hooks import RemovableHandle

from megatron_sp.config.schema import ModelConfig
from megatron_sp.mpu import comm
from megatron_sp.model.attention.context_parallel import AttentionMeta, context_parallel_attention
from megatron_sp.model.attention.kernels import cached_attention, dot_product_attention
from megatron_sp.mpu.layers import ColumnParallelLinear, RowParallelLinear, linear, set_tp_attributes
from megatron_sp.mpu.mappings import copy_to_tp, gather_from_sp
from megatron_sp.mpu.random import TP_DIFFERENT, RNGTracker, checkpoint, get_tracker

ARCHS = ("neox", "llama")


@dataclass(frozen=True)
class ArchSpec:
    """The architectural choices that differ between ``neox`` and ``llama``."""

    layernorm: bool
    """LayerNorm with bias (True) or RMSNorm, weight only (False)."""
    bias: bool
    """Biases on every linear layer (except the output layer, which never has one)."""
    parallel_residual: bool
    """``x + attn(n1(x)) + mlp(n2(x))`` (True) or ``x += attn(n1(x)); x += mlp(n2(x))``."""
    swiglu: bool
    """SwiGLU MLP (gate, up, down) instead of ``fc2(gelu(fc1(x)))``."""


def arch_spec(arch: str) -> ArchSpec:
    """The ``ArchSpec`` of ``arch`` ('neox' or 'llama')."""
    if arch == "neox":
        return ArchSpec(layernorm=True, bias=True, parallel_residual=True, swiglu=False)
    if arch == "llama":
        return ArchSpec(layernorm=False, bias=False, parallel_residual=False, swiglu=True)
    raise ValueError(f"unknown model.arch {arch!r}; expected one of {ARCHS}")


@dataclass(frozen=True)
class TensorParallel:
    """How the model is split over its tensor-parallel group; the default is the plain model.

    ``group`` is the TP process group (default ``comm.LOCAL``: this process alone). Under
    ``sequence_parallel`` the activations between TP regions are ``[s/t, b, h]``. ``tracker``
    holds the "tp-different" RNG stream used for dropout on TP-sharded tensors (see
    ``megatron_sp.mpu.random``); ``recompute`` is ``none | selective | full``.
    """

    group: Any = comm.LOCAL
    size: int = 1
    rank: int = 0
    sequence_parallel: bool = False
    recompute_allgather: bool = True
    recompute: str = "none"
    tracker: RNGTracker = field(default_factory=get_tracker)
    cp_group: Any = comm.LOCAL
    """The context-parallel group: each of its ranks holds ``s/cp`` of every sample's tokens."""
    cp_algo: str = "ring"
    """``parallel.cp_algo``: ring | zigzag | llama3 | ulysses (see ``attention.context_parallel``)."""
    cp_heads_k_stride: int = 1
    """``parallel.cp_heads_k_stride``: kv heads per llama3 all-gather."""
    cp_ulysses_group: Any = None
    """USP: the Ulysses sub-group of the cp group, and the ring sub-group across them."""
    cp_ring_group: Any = None

    def sharded_dropout(self) -> contextlib.AbstractContextManager:
        """The RNG context for dropout on a tensor that is split over TP (different per TP rank)."""
        return self.tracker.fork(TP_DIFFERENT) if TP_DIFFERENT in self.tracker else contextlib.nullcontext()

    def hidden_dropout(self, x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
        """Dropout on a hidden state: ``[s/t, b, h]`` shards under SP use the TP-different stream."""
        if p <= 0 or not training:
            return x
        if self.sequence_parallel and self.size > 1:
            with self.sharded_dropout():
                return F.dropout(x, p, True)
        return F.dropout(x, p, True)


def check_model_config(cfg: ModelConfig) -> None:
    """Raise ValueError unless ``cfg`` is finalized and its shapes are consistent."""
    arch_spec(cfg.arch)
    derived = ("num_kv_heads", "ffn_hidden_size", "rotary_pct", "padded_vocab_size")
    missing = [name for name in derived if getattr(cfg, name) is None]
    if missing:
        raise ValueError(f"ModelConfig is not finalized, {', '.join(missing)} unset: run the config loader's "
                         "finalize() first")
    if cfg.hidden_size % cfg.num_heads:
        raise ValueError(f"hidden_size {cfg.hidden_size} is not divisible by num_heads {cfg.num_heads}")
    if cfg.num_heads % cfg.num_kv_heads:
        raise ValueError(f"num_heads {cfg.num_heads} is not divisible by num_kv_heads {cfg.num_kv_heads}")
    if rotary_dim(cfg) % 2:
        raise ValueError(f"rotary dims per head ({rotary_dim(cfg)}) must be even")


def head_dim(cfg: ModelConfig) -> int:
    """Dims per attention head."""
    return cfg.hidden_size // cfg.num_heads


def rotary_dim(cfg: ModelConfig) -> int:
    """Leading dims of each head that receive rotary embeddings (GPT-NeoX's ``int(d * rotary_pct)``)."""
    return int(head_dim(cfg) * cfg.rotary_pct)


def make_norm(cfg: ModelConfig, tp: TensorParallel | None = None) -> nn.Module:
    """LayerNorm (neox) or RMSNorm (llama) over the hidden dim, eps ``norm_eps``.

    Under sequence parallelism a norm sees s/t of the tokens on each TP rank, so its parameters
    are tagged ``sequence_parallel`` (their grads are summed over TP after backward).
    """
    norm: nn.Module
    if arch_spec(cfg.arch).layernorm:
        norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
    else:
        norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
    sp = tp is not None and tp.sequence_parallel and tp.size > 1
    for param in norm.parameters():
        set_tp_attributes(param, False, -1, sequence_parallel=sp)
    return norm


class RotaryEmbedding(nn.Module):
    """cos/sin tables of the rotary angles ``position · base^(-2i/rotary_dim)``, i < rotary_dim/2.

    The rotate-half convention (GPT-NeoX, HF Llama) pairs dim ``i`` with dim ``i + rotary_dim/2``
    and uses the same angle for both; the tables are ``cat(cos, cos)`` and the signed
    ``cat(-sin, sin)`` that ``apply_rotary`` expects. Angles are computed in fp32 (fp64 for an fp64 model),
    as HF does, then cast to the compute dtype. The tables for the default positions
    ``arange(s)`` are cached per (length, device, dtype); explicit ``position_ids`` are computed
    once per forward and shared by all layers.
    """

    def __init__(self, rotary_dim: int, base: float) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        self.base = base
        self._cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def inv_freq(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """``base^(-2i/rotary_dim)`` for i < rotary_dim/2. # [rotary_dim/2]"""
        exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.int64, device=device).to(dtype) / self.rotary_dim
        return 1.0 / (self.base ** exponents)

    def forward(self, position_ids: torch.Tensor | None, seq_len: int, device: torch.device,
                angle_dtype: torch.dtype, out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin), each ``[s, b, rotary_dim]`` (``[s, 1, rotary_dim]`` for default positions).

        ``position_ids`` is ``[b, s]`` or None for ``arange(seq_len)``.
        """
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
        return torch.cat([cos, cos], dim=-1).to(out_dtype), torch.cat([-sin, sin], dim=-1).to(out_dtype)  # [s, b, rd]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding on the first ``rd = cos.shape[-1]`` dims of ``x``; the rest pass.

    ``x [..., d]``; ``cos = cat(c, c)`` and ``sin = cat(-s, s)`` broadcast to ``[..., rd]`` (see
    ``RotaryEmbedding``). With ``x_rot = cat(x1, x2)``: ``x_rot · cos + cat(x2, x1) · sin``
    ``= cat(x1·c − x2·s, x2·c + x1·s)``, HF's ``x_rot·cos + rotate_half(x_rot)·sin``. The swapped halves
    come from one ``flip`` of a ``[..., 2, rd/2]`` view, so no concatenation is needed for full rotary.
    """
    rd = cos.shape[-1]
    d = x.shape[-1]
    x_rot, x_pass = (x, None) if rd == d else x.split([rd, d - rd], dim=-1)
    swapped = x_rot.unflatten(-1, (2, rd // 2)).flip(-2).flatten(-2)  # cat(x2, x1)
    rotated = x_rot * cos + swapped * sin
    return rotated if x_pass is None else torch.cat([rotated, x_pass], dim=-1)


class ReplicatedGroupQKV(nn.Module):
    """The fused QKV projection when tp > num_kv_heads: each rank computes one kv group's share.

    The full weight ``[g·(r+2)·d, h]`` is replicated on every TP rank (tagged
    ``sequence_parallel``: its grad is summed over TP, where each rank contributes only the rows
    it used); rank ``j`` uses group ``j // (t/g)``: its ``r·g/t`` query heads numbered
    ``j % (t/g)`` within the group, plus the group's key and value. Trade-off: the QKV weight and
    its optimizer state are not sharded (t× their memory) in exchange for keeping the parameter
    identical to the unsharded model's, so checkpoints stay layout-free.
    """

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, bias: bool) -> None:
        super().__init__()
        g, n, d = cfg.num_kv_heads, cfg.num_heads, head_dim(cfg)
        self.tp = tp
        self.groups, self.q_per_kv, self.head_dim = g, n // g, d
        self.ranks_per_group = tp.size // g
        self.group_index, self.sub = divmod(tp.rank, self.ranks_per_group)
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
        x_full = gather_from_sp(x, self.tp.group) if self.tp.sequence_parallel else copy_to_tp(x, self.tp.group)
        bias = self._rows(self.bias) if self.bias is not None else None
        return linear(x_full, self._rows(self.weight), bias)  # weight grad deferrable (zero-bubble W)


class LayerKV(Protocol):
    """What a layer needs of its KV cache (``model.inference.LayerKVCache``; the model does not import it)."""

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new ``k``/``v`` ``[s, b, g, d]``; return cached + new ``[past + s, b, g, d]``."""
        ...


KernelHook = Callable[..., torch.Tensor]
"""``hook(kernel, q, k, v, dropout_p) -> output``: see ``SelfAttention.register_kernel_hook``."""


class SelfAttention(nn.Module):
    """Fused QKV projection (column-parallel over kv groups), rotary, causal attention, row-parallel output.

    Each TP rank holds ``n/t`` query heads: with ``num_kv_heads % t == 0`` a contiguous slice of
    the kv groups; with ``t % num_kv_heads == 0`` part of one group whose key/value it shares
    (``ReplicatedGroupQKV``).
    """

    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        tp = tp or TensorParallel()
        self.tp = tp
        bias = arch_spec(cfg.arch).bias
        g, n, d = cfg.num_kv_heads, cfg.num_heads, head_dim(cfg)
        self.head_dim = d
        self.qkv: nn.Module
        if g % tp.size == 0:
            self.q_per_kv = n // g
            self.qkv = ColumnParallelLinear(cfg.hidden_size, g * (self.q_per_kv + 2) * d, bias=bias, group=tp.group,
                                            sequence_parallel=tp.sequence_parallel,
                                            recompute_allgather=tp.recompute_allgather)
        else:
            self.qkv = ReplicatedGroupQKV(cfg, tp, bias)
            self.q_per_kv = self.qkv.local_q
        self.out = RowParallelLinear(n * d, cfg.hidden_size, bias=bias, group=tp.group,
                                     sequence_parallel=tp.sequence_parallel, input_is_parallel=True)
        self.dropout_p = cfg.attention_dropout
        self.attention_fn: Callable[..., torch.Tensor] = dot_product_attention
        self._kernel_hooks: OrderedDict[int, KernelHook] = OrderedDict()  # weak-referenceable, for RemovableHandle

    def register_kernel_hook(self, hook: KernelHook) -> RemovableHandle:
        """Wrap this layer's ``attention_fn`` calls: ``hook(kernel, q, k, v, dropout_p)`` runs in their place
        and returns the output (normally ``kernel(q, k, v, dropout_p)``); hooks registered later wrap
        earlier ones. Not called on the context-parallel / packed-document path. ``handle.remove()``
        unregisters it."""
        handle = RemovableHandle(self._kernel_hooks)
        self._kernel_hooks[handle.id] = hook
        return handle

    def _kernel(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: float) -> torch.Tensor:
        call = self.attention_fn
        for hook in self._kernel_hooks.values():
            call = functools.partial(hook, call)
        return call(q, k, v, p)

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMeta | None = None) -> torch.Tensor:
        """The attention core on local heads; its dropout draws from the TP-different stream.

        With ``meta`` (context parallelism, or packed documents) the masks come from the tokens'
        global indices and document ids (``attention.context_parallel``); attention dropout is
        not available there (the config refuses it).
        """
        p = self.dropout_p if self.training else 0.0
        if meta is not None:
            if p > 0:
                raise ValueError("attention dropout with context parallelism or packed documents is not available: "
                                 "set model.attention_dropout=0")
            return context_parallel_attention(q, k, v, meta)
        if p > 0:
            with self.tp.sharded_dropout():
                return self._kernel(q, k, v, p)
        return self._kernel(q, k, v, 0.0)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMeta | None = None, kv_cache: LayerKV | None = None) -> torch.Tensor:
        """x ``[s/t, b, h]`` (SP) or ``[s, b, h]``, cos/sin ``[s, b|1, rd/2]`` → same shape as x.

        Under context parallelism ``s`` is this rank's ``s/cp`` tokens and ``meta`` says which.
        With ``kv_cache`` (inference, tp 1) the ``s`` tokens follow the cached ones: their keys and
        values are appended and the queries attend over all of them (``cached_attention``)."""
        r, d = self.q_per_kv, self.head_dim
        qkv = self.qkv(x)  # [s, b, local (r+2)·d·groups]
        s, b = qkv.shape[0], qkv.shape[1]
        qkv = qkv.view(s, b, -1, r + 2, d)  # [s, b, g_local, r+2, d]
        cos = cos.to(qkv.dtype)[:, :, None, None, :]  # [s, b|1, 1, 1, rd/2]
        sin = sin.to(qkv.dtype)[:, :, None, None, :]
        qk, v = qkv.split([r + 1, 1], dim=3)  # [s, b, g, r+1, d], [s, b, g, 1, d]
        qk = apply_rotary(qk, cos, sin)  # queries and keys rotated together
        q, k = qk.split([r, 1], dim=3)
        q = q.reshape(s, b, -1, d)  # [s, b, n/t, d]
        # v is a view into the projection output: copy it so autograd does not keep all of qkv alive.
        k, v = k.squeeze(3), v.squeeze(3).contiguous()  # [s, b, g_local, d]
        if kv_cache is not None:
            k_all, v_all = kv_cache.append(k, v)  # [past + s, b, g, d]
            return self.out(cached_attention(q, k_all, v_all).reshape(s, b, -1))
        if self.tp.recompute == "selective" and self.training and torch.is_grad_enabled():
            ctx = checkpoint(self.core, q, k, v, meta, tracker=self.tp.tracker)  # [s, b, n/t, d]
        else:
            ctx = self.core(q, k, v, meta)  # [s, b, n/t, d]
        return self.out(ctx.reshape(s, b, -1))  # [s/t, b, h] (SP) or [s, b, h]


class MLP(nn.Module):
    """neox: ``fc2(gelu(fc1(x)))`` with exact (erf) GeLU; llama: ``down(silu(gate(x)) * up(x))``.

    fc1/gate/up are column-parallel (``ffn/t`` per rank), fc2/down row-parallel.
    """

    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        tp = tp or TensorParallel()
        spec = arch_spec(cfg.arch)
        self.swiglu = spec.swiglu
        h, f = cfg.hidden_size, cfg.ffn_hidden_size
        col = {"group": tp.group, "sequence_parallel": tp.sequence_parallel, "recompute_allgather": tp.recompute_allgather}
        row = {"group": tp.group, "sequence_parallel": tp.sequence_parallel, "input_is_parallel": True}
        if self.swiglu:
            self.gate = ColumnParallelLinear(h, f, bias=spec.bias, **col)
            self.up = ColumnParallelLinear(h, f, bias=spec.bias, **col)
            self.down = RowParallelLinear(f, h, bias=spec.bias, **row)
        else:
            self.fc1 = ColumnParallelLinear(h, f, bias=spec.bias, **col)
            self.fc2 = RowParallelLinear(f, h, bias=spec.bias, **row)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[s/t, b, h]`` (SP) or ``[s, b, h]`` → same shape."""
        if self.swiglu:
            # gate and up share one input all-gather (SP) / all-reduce of the input grad (TP):
            # one column-parallel matmul on their concatenated local weights.
            weight = torch.cat([self.gate.weight, self.up.weight])  # [2·ffn/t, h]
            bias = torch.cat([self.gate.bias, self.up.bias]) if self.gate.bias is not None else None
            gate, up = self.gate(x, weight=weight, bias=bias).chunk(2, dim=-1)  # [s, b, ffn/t] each
            return self.down(F.silu(gate) * up)
        return self.fc2(F.gelu(self.fc1(x)))  # [s, b, ffn/t] inside


class TransformerLayer(nn.Module):
    """Pre-norm transformer layer with parallel (neox) or sequential (llama) residual."""

    def __init__(self, cfg: ModelConfig, layer_number: int, tp: TensorParallel | None = None) -> None:
        super().__init__()
        tp = tp or TensorParallel()
        self.tp = tp
        self.layer_number = layer_number
        self.parallel_residual = arch_spec(cfg.arch).parallel_residual
        self.hidden_dropout = cfg.hidden_dropout
        self.attn_norm = make_norm(cfg, tp)
        self.attention = SelfAttention(cfg, tp)
        self.mlp_norm = make_norm(cfg, tp)
        self.mlp = MLP(cfg, tp)

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.hidden_dropout(x, self.hidden_dropout, self.training)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMeta | None = None, kv_cache: LayerKV | None = None) -> torch.Tensor:
        """x ``[s/t, b, h]`` (SP) or ``[s, b, h]`` → same shape (``meta``, ``kv_cache``: see ``SelfAttention.forward``)."""
        if self.parallel_residual:
            attn = self._dropout(self.attention(self.attn_norm(x), cos, sin, meta, kv_cache))
            mlp = self._dropout(self.mlp(self.mlp_norm(x)))
            return x + attn + mlp
        x = x + self._dropout(self.attention(self.attn_norm(x), cos, sin, meta, kv_cache))
        return x + self._dropout(self.mlp(self.mlp_norm(x)))


def scaled_init_std(cfg: ModelConfig) -> float:
    """Init std of the output projections: ``init_std / sqrt(2 · num_layers)`` when ``scaled_init``."""
    return cfg.init_std / math.sqrt(2.0 * cfg.num_layers) if cfg.scaled_init else cfg.init_std
