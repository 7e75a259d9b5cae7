"""Tensor + sequence parallelism end to end: every layout meets the parity standard against 1 rank."""
from __future__ import annotations

import pytest

from megatron_sp.parity import compare_runs

from .runs import PARITY, train

LLAMA = ["model.arch=llama", "model.num_heads=4", "model.num_kv_heads=2", "model.ffn_multiple_of=32"]

LAYOUTS = {
    "tp2": ([], ["parallel.tp=2"]),
    "tp4": ([], ["parallel.tp=4"]),
    "tp2_sp": ([], ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "tp4_sp": ([], ["parallel.tp=4", "parallel.sequence_parallel=true"]),
    "tp2_sp_no_recompute_allgather": ([], ["parallel.tp=2", "parallel.sequence_parallel=true",
                                           "parallel.tp_recompute_allgather=false"]),
    "tp2_sp_full_recompute": ([], ["parallel.tp=2", "parallel.sequence_parallel=true", "model.recompute=full"]),
    "tp2_sp_selective_recompute": ([], ["parallel.tp=2", "parallel.sequence_parallel=true",
                                        "model.recompute=selective"]),
    "llama_gqa_tp2_sp": (LLAMA, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "llama_gqa_tp4_kv_replicated": (LLAMA, ["parallel.tp=4", "parallel.sequence_parallel=true"]),
    "llama_tied_tp2_sp": (LLAMA + ["model.tie_embeddings=true"], ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "tp2_sp_dp2": ([], ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.dp=2"]),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_tensor_parallel_parity(tmp_path, byte_data, reference_run, name):
    model, layout = LAYOUTS[name]
    ref = reference_run(*model)
    train(tmp_path, byte_data, *PARITY, *model, *layout)
    report = compare_runs(ref, tmp_path / "log")
    assert report.ok, f"{name}: {report.describe()}"
