"""tools/fuzz_parity.py without training: the space covers every model/parallel key, draws are seeded, validated and
sized so that the layout divides them, and the verdict fails a run that is wrong (docs/parity.md, "The parity fuzzer")."""
from __future__ import annotations

import json
import math
from dataclasses import fields
from pathlib import Path

import torch

from megatron_sp.config import Config, ModelConfig, ParallelConfig
from megatron_sp.mpu.cp_layout import required_divisor
from tools import fuzz_parity as fz


def test_space_covers_every_model_and_parallel_key():
    """A key added to model: or parallel: joins FEATURES, LAYOUT or DIMS, or EXCLUDED with its reason."""
    listed = [*fz.FEATURES, *fz.LAYOUT, *fz.DIMS, *fz.EXCLUDED]
    assert len(listed) - len(set(listed)) == 1, "a key is listed twice"  # the micro-batch: the model's or the layout's
    keys = {f"{section}.{f.name}" for section, cls in (("model", ModelConfig), ("parallel", ParallelConfig))
            for f in fields(cls)}
    missing = sorted(keys - set(listed))
    assert not missing, f"add these keys to tools/fuzz_parity.py's space (or EXCLUDED with a reason): {missing}"
    cfg = Config()
    for key in listed:  # every listed key is a config key (a rename shows here)
        section, name = key.split(".")
        assert hasattr(getattr(cfg, section), name), key


def test_draws_are_seeded_and_grouped():
    a, b = fz.draw_cases(5, 6), fz.draw_cases(5, 6)
    assert [c.overrides() for c in a] == [c.overrides() for c in b]
    assert [c.overrides() for c in a] != [c.overrides() for c in fz.draw_cases(6, 6)]
    assert a[0].model == a[1].model and a[0].reference_overrides() == a[1].reference_overrides()  # one reference
    assert a[:4] == fz.draw_cases(5, 4)  # a longer draw starts with the shorter one


def test_draws_validate_and_the_layouts_divide_the_model():
    cases = fz.draw_cases(0, 200, max_world=4)
    refused, seen = [], {key: set() for key in {**fz.FEATURES, **fz.LAYOUT}}
    for case in cases:
        both = {**case.model, **case.layout}
        for key, value in both.items():
            if key in seen:
                seen[key].add(value)
        line = fz.validate(case.reference_overrides()) or fz.validate(case.overrides())
        if line is not None:
            assert "\n" not in line and line
            refused.append(line)
            continue
        get = both.get
        tp, pp, cp, dp = (get(f"parallel.{k}", 1) for k in ("tp", "pp", "cp", "dp"))
        mbs, micro = get("train.micro_batch_size"), case.model["train.micro_batch_size"]
        assert mbs == micro or not get("model.num_experts")  # MoE's aux loss is per micro-batch: the reference's
        assert 2 <= tp * pp * cp * dp <= 4
        assert all(rule(both) for rule in fz.RULES.values())
        assert get("model.num_heads") % tp == 0 and get("model.num_layers") >= pp * get("parallel.virtual_stages", 1)
        assert get("model.seq_length") % required_divisor(get("parallel.cp_algo", "ring"), cp, tp,
                                                          bool(get("parallel.sequence_parallel"))) == 0
        accum, rest = divmod(get("train.global_batch_size"), dp * mbs)
        assert rest == 0 and accum >= pp and get("train.global_batch_size") % micro == 0
    assert len(refused) <= 0.4 * len(cases), refused[:5]  # most draws run (today ~17 % refused: capacity with cp)
    for key, spec in {**fz.FEATURES, **fz.LAYOUT}.items():  # every choice of every key is drawn (no dead `when`)
        assert seen[key] == set(spec.choices) if isinstance(spec.choices, tuple) else len(seen[key]) > 1, (key, seen[key])


