"""GPTModel: embedding → transformer layers → final norm → output layer (+ per-token loss).

Parameter names are global, independent of the pipeline stage: ``embedding.weight``, ``layers.<i>.…`` (global
index ``i``; docs/tensor_parallel.md), ``final_norm.*``, ``output_layer.weight`` (a tied last stage's copy:
docs/pipeline.md). Initialisation is layout-independent: ``init_full_tensor`` draws each parameter's full
tensor from a generator seeded by (seed, parameter name); each rank keeps its TP shard of it.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence
from functools import partial
from typing import Protocol

import torch
from torch import nn

from megatron_sp.model.attention.context_parallel import AttentionMeta
from megatron_sp.mpu import comm
from megatron_sp.mpu.layers import ColumnParallelLinear, VocabParallelEmbedding, linear, vocab_parallel_cross_entropy
from megatron_sp.mpu.mappings import copy_to_tp, gather_from_sp, gather_from_tp
from megatron_sp.mpu.parallel_state import ParallelContext
from megatron_sp.mpu.random import checkpoint
from megatron_sp.mpu.sharding import local_shard_of, stored_shape
from megatron_sp.config.schema import ModelConfig
from megatron_sp.model.mla import mla_parameters
from megatron_sp.model.moe import AuxLossGrad, expert_ffn, is_moe_layer
from megatron_sp.model.mtp import MTPModule
from megatron_sp.model.rope import RopeScaling
from megatron_sp.mpu.zero3 import Entry, ParamUnits, UnitRunner
from megatron_sp.model.transformer import (EAGER, LayerKV, RotaryEmbedding, TransformerLayer, arch_spec, check_model_config,
                                           compiled, head_dim, hidden_dropout, make_norm, norm_args, rotary_dim, scaled_init_std)

EMBEDDING_NAME = "embedding.weight"
"""The input embedding's parameter name (also the init name of a tied output-layer copy)."""

MTP_EMBEDDING = "mtp_embedding.weight"
"""A last pipeline stage's copy of the input embedding for multi-token prediction (untied; a tied stage uses the
output layer's copy)."""

OUTPUT_PROJECTIONS = ("attention.out.weight", "mlp.fc2.weight", "mlp.down.weight", "mlp.experts.fc2.weight",
                      "mlp.experts.down.weight", "mlp.shared.fc2.weight", "mlp.shared.down.weight")
"""Weights initialised with the scaled std (they write into the residual stream; MoE: routed and shared experts)."""

NORM_MODULES = ("attn_norm", "mlp_norm", "final_norm", "q_norm", "k_norm", "q_latent_norm", "kv_latent_norm", "enorm",
                "hnorm")

INIT_KINDS = ("normal", "scaled_normal", "zeros", "ones")


def param_unit(name: str) -> str:
    """The ZeRO-3 unit of a parameter (gathered together): ``embedding``, ``layers.<i>``, ``head`` (final norm and output
    layer), ``mtp.<k>`` or ``mtp_embedding``."""
    parts = name.split(".")
    if parts[0] in ("layers", "mtp"):
        return f"{parts[0]}.{parts[1]}"
    return "head" if parts[0] in ("final_norm", "output_layer") else parts[0]


def init_kind(name: str) -> str:
    """The init kind of a parameter from its full name: norm weights ``ones``, biases ``zeros``,
    ``OUTPUT_PROJECTIONS`` ``scaled_normal``, every other weight ``normal``."""
    parts = name.split(".")
    if parts[-1] == "bias":
        return "zeros"
    if parts[-1] != "weight":
        raise ValueError(f"no init rule for parameter {name!r}")
    if len(parts) >= 2 and parts[-2] in NORM_MODULES:
        return "ones"
    if name.endswith(OUTPUT_PROJECTIONS):
        return "scaled_normal"
    return "normal"


