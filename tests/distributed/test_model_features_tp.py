"""The open-model features (QK-norm, q/k/v bias, head_dim ≠ hidden/heads, llama3 rope) in one model under tp2, with and
without SP, column-parallel and replicated-group QKV, against the 1-rank model (fp64): loss and every gradient after
the trainer's TP sum of ``sequence_parallel`` parameters (the QK-norm weights see only a rank's heads, so they need it
with and without SP). The same for OLMo-2's features (QK-norm over the whole projection: its statistic all-reduced
over TP, its weights split like the heads or, for a replicated kv group, whole; norms after the sublayers), and for
DeepSeek's latent attention (the replicated down projections and latent norms summed over TP under SP), with and
without a query latent. Full recompute on one rank is checked in the same launch."""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from megatron_sp.config.schema import ModelConfig
from megatron_sp.model import GPTModel
from megatron_sp.mpu import ParallelContext, comm, shard
from megatron_sp.testing import run_distributed

S, B = 16, 2


def _cfg(kv: int, recompute: str = "none", olmo: bool = False) -> ModelConfig:
    olmo2 = {"qk_norm_scope": "projection", "norm_placement": "post_sublayer"} if olmo else {}
    return ModelConfig(arch="llama", num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=kv, head_dim=12,
                       ffn_hidden_size=48, rotary_pct=1.0, seq_length=S, vocab_size=50, padded_vocab_size=64,
                       qk_norm=True, qkv_bias=True, rope_scaling="llama3", rope_scaling_factor=8.0,
                       rope_original_max_positions=8, init_std=0.2, recompute=recompute, **olmo2)


def _run(model: GPTModel, rank: int = 0, world: int = 1) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and grads of ``model`` (this rank's shards) on a fixed batch, its norms and biases moved off 1 and 0."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                g = torch.Generator().manual_seed(len(name))
                full = 1 + 0.3 * torch.randn(p.shape[0] * (world if p.tensor_model_parallel else 1), generator=g)
                p.copy_(shard(full, p.partition_dim, rank, world) if p.tensor_model_parallel else full)
    tokens = torch.randint(0, 50, (B, S), generator=torch.Generator().manual_seed(3))
    loss = model(tokens, labels=tokens.roll(-1, 1)).mean()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _mla_cfg(q_lora: int, recompute: str = "none") -> ModelConfig:
    """DeepSeek's latent attention (the loader's derived head_dim = nope + rope, num_kv_heads = num_heads by hand)."""
    return ModelConfig(arch="llama", num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=4, head_dim=12,
                       ffn_hidden_size=48, rotary_pct=1.0, seq_length=S, vocab_size=50, padded_vocab_size=64,
                       kv_lora_rank=16, q_lora_rank=q_lora, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
                       init_std=0.2, recompute=recompute)


# (case, config with a recompute mode, sequence parallelism): column-parallel QKV with / without SP; a replicated kv
# group (Qwen3's per-head QK-norm, OLMo-2's over the projection); MLA with and without a query latent
CASES = [(f"kv{kv} sp{sp}{' olmo' if olmo else ''}", functools.partial(_cfg, kv, olmo=olmo), sp)
         for kv, sp, olmo in ((2, True, False), (2, False, False), (1, False, False), (2, True, True),
                              (2, False, True), (1, True, True))] + \
        [(f"mla q_lora{q} sp{sp}", functools.partial(_mla_cfg, q), sp) for q, sp in ((24, True), (24, False), (0, True))]


def _features(rank: int, world: int) -> dict[str, float]:
    group, errors = dist.group.WORLD, {}
    for case, cfg, sp in CASES:
        ref_loss, ref = _run(GPTModel(cfg(), seed=5).double())
        model = GPTModel(cfg(), seed=5, parallel=ParallelContext(tp_group=group, sequence_parallel=sp)).double()
        loss, grads = _run(model, rank, world)
        errors[f"{case} loss"] = abs(loss.item() - ref_loss.item()) / ref_loss.item()
        for name, p in model.named_parameters():
            grad = comm.all_reduce(grads[name].clone(), group) if p.sequence_parallel else grads[name]
            want = shard(ref[name], p.partition_dim, rank, world) if p.tensor_model_parallel else ref[name]
            errors[f"{case} {name}"] = ((grad - want).abs().max() / want.abs().max()).item()
    if rank == 0:  # full recompute replays the same layers: the same grads
        for case, cfg in (("recompute", functools.partial(_cfg, 2)), ("mla recompute", functools.partial(_mla_cfg, 24))):
            ref_loss, ref = _run(GPTModel(cfg(), seed=5).double())
            loss, grads = _run(GPTModel(cfg(recompute="full"), seed=5).double())
            errors[f"{case} loss"] = abs(loss.item() - ref_loss.item())
            errors.update({f"{case} {n}": (grads[n] - g).abs().max().item() for n, g in ref.items()})
    return errors


def test_features_under_tp2_equal_one_rank() -> None:
    for errors in run_distributed(_features, 2):
        bad = {k: v for k, v in errors.items() if not v <= 1e-12}
        assert not bad, bad
