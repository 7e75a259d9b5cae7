"""Multi-head latent attention (DeepSeek-V2/V3, ``model.kv_lora_rank`` > 0) under TP, SP, CP and PP.

Per token: keys and values come from one compressed latent ``c = RMSNorm(x W_dkv)`` of ``kv_lora_rank`` values
(``kv_up``: per head ``qk_nope_head_dim`` key dims and ``v_head_dim`` value dims) plus one rotary key of
``qk_rope_head_dim`` dims shared by every head; queries from a full projection (``q_lora_rank`` 0) or from their own
latent (``q_down``, ``q_latent_norm``, ``q_up``). A head's query and key are ``[nope | rope]`` (transformers' order), cut
from the projections by ``split``: its backward is one concatenation, a slice's fills a zeroed full-width gradient (the
sublayer's forward + backward 6 % (fp32) and 15 % (bf16) slower on CPU, tools/bench/mla.py).

Layout: the down projections and latent norms are replicated and act on this rank's tokens, so under SP the
all-gather before the head-split up projections moves the latent (``kv_lora_rank`` + ``qk_rope_head_dim`` values a
token, not ``hidden_size``); their gradients are summed over TP under SP (tagged ``sequence_parallel``), as a
LayerNorm's. The shared rotary key enters the TP region like the latent (gathered under SP, ``copy_to_tp`` without),
so its gradient sums every rank's heads. The attention kernels take one head dim: values are padded with zeros to the
query/key dim (exact: the padded output columns are zero and cut off), the scale stays ``1/sqrt(nope + rope)``.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megatron_sp.config.schema import ModelConfig
from megatron_sp.model.rope import apply_rotary
from megatron_sp.mpu.layers import ColumnParallelLinear, set_tp_attributes
from megatron_sp.mpu.mappings import copy_to_tp, gather_from_sp
from megatron_sp.mpu.parallel_state import ParallelContext


def _replicated(in_features: int, out_features: int, sp: bool) -> nn.Linear:
    """A down projection on this rank's tokens: whole on every TP rank, its grad summed over TP under SP."""
    linear = nn.Linear(in_features, out_features, bias=False)
    set_tp_attributes(linear.weight, False, -1, sequence_parallel=sp)
    return linear


def _latent_norm(width: int, cfg: ModelConfig, sp: bool) -> nn.RMSNorm:
    norm = nn.RMSNorm(width, eps=cfg.norm_eps)
    set_tp_attributes(norm.weight, False, -1, sequence_parallel=sp)
    return norm


def yarn_mscale(factor: float, mscale: float) -> float:
    """DeepSeek's yarn magnitude scale ``0.1·mscale·ln(factor) + 1``, 1 for ``factor <= 1`` (transformers'
    ``yarn_get_mscale``); ``mscale`` 0 (``model.rope_mscale_all_dim`` unset): 1."""
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def mla_parameters(cfg: ModelConfig) -> int:
    """Parameters of one MLA block (projections and latent norms; the layer norm before it is not counted)."""
    h, n, qk = cfg.hidden_size, cfg.num_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    q = h * cfg.q_lora_rank + cfg.q_lora_rank + cfg.q_lora_rank * n * qk if cfg.q_lora_rank else h * n * qk
    kv = h * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank
    return q + kv + cfg.kv_lora_rank * n * (cfg.qk_nope_head_dim + cfg.v_head_dim) + n * cfg.v_head_dim * h


class LatentAttention(nn.Module):
    """MLA's projections in place of ``SelfAttention.qkv``: the layer keeps its ``core`` (kernels, CP, recompute,
    hooks) and output projection (``num_heads · v_head_dim`` → hidden, row-parallel); its KV cache holds each token's
    latent and shared rotary key (``kv_lora_rank + qk_rope_head_dim`` values a layer), expanded every step."""

    def __init__(self, cfg: ModelConfig, parallel: ParallelContext) -> None:
        super().__init__()
        sp, group, t = parallel.sequence_parallel, parallel.tp_group, parallel.tp_size
        self.parallel = parallel
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora = cfg.kv_lora_rank
        # DeepSeek's yarn: the softmax scale × mscale², on the queries (the kernels take 1/sqrt(d))
        self.q_scale = yarn_mscale(cfg.rope_scaling_factor, cfg.rope_mscale_all_dim) ** 2
        self.heads = cfg.num_heads // t
        up = {"bias": False, "group": group, "sequence_parallel": sp,
              "recompute_allgather": parallel.recompute_allgather}
        qk = self.nope + self.rope
        if cfg.q_lora_rank:
            self.q_down = _replicated(cfg.hidden_size, cfg.q_lora_rank, sp)
            self.q_latent_norm = _latent_norm(cfg.q_lora_rank, cfg, sp)
            self.q_up = ColumnParallelLinear(cfg.q_lora_rank, cfg.num_heads * qk, **up)
        else:
            self.q_proj = ColumnParallelLinear(cfg.hidden_size, cfg.num_heads * qk, **up)
        self.kv_down = _replicated(cfg.hidden_size, cfg.kv_lora_rank + self.rope, sp)
        self.kv_latent_norm = _latent_norm(cfg.kv_lora_rank, cfg, sp)
        self.kv_up = ColumnParallelLinear(cfg.kv_lora_rank, cfg.num_heads * (self.nope + self.v_dim), **up)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x ``[s/t, b, h]`` (SP) or ``[s, b, h]`` → q ``[s, b, n/t, nope + rope]`` (rotary on the rope dims),
        the normed latent ``[s/t | s, b, kv_lora_rank]`` and the rotated shared key ``[s, b, rope]``: what a KV cache
        keeps of each token (``expand`` makes the heads' keys and values of them)."""
        group, n, qk = self.parallel.tp_group, self.heads, self.nope + self.rope
        q = self.q_up(self.q_latent_norm(self.q_down(x))) if hasattr(self, "q_up") else self.q_proj(x)
        latent, k_rope = self.kv_down(x).split([self.kv_lora, self.rope], dim=-1)
        sp = self.parallel.sequence_parallel and self.parallel.tp_size > 1
        k_rope = gather_from_sp(k_rope, group) if sp else copy_to_tp(k_rope, group)  # [s, b, rope]
        s, b = q.shape[0], q.shape[1]
        cos, sin = cos.to(q.dtype)[:, :, None, :], sin.to(q.dtype)[:, :, None, :]  # [s, b|1, 1, rope]
        q_nope, q_rope = q.view(s, b, n, qk).split([self.nope, self.rope], dim=-1)
        q = torch.cat([q_nope, apply_rotary(q_rope, cos, sin)], dim=-1)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        return q, self.kv_latent_norm(latent), apply_rotary(k_rope[:, :, None, :], cos, sin)[:, :, 0]

    def expand(self, latent: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The heads' keys ``[s, b, n/t, nope + rope]`` and values (zero-padded from ``v_head_dim`` to the same
        width) of the normed latents and rotated shared keys of ``forward`` (or of a cache: every token so far)."""
        kv = self.kv_up(latent)  # [s, b, n/t·(nope + v)]; under SP the latent is gathered here
        s, b, n, qk = kv.shape[0], kv.shape[1], self.heads, self.nope + self.rope
        k_nope, v = kv.view(s, b, n, self.nope + self.v_dim).split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rope[:, :, None, :].expand(s, b, n, self.rope)], dim=-1)
        return k, F.pad(v, (0, qk - self.v_dim)) if self.v_dim < qk else v
