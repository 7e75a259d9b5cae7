"""tools/fuzz_parity.py end to end: a seeded sample of the parity fuzzer's space (one drawn model, two 2-rank
layouts, one shared reference run: three train.py runs) meets the parity standard, and the verdict fails the same
run once one of its dumped gradients is off by 1e-4 (docs/parity.md, "The parity fuzzer")."""
from __future__ import annotations

import json
import shutil

import torch

from megatron_sp.parity import load_grads
from tools import fuzz_parity as fz

# Seed 236 draws a tied llama with latent attention (a query latent), llama3 rope, norms after the sublayers, MoE (8
# experts, top-1, a shared one, every second layer after a dense first one, sigmoid scores renormalised, the routing
# bias), two multi-token prediction modules and Muon (split heads, no Nesterov); layouts dp2 + ZeRO-3 without prefetch,
# and tp2+SP with ep2. After an edit of the space, pick a seed whose two cases run:
#     python tools/fuzz_parity.py --seed S --count 2 --max-world 2 --draw-only
SAMPLE = ["--seed", "236", "--count", "2", "--max-world", "2"]


def test_seeded_sample_meets_parity_and_a_wrong_gradient_fails(tmp_path, capsys):
    rc = fz.main([*SAMPLE, "--keep", str(tmp_path), "--json"])
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert result["ok"] == 2, ("a case failed or was refused (after an edit of the space, choose another seed)",
                               [(c["layout"], c["verdict"], c["detail"]) for c in result["cases"]])
    assert rc == 0
    case = fz.draw_cases(int(SAMPLE[1]), 2, max_world=2)[0]  # (case0, whose run is copied)
    bad = tmp_path / "bad"
    shutil.copytree(tmp_path / "cases" / "case0", bad)
    grads = load_grads(bad / "grads_step1.pt")
    name = max(grads, key=lambda n: grads[n].abs().max().item())
    grads[name] = grads[name] * (1 + 1e-4)
    torch.save(grads, bad / "grads_step1.pt")
    report = fz.judge(tmp_path / "refs" / "ref0", bad, case)
    assert not report.ok and name in report.problems[-1], report.describe()
