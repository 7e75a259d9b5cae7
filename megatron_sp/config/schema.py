"""The typed config tree: one dataclass per section, one documented field per key. "Derived" fields
(default ``None``) are filled by ``loader.finalize`` unless set, and then checked instead."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


def doc(default: Any, text: str) -> Any:
    """A dataclass field with a default and its documentation (shown by ``train.py --help``)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"doc": text})
    return field(default=default, metadata={"doc": text})


@dataclass
class ModelConfig:
    """The GPT architecture."""

    arch: str = doc("neox", "Architecture: 'neox' (LayerNorm, partial rotary, parallel residual, GeLU, "
                            "biases, untied output) or 'llama' (RMSNorm, rotary, SwiGLU, GQA, no biases).")
    num_layers: int = doc(2, "Number of transformer layers.")
    hidden_size: int = doc(128, "Model width h.")
    num_heads: int = doc(4, "Attention (query) heads.")
    num_kv_heads: int | None = doc(None, "Derived (= num_heads) unless set: key/value heads for grouped-query "
                                         "attention (llama). Must divide num_heads.")
    ffn_hidden_size: int | None = doc(None, "Derived unless set: MLP width. neox: 4h; llama: 8h/3 rounded up "
                                            "to a multiple of ffn_multiple_of.")
    ffn_multiple_of: int = doc(256, "llama: the derived ffn_hidden_size is rounded up to a multiple of this.")
    seq_length: int = doc(128, "Training sequence length in tokens.")
    rotary_pct: float | None = doc(None, "Derived unless set: fraction of the head dim that gets rotary "
                                         "embeddings (neox 0.25, llama 1.0).")
    rotary_base: float = doc(10000.0, "Rotary embedding base (theta).")
    rope_scaling: str = doc("none", "Rotary frequency scaling, as transformers' rope types: none | linear (frequencies / "
                                    "rope_scaling_factor) | llama3 (Llama-3.1: low frequencies / factor, high ones kept, "
                                    "a smooth band between) | yarn (NTK-by-parts, cos/sin × rope_attention_factor).")
    rope_scaling_factor: float = doc(1.0, "linear, llama3, yarn: the context extension factor (HF 'factor').")
    rope_low_freq_factor: float = doc(1.0, "llama3: wavelengths above original_max_positions / this are scaled.")
    rope_high_freq_factor: float = doc(4.0, "llama3: wavelengths below original_max_positions / this are kept.")
    rope_original_max_positions: int = doc(8192, "llama3, yarn: the pre-training context (HF "
                                                 "'original_max_position_embeddings').")
    rope_beta_fast: float = doc(32.0, "yarn: rotations bounding the extrapolated (kept) frequencies.")
    rope_beta_slow: float = doc(1.0, "yarn: rotations bounding the interpolated (scaled) frequencies.")
    rope_attention_factor: float | None = doc(None, "yarn: factor on cos and sin; unset: 0.1·ln(factor) + 1.")
    rope_mscale_all_dim: float = doc(0.0, "yarn with latent attention (DeepSeek-V3's mscale_all_dim, e.g. 1.0): the "
                                          "softmax scale × (0.1·this·ln(rope_scaling_factor) + 1)²; 0: off.")
    head_dim: int | None = doc(None, "Derived (= hidden_size / num_heads) unless set: dims per attention head; Qwen3 "
                                     "sets it apart from hidden/heads (the attention is num_heads·head_dim wide).")
    kv_lora_rank: int = doc(0, "Multi-head latent attention (DeepSeek-V2/V3) when > 0: keys and values from a "
                               "compressed latent of this many values a token (plus one shared rotary key); llama only.")
    q_lora_rank: int = doc(0, "MLA: queries from a latent of this rank (DeepSeek-V3: 1536); 0: a full projection.")
    qk_nope_head_dim: int = doc(128, "MLA: query/key dims per head without rotary.")
    qk_rope_head_dim: int = doc(64, "MLA: query/key dims per head with rotary (the key's shared by the heads).")
    v_head_dim: int = doc(128, "MLA: value dims per head (at most qk_nope_head_dim + qk_rope_head_dim).")
    mtp_layers: int = doc(0, "Multi-token prediction (DeepSeek-V3): this many sequential modules after the main model; "
                             "module k predicts the token k + 1 ahead from module k-1's state and the embedding of "
                             "token k ahead, sharing the embedding and output layer. Training only. 0: off. docs/mtp.md.")
    mtp_loss_coeff: float = doc(0.1, "MTP: lambda; the objective adds lambda/mtp_layers · Σ_k L_k, L_k module k's mean "
                                     "cross entropy over its valid targets in the global batch (DeepSeek-V3: 0.3, then 0.1).")
    qkv_bias: bool = doc(False, "llama: biases on the q/k/v projections only (Qwen2); neox has every bias anyway.")
    qk_norm: bool = doc(False, "RMSNorm of each query and key head over its head_dim before rotary (Qwen3); one "
                               "[head_dim] weight each for q and k per layer, shared by the heads.")
    qk_norm_scope: str = doc("head", "model.qk_norm's span: head (each head over its head_dim, Qwen3) | projection "
                                     "(the whole q and k projections, OLMo-2: weights [num_heads·head_dim] and "
                                     "[num_kv_heads·head_dim], split over TP like the heads, statistic summed over TP).")
    norm_placement: str = doc("pre", "Where the layer norms sit: pre (x + f(norm(x)), GPT/Llama) | post_sublayer "
                                     "(x + norm(f(x)), OLMo-2: no norm before attention or MLP).")
    norm_eps: float = doc(1e-5, "Epsilon of LayerNorm / RMSNorm.")
    hidden_dropout: float = doc(0.0, "Dropout on the attention and MLP outputs before the residual add.")
    attention_dropout: float = doc(0.0, "Dropout on the attention probabilities.")
    sliding_window: int | None = doc(None, "Sliding-window attention (Mistral): a token sees itself and the "
                                           "sliding_window - 1 tokens before it (transformers' convention, flash-attn's "
                                           "window_size=(w-1, 0)), in training (every cp_algo, packed documents) and "
                                           "generation. None or 0: full causal. Needs attention_dropout=0.")
    cpu_attention_max_scores: int | None = doc(None, "CPU causal attention without CP or packed documents: the "
                                                     "block-causal explicit-scores kernel (faster; keeps about half "
                                                     "of the b·(n/tp)·s² probabilities per layer) while b·(n/tp)·s² is "
                                                     "at most this, torch's O(s)-memory flash kernel beyond. 0: "
                                                     "always flash. Unset: 2^24 (kernels.MATH_ATTENTION_MAX_SCORES).")
    tie_embeddings: bool = doc(False, "Share the input embedding with the output layer (llama option).")
    recompute: str = doc("none", "Activation recomputation: none | selective (the attention core: scores, "
                                 "softmax, dropout) | full (each layer keeps only its input).")
    init_std: float = doc(0.02, "Standard deviation of the normal initialisation of weights.")
    scaled_init: bool = doc(True, "Scale the init std of the output projections (attention out, MLP out) by "
                                  "1/sqrt(2·num_layers), as Megatron and GPT-2 do.")
    make_vocab_size_divisible_by: int = doc(128, "The embedding rows are padded to a multiple of this × tp.")
    vocab_size: int | None = doc(None, "Derived from the tokenizer (or checkpoint.load's model): its number of "
                                       "tokens (unpadded); set, it may exceed the tokenizer's (Qwen: 151936 > 151669).")
    padded_vocab_size: int | None = doc(None, "Derived: vocab_size padded to make_vocab_size_divisible_by × tp.")
    num_experts: int = doc(0, "Mixture of experts: routed experts per MoE layer (0: a dense model, every other moe_* "
                              "key left at its default). docs/moe.md.")
    moe_top_k: int = doc(2, "MoE: experts each token is routed to (1..num_experts).")
    moe_ffn_hidden_size: int | None = doc(None, "MoE: hidden width of each expert (and of each shared expert). "
                                                "Derived (= ffn_hidden_size) unless set.")
    moe_shared_experts: int = doc(0, "MoE: always-on shared experts, one MLP of moe_shared_experts · "
                                     "moe_ffn_hidden_size added to the routed output (DeepSeek, Qwen2-MoE).")
    moe_layer_freq: int = doc(1, "MoE: from layer moe_first_dense_layers on, every this many layers is a MoE layer "
                                 "(1: all of them); the others keep the dense MLP.")
    moe_first_dense_layers: int = doc(0, "MoE: the first this many layers keep the dense MLP (DeepSeek's first_k_dense).")
    moe_router_score: str = doc("softmax", "MoE router scores: softmax (over all experts) | sigmoid (per expert, "
                                           "DeepSeek-V3). With top_k > 1 the selected scores are renormalised to sum "
                                           "to 1 (Mixtral, DeepSeek-V3); top-1 keeps its score (Switch).")
    moe_renormalize: bool | None = doc(None, "MoE: renormalise the selected top-k scores to sum to 1 (transformers' "
                                             "norm_topk_prob). Unset: exactly when moe_top_k > 1.")
    moe_router_groups: int = doc(1, "MoE group-limited routing (DeepSeek-V3 n_group): the experts form this many "
                                    "consecutive groups; a group scores the sum of its two highest selection scores "
                                    "(routing bias included). 1: no groups.")
    moe_router_group_topk: int = doc(1, "MoE: a token's top-k experts come from its this many best groups "
                                        "(DeepSeek-V3 topk_group).")
    moe_routed_scaling: float = doc(1.0, "MoE: the routed experts' combine weights are multiplied by this after any "
                                         "renormalisation (DeepSeek-V3 routed_scaling_factor, e.g. 2.5).")
    moe_aux_loss_coeff: float = doc(0.01, "MoE: coefficient of the Switch/GShard load-balancing loss "
                                          "E·Σ f_i·P_i per micro-batch, added to the training objective (0: off).")
    moe_z_loss_coeff: float = doc(0.0, "MoE: coefficient of the router z-loss mean(logsumexp(logits)²) (ST-MoE; "
                                       "e.g. 1e-3; 0: off).")
    moe_bias_update_rate: float = doc(0.0, "MoE aux-loss-free balancing (DeepSeek-V3; e.g. 1e-3; 0: off): a per-expert "
                                           "bias added to the router scores for the top-k selection only, after each "
                                           "step moved by rate·sign(mean load − load) with the loads of the global batch.")
    moe_capacity_factor: float | None = doc(None, "MoE: when set, while training each expert takes at most "
                                                  "min(seq_length, ceil(factor · seq_length · top_k / num_experts)) tokens of each "
                                                  "sequence, those of highest score (ties: earlier position); the "
                                                  "others skip it. Unset: dropless.")


