"""Mixture of experts: the MoE MLP of a transformer layer (router → dispatcher → experts → combine).

A MoE layer replaces the dense MLP of the layers ``is_moe_layer`` picks. Tokens ``[s, b, h]`` are flattened to
``T = s·b`` rows (row ``t = i·b + j`` is position i of sequence j). The router scores every expert in fp32 (fp64
for an fp64 model) whatever the autocast precision, each token takes its top-k experts; the ``Dispatcher`` is the
only code that knows the token permutation: it sorts the (token, slot) assignments by expert so the ``Experts``
see contiguous per-expert blocks (``torch._grouped_mm`` or a loop over experts), then puts the outputs back and
sums each token's k outputs weighted by its router weights. Shared experts (one MLP) add to the routed output.
The load-balancing loss and the router z-loss reach the gradient through ``AuxLossGrad`` (the objective, the
scale and why it stays exact: docs/moe.md). Under expert parallelism (``parallel.ep``) each rank holds E/ep experts
and the dispatcher all-to-alls the rows to them and back.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from fractions import Fraction
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from megatron_sp.config.registry import check, choice
from megatron_sp.config.schema import ModelConfig
from megatron_sp.errors import ConfigError
from megatron_sp.mpu import comm
from megatron_sp.mpu.layers import set_tp_attributes
from megatron_sp.mpu.mappings import all_to_all_rows, copy_to_tp, reduce_from_tp
from megatron_sp.mpu.parallel_state import ParallelContext

if TYPE_CHECKING:
    from megatron_sp.config.schema import Config
    from megatron_sp.model.transformer import ArchSpec, Regions
    from megatron_sp.mpu import ParallelState

ROUTER_SCORES = ("softmax", "sigmoid")
EXPERT_BACKENDS = ("auto", "loop", "grouped")


def is_moe_layer(cfg: ModelConfig, index: int) -> bool:
    """Whether global layer ``index`` has a MoE MLP: from ``moe_first_dense_layers`` on, every ``moe_layer_freq``-th."""
    first = cfg.moe_first_dense_layers
    return cfg.num_experts > 0 and index >= first and (index - first) % cfg.moe_layer_freq == 0


def expert_ffn(cfg: ModelConfig) -> int:
    """The hidden width of one expert (``moe_ffn_hidden_size``, else ``ffn_hidden_size``)."""
    width = cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size
    if width is None:
        raise ValueError("ModelConfig is not finalized: ffn_hidden_size unset")
    return width


@check
def check_moe_config(cfg: Config) -> None:
    """The ``model.num_experts`` / ``model.moe_*`` keys; fills ``moe_ffn_hidden_size`` of a MoE model."""
    m, p = cfg.model, cfg.parallel
    if m.num_experts < 0:
        raise ConfigError(f"model.num_experts: {m.num_experts} must be >= 0 (0: a dense model)")
    if p.expert_tp not in (1, p.tp):
        raise ConfigError(f"parallel.expert_tp: {p.expert_tp} must be 1 (experts whole on each rank) or parallel.tp "
                          f"{p.tp} (each expert's matrices split over the TP ranks)")
    if p.expert_tp > 1 and p.sequence_parallel:
        raise ConfigError(f"parallel.expert_tp: {p.expert_tp} with parallel.sequence_parallel is not available (under "
                          "SP the TP ranks route their own tokens and ep folds over them); set parallel.expert_tp=1")
    if p.ep < 1:
        raise ConfigError(f"parallel.ep: {p.ep} must be >= 1")
    if p.ep > 1 and m.num_experts == 0:
        raise ConfigError(f"parallel.ep: {p.ep} needs a MoE model; set model.num_experts or parallel.ep=1")
    if m.num_experts % p.ep:
        raise ConfigError(f"model.num_experts: {m.num_experts} must be divisible by parallel.ep {p.ep}")
    if p.dp is not None and (p.cp * p.dp * (p.tp if p.sequence_parallel else 1)) % p.ep:
        ranks, n = ("tp·cp·dp", p.tp * p.cp * p.dp) if p.sequence_parallel and p.tp > 1 else ("cp·dp", p.cp * p.dp)
        raise ConfigError(f"parallel.ep: {p.ep} must divide {ranks} = {n} (experts fold over the {ranks} ranks of a "
                          "stage; without sequence parallelism the MoE input is replicated over tp)")
    if m.num_experts == 0:
        changed = [f.name for f in fields(ModelConfig) if f.name.startswith("moe_") and getattr(m, f.name) != f.default]
        if changed:
            raise ConfigError(f"model.{changed[0]} is set but model.num_experts is 0 (a dense model); set "
                              "model.num_experts or drop the MoE keys")
        return
    choice("model.moe_router_score", m.moe_router_score, ROUTER_SCORES)
    if not 1 <= m.moe_top_k <= m.num_experts:
        raise ConfigError(f"model.moe_top_k: {m.moe_top_k} must be in 1..model.num_experts ({m.num_experts})")
    if m.moe_ffn_hidden_size is None:
        m.moe_ffn_hidden_size = m.ffn_hidden_size
    for key in ("moe_ffn_hidden_size", "moe_layer_freq"):
        if getattr(m, key) < 1:
            raise ConfigError(f"model.{key}: {getattr(m, key)} must be >= 1")
    for key in ("moe_shared_experts", "moe_first_dense_layers", "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_bias_update_rate"):
        if getattr(m, key) < 0:
            raise ConfigError(f"model.{key}: {getattr(m, key)} must be >= 0 (0: off)")
    if m.moe_first_dense_layers >= m.num_layers:
        raise ConfigError(f"model.moe_first_dense_layers: {m.moe_first_dense_layers} leaves no MoE layer among the "
                          f"{m.num_layers} layers; lower it or set model.num_experts=0")
    groups, per = m.moe_router_groups, m.num_experts // max(m.moe_router_groups, 1)
    if groups < 1 or m.num_experts % groups or (groups > 1 and per < 2):
        raise ConfigError(f"model.moe_router_groups: {groups} must be >= 1 and divide model.num_experts "
                          f"({m.num_experts}) into groups of at least 2 experts (1: no groups)")
    if not 1 <= m.moe_router_group_topk <= groups or m.moe_top_k > m.moe_router_group_topk * per:
        raise ConfigError(f"model.moe_router_group_topk: {m.moe_router_group_topk} must be in 1..moe_router_groups "
                          f"({groups}) with moe_router_group_topk · {per} experts per group >= moe_top_k ({m.moe_top_k})")
    if not m.moe_routed_scaling > 0:
        raise ConfigError(f"model.moe_routed_scaling: {m.moe_routed_scaling} must be > 0 (1: the weights as routed)")
    if m.moe_capacity_factor is not None and not m.moe_capacity_factor > 0:
        raise ConfigError(f"model.moe_capacity_factor: {m.moe_capacity_factor} must be > 0 (unset: dropless)")
    if m.moe_ffn_hidden_size % p.expert_tp:
        raise ConfigError(f"model.moe_ffn_hidden_size: {m.moe_ffn_hidden_size} must be divisible by parallel.expert_tp "
                          f"{p.expert_tp}")
    if m.moe_shared_experts and (m.moe_shared_experts * m.moe_ffn_hidden_size) % p.tp:
        raise ConfigError(f"model.moe_shared_experts · moe_ffn_hidden_size = {m.moe_shared_experts * m.moe_ffn_hidden_size} "
                          f"must be divisible by parallel.tp {p.tp}")
    if p.cp > 1 and m.moe_capacity_factor is not None:
        raise ConfigError("model.moe_capacity_factor with parallel.cp > 1 is not available yet (which tokens drop is "
                          "decided on the whole sequence in position order); unset it (dropless) or set parallel.cp=1")


class Router(nn.Module):
    """``logits = x · Wᵀ`` over the experts, ``weight [E, h]``, computed in fp32 (fp64 for fp64 input) outside autocast.

    ``expert_bias [E]`` (fp32 buffer, aux-loss-free balancing) is added to the scores for the top-k selection only
    (``route``) and moved after each step by ``end_step``; it is the same on every rank and saved in the checkpoint's
    meta.json (``expert_bias_state``). ``bias_in_use``: ``moe_bias_update_rate`` > 0 or a non-zero bias loaded
    (``load_expert_bias``); otherwise the bias is zero, which routes as no bias, and ``MoE`` skips it.
    ``step_stats`` sums this rank's training micro-batches since the last ``end_step``: fp64 ``[E + 4]``, the tokens
    per expert, then the aux loss, z-loss, dropped assignments, micro-batches (a micro-batch split over SP/CP ranks is
    counted by its first shard only)."""

    def __init__(self, hidden_size: int, num_experts: int, bias_in_use: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32))
        self.bias_in_use = bias_in_use
        self.step_stats: torch.Tensor | None = None

    def record(self, tokens_per_expert: torch.Tensor, aux: torch.Tensor, z: torch.Tensor, dropped: torch.Tensor,
               micro: float = 1.0) -> None:
        """Add one training micro-batch (or this rank's shard of it) to ``step_stats`` (fp64 ``[E + 4]``: integer
        counts stay exact)."""
        extra = torch.stack([aux, z, torch.as_tensor(dropped, device=aux.device), torch.full_like(aux, micro)])
        row = torch.cat([tokens_per_expert.double(), extra.double()])
        self.step_stats = row if self.step_stats is None else self.step_stats + row

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens ``[T, h]`` → logits ``[T, E]``."""
        dtype = torch.promote_types(tokens.dtype, torch.float32)
        with torch.autocast(tokens.device.type, enabled=False):
            return F.linear(tokens.to(dtype), self.weight.to(dtype))


