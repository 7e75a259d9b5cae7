"""gather_full (behind parity.full_main_grads) reassembles full gradients from TP shards and PP stages (tp2·pp2)."""
import torch
from torch import nn

from megatron_sp.mpu import ParallelDims, initialize
from megatron_sp.mpu.sharding import gather_full
from megatron_sp.optim import named_trainable
from megatron_sp.parity import grad_diffs
from megatron_sp.testing import run_distributed


def _full_grads() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"stage{s}.{n}": torch.randn(shape, generator=g)
            for s in range(2) for n, shape in (("col.weight", (8, 4)), ("row.weight", (4, 8)), ("norm.weight", (4,)))}


class _Stage(nn.Module):
    def __init__(self, pp_rank: int, tp_rank: int, tp: int) -> None:
        super().__init__()
        full = _full_grads()
        self.params = nn.ParameterDict()
        for name, grad in full.items():
            stage, leaf = name.split(".", 1)
            if stage != f"stage{pp_rank}":
                continue
            dim = {"col.weight": 0, "row.weight": 1}.get(leaf)
            shard = grad if dim is None else grad.chunk(tp, dim=dim)[tp_rank]
            p = nn.Parameter(torch.zeros_like(shard))
            p.grad = shard.clone()
            p.tensor_model_parallel = dim is not None
            p.partition_dim = -1 if dim is None else dim
            self.params[name.replace(".", "_")] = p


def _gather(rank, world):
    st = initialize(ParallelDims(tp=2, pp=2, world_size=world))
    model = _Stage(st.pp_rank, st.tp_rank, st.tp_size)
    out = gather_full(named_trainable(model), st, lambda p: p.grad)
    st.destroy()
    return out


def test_full_grads_from_tp_shards_and_pp_stages():
    results = run_distributed(_gather, 4)
    expected = {n.replace(".", "_"): g for n, g in _full_grads().items()}
    expected = {f"params.{n}": g for n, g in expected.items()}
    for rank, got in enumerate(results):
        diffs = grad_diffs(got, expected)
        assert set(diffs) == set(expected), rank
        assert max(diffs.values()) == 0.0, (rank, diffs)


def test_grad_diffs_flags_missing_and_wrong():
    ref = {"a": torch.ones(3), "b": torch.ones(2)}
    d = grad_diffs({"a": torch.tensor([1.0, 1.0, 1.5]), "c": torch.ones(1)}, ref)
    assert d["a"] == 0.5 and d["b"] == float("inf") and d["c"] == float("inf")