@dataclass
class ParallelConfig:
    """The layout: world = tp · pp · cp · dp, rank order tp-cp-dp-pp (TP innermost)."""

    tp: int = doc(1, "Tensor-parallel size.")
    pp: int = doc(1, "Pipeline-parallel size (stages).")
    cp: int = doc(1, "Context-parallel size (the sequence is split over cp ranks).")
    dp: int | None = doc(None, "Derived unless set: data-parallel size = world / (tp·pp·cp). Without torchrun "
                               "it defaults to 1 and sets the number of local ranks train.py starts.")
    sequence_parallel: bool = doc(False, "Megatron sequence parallelism inside the TP group (needs tp > 1): "
                                         "activations between TP regions are split along the sequence.")
    tp_recompute_allgather: bool = doc(True, "Sequence parallelism: column-parallel layers keep only their input shard "
                                             "and all-gather it again in backward; false caches the gathered input.")
    cp_algo: str = doc("ring", "Context-parallel attention: ring | zigzag | llama3 | ulysses | usp (Ulysses of "
                               "degree cp_ulysses inside a ring).")
    cp_ulysses: int = doc(1, "cp_algo=usp: the Ulysses degree inside the cp group (divides cp; the ring runs over "
                             "cp / cp_ulysses).")
    cp_heads_k_stride: int = doc(1, "llama3 context parallelism: kv heads per all-gather (the next group's "
                                    "gather overlaps the current group's attention).")
    cp_document_chunk: int = doc(128, "zigzag/usp with packed documents: each document of at least 2·cp·this many "
                                      "tokens is zigzagged on its own, the shorter ones together (1: every document).")
    pp_schedule: str = doc("1f1b", "Pipeline schedule: 1f1b | interleaved (needs virtual_stages >= 2) | zero_bubble "
                                   "(ZB-H1) | none (one micro-batch at a time through all stages). docs/pipeline.md.")
    virtual_stages: int = doc(1, "Model chunks per pipeline rank (interleaved schedule): rank r holds layer blocks "
                                 "r, r+pp, r+2pp, ...")
    pp_partition: str = doc("uniform", "Layers per pipeline stage: uniform | balanced (even parameter counts) | a "
                                       "layer count per virtual stage, e.g. \"3,5\" (docs/pipeline.md).")
    zero: int = doc(0, "ZeRO stage: 0 (off), 1 (optimizer state sharded over DP), 2 (also the fp32 gradients, "
                       "reduce-scattered every micro-batch) or 3 (also the parameters, all-gathered per layer before its "
                       "forward and its backward; docs/optimizer.md).")
    zero3_prefetch: int = doc(1, "ZeRO-3: layers whose parameters are all-gathered ahead of their use (forward and "
                                 "backward), overlapping the current layer's compute; 0: gathered when reached.")
    ep: int = doc(1, "MoE expert parallelism: each rank holds num_experts/ep experts; the ep ranks fold from the cp·dp "
                     "ranks of a stage (tp·cp·dp under sequence_parallel; consecutive), the rest are expert-data-parallel "
                     "replicas (docs/moe.md).")
    expert_tp: int = doc(1, "MoE: 1 (each expert whole on its rank) or parallel.tp: each expert's matrices split over the TP "
                            "ranks, no SP (without it every TP rank computes every expert of its tokens; docs/moe.md).")
    backend: str | None = doc(None, "Derived unless set: torch.distributed backend, 'nccl' on CUDA, 'gloo' on CPU.")
    device: str | None = doc(None, "Derived unless set: 'cuda' when a GPU is visible, else 'cpu'.")
    timeout_s: float = doc(600.0, "Collective timeout in seconds: a hung or dead rank ends the run after this.")
    world_size: int | None = doc(None, "Derived: tp · pp · cp · dp.")


