"""The numbers every formula reads, from a finalized config (vocabulary set)."""
from __future__ import annotations

from dataclasses import dataclass

from megatron_sp.config.schema import Config, ModelConfig
from megatron_sp.model.moe import expert_ffn, is_moe_layer
from megatron_sp.model.transformer import head_dim, rotary_dim
from megatron_sp.pipeline.partition import stage_chunks

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}  # a parameter / activation element per ``train.precision``
GRAD_BYTES = 4  # main gradients are always fp32
DEFAULT_BUCKET_BYTES = 25 * 2**20  # ``DistributedOptimizer``'s default ``bucket_bytes``
DEFAULT_PEAK_TFLOPS = 312.0  # per-device peak for the ranking: an A100's dense bf16 rate (pass your device's)
DEFAULT_BANDWIDTH_GBS = 100.0  # per-rank bus bandwidth for the ranking, GB/s (pass your interconnect's)
ACHIEVABLE_MFU = {"cpu": 0.75, "cuda": 0.5}
"""The share of the peak the step-time estimate lets a layout reach (its MFU ceiling), by modelled device: on CPU
configs/125M_cpu.yml measures 78 % of this host's matmul peak (small models reach less: the demo, hidden 256,
10–50 %); on GPU Megatron-LM's published runs reach 40–56 %. The kernels between the matmuls (norms, softmax,
optimizer) and launch overheads are what the FLOP count leaves out."""


@dataclass(frozen=True)
class PlanDims:
    """Model shape, batch, layout and precision of a config (not ``mpu.ParallelDims``, which sizes groups)."""

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
    e: int  # bytes of an activation element (the autocast / parameter dtype)
    s_local: int  # tokens of a sample on this rank: ``seq / cp``
    tokens: int  # tokens of one micro-batch on this rank (``b · s/cp``), as the TP regions see them
    shard_tokens: int  # tokens between TP regions: ``/tp`` under sequence parallelism
    kv_split: bool  # kv heads split over TP (else every rank holds the whole QKV weight: ``ReplicatedGroupQKV``)
    local_heads: int
    local_kv: int  # kv heads a TP rank computes (1 when replicated: each rank uses one group)
    local_ffn: int
    dp_cp: int  # the gradient-reduction group (and ZeRO-1 shard count)
    world: int
    mask_bytes: int  # a dropout mask element: CPU multiplies by one in the activation dtype; CUDA keeps a bool
    compiled: bool  # train.compile (unset: on CUDA): the loss runs compiled, without its fp32 chunk
    cpu_attention_max_scores: int | None  # model.cpu_attention_max_scores: the CPU block kernel's bound
    experts: int = 0  # MoE: routed experts per MoE layer (0: a dense model; every field below is then 0 or 1)
    top_k: int = 0
    moe_ffn: int = 0  # the width of one expert
    shared_ffn: int = 0  # the shared experts' MLP width, ``moe_shared_experts · moe_ffn`` (tensor-parallel like a dense MLP)
    ep: int = 1  # expert parallelism: E/ep experts per rank
    sigmoid: bool = False  # the router scores by sigmoid (else softmax)
    renorm: bool = False  # the selected top-k scores are renormalised (``model.moe_renormalize``; unset: k > 1)
    capacity: bool = False  # model.moe_capacity_factor set (training drops assignments past each expert's capacity)
    edp: int = 1  # expert data parallelism: ``expert_fold / ep`` ranks hold the same experts (their gradient and ZeRO group)
    etp: int = 1  # expert tensor parallelism (``parallel.expert_tp``, 1 or tp, no SP): each TP rank holds moe_ffn/etp of every expert
    mla: tuple[int, int, int, int] = (0, 0, 0, 0)  # latent attention: kv_lora_rank, q_lora_rank, qk_rope, v head dims

    @property
    def expert_local_ffn(self) -> int:
        """The width of one expert on a TP rank: ``moe_ffn / etp``."""
        return self.moe_ffn // self.etp


def expert_fold(cfg: Config) -> int:
    """The ranks of one pipeline stage whose experts fold as ep × edp (``mpu.ParallelDims.expert_fold``): tp·cp·dp
    under sequence parallelism at tp > 1 (the TP ranks route different tokens), else cp·dp (experts replicated over
    tp)."""
    p = cfg.parallel
    return p.cp * p.dp * (p.tp if p.sequence_parallel and p.tp > 1 else 1)