def name_seed(seed: int, name: str) -> int:
    """A stable 63-bit generator seed from (seed, parameter name): sha256, not Python's salted hash."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def init_full_tensor(name: str, shape: Sequence[int], kind: str, cfg: ModelConfig, seed: int) -> torch.Tensor:
    """The full (unsharded) initial value of parameter ``name``: an fp32 CPU tensor of ``shape``, depending only
    on (seed, name, shape, kind, cfg), never on the layout. ``normal`` is N(0, init_std²), ``scaled_normal``
    uses ``scaled_init_std``; the draw uses a CPU generator seeded with ``name_seed(seed, name)``."""
    shape = tuple(int(n) for n in shape)
    if kind == "zeros":
        return torch.zeros(shape)
    if kind == "ones":
        return torch.ones(shape)
    if kind not in INIT_KINDS:
        raise ValueError(f"unknown init kind {kind!r}; expected one of {INIT_KINDS}")
    std = cfg.init_std if kind == "normal" else scaled_init_std(cfg)
    generator = torch.Generator(device="cpu").manual_seed(name_seed(seed, name))
    return torch.empty(shape).normal_(0.0, std, generator=generator)


def tag_parameter(param: nn.Parameter, shared_embedding: bool = False) -> None:
    """Set the attributes distributed code reads, keeping those a parallel layer already set
    (defaults: not split over TP, no TP gradient sync)."""
    for attr, default in (("tensor_model_parallel", False), ("partition_dim", -1), ("sequence_parallel", False)):
        if not hasattr(param, attr):
            setattr(param, attr, default)
    param.shared_embedding = shared_embedding


class KVCacheLike(Protocol):
    """What ``GPTModel.forward`` needs of a KV cache (``model.inference.KVCache``; not imported here)."""

    length: int
    pad: torch.Tensor | None  # [b]: left-padding tokens of each sequence (positions start after them)

    def layer(self, index: int) -> LayerKV: ...  # the cache of global layer ``index``

    def advance(self, new_tokens: int) -> None: ...  # mark ``new_tokens`` more tokens as filled


class GPTModel(nn.Module):
    """A GPT (``neox`` or ``llama`` per ``cfg.arch``), or one pipeline stage of it.

    Args:
        layer_range: global indices of the layers this stage holds (default: all).
        layer_chunks: instead, one range per model chunk of an interleaved pipeline rank (``forward(chunk=c)``).
        pre_process / post_process: hold the embedding (first stage) / final norm and output layer (last).
        parallel: the layout (default: one process). Parameters are this rank's TP shards.
        label_smoothing, z_loss: the last stage's cross-entropy options (``train.*``).
    """

    def __init__(self, cfg: ModelConfig, seed: int, layer_range: range | None = None,
                 pre_process: bool = True, post_process: bool = True, parallel: ParallelContext | None = None, *,
                 layer_chunks: Sequence[range] | None = None, label_smoothing: float = 0.0,
                 z_loss: float = 0.0) -> None:
        super().__init__()
        check_model_config(cfg)
        parallel = parallel or ParallelContext()
        self.parallel = parallel
        self.cp_group = parallel.cp_group  # set to comm.LOCAL to run one CP rank alone on whole sequences (decoding)
        self.cfg = cfg
        self.seed = seed
        self.pre_process = pre_process
        self.post_process = post_process
        self.padded_vocab_size = cfg.padded_vocab_size
        self.vocab_size = cfg.vocab_size or cfg.padded_vocab_size
        self.label_smoothing = label_smoothing  # the loss options of the last stage (see vocab_parallel_cross_entropy)
        self.z_loss = z_loss
        if layer_chunks is not None and layer_range is not None:
            raise ValueError("give layer_range or layer_chunks, not both")
        if layer_chunks is None:
            layer_chunks = [range(cfg.num_layers) if layer_range is None else layer_range]
        self.layer_chunks = [range(r.start, r.stop) for r in layer_chunks]
        indices = [i for r in self.layer_chunks for i in r]
        if not self.layer_chunks or len(set(indices)) != len(indices) or \
                any(not 0 <= i < cfg.num_layers for i in indices):
            raise ValueError(f"layer chunks {self.layer_chunks}: need at least one chunk and distinct layer "
                             f"indices in 0..{cfg.num_layers - 1}")
        self.hidden_dropout = cfg.hidden_dropout
        self.regions = EAGER  # the final norm's; each layer has its own (compile_regions)

        group, sp = parallel.tp_group, parallel.sp
        self.embedding = (VocabParallelEmbedding(self.padded_vocab_size, cfg.hidden_size, group=group,
                                                 sequence_parallel=sp) if pre_process else None)
        self.rotary = RotaryEmbedding(rotary_dim(cfg), cfg.rotary_base, RopeScaling.of(cfg))
        self.layers = nn.ModuleDict({str(i): TransformerLayer(cfg, i, parallel) for i in indices})
        self.final_norm = make_norm(cfg, parallel) if post_process else None
        tied_here = cfg.tie_embeddings and pre_process
        # Output layer: column-parallel over the vocab; logits stay split ([s, b, V/t]) into the
        # vocab-parallel cross entropy. Tied on this stage: it multiplies by the embedding's shard.
        self.output_layer = (ColumnParallelLinear(cfg.hidden_size, self.padded_vocab_size, bias=False, group=group,
                                                  sequence_parallel=sp, recompute_allgather=parallel.recompute_allgather,
                                                  skip_weight=tied_here)
                             if post_process else None)
        # Multi-token prediction (model/mtp.py): its modules on the last stage, with the embedding's copy there.
        self.mtp = (nn.ModuleList(MTPModule(cfg, k, parallel) for k in range(cfg.mtp_layers))
                    if post_process and cfg.mtp_layers else None)
        self.mtp_embedding = (VocabParallelEmbedding(self.padded_vocab_size, cfg.hidden_size, group=group,
                                                     sequence_parallel=sp, skip_weight=cfg.tie_embeddings)
                              if self.mtp is not None and not pre_process else None)
        self.mtp_loss_scales: list[float] = [0.0] * cfg.mtp_layers  # mtp.set_loss_scales
        self.mtp_sums: torch.Tensor | None = None  # [D] fp32: the micro-batches' summed MTP losses since then
        self.param_units: ParamUnits | None = None  # ZeRO-3: the optimizer's gatherer (forward runs ``unit_plan``)

        for name, param in self.named_parameters():
            shared = (cfg.tie_embeddings and name in (EMBEDDING_NAME, "output_layer.weight")) or name == MTP_EMBEDDING
            tag_parameter(param, shared_embedding=shared)
            if name in (EMBEDDING_NAME, "output_layer.weight", MTP_EMBEDDING):
                param.vocab_rows = self.vocab_size  # rows past it are padding (see mpu.sharding)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Set every parameter to its shard of the ``init_full_tensor`` value (a tied copy takes the embedding's)."""
        for name, param in self.named_parameters():
            init_name = EMBEDDING_NAME if getattr(param, "shared_embedding", False) else name
            t = self.parallel.tp_size
            full = init_full_tensor(init_name, stored_shape(param, t), init_kind(init_name), self.cfg, self.seed)
            param.copy_(local_shard_of(full, param, self.parallel.tp_rank, t))

    def compile_regions(self, enabled: bool = True) -> None:
        """Run the pointwise regions of every layer, the final norm and the loss's per-token sums and gradient
        (``mpu.layers.token_stats``, ``logit_grad``) through ``torch.compile`` (``train.compile``; see
        ``transformer.Regions``), or eagerly again with ``enabled=False``."""
        self.regions = compiled() if enabled else EAGER
        for layer in [*self.layers.values(), *(m.layer for m in self.mtp or ())]:
            layer.set_regions(self.regions)

    def output_weight(self) -> torch.Tensor:
        """This rank's ``[padded_vocab/t, h]`` output weight (the embedding's when tied on this stage)."""
        if self.output_layer is not None and self.output_layer.weight is not None:
            return self.output_layer.weight
        if self.embedding is None:
            raise RuntimeError("this stage has no output layer")
        return self.embedding.weight

    def forward(self, tokens: torch.Tensor | None, position_ids: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, hidden_states: torch.Tensor | None = None,
                chunk: int = 0, token_index: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None, kv_cache: KVCacheLike | None = None,
                logit_rows: torch.Tensor | None = None,
                mtp: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Run this stage (or its model chunk ``chunk``).

        Args:
            tokens: ``[b, s]`` token ids (first stage). labels: ``[b, s]`` targets (last stage; -100 → loss 0).
            position_ids: ``[b, s]`` rotary positions (default ``arange(s)``, after the cached tokens).
            hidden_states: ``[s, b, h]`` input of a stage without the embedding.
            token_index: ``[b, s]`` global index of each held token (CP: ``layout.shard_batch``).
            document_ids: ``[b, s]`` document of each token (packed documents): attention stays inside one.
            kv_cache: ``inference.KVCache`` of this stage's layers: ``tokens`` / ``hidden_states`` follow the cached
                ones (positions after them, less the cache's left padding). Under CP with ``token_index``: a
                prefill, each rank its shard, the whole sequence's keys/values filled into every rank's cache.
            logit_rows: ``[b]`` (inference, without ``labels``): the logits of one row per sequence only, its index
                in this rank's ``s`` rows (under SP in the whole sequence): the final norm and the output layer run
                on ``b`` rows, not ``s·b`` (a prefill samples from its last token alone).
            mtp: ``(mtp_tokens, mtp_labels)``, ``[b, s, D]`` each (``data.batching.mtp_targets``): a training step's
                multi-token prediction, whose loss joins the gradient (``model/mtp.py``), not the returned losses.

        Returns: last stage: logits ``[b, s, padded_vocab]`` (``[b, 1, padded_vocab]`` with ``logit_rows``) without
        ``labels``, else the per-token fp32 cross entropy ``[b, s]`` (unreduced); other stages: hidden ``[s, b, h]``.
        """
        if not 0 <= chunk < len(self.layer_chunks):
            raise ValueError(f"chunk {chunk} outside 0..{len(self.layer_chunks) - 1}")
        if kv_cache is not None and (token_index is None or comm.group_size(self.cp_group) == 1):
            self.check_kv_cache_usable(document_ids)  # (a CP prefill: each rank its shard, the cache filled whole)
        head = self.post_process and chunk == len(self.layer_chunks) - 1
        run_mtp = head and self.mtp is not None and self.training and torch.is_grad_enabled() and labels is not None
        run = UnitRunner(self.param_units, self.unit_plan(chunk, head, run_mtp) if self.param_units else [])
        if self.embedding is not None and chunk == 0:
            if tokens is None:
                raise ValueError("the first stage needs tokens")
            x = run(("embedding",), partial(self.embedding, tokens.t()))  # [s/t, b, h] under SP, else [s, b, h]
            x = hidden_dropout(x, self.hidden_dropout, self.training, self.parallel)
        else:
            if hidden_states is None:
                raise ValueError("a stage without the embedding needs hidden_states")
            x = hidden_states  # [s/t, b, h] under SP, else [s, b, h]

        par = self.parallel
        if kv_cache is not None and position_ids is None:
            position_ids = torch.arange(kv_cache.length, kv_cache.length + x.shape[0], device=x.device).unsqueeze(0)
            position_ids = (position_ids - kv_cache.pad[:, None]).clamp_min(0) if kv_cache.pad is not None \
                else position_ids.expand(x.shape[1], -1)  # [b, s]
        seq_len = x.shape[0] * (par.tp_size if par.sp else 1)
        angle_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        dev_type = x.device.type
        rope_dtype = torch.get_autocast_dtype(dev_type) if torch.is_autocast_enabled(dev_type) else x.dtype
        cos, sin = self.rotary(position_ids, seq_len, x.device, angle_dtype, rope_dtype)  # [s, b|1, rd/2]

        meta = None
        cp = comm.group_size(self.cp_group)  # a window cuts something when it is below the whole sequence (cp ranks')
        window = self.cfg.sliding_window if self.cfg.sliding_window and self.cfg.sliding_window < seq_len * cp else None
        if cp > 1 or document_ids is not None or (window and kv_cache is None):
            if token_index is None and cp > 1:
                raise ValueError("context parallelism needs token_index (the global index of each held token: "
                                 "layout.shard_batch provides it)")
            if token_index is None:
                token_index = torch.arange(seq_len, device=x.device).unsqueeze(0).expand(x.shape[1], seq_len)
            meta = AttentionMeta.build(token_index, document_ids, par.cp_algo, self.cp_group,
                                       par.cp_heads_k_stride, par.cp_ulysses_group, par.cp_ring_group, window)
        full_recompute = par.recompute == "full" and self.training and torch.is_grad_enabled()
        for index in self.layer_chunks[chunk]:
            layer = self.layers[str(index)]
            if kv_cache is not None:
                call = partial(layer, x, cos, sin, meta, kv_cache.layer(index))  # [s, b, h] (CP prefill: [s/cp, b, h])
            elif full_recompute:
                call = partial(checkpoint, layer, x, cos, sin, meta, tracker=par.tracker)  # keeps only the layer input
            else:
                call = partial(layer, x, cos, sin, meta)  # [s/t, b, h] under SP, else [s, b, h]
            x = run((f"layers.{index}",), call)
        if kv_cache is not None:
            kv_cache.advance(x.shape[0] * (meta.size if meta is not None else 1))
        if not head:
            return x
        head_units = self._head_units()

        if logit_rows is not None:  # position-wise from here: keep the rows whose logits are wanted
            if labels is not None:
                raise ValueError("logit_rows is for inference: give it or labels, not both")
            if par.sp:
                x = gather_from_sp(x, par.tp_group)  # [s, b, h] (the output layer would gather it too)
            x = x[logit_rows, torch.arange(x.shape[1], device=x.device)].unsqueeze(0)  # [1, b, h]
            logits = run(head_units, lambda: linear(copy_to_tp(self.regions.norm(x, *norm_args(self.final_norm)),
                                                               par.tp_group), self.output_weight()))  # [1, b, V/t]
            return gather_from_tp(logits, par.tp_group).transpose(0, 1)  # [b, 1, V]
        if labels is None:
            logits = run(head_units, lambda: self.output_layer(self.regions.norm(x, *norm_args(self.final_norm)),
                                                               weight=self.output_weight()))
            return gather_from_tp(logits, par.tp_group).transpose(0, 1)  # [b, s, V]
        losses = run(head_units, partial(self._head_loss, x, self.final_norm, labels))  # [b, s]
        if run_mtp:
            if mtp is None:
                raise ValueError("a model with model.mtp_layers trains with mtp=(mtp_tokens, mtp_labels) "
                                 "(data.batching.mtp_targets)")
            sums = []
            for k, module in enumerate(self.mtp):  # type: ignore[arg-type]
                emb = run(self._mtp_embedding_units(), partial(self._mtp_embedding, mtp[0][..., k]))
                emb = hidden_dropout(emb, self.hidden_dropout, self.training, par)
                x, loss_sum = run((f"mtp.{k}", *head_units), partial(self._mtp_step, module, x, emb, cos, sin, meta,
                                                                      full_recompute, mtp[1][..., k]))
                sums.append(loss_sum)  # fp32 (fp64 model: fp64)
            sums_t = torch.stack(sums)  # [D]: this micro-batch's summed loss of each module
            self.mtp_sums = sums_t.detach() if self.mtp_sums is None else self.mtp_sums + sums_t.detach()
            weighted = (sums_t * sums_t.new_tensor(self.mtp_loss_scales)).sum()
            losses = AuxLossGrad.apply(losses, weighted, 1.0)
        return losses

    def _mtp_step(self, module: MTPModule, x: torch.Tensor, emb: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  meta: AttentionMeta | None, recompute: bool, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One MTP module: (its state, its summed loss on ``labels``)."""
        x = module(x, emb, cos, sin, meta, recompute)
        return x, self._head_loss(x, module.final_norm, labels).sum()

    def _head_units(self) -> Entry:
        """The ZeRO-3 units the head reads: the embedding too when it is the output layer here."""
        return ("head", "embedding") if self.cfg.tie_embeddings and self.embedding is not None else ("head",)

    def _mtp_embedding_units(self) -> Entry:
        if self.embedding is not None:
            return ("embedding",)
        return ("mtp_embedding", "head") if self.cfg.tie_embeddings else ("mtp_embedding",)

    def unit_plan(self, chunk: int, head: bool, mtp: bool) -> list[Entry]:
        """ZeRO-3: the entries (units gathered together) ``forward`` runs in order, for its prefetch."""
        plan: list[Entry] = [("embedding",)] if self.embedding is not None and chunk == 0 else []
        plan += [(f"layers.{i}",) for i in self.layer_chunks[chunk]]
        if head:
            plan.append(self._head_units())
        for k in range(self.cfg.mtp_layers if mtp else 0):
            plan += [self._mtp_embedding_units(), (f"mtp.{k}", *self._head_units())]
        return plan

    def _head_loss(self, x: torch.Tensor, norm: nn.Module, labels: torch.Tensor) -> torch.Tensor:
        """Per-token cross entropy ``[b, s]`` of ``labels [b, s]`` from the state ``x`` through ``norm`` and the
        output layer. Padded vocab rows (ids >= vocab_size) are outside the softmax: the same loss for any padding."""
        logits = self.output_layer(self.regions.norm(x, *norm_args(norm)), weight=self.output_weight())  # [s, b, V/t]
        return vocab_parallel_cross_entropy(logits, labels.t(), self.parallel.tp_group,
                                            label_smoothing=self.label_smoothing, vocab_size=self.vocab_size,
                                            z_loss=self.z_loss, compiled=self.regions is not EAGER).t()

    def _mtp_embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """The input embedding of ``ids [b, s]`` on the last stage: ``[s/t, b, h]`` under SP, else ``[s, b, h]``."""
        if self.embedding is not None:
            return self.embedding(ids.t())
        assert self.mtp_embedding is not None
        return self.mtp_embedding(ids.t(), weight=self.output_weight() if self.cfg.tie_embeddings else None)

    def kv_cache_unsupported(self) -> str | None:
        """Why this model cannot decode with a ``inference.KVCache`` (None when it can)."""
        if self.parallel.sp:
            return "sequence parallelism (decode with parallel.sequence_parallel=false)"
        if comm.group_size(self.cp_group) > 1:
            return "context parallelism (set model.cp_group = comm.LOCAL to decode on one rank)"
        if len(self.layer_chunks) != 1:
            return "virtual pipeline stages (decode with parallel.virtual_stages=1)"
        return None

    def check_kv_cache_usable(self, document_ids: torch.Tensor | None = None) -> None:
        """Raise ValueError unless ``forward(..., kv_cache=...)`` is allowed for this model now."""
        reason = self.kv_cache_unsupported()
        if reason is None and self.training:
            reason = "training mode (call model.eval())"
        if reason is None and document_ids is not None:
            reason = "packed documents (document_ids)"
        if reason is not None:
            raise ValueError(f"the KV cache is for inference; not available with {reason}")

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Parameters on this stage (a tied weight once); ``exclude_embeddings`` leaves out the input
        embedding unless it doubles as the output layer."""
        total = sum(p.numel() for p in self.parameters())
        embedding_is_output = self.post_process and self.output_layer is not None and self.output_layer.weight is None
        if exclude_embeddings and self.embedding is not None and not embedding_is_output:
            total -= self.embedding.weight.numel()
        if exclude_embeddings and self.mtp_embedding is not None and self.mtp_embedding.weight is not None:
            total -= self.mtp_embedding.weight.numel()
        return total


def mlp_parameters(cfg: ModelConfig, f: int) -> int:
    """Parameters of one dense MLP (or one expert) of width ``f``."""
    spec, h = arch_spec(cfg.arch), cfg.hidden_size
    mlp = 3 * h * f if spec.swiglu else 2 * h * f
    if spec.bias:
        mlp += (2 * f if spec.swiglu else f) + h
    return mlp


def parameter_parts(cfg: ModelConfig) -> dict[str, int]:
    """Parameter counts from the config alone: ``embedding``, ``layer`` (one dense transformer layer),
    ``final_norm`` and ``output_layer`` (counted even when tied: a last stage holds a copy); with experts also
    ``moe_layer`` (one MoE layer: router, every expert, shared experts) and ``moe_layer_active`` (the parameters one
    token passes through: router, top-k experts, shared experts); with multi-token prediction ``mtp`` and
    ``mtp_active`` (its D modules: norms, ``eh_proj``, the layer; the shared embedding and output layer not again)."""
    check_model_config(cfg)
    spec = arch_spec(cfg.arch)
    h, d = cfg.hidden_size, head_dim(cfg)
    qkv_out = (cfg.num_heads + 2 * cfg.num_kv_heads) * d
    norm = 2 * h if spec.layernorm else h
    attention = h * qkv_out + cfg.num_heads * d * h + (qkv_out + h if spec.bias else qkv_out if cfg.qkv_bias else 0)
    attention += (2 * d if cfg.qk_norm_scope == "head" else (cfg.num_heads + cfg.num_kv_heads) * d) if cfg.qk_norm else 0
    attention = mla_parameters(cfg) if cfg.kv_lora_rank else attention
    embedding = cfg.padded_vocab_size * h
    parts = {"embedding": embedding, "layer": attention + mlp_parameters(cfg, cfg.ffn_hidden_size) + 2 * norm,
             "final_norm": norm, "output_layer": embedding}
    if cfg.num_experts > 0:
        f = expert_ffn(cfg)
        base = attention + 2 * norm + cfg.num_experts * h  # + router
        shared = mlp_parameters(cfg, cfg.moe_shared_experts * f) if cfg.moe_shared_experts else 0
        parts["moe_layer"] = base + shared + cfg.num_experts * mlp_parameters(cfg, f)
        parts["moe_layer_active"] = base + shared + cfg.moe_top_k * mlp_parameters(cfg, f)
    for key, moe_part in (("mtp", "moe_layer"), ("mtp_active", "moe_layer_active")):
        parts[key] = sum(3 * norm + 2 * h * h + parts[moe_part if is_moe_layer(cfg, cfg.num_layers + k) else "layer"]
                         for k in range(cfg.mtp_layers))
    return parts


def count_parameters(cfg: ModelConfig, exclude_embeddings: bool = True, active: bool = False) -> int:
    """Parameters of the full model from the config alone (the same count as ``GPTModel.num_parameters``);
    ``active``: a MoE layer counts only the parameters one token passes through (top-k of its experts)."""
    parts = parameter_parts(cfg)
    moe_part = "moe_layer_active" if active else "moe_layer"
    layers = sum(parts[moe_part] if is_moe_layer(cfg, i) else parts["layer"] for i in range(cfg.num_layers))
    # final norm + output layer (or the tied embedding, counted here as the output layer)
    total = layers + parts["final_norm"] + parts["output_layer"] + parts["mtp_active" if active else "mtp"]
    if not cfg.tie_embeddings and not exclude_embeddings:
        total += parts["embedding"]
    return total


def attended_keys(seq: int, window: int | None) -> float:
    """Keys a query meets on average, in the MFU's continuous count: ``s/2`` causal (the half of ``s²``), and under a
    sliding window ``W < s`` the band ``(W·s − W²/2)/s`` (equal to ``s/2`` at ``W = s``)."""
    return seq / 2 if not window or window >= seq else window - window * window / (2 * seq)


def flops_per_token(cfg: ModelConfig) -> float:
    """Training FLOPs per token for MFU, ``6·N + 6·L·h·s``: PaLM appendix B with the attention term over the
    causal half; N excludes the input embedding and, in MoE layers, counts the active parameters only (router,
    top-k experts, shared experts: what a token computes with; docs/metrics.md, docs/moe.md). The attention term is
    ``6·L·n·(d_qk + d_v)·k`` with ``k = attended_keys`` (``s/2``, less under a sliding window; ``h = n·d`` when both
    are the head dim; latent attention's values are ``v_head_dim`` wide, the kernels' zero padding not counted).
    Multi-token prediction adds its modules' parameters, their layers' attention and one more pass through the
    output layer each."""
    n = count_parameters(cfg, exclude_embeddings=True, active=True) + cfg.mtp_layers * parameter_parts(cfg)["output_layer"]
    d_v = cfg.v_head_dim if cfg.kv_lora_rank else head_dim(cfg)
    layers = cfg.num_layers + cfg.mtp_layers
    keys = attended_keys(cfg.seq_length, cfg.sliding_window)
    return 6.0 * n + 6.0 * layers * cfg.num_heads * (head_dim(cfg) + d_v) * keys