@dataclass
class TrainConfig:
    """Optimisation and the step loop."""

    iters: int = doc(100, "Number of optimizer steps to train for.")
    micro_batch_size: int = doc(1, "Samples per micro-batch per data-parallel rank.")
    global_batch_size: int | None = doc(None, "Derived (= micro_batch_size · dp) unless set: samples per optimizer "
                                              "step over all ranks, a multiple of micro_batch_size · dp.")
    grad_accum_steps: int | None = doc(None, "Derived: micro-batches per rank per step = global_batch_size / "
                                             "(micro_batch_size · dp).")
    seed: int = doc(1234, "Seed of the model initialisation, data order and dropout.")
    precision: str = doc("fp32", "fp32 | bf16 (bf16 params, fp32 master params and grad accumulation) | fp16 "
                                 "(like bf16, with dynamic loss scaling: overflowing steps are skipped).")
    skip_nan_steps: bool = doc(False, "fp32/bf16: skip a step whose gradient norm is inf/NaN (logged) instead of "
                                      "stopping with an error. fp16 always skips overflowing steps.")
    loss_scale_init: float = doc(65536.0, "fp16: initial loss scale.")
    loss_scale_window: int = doc(1000, "fp16: grow the loss scale ×2 after this many steps without overflow.")
    loss_scale_hysteresis: int = doc(2, "fp16: overflows tolerated before the loss scale is halved.")
    lr: float = doc(3e-4, "Peak learning rate.")
    min_lr: float = doc(3e-5, "Learning rate at the end of the decay.")
    lr_warmup_iters: int | None = doc(None, "Derived unless set: linear warm-up steps from 0 to lr; 0, or "
                                            "round(lr_warmup_fraction · lr_decay_iters) when that is set.")
    lr_warmup_fraction: float | None = doc(None, "Warm-up as a fraction in [0, 1] of lr_decay_iters (Megatron "
                                                 "--lr-warmup-fraction), so a shortened run keeps a fitting warm-up. "
                                                 "Set this or lr_warmup_iters, not both.")
    lr_decay_style: str = doc("cosine", "cosine | linear | constant, from lr to min_lr after warm-up.")
    lr_decay_iters: int | None = doc(None, "Derived (= iters) unless set: the step at which the decay reaches min_lr.")
    weight_decay: float = doc(0.1, "AdamW weight decay (not applied to biases and norm weights).")
    adam_beta1: float = doc(0.9, "AdamW beta1.")
    adam_beta2: float = doc(0.95, "AdamW beta2.")
    adam_eps: float = doc(1e-8, "AdamW epsilon.")
    optimizer: str = doc("adamw", "adamw | muon: Muon for the 2-D weights of attention, MLPs and experts, AdamW (with "
                                  "the adam_* keys) for the rest (docs/optimizer.md, \"Muon\").")
    muon_momentum: float = doc(0.95, "Muon: momentum μ of buf = μ·buf + (1-μ)·grad.")
    muon_nesterov: bool = doc(True, "Muon: orthogonalise (1-μ)·grad + μ·buf instead of buf.")
    muon_ns_steps: int = doc(5, "Muon: Newton–Schulz iterations.")
    muon_update_scale: str = doc("moonlight", "Muon: the orthogonalised m×n update times moonlight 0.2·sqrt(max(m, "
                                              "n)) (AdamW's update RMS: its lr and weight decay carry over) | spectral "
                                              "sqrt(max(1, m/n)) | none.")
    muon_split_heads: bool = doc(False, "Muon: orthogonalise q, k and v per head instead of per projection.")
    clip_grad: float = doc(1.0, "Clip the global gradient norm to this; 0 disables clipping.")
    label_smoothing: float = doc(0.0, "ε in [0, 1) of the cross entropy over the full (unpadded) vocabulary (Megatron "
                                      "--label-smoothing); the logged loss and val_loss are the smoothed loss.")
    z_loss: float = doc(0.0, "PaLM's z-loss coefficient, e.g. 1e-4 (0: off): adds z_loss·log²Z per token, masked and "
                             "averaged like the cross entropy; the logged loss and val_loss include it.")
    compile: bool | None = doc(None, "Derived unless set: true on CUDA, false on CPU. Run each layer's pointwise "
                                     "regions through torch.compile (first step includes compile time). docs/compile.md.")
    cache_host_memory: bool = doc(True, "Keep the memory the process frees for reuse (glibc malloc: no mmap of "
                                        "blocks up to 2 GiB, no heap trim) instead of page-faulting large tensors "
                                        "back every step; the resident size stays at its peak. No effect off glibc.")
    preflight: bool = doc(True, "Before any data is built or any rank starts, hold the planner's per-rank memory "
                                "against this host (RAM shared by the local ranks on CPU, one GPU's memory) and "
                                "refuse a layout that cannot fit, naming one that does (docs/planner.md).")
    eval_interval: int = doc(0, "Run validation every this many steps (0: never).")
    eval_iters: int = doc(4, "Global batches per validation run.")
    sample_prompt: str | None = doc(None, "If set, print a greedy sample continuing this prompt at the end.")
    sample_tokens: int = doc(48, "Tokens generated for sample_prompt.")