def dims_of(cfg: Config) -> PlanDims:
    """The ``PlanDims`` of a finalized config whose vocabulary is set (``config.set_vocab``)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    if m.padded_vocab_size is None or m.vocab_size is None:
        raise ValueError("the config's vocabulary is not set: call config.set_vocab(cfg, vocab_size) first")
    schedule = p.pp_schedule
    if p.pp == 1 and schedule in ("1f1b", "interleaved", "none") and p.virtual_stages == 1:
        schedule = "none"  # what forward_backward runs at pp == 1
    sp, e, device = p.sequence_parallel and p.tp > 1, DTYPE_BYTES[t.precision], p.device or "cpu"
    tokens, kv_split = t.micro_batch_size * (m.seq_length // p.cp), m.num_kv_heads % p.tp == 0
    moe = m.num_experts > 0
    moe_ffn = expert_ffn(m) if moe else 0
    return PlanDims(arch=m.arch, layers=m.num_layers, h=m.hidden_size, heads=m.num_heads, kv_heads=m.num_kv_heads,
                    head_dim=head_dim(m), ffn=m.ffn_hidden_size, rotary_dim=rotary_dim(m), vocab=m.vocab_size,
                    padded_vocab=m.padded_vocab_size, seq=m.seq_length, micro_batch=t.micro_batch_size,
                    micro_batches=t.grad_accum_steps, global_batch=t.global_batch_size, tp=p.tp, pp=p.pp, cp=p.cp,
                    dp=p.dp, virtual_stages=p.virtual_stages, sp=sp, recompute_allgather=p.tp_recompute_allgather,
                    recompute=m.recompute, precision=t.precision, zero=p.zero, cp_algo=p.cp_algo,
                    cp_ulysses=p.cp_ulysses if p.cp_algo == "usp" else 1, device=device, hidden_dropout=m.hidden_dropout,
                    attention_dropout=m.attention_dropout,
                    documents=cfg.data.reset_attention_mask or cfg.data.packing == "position_ids",
                    tie=m.tie_embeddings, schedule=schedule, e=e, s_local=m.seq_length // p.cp, tokens=tokens,
                    shard_tokens=tokens // p.tp if sp else tokens, kv_split=kv_split, local_heads=m.num_heads // p.tp,
                    local_kv=m.num_kv_heads // p.tp if kv_split else 1, local_ffn=m.ffn_hidden_size // p.tp,
                    dp_cp=p.dp * p.cp, world=p.tp * p.pp * p.cp * p.dp, mask_bytes=1 if device == "cuda" else e,
                    compiled=t.compile if t.compile is not None else device == "cuda",
                    cpu_attention_max_scores=m.cpu_attention_max_scores, experts=m.num_experts,
                    top_k=m.moe_top_k if moe else 0, moe_ffn=moe_ffn, shared_ffn=m.moe_shared_experts * moe_ffn,
                    sigmoid=m.moe_router_score == "sigmoid",
                    renorm=moe and (m.moe_top_k > 1 if m.moe_renormalize is None else m.moe_renormalize),
                    capacity=moe and m.moe_capacity_factor is not None, ep=p.ep, edp=max(1, expert_fold(cfg) // p.ep),
                    etp=p.expert_tp if moe else 1,
                    mla=(m.kv_lora_rank, m.q_lora_rank, m.qk_rope_head_dim, m.v_head_dim) if m.kv_lora_rank else (0, 0, 0, 0))


def kv_cache_bytes_per_token(m: ModelConfig, element_bytes: int, layers: int | None = None) -> int:
    """Bytes the decode KV cache (``model.inference.KVCache``) keeps per token of one sequence over ``layers`` layers
    (default all), unsharded: MLA the normed latent and the shared rotary key, ``kv_lora_rank + qk_rope_head_dim``
    values a layer; MHA/GQA a key and a value per kv head, ``2 · num_kv_heads · head_dim``."""
    per_layer = m.kv_lora_rank + m.qk_rope_head_dim if m.kv_lora_rank else 2 * m.num_kv_heads * head_dim(m)
    return per_layer * element_bytes * (m.num_layers if layers is None else layers)


def stage_layers(cfg: Config, pp_rank: int) -> list[range]:
    """The layer ranges of pipeline rank ``pp_rank``'s model chunks (the pipeline's own split)."""
    p = cfg.parallel
    return stage_chunks(cfg.model, p.pp, pp_rank, p.virtual_stages, p.pp_partition)


def moe_layers_of(cfg: Config, layers: range) -> int:
    """How many of ``layers`` (global layer numbers) have a MoE MLP (``moe.is_moe_layer``)."""
    return sum(is_moe_layer(cfg.model, i) for i in layers)
