"""The collective wrappers (``mpu.comm``) and the paired autograd mappings (``mpu.mappings``) on gloo.

Every rank builds the same full fp64 tensors from fixed seeds; rank j of a group contributes
``X_j`` where a mapping reduces or gathers. Each mapping's forward and backward is compared with its
definition computed on those full tensors (sum, concatenation, chunk). At world 4 the checks also
run on the two TP-like pairs {0,1}, {2,3}, and on one-rank groups (identity: the input object comes
back unchanged). One launch per world size runs everything; the ranks return their max errors.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_sp.mpu import comm, mappings
from megatron_sp.testing import run_distributed

TOL = 1e-12  # fp64: only summation order differs from the reference


def _full(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64)


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    assert tuple(got.shape) == tuple(want.shape), (tuple(got.shape), tuple(want.shape))
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    return (got - want).abs().max().item()


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


def _check_mappings(group, n: int, r: int) -> dict[str, float]:
    """Forward and backward of every mapping against its definition; group of size n, this rank r."""
    errs: dict[str, float] = {}
    shape = (8, 3, 8)
    X = [_full(shape, 10 + j) for j in range(n)]  # X[j]: rank j's contribution
    G = [_full(shape, 20 + j) for j in range(n)]  # G[j]: rank j's incoming grad (rank-different)
    X0, G0 = X[0], G[0]

    # f: identity / all-reduce
    x = _leaf(X0)
    y = mappings.copy_to_tp(x, group)
    y.backward(G[r])
    errs["copy_to_tp fwd"] = _err(y, X0)
    errs["copy_to_tp bwd"] = _err(x.grad, sum(G))

    # g: all-reduce / identity
    x = _leaf(X[r])
    y = mappings.reduce_from_tp(x, group)
    y.backward(G0)
    errs["reduce_from_tp fwd"] = _err(y, sum(X))
    errs["reduce_from_tp bwd"] = _err(x.grad, G0)
    errs["reduce_from_tp leaves input"] = _err(x.detach(), X[r])

    # split last dim / all-gather last dim
    x = _leaf(X0)
    y = mappings.scatter_to_tp(x, group)
    y.backward(G0.chunk(n, -1)[r])
    errs["scatter_to_tp fwd"] = _err(y, X0.chunk(n, -1)[r])
    errs["scatter_to_tp bwd"] = _err(x.grad, G0)

    # all-gather last dim / split last dim
    x = _leaf(X0.chunk(n, -1)[r])
    y = mappings.gather_from_tp(x, group)
    y.backward(G0)
    errs["gather_from_tp fwd"] = _err(y, X0)
    errs["gather_from_tp bwd"] = _err(x.grad, G0.chunk(n, -1)[r])

    # split dim 0 / all-gather dim 0
    x = _leaf(X0)
    y = mappings.scatter_to_sp(x, group)
    y.backward(G0.chunk(n, 0)[r])
    errs["scatter_to_sp fwd"] = _err(y, X0.chunk(n, 0)[r])
    errs["scatter_to_sp bwd"] = _err(x.grad, G0)

    # all-gather dim 0 / reduce-scatter dim 0 (the consumer is tensor-parallel: rank-different grads)
    x = _leaf(X0.chunk(n, 0)[r])
    y = mappings.gather_from_sp(x, group)
    y.backward(G[r])
    errs["gather_from_sp fwd"] = _err(y, X0)
    errs["gather_from_sp bwd"] = _err(x.grad, sum(G).chunk(n, 0)[r])

    # reduce-scatter dim 0 / all-gather dim 0
    x = _leaf(X[r])
    y = mappings.reduce_scatter_to_sp(x, group)
    y.backward(G0.chunk(n, 0)[r])
    errs["reduce_scatter_to_sp fwd"] = _err(y, sum(X).chunk(n, 0)[r])
    errs["reduce_scatter_to_sp bwd"] = _err(x.grad, G0)

    # all-to-all / reverse all-to-all, Ulysses-like [s/n, b, heads, d] -> [s, b, heads/n, d] and another pair
    for scatter_dim, gather_dim in ((2, 0), (0, -1)):
        A = [_full((4, 3, 8, 4), 30 + j) for j in range(n)]
        x = _leaf(A[r])
        y = mappings.all_to_all(x, group, scatter_dim, gather_dim)
        want = torch.cat([a.chunk(n, scatter_dim)[r] for a in A], dim=gather_dim)
        GA = [_full(tuple(want.shape), 40 + j) for j in range(n)]
        y.backward(GA[r])
        errs[f"all_to_all({scatter_dim},{gather_dim}) fwd"] = _err(y, want)
        errs[f"all_to_all({scatter_dim},{gather_dim}) bwd"] = _err(
            x.grad, torch.cat([g.chunk(n, gather_dim)[r] for g in GA], dim=scatter_dim))
    return errs


def _check_comm(group, n: int, r: int) -> tuple[dict[str, float], dict[str, bool]]:
    """The raw wrappers: every dim, non-contiguous inputs, out buffers, async handles, MAX."""
    errs: dict[str, float] = {}
    facts: dict[str, bool] = {}
    shape = (4, 8, 4)
    X = [_full(shape, 50 + j) for j in range(n)]
    for dim in (0, 1, 2, -1):
        errs[f"all_gather dim {dim}"] = _err(comm.all_gather(X[r], group, dim=dim), torch.cat(X, dim=dim))
        errs[f"reduce_scatter dim {dim}"] = _err(comm.reduce_scatter(X[r], group, dim=dim), sum(X).chunk(n, dim)[r])
        part = comm.split(X[0], group, dim=dim)
        errs[f"split dim {dim}"] = _err(part, X[0].chunk(n, dim)[r])
        facts[f"split dim {dim} contiguous"] = part.is_contiguous()
    # non-contiguous inputs
    xt = X[r].transpose(0, 2)  # [4, 8, 4] view, not contiguous
    errs["all_gather non-contiguous"] = _err(comm.all_gather(xt, group, dim=1),
                                             torch.cat([x.transpose(0, 2) for x in X], dim=1))
    errs["reduce_scatter non-contiguous"] = _err(comm.reduce_scatter(xt, group, dim=0),
                                                 sum(X).transpose(0, 2).chunk(n, 0)[r])
    base = X[r].clone()
    view = base.transpose(0, 1)
    out = comm.all_reduce(view, group)
    facts["all_reduce returns its input"] = out is view
    errs["all_reduce in place (non-contiguous)"] = _err(base, sum(X))
    m = torch.tensor([float(r), -float(r)], dtype=torch.float64)
    comm.all_reduce(m, group, op=comm.ReduceOp.MAX)
    errs["all_reduce MAX"] = _err(m, torch.tensor([float(n - 1), 0.0], dtype=torch.float64))
    # out buffer and async handles
    buf = torch.empty((n * 4, 8, 4), dtype=torch.float64)
    got = comm.all_gather(X[r], group, dim=0, out=buf)
    facts["all_gather fills the out buffer"] = got.data_ptr() == buf.data_ptr() or n == 1
    errs["all_gather out buffer"] = _err(got, torch.cat(X, 0))
    errs["all_gather_async"] = _err(comm.all_gather_async(X[r], group).wait(), torch.cat(X, 0))
    errs["reduce_scatter_async"] = _err(comm.reduce_scatter_async(X[r], group).wait(), sum(X).chunk(n, 0)[r])
    return errs, facts


def _identity_facts(group) -> dict[str, bool]:
    """A one-rank group: every wrapper and mapping returns its input object; nothing is counted."""
    x = _full((4, 3, 4), 60)
    facts = {}
    with comm.count() as c:
        for name in ("copy_to_tp", "reduce_from_tp", "scatter_to_tp", "gather_from_tp", "scatter_to_sp",
                     "gather_from_sp", "reduce_scatter_to_sp"):
            facts[f"size-1 {name} is identity"] = getattr(mappings, name)(x, group) is x
        facts["size-1 all_to_all is identity"] = mappings.all_to_all(x, group, 2, 0) is x
        facts["size-1 comm is identity"] = all(out is x for out in (
            comm.all_reduce(x, group), comm.all_gather(x, group, 1), comm.reduce_scatter(x, group, 0),
            comm.split(x, group, 2), comm.all_to_all(x, group, 0, 2), comm.all_gather_async(x, group).wait()))
    facts["size-1 nothing counted"] = c.total_calls == 0
    return facts


def _counter_numbers(group, n: int) -> dict[str, object]:
    """Bytes and calls recorded for one call of each op (fp64, 8 bytes per element)."""
    x = _full((8, 2, 4), 70)  # 64 elements, 512 bytes
    with comm.count() as outer:
        comm.all_reduce(x.clone(), group)
        with comm.count() as inner:
            comm.all_gather(x, group, dim=1)
            comm.reduce_scatter(x, group, dim=0)
            comm.all_to_all(x, group, 0, 1)
            comm.split(x, group, 0)  # no communication, not counted
    after = comm.CommCounter()
    comm.all_reduce(x.clone(), group)  # outside every counter
    return {"outer": outer.summary(), "inner": inner.summary(), "after": after.summary(),
            "outer_total": outer.total_bytes}


def _worker(rank: int, world: int) -> dict[str, object]:
    torch.manual_seed(0)
    configs = [("world", dist.group.WORLD, list(range(world)))]
    if world == 4:
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        configs.append(("pair", pairs[rank // 2], [rank - rank % 2, rank - rank % 2 + 1]))
    singles = [dist.new_group([j]) for j in range(world)]
    errs: dict[str, float] = {}
    facts: dict[str, bool] = {}
    for name, group, ranks in configs:
        n, r = len(ranks), ranks.index(rank)
        facts[f"{name} group size"] = comm.group_size(group) == n and comm.group_rank(group) == r
        errs.update({f"{name}: {k}": v for k, v in _check_mappings(group, n, r).items()})
        c_errs, c_facts = _check_comm(group, n, r)
        errs.update({f"{name}: {k}": v for k, v in c_errs.items()})
        facts.update({f"{name}: {k}": v for k, v in c_facts.items()})
    single = singles[rank]
    errs.update({f"single: {k}": v for k, v in _check_mappings(single, 1, 0).items()})
    facts.update(_identity_facts(single))
    return {"errs": errs, "facts": facts, "counts": _counter_numbers(dist.group.WORLD, world)}


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def results(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, object]]]:
    return request.param, run_distributed(_worker, request.param)


def test_mappings_forward_and_backward(results):
    world, per_rank = results
    for rank, res in enumerate(per_rank):
        bad = {k: v for k, v in res["errs"].items() if not v <= TOL}
        assert not bad, f"world {world} rank {rank}: errors above {TOL}: {bad}"
        expected = 2 * 9 + 2 * 2  # 8 mappings + all_to_all twice, fwd and bwd, + reduce_from_tp input check
        assert sum(k.startswith("world: ") for k in res["errs"]) >= expected


def test_comm_wrappers_and_identity_at_size_one(results):
    world, per_rank = results
    for rank, res in enumerate(per_rank):
        failed = [k for k, ok in res["facts"].items() if not ok]
        assert not failed, f"world {world} rank {rank}: {failed}"


def test_comm_counter_ring_bytes(results):
    world, per_rank = results
    n, nbytes = world, 8 * 64
    ring = (n - 1) / n
    inner = {"all_gather": {"calls": 1, "bytes": ring * n * nbytes},  # (n−1)/n of the OUTPUT (n× the input)
             "reduce_scatter": {"calls": 1, "bytes": ring * nbytes},  # (n−1)/n of the input
             "all_to_all": {"calls": 1, "bytes": ring * nbytes}}
    outer = dict(inner, all_reduce={"calls": 1, "bytes": 2 * ring * nbytes})
    for res in per_rank:
        counts = res["counts"]
        for got, want in ((counts["inner"], inner), (counts["outer"], outer)):
            assert got.keys() == want.keys()
            for op in want:
                assert got[op]["calls"] == want[op]["calls"], op
                assert got[op]["bytes"] == pytest.approx(want[op]["bytes"], rel=1e-12, abs=0), op
        assert counts["after"] == {}
        assert counts["outer_total"] == pytest.approx(sum(v["bytes"] for v in outer.values()), rel=1e-12)


def test_single_process_is_identity():
    """Without torch.distributed initialised every group counts as one rank."""
    if dist.is_initialized():
        pytest.skip("a default process group exists in this process")
    x = torch.randn(4, 2, 4, dtype=torch.float64, requires_grad=True)
    assert comm.group_size(None) == 1 and comm.group_rank(None) == 0
    for fn in (mappings.copy_to_tp, mappings.reduce_from_tp, mappings.scatter_to_tp, mappings.gather_from_tp,
               mappings.scatter_to_sp, mappings.gather_from_sp, mappings.reduce_scatter_to_sp):
        assert fn(x, None) is x
    assert comm.all_reduce(x, None) is x and comm.all_gather(x, None, 2) is x