@dataclass
class DataConfig:
    """Training data: Megatron mmap indexed datasets (.bin + .idx), one or a weighted blend."""

    paths: list = doc([], "Dataset prefixes (each names PREFIX.bin and PREFIX.idx): [PREFIX], or a blend [w1, PREFIX1, "
                          "w2, PREFIX2, ...] (Megatron's --data-path; no weights: by tokens). docs/data.md, Blending.")
    split: str = doc("98,2,0", "train,valid,test ratios over the documents of each dataset, Megatron style.")
    eod_mask_loss: bool = doc(False, "Leave out of the loss the positions whose input token is EOD (Megatron's "
                                        "rule: predicting EOD is trained, guessing the next document's start is not).")
    reset_position_ids: bool = doc(False, "Rotary positions restart at 0 after each end-of-document token inside a sample.")
    reset_attention_mask: bool = doc(False, "Packed documents: a token attends only to earlier tokens of its own document "
                                            "(document ids from end-of-document tokens).")
    packing: str = doc("eod", "eod: samples cut from EOD-delimited documents | position_ids: Hugging Face pre-packed "
                              "samples (tools/preprocess_data.py --packed-samples; docs/data.md, Pre-packed samples).")
    num_workers: int = doc(0, "Loader processes per rank that read and collate batches ahead of the step (0: in the "
                              "training process, cheaper on CPU unless storage is slow; docs/data.md).")
    prefetch_factor: int = doc(2, "Batches each loader process prepares ahead (data.num_workers > 0).")
    build_demo: bool = doc(False, "If the data or tokenizer files are absent, build the demo corpus (from the "
                                  "Python standard library's sources), train the tokenizer and preprocess it.")
    demo_dir: str = doc("data/demo", "Where build_demo writes the corpus, tokenizer and dataset.")
    cache_dir: str | None = doc(None, "Derived (= each dataset's directory) unless set: where the index caches are "
                                      "written (named by a hash of their parameters and dataset files).")


