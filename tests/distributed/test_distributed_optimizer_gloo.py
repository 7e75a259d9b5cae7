"""DistributedOptimizer on gloo ranks against the single-process full-batch run.

Every rank builds the same small MLP from a seed, takes its contiguous slice of each global batch
(12 rows) and normalises its loss by the global row count, as the trainer does with tokens. The
oracle is computed in each rank's process: the same MLP on the whole batch with autograd grads,
``torch.nn.utils.clip_grad_norm_`` and ``torch.optim.AdamW``. Checked per world size (2 and 4),
for ZeRO 0, 1 and 2, 1 and 3 micro-batches, several small buckets (69 elements: not divisible by the
world size, so buckets are padded) and one bucket: reduced main grads, no communication on
non-final micro-batches (ZeRO-2: every bucket reduce-scattered in every micro-batch, into a grad buffer of
the shard's size, no staging buffer left after the sync), grad norm and parameters over 3 steps, an early bucket launch
(overlap), bf16 ZeRO-0 = ZeRO-1 = ZeRO-2, and a checkpoint written at dp2 + ZeRO-1 resumed at dp4 (ZeRO-2) and dp1.
A tp2·dp2 launch checks the TP side: sequence-parallel grads summed over TP (owned elements alike
on both TP ranks, or not), and the grad norm counting TP-replicated parameters once. Both launches
also check that on ~1M-element buffers the grad norm (ZeRO 0 and 1) is the fp64 norm of the full
gradients to 1e-7 and that clipping uses it.
Each launch returns ``{check: (error, tolerance)}``; the test asserts them.
"""
from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

from megatron_sp.config import TrainConfig
from megatron_sp.mpu import ParallelDims, comm, initialize
from megatron_sp.optim.distributed import DistributedOptimizer
from megatron_sp.testing import run_distributed

ROWS = 12  # global batch
STEPS = 3
LRS = [1e-2, 2e-2, 1.5e-2]
CLIP = 0.5
SMALL = 80  # bytes per bucket (20 fp32 elements) → buckets fc2 (24), fc1 (42), scale (3 + padding)
RTOL = 1e-6  # max|Δ| / max|ref|; fp32 reduction order only
BIG = {"big.weight": (1024, 1200), "big.bias": (1200,)}  # ~1.2M elements: torch's fp32 norm is off by >1e-6 here
NORM_RTOL = 1e-7  # grad norm against the fp64 norm of the full gradients


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(5, 7)
        self.fc2 = nn.Linear(7, 3)
        self.scale = nn.Parameter(1 + 0.1 * torch.randn(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x))) * self.scale


def _cfg() -> TrainConfig:
    return TrainConfig(weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, clip_grad=CLIP)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(ROWS, 5, generator=g), torch.randn(ROWS, 3, generator=g)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x) - y) ** 2).sum() / ROWS  # normalised by the GLOBAL count


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape, (got.shape, want.shape)
    scale = want.abs().max().item()
    return (got.double() - want.double()).abs().max().item() / (scale if scale > 0 else 1.0)


def _worst(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    return max(_rel(got[k], want[k]) for k in want)


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().clone() for n, p in model.named_parameters()}


def _reference() -> dict[str, Any]:
    """Single process, full batch: step-1 grads, per-step grad norms and parameters."""
    model, cfg = _MLP(), _cfg()
    opt = torch.optim.AdamW([{"params": [p for p in model.parameters() if p.ndim >= 2], "weight_decay": cfg.weight_decay},
                             {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0}],
                            lr=1.0, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)
    out: dict[str, Any] = {"norms": [], "params": []}
    for step in range(STEPS):
        opt.zero_grad()
        _loss(model, *_batch(step)).backward()
        if step == 0:
            out["grads"] = {n: p.grad.clone() for n, p in model.named_parameters()}
        out["norms"].append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        for group in opt.param_groups:
            group["lr"] = LRS[step]
        opt.step()
        out["params"].append(_params(model))
    return out


def _backward(opt: DistributedOptimizer, model: nn.Module, step: int, rank: int, world: int, n_micro: int) -> list[int]:
    """zero_grad, then forward/backward of this rank's slice of global batch ``step``; comm calls per micro-batch."""
    x, y = _batch(step)
    per_rank = ROWS // world
    x, y = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
    mb = per_rank // n_micro
    calls = []
    opt.zero_grad()
    for i in range(n_micro):
        opt.sync_grads = i == n_micro - 1
        with comm.count() as counter:
            _loss(model, x[i * mb:(i + 1) * mb], y[i * mb:(i + 1) * mb]).backward()
        calls.append(counter.total_calls)
    return calls


