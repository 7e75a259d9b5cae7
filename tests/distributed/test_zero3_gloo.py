"""ZeRO-3 on two gloo ranks (dp2) against ZeRO-0 on the same ranks: a tied llama (the head reads the embedding unit)
trains 2 steps of 2 micro-batches. Losses equal bit for bit (the gathered weights are the weights), reduced gradients
and updated parameters within the fp32 reduction-order tolerance (and bit for bit ZeRO-2's, which sums in the same
order), bf16 with one micro-batch bit for bit; between uses
every sharded parameter's storage is empty, at most the current and the prefetched entries are gathered, an eval
forward leaves nothing gathered, and ``full_params`` writes reach the shards (and the next forward)."""
from __future__ import annotations

from typing import Any

import torch

from megatron_sp.config import TrainConfig
from megatron_sp.config.schema import ModelConfig
from megatron_sp.model import GPTModel
from megatron_sp.model.gpt import param_unit
from megatron_sp.mpu import ParallelContext, ParallelDims, initialize
from megatron_sp.optim import DistributedOptimizer, named_trainable
from megatron_sp.testing import run_distributed

S, B = 16, 2
RTOL = 1e-6


def _model_cfg() -> ModelConfig:
    return ModelConfig(arch="llama", num_layers=3, hidden_size=32, num_heads=4, num_kv_heads=2, ffn_hidden_size=48,
                       seq_length=S, vocab_size=50, padded_vocab_size=64, tie_embeddings=True, init_std=0.2,
                       rotary_pct=1.0)


def _batch(step: int, micro: int, rank: int) -> torch.Tensor:
    return torch.randint(0, 50, (B, S + 1), generator=torch.Generator().manual_seed(100 * step + 10 * micro + rank))


def _train(rank: int, state: Any, zero: int, precision: str, micro: int, prefetch: int = 1) -> dict[str, Any]:
    model = GPTModel(_model_cfg(), seed=7, parallel=ParallelContext.from_state(state))
    opt = DistributedOptimizer(named_trainable(model), TrainConfig(clip_grad=1.0), state, zero=zero,
                               precision=precision, unit_of=param_unit, prefetch=prefetch, bucket_bytes=4096)
    model.param_units = opt.units
    out: dict[str, Any] = {"losses": [], "peak_gathered": 0}
    units = opt.units
    sharded = [p for _, p in named_trainable(model)] if units is not None else []
    if units is not None:
        out["empty_at_start"] = all(p.untyped_storage().nbytes() == 0 for p in sharded)
        launch = units.launch

        def counting(keys: Any) -> None:
            launch(keys)
            live = sum(b.numel for bs in units.buckets.values() for b in bs if b.full.untyped_storage().nbytes())
            out["peak_gathered"] = max(out["peak_gathered"], live)
        units.launch = counting  # type: ignore[method-assign]
    for step in range(2):
        opt.zero_grad()
        for m in range(micro):
            tokens = _batch(step, m, rank)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                loss = model(tokens[:, :-1], labels=tokens[:, 1:]).sum() / (B * S * 2 * micro)
            opt.sync_grads = m == micro - 1
            loss.backward()
            out["losses"].append(loss.item())
        if step == 0:
            out["grads"] = opt.main_grads_by_name()
        opt.step(1e-2)
        if units is not None:
            out.setdefault("empty_after_step", []).append(all(p.untyped_storage().nbytes() == 0 for p in sharded))
    model.eval()
    with torch.no_grad():
        out["eval"] = model(_batch(9, 0, 0)[:, :-1]).float()
    if units is not None:
        out["empty_after_eval"] = all(p.untyped_storage().nbytes() == 0 for p in sharded)
    if units is not None:
        units.launch = launch  # type: ignore[method-assign]  # (full_params gathers everything at once)
    with opt.full_params(), torch.no_grad():
        out["params"] = {n: p.detach().float().clone() for n, p in named_trainable(model)}
        if units is not None:  # a write through the whole parameters lands in this rank's shard
            model.final_norm.weight.mul_(2.0)
    if units is not None:
        with torch.no_grad():
            out["eval_after_write"] = model(_batch(9, 0, 0)[:, :-1]).float()
        out["units"] = sorted(units.buckets)
    return out


def _worker(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    state = initialize(ParallelDims(dp=world))
    runs = {(zero, precision, micro, prefetch): _train(rank, state, zero, precision, micro, prefetch)
            for zero, precision, micro, prefetch in ((0, "fp32", 2, 1), (2, "fp32", 2, 1), (3, "fp32", 2, 1), (3, "fp32", 2, 0),
                                                     (0, "bf16", 1, 1), (3, "bf16", 1, 1))}
    state.destroy()
    return {str(k): v for k, v in runs.items()}


def _rel(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert got.keys() == want.keys()
    return max(((got[k].double() - want[k].double()).abs().max() / want[k].double().abs().max().clamp_min(1e-30)).item()
               for k in want)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return torch.equal(a, b) if torch.is_tensor(a) else a == b


def test_zero3_matches_zero0_and_frees_between_uses():
    for rank, runs in enumerate(run_distributed(_worker, 2)):
        ref, z3, z3_no_prefetch = runs["(0, 'fp32', 2, 1)"], runs["(3, 'fp32', 2, 1)"], runs["(3, 'fp32', 2, 0)"]
        for run in (z3, z3_no_prefetch):
            assert run["units"] == ["embedding", "head", "layers.0", "layers.1", "layers.2"]
            assert run["losses"][:2] == ref["losses"][:2]  # step 1: the same weights, gathered
            assert max(abs(a - b) / abs(b) for a, b in zip(run["losses"], ref["losses"])) < RTOL
            assert _rel(run["grads"], ref["grads"]) < RTOL, rank
            assert _rel(run["params"], ref["params"]) < 2e-5, rank  # (Adam's m/sqrt(v) of near-zero gradients)
            for key in ("losses", "grads", "params", "eval"):  # ZeRO-2 reduces in the same order: the same bits
                assert _same(run[key], runs["(2, 'fp32', 2, 1)"][key]), (rank, key)
            assert run["empty_at_start"] and all(run["empty_after_step"]) and run["empty_after_eval"]
            # the final norm doubled through full_params: the next forward reads it
            assert not torch.allclose(run["eval_after_write"], run["eval"])
        # gathered at once: the backward keeps the tied embedding (64x32, read by the head first, its gradient complete
        # at the end) with the current layer and, prefetching, the one before it (+ bucket padding: 64)
        layer = 32 * (32 + 2 * 16) + 32 * 32 + 3 * 32 * 48 + 2 * 32  # qkv, out, swiglu, two norms
        assert 64 * 32 + layer <= z3_no_prefetch["peak_gathered"] <= 64 * 32 + 32 + layer + 64
        assert 64 * 32 + 2 * layer <= z3["peak_gathered"] <= 64 * 32 + 32 + 2 * layer + 64
        bf0, bf3 = runs["(0, 'bf16', 1, 1)"], runs["(3, 'bf16', 1, 1)"]
        assert bf3["losses"] == bf0["losses"]
        assert _same(bf3["params"], bf0["params"]), rank
