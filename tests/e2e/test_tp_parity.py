"""Tensor + sequence parallelism end to end: every layout meets the parity standard against 1 rank."""
from __future__ import annotations

import pytest

from megatron_sp.parity import compare_runs

from .runs import PARITY, metrics, train

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


def test_tp_checkpoint_resumes_bitwise_and_at_another_layout(tmp_path, byte_data):
    """tp2+SP: 5 steps + resume + 5 steps is bitwise the 10-step run; the same checkpoint resumes at tp1."""
    tp2 = ["parallel.tp=2", "parallel.sequence_parallel=true"]
    full, first, again, other = (tmp_path / n for n in ("full", "first", "again", "tp1"))
    train(full, byte_data, "train.iters=10", *tp2)
    train(first, byte_data, "train.iters=5", f"checkpoint.save={first}/ckpt", *tp2)
    train(again, byte_data, "train.iters=10", f"checkpoint.load={first}/ckpt", *tp2)
    train(other, byte_data, "train.iters=10", f"checkpoint.load={first}/ckpt", "parallel.tp=1")
    ref, same, moved = metrics(full), metrics(again), metrics(other)
    assert sorted(same) == sorted(moved) == [6, 7, 8, 9, 10]
    for s in same:
        assert same[s]["loss"] == ref[s]["loss"], s                                 # same layout: bitwise
        assert abs(moved[s]["loss"] - ref[s]["loss"]) <= 5e-6 * ref[s]["loss"], s   # tp2 → tp1: reduction order only


PP_LAYOUTS = {
    "pp2": ([], ["parallel.pp=2"]),
    "pp2_tp2_sp": ([], ["parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true"]),
    "pp2_dp2_zero1": ([], ["parallel.pp=2", "parallel.dp=2", "parallel.zero=1"]),
    "llama_tied_pp2": (LLAMA + ["model.tie_embeddings=true"], ["parallel.pp=2"]),
}


@pytest.mark.parametrize("name", list(PP_LAYOUTS))
def test_pipeline_parallel_parity(tmp_path, byte_data, reference_run, name):
    """1F1B pipeline (alone and with TP+SP, DP+ZeRO-1, tied embeddings) meets the parity standard."""
    model, layout = PP_LAYOUTS[name]
    ref = reference_run(*model)
    train(tmp_path, byte_data, *PARITY, *model, *layout)
    report = compare_runs(ref, tmp_path / "log")
    assert report.ok, f"{name}: {report.describe()}"


def test_pipeline_checkpoint_resumes_without_pipeline(tmp_path, byte_data):
    """A pp2 checkpoint of a tied llama (the embedding stored once) resumes at pp1 on the same trajectory."""
    tied = LLAMA + ["model.tie_embeddings=true"]
    full, first, other = tmp_path / "full", tmp_path / "first", tmp_path / "pp1"
    train(full, byte_data, "train.iters=8", "parallel.pp=2", *tied)
    train(first, byte_data, "train.iters=4", "parallel.pp=2", f"checkpoint.save={first}/ckpt", *tied)
    train(other, byte_data, "train.iters=8", f"checkpoint.load={first}/ckpt", *tied)
    ref, got = metrics(full), metrics(other)
    assert sorted(got) == [5, 6, 7, 8]
    for s in got:
        assert abs(got[s]["loss"] - ref[s]["loss"]) <= 5e-6 * ref[s]["loss"], s
