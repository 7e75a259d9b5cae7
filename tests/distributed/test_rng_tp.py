"""RNG streams over a TP×PP grid and checkpointed TP blocks, on gloo.

World 2 runs the layout tp=2; world 4 runs tp=4 and tp=2 × pp=2 (each rank builds the groups
with ``mpu.initialize``). After ``init_rng`` every rank draws a dropout mask on the default
stream and one inside ``fork("tp-different")`` and sends them back: the test compares them
across ranks. Each rank also runs ColumnParallelLinear → GeLU → dropout (tp-different) →
RowParallelLinear → hidden dropout (tp-different under SP, default stream without) twice from one
RNG state, once plain and once under ``checkpoint``, and returns both results.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_sp.mpu import ColumnParallelLinear, ParallelDims, RowParallelLinear, initialize
from megatron_sp.mpu.random import TP_DIFFERENT, RNGTracker, checkpoint, init_rng
from megatron_sp.testing import run_distributed

SEED = 1234
P = 0.5  # dropout probability
N_MASK = 512  # mask length
S, B, H, FF = 8, 2, 8, 16  # seq (divisible by every tp), batch, hidden, ffn
INDEPENDENT_MIN = 0.3  # two independent p=0.5 masks of 512 differ in ~50% of places; equal ones in 0%
LAYOUTS = {2: [{"tp": 2}], 4: [{"tp": 4}, {"tp": 2, "pp": 2}]}


def _full(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _masks(tracker: RNGTracker) -> dict[str, torch.Tensor]:
    ones = torch.ones(N_MASK)
    default = F.dropout(ones, P, True) != 0
    with tracker.fork(TP_DIFFERENT):
        tp_different = F.dropout(ones, P, True) != 0
    again = F.dropout(ones, P, True) != 0  # the fork did not disturb the default stream's sequence
    return {"default": default, "tp-different": tp_different, "default again": again}


def _block(x: torch.Tensor, col: ColumnParallelLinear, row: RowParallelLinear, tracker: RNGTracker,
           sp: bool) -> torch.Tensor:
    h = F.gelu(col(x))  # [s, b, ff/t]: sharded over TP
    with tracker.fork(TP_DIFFERENT):
        h = F.dropout(h, P, True)
    y = row(h)  # [s/t, b, h] under SP, else [s, b, h] replicated
    if sp:
        with tracker.fork(TP_DIFFERENT):
            return F.dropout(y, P, True)
    return F.dropout(y, P, True)


def _block_run(group, tracker: RNGTracker, sp: bool, autocast: bool, ckpt: bool) -> dict[str, torch.Tensor]:
    col = ColumnParallelLinear(H, FF, bias=True, group=group, sequence_parallel=sp)
    row = RowParallelLinear(FF, H, bias=True, group=group, sequence_parallel=sp)
    with torch.no_grad():
        col.weight.copy_(col.shard_of(_full((FF, H), 1), "weight"))
        col.bias.copy_(col.shard_of(_full((FF,), 2), "bias"))
        row.weight.copy_(row.shard_of(_full((H, FF), 3), "weight"))
        row.bias.copy_(row.shard_of(_full((H,), 4), "bias"))
    t, r = col.tp_size, col.tp_rank
    X, G = _full((S, B, H), 5), _full((S, B, H), 6)
    x = (X.chunk(t, 0)[r] if sp else X).clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        if ckpt:
            y = checkpoint(_block, x, col, row, tracker, sp, tracker=tracker)
        else:
            y = _block(x, col, row, tracker, sp)
    y.float().backward(G.chunk(t, 0)[r] if sp else G)
    return {"y": y.detach(), "grad x": x.grad, "col grad w": col.weight.grad, "col grad b": col.bias.grad,
            "row grad w": row.weight.grad, "row grad b": row.bias.grad,
            "rng after": torch.get_rng_state(), **{f"tracker after {k}": v for k, v in tracker.get_states().items()}}


def _block_cases(group, tracker: RNGTracker) -> dict[str, dict[str, dict[str, torch.Tensor]]]:
    out = {}
    for sp in (False, True):
        for autocast in (False, True):
            start = (torch.get_rng_state(), tracker.get_states())
            plain = _block_run(group, tracker, sp, autocast, ckpt=False)
            torch.set_rng_state(start[0])
            tracker.set_states(start[1])
            ckpt = _block_run(group, tracker, sp, autocast, ckpt=True)
            out[f"sp={sp} autocast={autocast}"] = {"plain": plain, "checkpoint": ckpt}
    return out


def _worker(rank: int, world: int) -> dict[str, dict[str, object]]:
    results = {}
    for layout in LAYOUTS[world]:
        state = initialize(ParallelDims(**layout, world_size=world))
        tracker = RNGTracker("cpu")
        init_rng(tracker, SEED, state.tp_rank, state.pp_rank)
        results[str(layout)] = {"coords": state.coords, "masks": _masks(tracker),
                                "blocks": _block_cases(state.tp_group, tracker)}
        state.destroy()
    return results


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def results(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, dict[str, object]]]]:
    return request.param, run_distributed(_worker, request.param)


def _layouts(results) -> list[tuple[str, list[dict[str, object]]]]:
    world, per_rank = results
    return [(str(layout), [res[str(layout)] for res in per_rank]) for layout in LAYOUTS[world]]


def _differ(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a != b).float().mean().item()


def test_masks_across_tp_and_pp(results):
    """tp-different: a different mask on every rank; default: one mask per stage, different between stages."""
    checked = 0
    for layout, ranks in _layouts(results):
        for i, ri in enumerate(ranks):
            mi, pi = ri["masks"], ri["coords"]["pp"]
            assert 0.3 <= mi["default"].float().mean().item() <= 0.7, "not a p=0.5 mask"
            assert _differ(mi["default"], mi["default again"]) >= INDEPENDENT_MIN
            for j, rj in enumerate(ranks[:i]):
                mj, pj = rj["masks"], rj["coords"]["pp"]
                where = f"{layout}: ranks {j} and {i}"
                assert _differ(mi["tp-different"], mj["tp-different"]) >= INDEPENDENT_MIN, \
                    f"{where}: tp-different masks agree"
                if pi == pj:  # the same TP group (no dp/cp here): identical default masks
                    assert _differ(mi["default"], mj["default"]) == 0.0, f"{where}: default masks differ within TP"
                    assert _differ(mi["default again"], mj["default again"]) == 0.0, f"{where}: default after fork"
                else:
                    assert _differ(mi["default"], mj["default"]) >= INDEPENDENT_MIN, \
                        f"{where}: stages {pj} and {pi} share the default stream"
                checked += 1
    assert checked > 0


def test_checkpointed_tp_block_is_bitwise_equal(results):
    """Outputs, input and weight/bias grads, and the RNG/tracker states after backward: tolerance 0."""
    checked = 0
    for layout, ranks in _layouts(results):
        for rank, res in enumerate(ranks):
            for case, pair in res["blocks"].items():
                plain, ckpt = pair["plain"], pair["checkpoint"]
                assert plain.keys() == ckpt.keys()
                for key, want in plain.items():
                    assert want is not None, f"{layout} rank {rank} {case}: {key} missing"
                    where = f"{layout} rank {rank} {case} {key}"
                    torch.testing.assert_close(ckpt[key], want, rtol=0.0, atol=0.0,
                                               msg=lambda m, where=where: f"{where}: {m}")
                    checked += 1
    assert checked > 0


def test_replicated_output_stays_replicated(results):
    """Without SP the block output (dropped on the default stream) is identical on every TP rank;
    under SP the shards drop with independent masks."""
    for layout, ranks in _layouts(results):
        for case in ("sp=False autocast=False", "sp=False autocast=True"):
            for stage in {r["coords"]["pp"] for r in ranks}:
                ys = [r["blocks"][case]["plain"]["y"] for r in ranks if r["coords"]["pp"] == stage]
                for y in ys[1:]:
                    torch.testing.assert_close(y, ys[0], rtol=0.0, atol=0.0)
                gxs = [r["blocks"][case]["plain"]["grad x"] for r in ranks if r["coords"]["pp"] == stage]
                for gx in gxs[1:]:
                    torch.testing.assert_close(gx, gxs[0], rtol=0.0, atol=0.0)
        sp_zeros = [(r["blocks"]["sp=True autocast=False"]["plain"]["y"] == 0) for r in ranks
                    if r["coords"]["pp"] == 0]
        for z in sp_zeros[1:]:
            assert _differ(z, sp_zeros[0]) >= 0.2, f"{layout}: SP shards share a dropout mask"