def _train_step(opt: DistributedOptimizer, model: nn.Module, step: int, rank: int, world: int) -> tuple[float, bool]:
    _backward(opt, model, step, rank, world, 1)
    return opt.step(LRS[step], clip=CLIP)


def _big_grad(name: str, tp: int, dp: int) -> torch.Tensor:
    """A rank's synthetic gradient on a 2^-10 grid, so that its sums over ranks are exact in fp32."""
    g = torch.Generator().manual_seed(100 * sorted(BIG).index(name) + 10 * tp + dp)
    return torch.randn(BIG[name], generator=g).mul_(1024).round_().div_(1024)


def _big_norm_checks(state: Any, tp_sharded: set[str], tag: str) -> dict[str, tuple[float, float]]:
    """Grad norm and clipping on ~1M-element buffers (ZeRO 0 and 1) against the fp64 norm of the full gradients.

    ``tp_sharded`` parameters get different gradients per TP rank; the others are TP-replicated (counted once).
    """
    tp_of = {n: (range(state.tp_size) if n in tp_sharded else [0]) for n in BIG}
    reduced = {(n, t): sum(_big_grad(n, t, d) for d in range(state.dp_size)) for n in BIG for t in tp_of[n]}
    want = math.sqrt(sum(g.double().square().sum().item() for g in reduced.values()))
    clip = want / 3  # active
    coeff = clip / (want + 1e-6)
    mine = {n: state.tp_rank if n in tp_sharded else 0 for n in BIG}
    checks = {}
    for zero in (0, 1, 2):
        named = [(n, nn.Parameter(torch.zeros(BIG[n]))) for n in BIG]
        for n, p in named:
            p.tensor_model_parallel = n in tp_sharded
        opt = DistributedOptimizer(named, _cfg(), state, zero=zero)
        opt.zero_grad()
        sum((p * _big_grad(n, mine[n], state.dp_rank)).sum() for n, p in named).backward()
        norm, _ = opt.step(0.0, clip=clip)
        checks[f"{tag}.zero{zero}.norm"] = (abs(norm - want) / want, NORM_RTOL)
        # the fp32 grads scaled by the coefficient of the fp64 norm: two fp32 roundings at most
        clipped = {n: reduced[n, mine[n]] * coeff for n in BIG}
        checks[f"{tag}.zero{zero}.clipped"] = (_worst(opt.main_grads_by_name(), clipped), 2.5e-7)
    return checks


