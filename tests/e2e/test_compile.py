"""``train.compile``: compiled training meets the parity standard against the eager 1-rank run,
with the loss and gradient tolerances relaxed to 2e-5 (fusion changes the reduction order), and
never recompiles per step (torch's recompile log, read from each rank's output)."""
from __future__ import annotations

import contextlib
import importlib.util
import io
import re
from collections import Counter

import pytest

from megatron_sp import config
from megatron_sp.parity import compare_runs
from megatron_sp.testing import run_distributed

from .runs import PARITY, ROOT, train_argv

LLAMA = ["model.arch=llama", "model.num_heads=4", "model.num_kv_heads=2", "model.ffn_multiple_of=32"]

# (model overrides shared with the eager reference, the compiled run's layout). One run, to keep the
# suite inside its budget (a cold inductor cache costs ~40 s per 2-rank run): pipeline stages with the
# zero-bubble weight-gradient split, full recompute (RNG replay; the grad-mode graphs compiled in step 1), ZeRO-3 (the
# regions read parameters whose storage is given back and gathered again between calls).
# TP/SP and CP change only the regions' shapes: no region holds a collective (docs/compile.md).
LAYOUTS = {
    "llama_pp2_zero_bubble_full_recompute_dp2_zero3": (LLAMA, ["parallel.pp=2", "parallel.pp_schedule=zero_bubble",
                                                               "model.recompute=full", "parallel.dp=2",
                                                               "parallel.zero=3"]),
}


def _compiled_rank(rank: int, world_size: int, argv: list[str]) -> tuple[int, str]:
    """One rank of train.py's ``main(argv)``, as ``testing.train_ranks`` runs it, with torch's recompile log on (what
    ``TORCH_LOGS=recompiles`` does for a command line): (exit code, everything the rank printed)."""
    import torch._logging

    spec = importlib.util.spec_from_file_location("_compiled_train", ROOT / "train.py")
    train_py = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(train_py)  # type: ignore[union-attr]
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        torch._logging.set_logs(recompiles=True)  # its handler writes to this moment's stderr: ``out``
        code = train_py.main(argv)
    return code, out.getvalue()


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_compiled_layout_matches_eager(tmp_path, byte_data, reference_run, name):
    model, layout = LAYOUTS[name]
    ref = reference_run(*model)
    argv = train_argv(tmp_path, byte_data, *PARITY, *model, *layout, "train.compile=true", "train.preflight=false")
    ranks = run_distributed(_compiled_rank, config.load([], argv).parallel.world_size, init=False, argv=argv)
    assert [code for code, _ in ranks] == [0] * len(ranks), "\n".join(out[-3000:] for _, out in ranks)
    report = compare_runs(ref, tmp_path / "log", loss_rtol=2e-5, grad_norm_rtol=2e-5, grad_tol=2e-5)
    assert report.ok and len(report.steps) == 5, f"{name}: {report.describe()}"
    assert "train.compile: first step" in ranks[0][1], "no compile-time log line"
    # A region compiles once, plus once more for no-grad calls (full recompute's first forward): a
    # recompile per step would show up to 4 more times per region and rank in 5 steps.
    recompiles = Counter((rank, re.sub(r"^.*Recompiling function (\w+).*$", r"\1", line))
                         for rank, (_, out) in enumerate(ranks) for line in out.splitlines()
                         if "Recompiling function" in line)
    assert recompiles, "no recompile log read (full recompute's no-grad forward recompiles each region once)"
    assert all(n <= 1 for n in recompiles.values()), f"recompiled per step: {recompiles}"