@dataclass
class TokenizerConfig:
    """How text becomes token ids."""

    type: str = doc("sentencepiece", "sentencepiece | hf (a Hugging Face tokenizers tokenizer.json) | byte (raw "
                                     "UTF-8 bytes, 256 ids + EOD + pad).")
    model: str | None = doc(None, "The SentencePiece .model file (type sentencepiece), or the tokenizer.json (or its "
                                  "directory) of type hf.")
    vocab_size: int = doc(4096, "Vocabulary size: of the tokenizer build_demo trains, and what the pre-flight "
                                  "and the missing-tokenizer hint use while the tokenizer file is absent.")
    eod_token: str | None = doc(None, "The end-of-document token. Default: sentencepiece's eos piece; hf: the first of "
                                      "<|endoftext|>, </s>, <|end_of_text|>, <eos> in the vocabulary.")
    pad_token: str | None = doc(None, "The padding token. Default: the tokenizer's pad piece (<pad>, <|padding|>, "
                                      "[PAD]), else the EOD token.")


@dataclass
class CheckpointConfig:
    """Saving and resuming."""

    save: str | None = doc(None, "Directory to save checkpoints into (none: no checkpoints); '{name}' in it becomes "
                                 "logging.name.")
    load: str | None = doc(None, "Directory to resume from (its 'latest' checkpoint); '{name}' in it becomes "
                                 "logging.name.")
    interval: int = doc(0, "Save every this many steps (0: only at the end).")
    keep: int = doc(0, "Keep only the newest this many checkpoints (0: keep all).")
    save_at_end: bool = doc(True, "Save a checkpoint after the last step (needs save).")
    async_save: bool = doc(False, "Write checkpoint files in a background thread while training goes on; the "
                                  "checkpoint becomes 'latest' once every rank has written it (docs/checkpoints.md).")
    auto_resume: bool = doc(False, "Resume from checkpoint.save's 'latest' when it exists (else from checkpoint.load, "
                                   "else from scratch), so a restarted or requeued job continues where it stopped.")
    overwrite: bool = doc(False, "Let this run save into a checkpoint.save directory holding checkpoints it does not "
                                 "resume from (refused at start-up when off; docs/checkpoints.md).")
    allow_data_change: bool = doc(False, "Resume although model.seq_length or the tokenizer differs from the "
                                         "checkpoint's (refused when off): the sample index goes on from its "
                                         "consumed_samples in the new data order (docs/checkpoints.md).")
    allow_optimizer_change: bool = doc(False, "Resume a checkpoint of another train.optimizer (refused when off): "
                                              "the weights load, the optimizer state starts fresh.")


