"""Expert parallelism (issue 33, slice 2): the MoE layer with its experts split over an ep group, against the
unsharded layer in the same process (fp64).

Rank j of an ep group routes its own tokens ``X_j`` (as a data-parallel rank would). The reference runs the full
layer on each ``X_j`` with the incoming gradient ``G_j``. Then on rank r: the output and the input gradient are the
reference's on ``X_r``; the router (a dense parameter, reduced over dp_cp by the optimizer later) has the gradient
of ``X_r`` alone; each local expert has the gradient summed over every ``X_j`` of the group (the tokens of all ep
ranks reach their expert's owner), i.e. slice r of that sum. With capacity and the aux/z losses in the gradient.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_sp.config.schema import ModelConfig
from megatron_sp.model import moe
from megatron_sp.model.transformer import EAGER, MLP, arch_spec
from megatron_sp.mpu import ParallelContext, ParallelDims, comm
from megatron_sp.mpu.sharding import full_shape, local_shard_of
from megatron_sp.testing import run_distributed

S, B, H, E, F_EXP = 8, 2, 16, 8, 12
CASES = {  # name: model overrides
    "llama_top2_capacity_aux": {"arch": "llama", "moe_capacity_factor": 1.0, "moe_aux_loss_coeff": 0.1,
                                "moe_z_loss_coeff": 0.01},
    "neox_top1_shared_sigmoid": {"arch": "neox", "moe_top_k": 1, "moe_shared_experts": 1, "moe_router_score": "sigmoid"},
}


def _cfg(**overrides: object) -> ModelConfig:
    base: dict[str, object] = {"arch": "llama", "num_layers": 2, "hidden_size": H, "num_heads": 2, "seq_length": S,
                               "vocab_size": 50, "padded_vocab_size": 64, "num_kv_heads": 2, "ffn_hidden_size": 32,
                               "rotary_pct": 1.0, "num_experts": E, "moe_top_k": 2, "moe_ffn_hidden_size": F_EXP,
                               "moe_aux_loss_coeff": 0.0}
    base.update(overrides)
    return ModelConfig(**base)


def _layer(cfg: ModelConfig, dtype: torch.dtype, group: object = comm.LOCAL) -> moe.MoE:
    shared = MLP(cfg, None, cfg.moe_shared_experts * cfg.moe_ffn_hidden_size) if cfg.moe_shared_experts else None
    return moe.MoE(cfg, arch_spec(cfg.arch), EAGER, shared, ParallelContext(ep_group=group)).to(dtype)


def _check(cfg: ModelConfig, group: object, members: list[int], dtype: torch.dtype) -> dict[str, float]:
    """Max error of output, input grad and every parameter grad of this rank's EP layer against the reference."""
    def rand(shape: tuple[int, ...], seed: int) -> torch.Tensor:
        return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)

    ref = _layer(cfg, dtype)
    with torch.no_grad():
        for i, p in enumerate(ref.parameters()):
            p.copy_(rand(tuple(p.shape), 100 + i) * 0.5)
    xs = [rand((S, B, H), 10 + j) for j in members]
    gs = [rand((S, B, H), 20 + j) for j in members]
    sums = {n: torch.zeros_like(p) for n, p in ref.named_parameters()}
    outs, dxs, own = [], [], {}
    me = members.index(dist.get_rank())
    for j, (x, g) in enumerate(zip(xs, gs)):
        ref.zero_grad()
        x = x.clone().requires_grad_(True)
        out = ref(x)
        out.backward(g)
        outs.append(out.detach())
        dxs.append(x.grad)
        for n, p in ref.named_parameters():
            sums[n] += p.grad
            if j == me:
                own[n] = p.grad.clone()

    layer = _layer(cfg, dtype, group)
    full = dict(ref.named_parameters())
    with torch.no_grad():
        for n, p in layer.named_parameters():
            assert full_shape(p, 1) == tuple(full[n].shape), n
            p.copy_(local_shard_of(full[n], p, 0, 1))
    x = xs[me].clone().requires_grad_(True)
    with comm.count() as counter:
        out = layer(x)
        out.backward(gs[me])
    errs = {"out": (out - outs[me]).abs().max().item(), "dx": (x.grad - dxs[me]).abs().max().item()}
    for n, p in layer.named_parameters():
        want = local_shard_of(sums[n], p, 0, 1) if getattr(p, "expert_parallel", False) else own[n]
        errs[n] = ((p.grad - want).abs().max() / want.abs().max()).item()
    # forward: counts, rows out (dispatch) and back (combine); backward: the two row exchanges reversed. Bytes: the
    # counts for the other ranks, then rows sent to other ranks (dispatch) and rows returned to them (combine), twice
    assert counter.calls["all_to_all"] == 5, counter.calls
    owner = [moe.route(ref.router(x.view(-1, H)), cfg.moe_top_k, cfg.moe_router_score)[0].view(-1) // (E // len(xs))
             for x in xs]
    sent = int((owner[me] != me).sum())
    returned = sum(int((o == me).sum()) for j, o in enumerate(owner) if j != me)
    if cfg.moe_capacity_factor is None:  # (capacity drops rows before they are sent)
        counts_bytes = (len(members) - 1) * (E // len(members)) * 8
        assert counter.bytes["all_to_all"] == counts_bytes + 2 * (sent + returned) * H * 8, (counter.bytes, sent)
    return errs


def _worker(rank: int, world: int) -> dict[str, dict[str, float]]:
    torch.manual_seed(0)
    results = {}
    layouts = [list(range(world))] if world == 2 else [list(range(world)), [0, 1], [2, 3]]
    groups = {tuple(m): dist.new_group(m) for m in layouts}  # every rank creates every group, in order
    for members in layouts:
        if rank not in members:
            continue
        for name, overrides in CASES.items():
            results[f"ep{len(members)} {name}"] = _check(_cfg(**overrides), groups[tuple(members)], members, torch.float64)
        # fp32: the grouped GEMM (fp64 runs the loop), against the reference's own grouped GEMM
        results[f"ep{len(members)} fp32"] = _check(_cfg(**CASES["llama_top2_capacity_aux"]), groups[tuple(members)],
                                                   members, torch.float32)
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_ep_layer_equals_the_unsharded_layer(world: int) -> None:
    for rank, results in enumerate(run_distributed(_worker, world)):
        for case, errs in results.items():
            bad = {k: v for k, v in errs.items() if not v <= (1e-5 if "fp32" in case else 1e-12)}
            assert not bad, f"rank {rank} {case}: {bad}"
        assert len(results) == (3 if world == 2 else 6)


def test_expert_groups_fold_cp_dp_ranks() -> None:
    """ep consecutive in each (tp, pp) position's cp·dp ranks; edp across the runs; tp ranks never share a group."""
    dims = ParallelDims(tp=2, dp=4, ep=2)
    ep, edp = dims.expert_groups()
    assert ep == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert edp == [[0, 4], [2, 6], [1, 5], [3, 7]]
    ep, edp = ParallelDims(cp=2, dp=2, pp=2, ep=4).expert_groups()
    assert ep == [[0, 1, 2, 3], [4, 5, 6, 7]] and edp == [[0], [1], [2], [3], [4], [5], [6], [7]]
    with pytest.raises(Exception, match="parallel.ep = 3 must divide cp·dp"):
        ParallelDims(dp=4, ep=3)
    # under SP (ep_tp) the TP ranks route their own tokens: the fold is tp·cp·dp of each stage, tp innermost
    ep, edp = ParallelDims(tp=2, dp=2, pp=2, ep=2, ep_tp=True).expert_groups()
    assert ep == [[0, 1], [2, 3], [4, 5], [6, 7]] and edp == [[0, 2], [1, 3], [4, 6], [5, 7]]
    ep, edp = ParallelDims(tp=2, cp=2, ep=4, ep_tp=True).expert_groups()
    assert ep == [[0, 1, 2, 3]] and edp == [[0], [1], [2], [3]]
    with pytest.raises(Exception, match="parallel.ep = 4 must divide tp·cp·dp = 2"):
        ParallelDims(tp=2, ep=4, ep_tp=True)