def test_draw_only_and_max_world(capsys):
    assert all(c.world == 2 for c in fz.draw_cases(3, 10, max_world=2))
    assert fz.main(["--seed", "3", "--count", "4", "--max-world", "2", "--draw-only"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("case | features | layout") and len(out) >= 6
    result = json.loads(out[-1])
    assert result["drawn"] + result["refused"] == 4 and all(c["world"] == 2 for c in result["cases"])
    assert fz.main(["--max-world", "1"]) == 2
    assert capsys.readouterr().err.startswith("error: --max-world: 1 must be at least 2")


def _write_run(run_dir: Path, world: int = 1, grads: dict | None = None, losses=(5.0, 4.9, 4.8, 4.7, 4.6),
               grad_norm: float = 1.5, moe: float | None = None) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    rows = [{"step": s + 1, "loss": loss, "grad_norm": grad_norm if s == 0 else 1.0, "world_size": world,
             **({"moe_aux_loss": moe, "moe_tokens_per_expert": [3, 5]} if moe is not None else {})}
            for s, loss in enumerate(losses)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = {"w": torch.linspace(-1, 1, 12).reshape(3, 4), "b": torch.tensor([0.5, -0.25])}
    torch.save(grads or base, run_dir / "grads_step1.pt")
    return run_dir


def test_the_verdict_fails_a_wrong_run(tmp_path):
    """The parity standard's three checks, the layout's world size and the MoE balancing metrics each fail alone."""
    case = fz.Case(0, 0, {}, {"parallel.tp": 2})
    ref = _write_run(tmp_path / "ref", moe=0.25)
    assert fz.judge(ref, _write_run(tmp_path / "same", world=2, moe=0.25), case).ok
    wrong_grad = {"w": torch.linspace(-1, 1, 12).reshape(3, 4) * (1 + 1e-4), "b": torch.tensor([0.5, -0.25])}
    wrong = {"gradients differ": _write_run(tmp_path / "g", 2, grads=wrong_grad, moe=0.25),
             "grad norm differs": _write_run(tmp_path / "n", 2, grad_norm=1.5 * (1 + 1e-5), moe=0.25),
             "loss differs": _write_run(tmp_path / "l", 2, losses=(5.0, 4.9, 4.8 * (1 + 1e-5), 4.7, 4.6), moe=0.25),
             "world size 4": _write_run(tmp_path / "w", 4, moe=0.25),
             "moe_aux_loss": _write_run(tmp_path / "m", 2, moe=0.25 * (1 + 1e-5))}
    for what, run in wrong.items():
        report = fz.judge(ref, run, case)
        assert not report.ok and what in "; ".join(report.problems), (what, report.problems)


def test_a_failing_case_exits_1_with_its_reproduction(tmp_path, monkeypatch, capsys):
    """The whole tool with train.py replaced: case 0's gradients are off (FAIL, reproduced by its overrides), case 1
    exits 2 (refused: not a failure), case 2 crashes (error)."""
    def fake_train(argv: list[str]) -> tuple[int, str]:
        run_dir = Path(next(a for a in argv if a.startswith("logging.dir="))[len("logging.dir="):])
        if run_dir.parent.name == "refs":
            _write_run(run_dir)
            return 0, ""
        index = int(run_dir.name[len("case"):])
        if index == 1:
            return 2, "error: refused by the fake"
        if index == 2:
            return 1, "Traceback: boom"
        world = math.prod(int(a.split("=")[1]) for a in argv if a.split("=")[0] in
                          ("parallel.tp", "parallel.pp", "parallel.cp", "parallel.dp"))
        _write_run(run_dir, world, grads={"w": torch.ones(3, 4), "b": torch.tensor([0.5, -0.25])})
        return 0, ""

    monkeypatch.setattr(fz, "train", fake_train)
    monkeypatch.setattr(fz, "validate", lambda args: None)
    monkeypatch.setattr(fz, "_dataset", lambda work, packed: str(work / "data" / "byte_text_document"))
    assert fz.main(["--seed", "3", "--count", "3", "--keep", str(tmp_path)]) == 1
    out = capsys.readouterr().out.splitlines()
    result = json.loads(out[-1])
    assert (result["FAIL"], result["refused"], result["error"], result["ok"]) == (1, 1, 1, 0)
    assert [c["verdict"] for c in result["cases"]] == ["FAIL", "refused", "error"]
    assert "gradients differ" in result["cases"][0]["detail"]
    assert result["cases"][1]["detail"] == "layout run: error: refused by the fake"
    case0 = fz.draw_cases(3, 3)[0]
    layout_line = next(line for line in out if line.strip().startswith("layout:") and "case0" in line)
    assert all(arg in layout_line for arg in case0.overrides()) and "python train.py" in layout_line
