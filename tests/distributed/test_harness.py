"""run_distributed: per-rank results, errors naming the rank, and its launch cost."""
import time

import pytest
import torch
import torch.distributed as dist

from megatron_sp.testing import RankError, run_distributed


def _sum_ranks(rank, world, offset=0):
    t = torch.tensor([float(rank + offset)])
    dist.all_reduce(t)
    return {"rank": rank, "sum": t.item(), "threads": torch.get_num_threads(), "world": dist.get_world_size()}


def _fail_on_rank_1(rank, world):
    if rank == 1:
        raise ValueError("deliberate failure")
    dist.barrier()  # rank 0 would hang here without the harness stopping it
    return rank


@pytest.mark.parametrize("world", [2, 4])
def test_results_per_rank(world):
    res = run_distributed(_sum_ranks, world, offset=1)
    assert [r["rank"] for r in res] == list(range(world))
    expected = sum(range(world)) + world
    assert all(r["sum"] == expected and r["threads"] == 1 and r["world"] == world for r in res)


def test_rank_error_names_the_rank():
    t = time.monotonic()
    with pytest.raises(RankError) as exc:
        run_distributed(_fail_on_rank_1, 2, timeout_s=60)
    assert exc.value.rank == 1
    assert "rank 1 failed" in str(exc.value) and "deliberate failure" in str(exc.value)
    assert time.monotonic() - t < 30