def route(logits: torch.Tensor, top_k: int, score: str, bias: torch.Tensor | None = None, renormalize: bool | None = None,
          groups: int = 1, group_top_k: int = 1, scaling: float = 1.0
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(experts ``[T, k]``, combine weights ``[T, k]``, selection scores ``[T, k]``, balancing probabilities
    ``[T, E]``, balancing experts ``[T, k]``) of logits ``[T, E]``. softmax: scores over all experts; sigmoid: per
    expert (DeepSeek-V3). With k > 1 the selected scores are renormalised to sum to 1; top-1 keeps its score
    (Switch), so the router learns from the LM loss (``renormalize``, ``model.moe_renormalize``, says otherwise).
    The balancing probabilities are the softmax, or the sigmoid
    scores normalised over the experts. ``bias [E]`` (aux-loss-free balancing) is added for choosing the top-k only:
    the selection scores, the weights and the probabilities are the unbiased scores of the chosen experts, and the
    balancing experts (the aux loss's f) are the top-k of the unbiased scores (DeepSeek-V3, megatron-core).
    ``groups`` > 1 (group-limited routing, DeepSeek-V3): the experts form ``groups`` consecutive groups, a group's
    score is the sum of its two highest selection scores (bias included), and a token's top-k come from its
    ``group_top_k`` best groups. The weights are multiplied by ``scaling`` (routed_scaling_factor) last."""
    scores = logits.softmax(dim=-1) if score == "softmax" else logits.sigmoid()  # [T, E]
    top_scores, experts = scores.topk(top_k, dim=-1)  # [T, k]
    balance = experts
    if bias is not None or groups > 1:
        choice = scores if bias is None else scores + bias.to(scores.dtype)  # [T, E]
        if groups > 1:
            grouped = choice.view(choice.shape[0], groups, -1)  # [T, G, E/G]
            best = grouped.topk(2, dim=-1).values.sum(dim=-1).topk(group_top_k, dim=-1).indices  # [T, group_top_k]
            keep = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best, True)  # [T, G]
            choice = grouped.masked_fill(~keep[..., None], float("-inf")).view_as(choice)
        experts = choice.topk(top_k, dim=-1).indices  # [T, k]
        top_scores = scores.gather(-1, experts)
    renorm = top_k > 1 if renormalize is None else renormalize
    weights = top_scores / (top_scores.sum(dim=-1, keepdim=True) + 1e-20) if renorm else top_scores
    if scaling != 1.0:
        weights = weights * scaling
    probs = scores if score == "softmax" else scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    return experts, weights, top_scores, probs, balance


def expert_capacity(factor: float, seq_len: int, top_k: int, num_experts: int) -> int:
    """Assignments each expert takes per sequence: ``ceil(factor · s · k / E)`` computed exactly, with ``factor``
    read as the shortest decimal that prints it (1.1 is 11/10, not the binary 1.100000000000000088…), capped at
    ``s`` (an expert gets at most one assignment per token, so every token then fits)."""
    return min(seq_len, math.ceil(Fraction(repr(float(factor))) * seq_len * top_k / num_experts))


RANK_BITS = 12
"""Significant bits of the selection score that rank a capacity contest (``capacity_keep``)."""


def capacity_keep(experts: torch.Tensor, top_scores: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """Which assignments ``[s, b, k]`` stay: per sequence and expert the ``capacity`` tokens of highest selection
    score rounded to ``RANK_BITS`` significant bits, ties to the earlier position; the others are dropped (their
    output for that expert is 0). The rounding makes scores a few fp32 ulps apart (a run of repeated tokens, whose
    order is rounding noise that differs between layouts) a tie that position breaks the same on every layout."""
    s, b, k = experts.shape
    by_seq = experts.permute(1, 0, 2)  # [b, s, k]
    drop = 24 - RANK_BITS  # fp32's significant bits below the kept ones; positive floats order as their bit patterns
    key = (top_scores.detach().float().view(torch.int32) + (1 << drop - 1)) >> drop
    dense = key.new_full((b, s, num_experts), -1).scatter_(2, by_seq, key.permute(1, 0, 2))
    order = dense.argsort(dim=1, descending=True, stable=True)  # [b, s, E]: positions by decreasing score
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(s, device=order.device).view(1, s, 1).expand_as(order))
    return (rank < capacity).gather(2, by_seq).permute(1, 0, 2)  # [s, b, k]


def load_balancing_loss(probs: torch.Tensor, experts: torch.Tensor, num_experts: int,
                        counts: torch.Tensor | None = None, total: int | None = None) -> torch.Tensor:
    """Switch/GShard ``E · Σ_i f_i · P_i`` over the T tokens: ``f_i`` the fraction of the T·k assignments
    ``experts`` (``route``'s balancing experts: no routing bias, no capacity drop; no gradient) of expert i, ``P_i``
    the mean balancing probability of expert i. When this rank holds a shard of the micro-batch (SP, CP): ``counts
    [E]`` the whole micro-batch's assignments per expert and ``total`` its T; the result is then this rank's share,
    ``E · Σ_i f_i · Σ_{t here} p_ti / T``, summing to the loss over the shards (so is its gradient, each token's on
    the rank that holds it)."""
    counts = torch.bincount(experts.reshape(-1), minlength=num_experts) if counts is None else counts
    total = probs.shape[0] if total is None else total
    f = counts.to(probs.dtype) / (total * experts.shape[-1])
    return num_experts * (f * probs.sum(dim=0)).sum() / total


def router_z_loss(logits: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """ST-MoE's ``mean_t logsumexp(logits_t)²`` over ``total`` tokens (default: these; a shard's share otherwise)."""
    return logits.logsumexp(dim=-1).square().sum() / (logits.shape[0] if total is None else total)


@dataclass
class DispatchPlan:
    """What ``Dispatcher.combine`` needs to undo a ``dispatch``."""

    order: torch.Tensor  # [N]: the flat assignment index t·k + slot of each kept assignment, sorted by expert
    send: list[int]  # EP: rows sent to each ep rank (its experts' blocks) ...
    recv: list[int]  # ... and rows received from each
    perm: torch.Tensor | None = None  # EP: received rows (by source rank, then local expert) → by local expert


class Dispatcher:
    """Token permutation: (token, slot) assignments sorted by expert into contiguous blocks, and back. The one place
    that knows where a token goes. With expert parallelism (``ep_group`` of ``ep`` ranks, rank j holding experts
    ``[j·E/ep, (j+1)·E/ep)``) the sorted blocks are all-to-all'd to their experts' ranks and back (docs/moe.md)."""

    def __init__(self, num_experts: int, ep_group: Any = comm.LOCAL) -> None:
        self.num_experts, self.ep_group = num_experts, ep_group
        self.ep = comm.group_size(ep_group)

    def dispatch(self, tokens: torch.Tensor, experts: torch.Tensor,
                 keep: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, DispatchPlan]:
        """tokens ``[T, h]``, experts ``[T, k]``, keep ``[T, k]`` or None → (rows ``[M, h]`` for this rank's E/ep
        experts, sorted by expert (inside an expert: by source ep rank, then token order), rows per local expert
        ``[E/ep]``, the plan). At ep 1: the N kept assignments' rows and counts ``[E]``."""
        flat = experts.reshape(-1)
        if keep is not None:
            flat = flat.masked_fill(~keep.reshape(-1), self.num_experts)  # dropped: past the last expert
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts + 1)[:self.num_experts]
        if keep is not None:
            order = order[:int(counts.sum())]
        rows = tokens[order // experts.shape[1]]  # [N, h]
        if self.ep == 1:
            return rows, counts, DispatchPlan(order, [], [])
        by_rank = counts.view(self.ep, -1)  # [ep, E/ep]: this rank's rows for each rank's experts
        got = comm.all_to_all(by_rank, self.ep_group, scatter_dim=0, gather_dim=0)  # [ep, E/ep]: from each rank
        send, recv = by_rank.sum(1).tolist(), got.sum(1).tolist()
        received = all_to_all_rows(rows, self.ep_group, send, recv)  # [M, h]: by source rank, then local expert
        local = torch.arange(got.shape[1], device=got.device).repeat(self.ep).repeat_interleave(got.reshape(-1))
        perm = local.argsort(stable=True)
        return received[perm], got.sum(0), DispatchPlan(order, send, recv, perm)

    def combine(self, rows: torch.Tensor, plan: DispatchPlan, weights: torch.Tensor) -> torch.Tensor:
        """rows (expert outputs, as ``dispatch`` gave them) → ``[T, h]``: Σ over each token's k slots of weight ·
        output in the rows' dtype (bf16 under bf16 autocast, as transformers; the sum accumulates in fp32); a
        dropped slot adds 0."""
        if plan.perm is not None:  # back to source-rank order, then to the ranks the rows came from
            rows = all_to_all_rows(rows.new_zeros(rows.shape).index_copy(0, plan.perm, rows), self.ep_group,
                                   plan.recv, plan.send)  # [N, h]
        t, k = weights.shape
        slots = rows.new_zeros(t * k, rows.shape[1]).index_copy(0, plan.order, rows)  # [T·k, h]
        return (slots.view(t, k, -1) * weights.to(rows.dtype).unsqueeze(-1)).sum(dim=1)


class _GroupedMM(torch.autograd.Function):
    """``y[rows of e] = x[rows of e] · weight[e]ᵀ`` for contiguous row blocks ending at ``offs`` (int32, cumulative)
    with ``torch._grouped_mm``, forward and backward (its own backward rejects a stride-0 gradient)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight, offs)
        return torch._grouped_mm(x, weight.transpose(1, 2), offs=offs)

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, offs = ctx.saved_tensors
        dy = dy.contiguous()
        dx = torch._grouped_mm(dy, weight, offs=offs) if ctx.needs_input_grad[0] else None
        dw = torch._grouped_mm(dy.t(), x, offs=offs) if ctx.needs_input_grad[1] else None  # [E, out, in]
        return dx, dw, None


def grouped_mm_usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """``torch._grouped_mm`` runs here: rows of ``x [N, in]`` and ``weight [E, out, in]`` 16-byte aligned (in and out
    times the element size multiples of 16, on CPU as on CUDA); CPU fp32/bf16/fp16 (measured on torch 2.13; not
    fp64); CUDA bf16 (not run by this repository's CPU tests)."""
    if not hasattr(torch, "_grouped_mm") or x.dtype != weight.dtype:
        return False
    if any(n * x.element_size() % 16 for n in weight.shape[1:]):
        return False
    if x.device.type == "cpu":
        return x.dtype in (torch.float32, torch.bfloat16, torch.float16)
    return x.device.type == "cuda" and x.dtype == torch.bfloat16


def expert_linear(x: torch.Tensor, counts: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  backend: str) -> torch.Tensor:
    """Per-expert ``linear`` of the sorted rows ``x [N, in]`` (``counts [E]`` rows per expert) with ``weight
    [E, out, in]``, ``bias [E, out]``: one grouped GEMM, or a loop over the experts (the reference)."""
    dev = x.device.type
    if torch.is_autocast_enabled(dev):  # the grouped GEMM has no autocast rule: cast as F.linear would
        dtype = torch.get_autocast_dtype(dev)
        x, weight = x.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
    if backend == "grouped" or (backend == "auto" and grouped_mm_usable(x, weight)):
        y = _GroupedMM.apply(x, weight, counts.cumsum(0).to(torch.int32))
        if bias is not None:
            y = y + bias.repeat_interleave(counts, dim=0, output_size=x.shape[0])
        return y
    splits = counts.tolist()
    return torch.cat([F.linear(x_e, weight[e], bias[e] if bias is not None else None)
                      for e, x_e in enumerate(x.split(splits))])


class StackedLinear(nn.Module):
    """The same linear layer of E experts: ``weight [E, out, in]`` (each as ``nn.Linear``'s), ``bias [E, out]``."""

    def __init__(self, num_experts: int, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features))
        self.bias = nn.Parameter(torch.empty(num_experts, out_features)) if bias else None


class Experts(nn.Module):
    """E routed experts, each the dense MLP of its arch: llama SwiGLU ``down(silu(gate(x)) · up(x))``, neox
    ``fc2(gelu(fc1(x)))`` with biases. ``backend``: auto (grouped GEMM where ``grouped_mm_usable``, else the
    loop) | loop | grouped. Over ``tp`` ranks (expert tensor parallelism) each holds ``ffn/tp`` of every expert:
    gate/up/fc1 split on their output dim, down/fc2 on their input dim, whose partial outputs ``MoE`` sums over tp;
    the down/fc2 bias is added by TP rank 0 alone (its gradient summed over tp, ``sequence_parallel``)."""

    def __init__(self, num_experts: int, hidden_size: int, ffn: int, spec: ArchSpec, tp: int = 1, tp_rank: int = 0) -> None:
        super().__init__()
        self.swiglu = spec.swiglu
        self.backend = "auto"
        self.tp_rank, f = tp_rank, ffn // tp
        names = ("gate", "up", "down") if self.swiglu else ("fc1", "fc2")
        for name in names:
            out = name in ("down", "fc2")
            setattr(self, name, StackedLinear(num_experts, f if out else hidden_size, hidden_size if out else f, spec.bias))
            if tp > 1:
                layer = getattr(self, name)
                set_tp_attributes(layer.weight, True, 2 if out else 1)
                if layer.bias is not None:
                    set_tp_attributes(layer.bias, not out, -1 if out else 1, sequence_parallel=out)

    def _out_bias(self, bias: torch.Tensor | None) -> torch.Tensor | None:
        return bias if bias is None or self.tp_rank == 0 else bias * 0.0  # (a zero gradient still reaches it)

    def forward(self, rows: torch.Tensor, counts: torch.Tensor, regions: Regions) -> torch.Tensor:
        """rows ``[N, h]`` sorted by expert, ``counts [E]`` → ``[N, h]``."""
        if self.swiglu and not self.training and not torch.is_grad_enabled():  # inference: no concatenation per call
            gate = expert_linear(rows, counts, self.gate.weight, self.gate.bias, self.backend)
            up = expert_linear(rows, counts, self.up.weight, self.up.bias, self.backend)
            return expert_linear(F.silu(gate) * up, counts, self.down.weight, self._out_bias(self.down.bias), self.backend)
        if self.swiglu:  # gate and up in one GEMM of their concatenated weights, as the dense MLP
            weight = torch.cat([self.gate.weight, self.up.weight], dim=1)  # [E, 2·ffn, h]
            bias = torch.cat([self.gate.bias, self.up.bias], dim=1) if self.gate.bias is not None else None
            inner = regions.swiglu(expert_linear(rows, counts, weight, bias, self.backend))  # [N, ffn]
            return expert_linear(inner, counts, self.down.weight, self._out_bias(self.down.bias), self.backend)
        inner = F.gelu(expert_linear(rows, counts, self.fc1.weight, self.fc1.bias, self.backend))  # [N, ffn]
        return expert_linear(inner, counts, self.fc2.weight, self._out_bias(self.fc2.bias), self.backend)


class AuxLossGrad(torch.autograd.Function):
    """Identity on the layer output; its backward also gives the scalar ``aux`` the gradient ``scale``, so
    ``scale · aux`` joins the objective wherever this layer's backward runs (any pipeline stage), without
    touching the LM loss. Megatron's ``MoEAuxLossAutoScaler`` does the same."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale, ctx.aux_dtype = scale, aux.dtype
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return dout, torch.full((), ctx.scale, dtype=ctx.aux_dtype, device=dout.device), None


class MoE(nn.Module):
    """The MoE MLP: router, dispatcher, experts, optional shared experts (``shared``, a dense MLP module).

    After each forward: ``aux_loss`` and ``z_loss`` (unscaled, detached), ``tokens_per_expert [E]`` (assignments
    before capacity) and ``dropped_tokens`` (assignments dropped), for the metrics. ``aux_loss_scale`` is the
    weight of this micro-batch's ``coeff·aux + coeff·z`` in the objective (``set_aux_loss_scale``)."""

    def __init__(self, cfg: ModelConfig, spec: ArchSpec, regions: Regions, shared: nn.Module | None = None,
                 parallel: ParallelContext | None = None) -> None:
        super().__init__()
        parallel = parallel or ParallelContext()
        ep_group, sp = parallel.ep_group, parallel.sp
        self.num_experts, self.top_k, self.score = cfg.num_experts, cfg.moe_top_k, cfg.moe_router_score
        self.renormalize = cfg.moe_renormalize
        self.groups, self.scaling = (cfg.moe_router_groups, cfg.moe_router_group_topk), cfg.moe_routed_scaling
        self.aux_coeff, self.z_coeff = cfg.moe_aux_loss_coeff, cfg.moe_z_loss_coeff
        self.capacity_factor = cfg.moe_capacity_factor
        self.router = Router(cfg.hidden_size, cfg.num_experts, cfg.moe_bias_update_rate > 0)
        self.dispatcher = Dispatcher(cfg.num_experts, ep_group)
        self.etp_group = parallel.tp_group if parallel.expert_tp else comm.LOCAL  # expert tensor parallelism
        self.experts = Experts(cfg.num_experts // self.dispatcher.ep, cfg.hidden_size, expert_ffn(cfg), spec,
                               comm.group_size(self.etp_group), comm.group_rank(self.etp_group))
        ep = self.dispatcher.ep
        for param in self.experts.parameters():  # rank r holds experts [r·E/ep, (r+1)·E/ep) (mpu.sharding)
            param.expert_parallel, param.ep_rank, param.ep_size = True, comm.group_rank(ep_group), ep
            param.ep_tp = sp and ep > 1  # folded over tp: each TP rank holds its own experts (checkpoint writers)
            # every TP rank holds them all (SP, ep 1), or the down/fc2 bias under expert TP: grads summed over tp
            param.sequence_parallel = sp and ep == 1 or getattr(param, "sequence_parallel", False)
        # Under SP (tp) and CP this rank routes a shard of the micro-batch's tokens: the balancing losses count the
        # whole micro-batch (docs/moe.md); the router's gradient is summed over tp as a LayerNorm's is (over cp by
        # the dp_cp reduction).
        self.router.weight.sequence_parallel = sp
        self.sp_group = parallel.tp_group if sp else None
        self.token_groups = [g for g in (self.sp_group, parallel.cp_group) if g is not None and comm.group_size(g) > 1]
        self.shared = shared
        self._regions = regions
        self.aux_loss_scale = 1.0
        self.aux_loss = self.z_loss = self.dropped_tokens = torch.zeros(())
        self.tokens_per_expert = torch.zeros(cfg.num_experts, dtype=torch.int64)

    @property
    def regions(self) -> Regions:
        return self._regions

    @regions.setter
    def regions(self, regions: Regions) -> None:
        self._regions = regions
        if self.shared is not None:
            self.shared.regions = regions

    def capacity(self, seq_len: int) -> int:
        """``expert_capacity`` of this layer for sequences of ``seq_len``."""
        return expert_capacity(self.capacity_factor, seq_len, self.top_k, self.num_experts)

    def _capacity_keep(self, experts: torch.Tensor, top_scores: torch.Tensor) -> torch.Tensor:
        """``capacity_keep`` of this rank's ``[s, b, k]`` assignments, decided on the whole sequences: under SP the
        selections of the tp ranks' contiguous chunks are gathered first (CP is refused by the config check)."""
        if self.sp_group is None:
            return capacity_keep(experts, top_scores, self.num_experts, self.capacity(experts.shape[0]))
        s = experts.shape[0]
        full_e = comm.all_gather(experts.contiguous(), self.sp_group, dim=0)
        full_s = comm.all_gather(top_scores.detach().contiguous(), self.sp_group, dim=0)
        keep = capacity_keep(full_e, full_s, self.num_experts, self.capacity(full_e.shape[0]))
        return keep[comm.group_rank(self.sp_group) * s:][:s]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[s, b, h]`` (whole sequences, or this rank's shard under SP ``[s/t, b, h]`` and CP) → same shape."""
        s, b, h = x.shape
        tokens = x.reshape(s * b, h)  # [T, h], row i·b + j
        logits = self.router(tokens)  # [T, E] fp32
        bias = self.router.expert_bias if self.router.bias_in_use else None
        experts, weights, top_scores, probs, balance = route(logits, self.top_k, self.score, bias, self.renormalize,
                                                             *self.groups, self.scaling)
        keep = None
        if self.capacity_factor is not None and self.training:
            keep = self._capacity_keep(experts.view(s, b, -1), top_scores.view(s, b, -1)).reshape(s * b, -1)
        # expert TP: the same tokens on every TP rank, each computes its ffn slice of the experts; the partial rows
        # are summed before the combine, whose weights' (router) gradient needs the whole expert outputs
        rows, counts, plan = self.dispatcher.dispatch(copy_to_tp(tokens, self.etp_group), experts, keep)  # [M, h]
        rows = reduce_from_tp(self.experts(rows, counts, self.regions), self.etp_group)
        out = self.dispatcher.combine(rows, plan, weights).view(s, b, h)
        if self.shared is not None:
            out = out + self.shared(x)
        self.tokens_per_expert = torch.bincount(experts.reshape(-1), minlength=self.num_experts).detach()
        loads = torch.bincount(balance.reshape(-1), minlength=self.num_experts)  # f: the top-k without the bias
        total, first = s * b, 1.0
        if self.token_groups and self.training:  # the micro-batch's loads and tokens; this rank's share of the losses
            for group in self.token_groups:
                comm.all_reduce(loads, group)
                total *= comm.group_size(group)
                first = first if comm.group_rank(group) == 0 else 0.0
        aux = load_balancing_loss(probs, balance, self.num_experts, loads, total)
        z = router_z_loss(logits, total)
        self.aux_loss, self.z_loss = aux.detach(), z.detach()
        self.dropped_tokens = experts.new_tensor(experts.numel() - plan.order.numel())
        if self.training and torch.is_grad_enabled():  # once per micro-batch (a full recompute's first pass has no grad)
            self.router.record(self.tokens_per_expert, self.aux_loss, self.z_loss, self.dropped_tokens, first)
        if torch.is_grad_enabled() and self.training and (self.aux_coeff or self.z_coeff):
            out = AuxLossGrad.apply(out, self.aux_coeff * aux + self.z_coeff * z, self.aux_loss_scale)
        return out


def set_aux_loss_scale(model: nn.Module, scale: float) -> None:
    """Weight of each micro-batch's MoE losses in the gradient: ``loss_scale · micro_batch_size / global_batch_size``
    (the objective averages them over the global batch's micro-batches; docs/moe.md)."""
    for module in model.modules():
        if isinstance(module, MoE):
            module.aux_loss_scale = scale


# ----------------------------------------------------------------------------- per step: balancing bias and metrics

def moe_layers(model: nn.Module) -> dict[int, MoE]:
    """{global layer number: its MoE MLP} of this rank's stage."""
    return {m.layer_number: m.mlp for m in model.modules() if isinstance(getattr(m, "mlp", None), MoE)}


@torch.no_grad()
def update_expert_bias(bias: torch.Tensor, load: torch.Tensor, rate: float) -> None:
    """DeepSeek-V3's aux-loss-free update, in place: ``bias_i += rate · sign(mean load − load_i)``, the sign taken
    exactly on the integer counts as ``sign(Σ load − E · load_i)``."""
    bias.add_(torch.sign(load.sum() - load.numel() * load).to(bias.dtype), alpha=rate)


def end_step(model: nn.Module, cfg: ModelConfig, state: ParallelState, stepped: bool) -> torch.Tensor:
    """After the optimizer step, on every rank: this step's ``Router.step_stats`` as ``[layers, E + 4]`` fp64
    (zero rows for dense layers), summed over the global batch, then (``moe_bias_update_rate`` set, step taken)
    every expert bias moved by ``update_expert_bias``; the accumulators restart.

    The sum runs over the ranks that route different tokens: dp_cp, and tp under SP (without SP the TP ranks route
    the same tokens); each rank counts only the tokens its own router chose experts for (before any dispatch), so
    expert-parallel ranks count nothing twice. Then over pp, where each layer lives on one stage. The counts are
    integers in fp64, so every rank gets the same loads and the same bias as the 1-rank run."""
    layers = moe_layers(model)
    device = next(model.parameters()).device
    stats = torch.zeros(cfg.num_layers + cfg.mtp_layers, cfg.num_experts + 4, dtype=torch.float64, device=device)
    for i, layer in layers.items():
        if layer.router.step_stats is not None:
            stats[i] = layer.router.step_stats
        layer.router.step_stats = None
    comm.all_reduce(stats, state.dp_cp_group)
    sp_group = next(iter(layers.values())).sp_group if layers else None  # (a TP group's ranks share their stage)
    if sp_group is not None:
        comm.all_reduce(stats, sp_group)
    comm.all_reduce(stats, state.pp_group)
    if cfg.moe_bias_update_rate and stepped:
        for i, layer in layers.items():
            update_expert_bias(layer.router.expert_bias, stats[i, :cfg.num_experts], cfg.moe_bias_update_rate)
    return stats


def metrics_record(steps: list[torch.Tensor], cfg: ModelConfig) -> dict[str, Any]:
    """The metrics.jsonl fields of the steps since the last record (their ``end_step`` stats): ``moe_aux_loss`` and
    ``moe_z_loss`` (unscaled, the mean over MoE layers and the micro-batches of the global batches),
    ``moe_load_imbalance`` (max over layers of max/mean tokens per expert of a global batch, the mean over the
    steps), ``moe_dropped_tokens`` (assignments dropped per step, all layers), ``moe_tokens_per_expert`` (per MoE
    layer, the counts summed over the steps)."""
    e = cfg.num_experts
    rows = [i for i in range(cfg.num_layers + cfg.mtp_layers) if is_moe_layer(cfg, i)]
    s = torch.stack(steps).cpu()[:, rows]  # [steps, MoE layers, E + 4]
    load = s[..., :e]
    micro = s[..., e + 3].sum(dim=0).clamp_min(1.0)  # [MoE layers]
    imbalance = load.amax(dim=-1) / load.mean(dim=-1).clamp_min(1e-9)  # [steps, MoE layers]
    return {"moe_aux_loss": (s[..., e].sum(dim=0) / micro).mean().item(),
            "moe_z_loss": (s[..., e + 1].sum(dim=0) / micro).mean().item(),
            "moe_load_imbalance": imbalance.mean(dim=0).max().item(),
            "moe_dropped_tokens": s[..., e + 2].sum().item() / len(steps),
            "moe_tokens_per_expert": load.sum(dim=0).long().tolist()}


def expert_bias_state(model: nn.Module, cfg: ModelConfig, state: ParallelState) -> dict[str, list[float]]:
    """{global layer: expert bias} of every MoE layer, gathered over pp (collective; the same on every rank): the
    layout-free form the checkpoint's meta.json keeps (fp32 → JSON float → fp32 is exact)."""
    layers = cfg.num_layers + cfg.mtp_layers  # (multi-token prediction's layers after the main ones)
    full = torch.zeros(layers, cfg.num_experts, dtype=torch.float64, device=next(model.parameters()).device)
    for i, layer in moe_layers(model).items():
        full[i] = layer.router.expert_bias
    comm.all_reduce(full, state.pp_group)
    return {str(i): full[i].tolist() for i in range(layers) if is_moe_layer(cfg, i)}


@torch.no_grad()
def load_expert_bias(model: nn.Module, saved: dict[str, list[float]] | None) -> None:
    """Restore the expert biases ``expert_bias_state`` saved (None, as in older checkpoints: they stay 0)."""
    for i, layer in moe_layers(model).items():
        if saved and str(i) in saved:
            layer.router.expert_bias.copy_(torch.tensor(saved[str(i)], dtype=torch.float64))
            layer.router.bias_in_use = layer.router.bias_in_use or any(saved[str(i)])
