"""Multi-head latent attention (``model.kv_lora_rank``) in a 2-layer llama under tp2, with and without SP, with and
without a query latent, against the 1-rank model in fp64: loss and every gradient after the trainer's TP sum of the
``sequence_parallel`` parameters (the replicated down projections and latent norms under SP). Full recompute on one
rank in the same launch. The layer itself against transformers' DeepseekV3Attention: tests/unit/test_mla.py."""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_sp.config.schema import ModelConfig
from megatron_sp.model import GPTModel
from megatron_sp.mpu import ParallelContext, comm, shard
from megatron_sp.testing import run_distributed

S, B = 16, 2


def mla_cfg(q_lora: int, recompute: str = "none") -> ModelConfig:
    """A tiny MLA llama (the loader's derived head_dim = nope + rope and num_kv_heads = num_heads set by hand)."""
    return ModelConfig(arch="llama", num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=4, head_dim=12,
                       ffn_hidden_size=48, rotary_pct=1.0, seq_length=S, vocab_size=50, padded_vocab_size=64,
                       kv_lora_rank=16, q_lora_rank=q_lora, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
                       init_std=0.2, recompute=recompute)


def _run(model: GPTModel) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    tokens = torch.randint(0, 50, (B, S), generator=torch.Generator().manual_seed(3))
    loss = model(tokens, labels=tokens.roll(-1, 1)).mean()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _rank(rank: int, world: int) -> dict[str, float]:
    group, errors = dist.group.WORLD, {}
    for q_lora, sp in ((24, True), (24, False), (0, True)):
        ref_loss, ref = _run(GPTModel(mla_cfg(q_lora), seed=5).double())
        model = GPTModel(mla_cfg(q_lora), seed=5, parallel=ParallelContext(tp_group=group, sequence_parallel=sp)).double()
        loss, grads = _run(model)
        case = f"q_lora{q_lora} sp{sp}"
        errors[f"{case} loss"] = abs(loss.item() - ref_loss.item()) / ref_loss.item()
        for name, p in model.named_parameters():
            grad = comm.all_reduce(grads[name].clone(), group) if p.sequence_parallel else grads[name]
            want = shard(ref[name], p.partition_dim, rank, world) if p.tensor_model_parallel else ref[name]
            errors[f"{case} {name}"] = ((grad - want).abs().max() / want.abs().max()).item()
    if rank == 0:
        ref_loss, ref = _run(GPTModel(mla_cfg(24), seed=5).double())
        loss, grads = _run(GPTModel(mla_cfg(24, "full"), seed=5).double())
        errors["recompute loss"] = abs(loss.item() - ref_loss.item())
        errors.update({f"recompute {n}": (grads[n] - g).abs().max().item() for n, g in ref.items()})
    return errors


def test_mla_under_tp2_equals_one_rank() -> None:
    for errors in run_distributed(_rank, 2):
        bad = {k: v for k, v in errors.items() if not v <= 1e-12}
        assert not bad, bad