@dataclass
class LoggingConfig:
    """Run directory, console and metrics."""

    name: str = doc("default", "The run's name (letters, digits, '.', '_', '-'): '{name}' in logging.dir, "
                               "checkpoint.save and checkpoint.load becomes it, so one override names a run's "
                               "directories, e.g. logging.name=tp2.")
    dir: str = doc("runs/{name}", "Run directory: receives config.yml and metrics.jsonl ('{name}': logging.name).")
    interval: int = doc(10, "Log a progress line and a metrics record every this many steps.")
    wandb: bool = doc(False, "Also log to Weights & Biases (needs the 'logging' extra; WANDB_MODE=offline works).")
    wandb_project: str = doc("megatron_sp", "wandb project name.")
    tensorboard: bool = doc(False, "Also log to TensorBoard under dir/tensorboard (needs the 'logging' extra).")
    peak_tflops: float | None = doc(None, "Peak dense TFLOP/s of one device for MFU (on GPU its datasheet number "
                                          "for train.precision). Unset on CPU: measured at start-up per host.")
    level: str = doc("info", "Console log level: debug | info | warning.")
    dump_grads_step: int = doc(0, "If > 0, write every parameter's full (unsharded) gradient after that step's "
                                  "reduction and before clipping to dir/grads_step<N>.pt (parity checks).")


@dataclass
class Config:
    """The whole config tree."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


SECTIONS: dict[str, type] = {f.name: f.default_factory for f in fields(Config)}  # type: ignore[misc]
