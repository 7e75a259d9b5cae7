"""Pre-packed samples the Hugging Face way (data.packing=position_ids): training losses and step-1 gradients of
cp2 (zigzag, documents kept apart by the document-aligned kernels) equal the 1-rank run's (docs/parity.md)."""
from __future__ import annotations

from megatron_sp.parity import compare_runs

from .runs import PARITY, make_hf_packed_dataset, metrics, train

PACKED_HF = ["data.packing=position_ids"]


def test_hf_packed_cp2_zigzag_matches_one_rank(tmp_path):
    data = make_hf_packed_dataset(tmp_path / "data")
    train(tmp_path / "ref", data, *PARITY, *PACKED_HF)
    train(tmp_path / "cp2", data, *PARITY, *PACKED_HF, "parallel.cp=2", "parallel.cp_algo=zigzag")
    report = compare_runs(tmp_path / "ref" / "log", tmp_path / "cp2" / "log")
    assert report.ok, report.describe()
    assert len(report.steps) == 5 and metrics(tmp_path / "cp2")[1]["world_size"] == 2
