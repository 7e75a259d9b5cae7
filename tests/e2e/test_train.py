"""End-to-end runs of train.py: determinism, exact resume, and the parity standard for data parallelism."""
from __future__ import annotations

import pytest
import torch

from megatron_sp.parity import compare_runs

from .runs import PARITY, metrics, train

def test_same_seed_same_losses_and_resume_is_bitwise(tmp_path, byte_data):
    full, again, first, second = (tmp_path / n for n in ("full", "again", "first", "second"))
    train(full, byte_data, "train.iters=10", f"checkpoint.save={full}/ckpt", "checkpoint.interval=5")
    train(again, byte_data, "train.iters=10")
    train(first, byte_data, "train.iters=5", f"checkpoint.save={first}/ckpt")
    train(second, byte_data, "train.iters=10", f"checkpoint.load={first}/ckpt", f"checkpoint.save={second}/ckpt")

    ref, rep = metrics(full), metrics(again)
    assert sorted(ref) == list(range(1, 11))
    assert [ref[s]["loss"] for s in ref] == [rep[s]["loss"] for s in ref]          # determinism: bitwise
    assert ref[10]["loss"] < ref[1]["loss"]

    resumed = metrics(second)
    assert sorted(resumed) == list(range(6, 11))
    for s in range(6, 11):                                                          # 5 + resume + 5: bitwise
        assert resumed[s]["loss"] == ref[s]["loss"], s
        assert resumed[s]["grad_norm"] == ref[s]["grad_norm"], s
    a = torch.load(full / "ckpt" / "iter_0000010" / "model.pt", weights_only=True)
    b = torch.load(second / "ckpt" / "iter_0000010" / "model.pt", weights_only=True)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert (full / "ckpt" / "latest").read_text().strip() == "iter_0000010"
    assert (full / "log" / "config.yml").is_file()


LAYOUTS = {
    "dp2": (["parallel.dp=2"], []),
    "dp4": (["parallel.dp=4"], []),
    "dp2_eod_masked": (["parallel.dp=2"], ["data.eod_mask_loss=true"]),  # ranks hold different token counts
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_data_parallel_parity(tmp_path, byte_data, reference_run, name):
    """The parity standard: per-step loss 5e-6, step-1 grad norm 1e-5, every full gradient 1e-5."""
    layout, common = LAYOUTS[name]
    ref = reference_run(*common)
    train(tmp_path, byte_data, *PARITY, *common, *layout)
    report = compare_runs(ref, tmp_path / "log")
    assert report.ok, report.describe()
    assert len(report.steps) == 5 and report.worst_grad[0] != "(none)"
    assert metrics(tmp_path)[1]["world_size"] == int(layout[0].split("=")[1])


def test_bf16_runs_close_to_fp32(tmp_path, byte_data):
    train(tmp_path / "fp32", byte_data, "train.iters=3")
    train(tmp_path / "bf16", byte_data, "train.iters=3", "train.precision=bf16")
    a, b = metrics(tmp_path / "fp32"), metrics(tmp_path / "bf16")
    assert abs(a[1]["loss"] - b[1]["loss"]) < 0.05 * a[1]["loss"]
    assert all(torch.isfinite(torch.tensor(b[s]["loss"])) for s in b)


def test_missing_data_is_one_line_naming_the_file(tmp_path):
    p = train(tmp_path / "x", str(tmp_path / "nope" / "missing_text_document"), "train.iters=1", expect_ok=False)
    assert p.returncode != 0
    assert "Traceback" not in p.stderr
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "missing_text_document" in lines[0] and "preprocess_data.py" in lines[0], p.stderr
