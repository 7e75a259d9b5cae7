"""The rank grid (tp-cp-dp-pp, TP innermost) and a gloo check of every group at world 8."""
import pytest
import torch
import torch.distributed as dist

from megatron_sp.errors import ConfigError
from megatron_sp.mpu import ParallelDims, initialize
from megatron_sp.testing import run_distributed


def test_rank_order_tp_innermost_pp_outermost():
    d = ParallelDims(tp=2, cp=2, dp=1, pp=2)
    assert d.coords(0) == {"tp": 0, "cp": 0, "dp": 0, "pp": 0}
    assert d.coords(1) == {"tp": 1, "cp": 0, "dp": 0, "pp": 0}
    assert d.coords(2) == {"tp": 0, "cp": 1, "dp": 0, "pp": 0}
    assert d.coords(4) == {"tp": 0, "cp": 0, "dp": 0, "pp": 1}
    for r in range(8):
        assert d.rank_of(**d.coords(r)) == r
    assert d.groups_along(("tp",)) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert d.groups_along(("pp",)) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert d.groups_along(("cp",)) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert d.groups_along(("tp", "pp")) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert d.embedding_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # every axis partitions the world
    for axes in (("tp",), ("cp",), ("dp",), ("pp",), ("cp", "dp"), ("tp", "pp")):
        flat = sorted(r for g in d.groups_along(axes) for r in g)
        assert flat == list(range(8))


def test_dims_error_prints_every_factor():
    with pytest.raises(ConfigError, match=r"2·1·3·1 = 6 != world size 8"):
        ParallelDims(tp=2, cp=1, dp=3, pp=1, world_size=8)
    with pytest.raises(ConfigError, match="parallel.tp"):
        ParallelDims(tp=0)


def _check_groups(rank, world, tp, cp, dp, pp):
    dims = ParallelDims(tp=tp, cp=cp, dp=dp, pp=pp, world_size=world)
    st = initialize(dims)
    out = {"coords": st.coords, "sizes": {}, "sums": {}, "ranks": dict(st.group_ranks),
           "first": st.is_first_stage, "last": st.is_last_stage, "dp_cp_rank": st.dp_cp_rank}
    for name, group in st.groups.items():
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=group)
        out["sums"][name] = t.item()
        out["sizes"][name] = dist.get_world_size(group)
    st.destroy()
    return out


@pytest.mark.parametrize("layout", [dict(tp=2, cp=1, dp=2, pp=2), dict(tp=2, cp=2, dp=1, pp=2)])
def test_every_group_at_world_8(layout):
    results = run_distributed(_check_groups, 8, **layout)
    dims = ParallelDims(**layout, world_size=8)
    expect_axes = {"tp": ("tp",), "cp": ("cp",), "dp": ("dp",), "pp": ("pp",), "dp_cp": ("cp", "dp"),
                   "mp": ("tp", "pp")}
    for rank, res in enumerate(results):
        assert res["coords"] == dims.coords(rank)
        for name, axes in expect_axes.items():
            group = next(g for g in dims.groups_along(axes) if rank in g)
            assert res["ranks"][name] == group, (rank, name)
            assert res["sizes"][name] == len(group)
            assert res["sums"][name] == float(sum(group)), (rank, name)   # the collective ran on exactly that group
        emb = next(g for g in dims.embedding_groups() if rank in g)
        assert res["sums"]["embedding"] == float(sum(emb))
        assert res["first"] == (dims.coords(rank)["pp"] == 0)
        assert res["last"] == (dims.coords(rank)["pp"] == dims.pp - 1)
        assert res["dp_cp_rank"] == res["ranks"]["dp_cp"].index(rank)