def _dp_checks(rank: int, world: int, ckpt: dict[str, Any] | None = None) -> dict[str, Any]:
    state = initialize(ParallelDims(dp=world))
    ref = _reference()
    checks: dict[str, tuple[float, float]] = {}
    facts: dict[str, Any] = {}
    for zero in (0, 1, 2):
        for n_micro in (1, 3):
            for bucket_bytes in (SMALL, 25 * 2**20):
                tag = f"zero{zero}.micro{n_micro}.bucket{bucket_bytes}"
                model = _MLP()
                opt = DistributedOptimizer(list(model.named_parameters()), _cfg(), state, zero=zero,
                                           bucket_bytes=bucket_bytes)
                facts[f"{tag}.layout"] = (opt.numel, len(opt._buckets), opt.shard_numel, opt.grad_buffer.numel())
                for step in range(STEPS):
                    facts[f"{tag}.step{step}.calls"] = _backward(opt, model, step, rank, world, n_micro)
                    opt.finish_grad_sync()
                    facts[f"{tag}.step{step}.staged"] = sum(b.staged is not None for b in opt._buckets) + len(opt._inflight)
                    if step == 0:
                        checks[f"{tag}.grads"] = (_worst(opt.main_grads_by_name(), ref["grads"]), RTOL)
                    norm, stepped = opt.step(LRS[step], clip=CLIP)
                    facts[f"{tag}.step{step}.stepped"] = stepped
                    checks[f"{tag}.step{step}.norm"] = (abs(norm - ref["norms"][step]) / ref["norms"][step], RTOL)
                    checks[f"{tag}.step{step}.params"] = (_worst(_params(model), ref["params"][step]), RTOL)

    # overlap: a bucket's reduce-scatter starts while backward still produces other grads
    events: list[str] = []
    launch = comm.reduce_scatter_async

    def recording(t: torch.Tensor, group: Any) -> Any:
        events.append(f"launch:{t.numel()}")
        return launch(t, group)

    model = _MLP()
    opt = DistributedOptimizer(list(model.named_parameters()), _cfg(), state, zero=1, bucket_bytes=SMALL)
    for name, p in model.named_parameters():  # registered after the optimizer's hook: runs after it
        p.register_post_accumulate_grad_hook(lambda _p, name=name: events.append(f"grad:{name}"))
    comm.reduce_scatter_async = recording  # type: ignore[assignment]
    try:
        _train_step(opt, model, 0, rank, world)
    finally:
        comm.reduce_scatter_async = launch  # type: ignore[assignment]
    facts["overlap.events"] = events

    # bf16: ZeRO-1 (cast, then all-gather the bf16 values) equals ZeRO-0 (all-reduce, every rank steps)
    bf16 = {}
    for zero in (0, 1, 2):
        model = _MLP()
        opt = DistributedOptimizer(list(model.named_parameters()), _cfg(), state, zero=zero, precision="bf16",
                                   bucket_bytes=SMALL)
        for step in range(2):
            x, y = _batch(step)
            per_rank = ROWS // world
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = _loss(model, x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank])
            loss.backward()
            opt.step(LRS[step], clip=CLIP)
        bf16[zero] = {n: p.detach().clone() for n, p in model.named_parameters()}
        facts[f"bf16.zero{zero}.dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
    for zero in (1, 2):
        checks[f"bf16.zero{zero}_vs_zero0"] = (max((bf16[0][n].float() - bf16[zero][n].float()).abs().max().item()
                                                   for n in bf16[0]), 0.0)
    facts["bf16.moved"] = _worst({n: v.float() for n, v in bf16[1].items()}, _params(_MLP()))

    # checkpoint: written here at dp2 + ZeRO-1 after 2 steps (then step 3 is the reference), or loaded (at ZeRO-2)
    model = _MLP()
    opt = DistributedOptimizer(list(model.named_parameters()), _cfg(), state, zero=1 if ckpt is None else 2,
                               bucket_bytes=SMALL)
    if ckpt is None:
        for step in range(2):
            _train_step(opt, model, step, rank, world)
        facts["ckpt"] = {"optim": opt.state_dict_by_name(), "params": _params(model)}
        _train_step(opt, model, 2, rank, world)
        facts["ckpt"]["params_step3"] = _params(model)
    else:
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(ckpt["params"][n])
        opt.load_state_dict_by_name(ckpt["optim"])
        facts["resume.step_count"] = opt.step_count
        _train_step(opt, model, 2, rank, world)
        checks["resume.params_step3"] = (_worst(_params(model), ckpt["params_step3"]), RTOL)
    checks.update(_big_norm_checks(state, set(), "big"))
    state.destroy()
    return {"checks": checks, "facts": facts}


def _assert_checks(results: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(results):
        bad = {k: v for k, v in res["checks"].items() if not v[0] <= v[1]}
        assert not bad, f"rank {rank}: {bad}"


def _assert_dp_facts(results: list[dict[str, Any]], world: int) -> None:
    for res in results:
        f = res["facts"]
        for zero in (0, 1, 2):
            for n_micro in (1, 3):
                small = f"zero{zero}.micro{n_micro}.bucket{SMALL}"
                numel, n_buckets, shard, grads = f[f"{small}.layout"]
                assert n_buckets == 3 and numel % world == 0 and numel > 69  # 69 = unpadded, odd
                assert shard == (numel // world if zero else numel)
                assert grads == (shard if zero == 2 else numel)  # ZeRO-2 keeps the fp32 grads of its shard only
                for step in range(STEPS):
                    calls = f[f"{small}.step{step}.calls"]
                    if zero == 2:  # every bucket reduce-scattered from inside every micro-batch's backward
                        assert calls == [3] * n_micro, calls
                    else:
                        assert calls[:-1] == [0] * (n_micro - 1), calls  # no comm on non-final micro-batches
                        assert calls[-1] == 3, calls  # every bucket launched from inside the last backward
                    assert f[f"{small}.step{step}.stepped"] and f[f"{small}.step{step}.staged"] == 0
        events = f["overlap.events"]
        launches = [i for i, e in enumerate(events) if e.startswith("launch")]
        grads = [i for i, e in enumerate(events) if e.startswith("grad")]
        assert len(launches) == 3 and len(grads) == 5, events
        assert launches[0] < grads[-1], events  # the first bucket went out before backward finished
        assert events[grads[-1]] == "grad:fc1.weight"
        # "scale" (the last bucket, 3 elements + padding) gets its grad first but goes out last: in bucket order
        fc1, scale = 42 + (-42 % world), 3 + (-3 % world)
        assert events[0] == "grad:scale" and [events[i] for i in launches] == ["launch:24", f"launch:{fc1}", f"launch:{scale}"]
        for zero in (0, 1, 2):
            assert f[f"bf16.zero{zero}.dtypes"] == ["torch.bfloat16"]
        assert f["bf16.moved"] > 1e-3  # the bf16 parameters did take the updates


@pytest.fixture(scope="module")
def world2() -> list[dict[str, Any]]:
    return run_distributed(_dp_checks, 2)


def test_dp2(world2: list[dict[str, Any]]) -> None:
    _assert_checks(world2)
    _assert_dp_facts(world2, 2)


def test_dp4_and_resume_from_dp2(world2: list[dict[str, Any]]) -> None:
    results = run_distributed(_dp_checks, 4, ckpt=world2[0]["facts"]["ckpt"])
    _assert_checks(results)
    _assert_dp_facts(results, 4)
    assert all(r["facts"]["resume.step_count"] == 2 for r in results)


def test_resume_from_dp2_on_one_process(world2: list[dict[str, Any]]) -> None:
    ckpt = world2[0]["facts"]["ckpt"]
    model = _MLP()
    opt = DistributedOptimizer(list(model.named_parameters()), _cfg(), None, zero=1, bucket_bytes=SMALL)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(ckpt["params"][n])
    opt.load_state_dict_by_name(ckpt["optim"])
    assert opt.step_count == 2
    for name, entry in opt.state_dict_by_name().items():  # round trip
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(entry[key], ckpt["optim"][name][key])
    _train_step(opt, model, 2, 0, 1)
    assert _worst(_params(model), ckpt["params_step3"]) <= RTOL


# ----------------------------------------------------------------------------------------- TP side

def _grad(name: str, shape: tuple[int, ...], tp: int, dp: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * sorted(SHAPES).index(name) + 10 * tp + dp)
    return torch.randn(shape, generator=g)


SHAPES = {"bias": (5,), "norm.weight": (8,), "extra": (3,), "col.weight": (2, 3)}


def _tp_params(tp_rank: int, misaligned: bool) -> list[tuple[str, nn.Parameter]]:
    """named_parameters order; "extra" (tp rank 1 only) shifts the offsets of the SP parameter on that rank."""
    names = ["bias", "norm.weight"] + (["extra"] if misaligned and tp_rank == 1 else []) + ["col.weight"]
    out = []
    for name in names:
        p = nn.Parameter(torch.zeros(SHAPES[name]))
        p.tensor_model_parallel = name in ("extra", "col.weight")
        p.sequence_parallel = name == "norm.weight"
        out.append((name, p))
    return out


def _tp_checks(rank: int, world: int) -> dict[str, Any]:
    state = initialize(ParallelDims(tp=2, dp=2))
    tp, dp = state.tp_rank, state.dp_rank
    checks: dict[str, tuple[float, float]] = {}
    facts: dict[str, Any] = {}
    for misaligned in (False, True):
        names = [n for n, _ in _tp_params(tp, misaligned)]
        want = {n: sum(_grad(n, SHAPES[n], tp, d) for d in range(2)) for n in names}
        want["norm.weight"] = sum(_grad("norm.weight", (8,), t, d) for t in range(2) for d in range(2))
        squares = sum(want[n].square().sum() for n in ("norm.weight",))
        squares += sum(sum(_grad("col.weight", (2, 3), t, d) for d in range(2)).square().sum() for t in range(2))
        squares += sum(_grad("bias", (5,), 0, d) for d in range(2)).square().sum()  # replicated: tp rank 0's
        if misaligned:
            squares += sum(_grad("extra", (3,), 1, d) for d in range(2)).square().sum()
        want_norm = squares.sqrt().item()
        for zero in (0, 1, 2):
            tag = f"{'misaligned' if misaligned else 'aligned'}.zero{zero}"
            named = _tp_params(tp, misaligned)
            opt = DistributedOptimizer(named, _cfg(), state, zero=zero)
            opt.zero_grad()
            sum((p * _grad(n, SHAPES[n], tp, dp)).sum() for n, p in named).backward()
            opt.finish_grad_sync()
            checks[f"{tag}.grads"] = (_worst(opt.main_grads_by_name(), want), RTOL)
            norm, _ = opt.step(1e-3, clip=0.0)
            checks[f"{tag}.norm"] = (abs(norm - want_norm) / want_norm, RTOL)
            facts[f"{tag}.alike"] = sorted(opt._align_cache.values())
    checks.update(_big_norm_checks(state, {"big.weight"}, "big"))
    state.destroy()
    return {"checks": checks, "facts": facts}


def test_tp2_dp2_sequence_parallel_grads_and_norm() -> None:
    results = run_distributed(_tp_checks, 4)
    _assert_checks(results)
    for res in results:
        f = res["facts"]
        for zero in (1, 2):
            assert f[f"aligned.zero{zero}.alike"] == [True]  # same layout on both TP ranks: owned elements only
            assert f[f"misaligned.zero{zero}.alike"] == [False]  # different layouts: the full-gradient fallback
        assert f["aligned.zero0.alike"] == f["misaligned.zero0.alike"] == []  # no ZeRO: nothing to check
