"""tools/evaluate.py: the validation loss train.py logged, and the same figures under every layout.

One 1-rank training run (2 steps, validated at step 2: the split's second window of 2 global batches, then saved)
serves every test. The layouts run on in-process ranks (``run_distributed``: several layouts per launch); the command
line runs once plainly at 1 rank and once under torchrun; its ``main`` runs on 2 harness ranks as torchrun starts it.
Run plainly with 2 ranks it starts them itself: the README's ``tools/evaluate.py ... parallel.tp=2``
(tests/e2e/test_readme_commands.py).
"""
from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_sp import checkpointing
from megatron_sp.testing import run_distributed

from .runs import ROOT, metrics, train

LAYOUTS = {2: {"tp2": ["parallel.tp=2"], "pp2": ["parallel.pp=2"], "dp2": ["parallel.dp=2"], "cp2": ["parallel.cp=2"]},
           4: {"tp2·pp2": ["parallel.tp=2", "parallel.pp=2"], "cp2·dp2": ["parallel.cp=2", "parallel.dp=2"]}}


@pytest.fixture(scope="module")
def trained(tmp_path_factory, byte_data) -> tuple[Path, float, str]:
    """(checkpoint.save dir, the validation loss logged at its last step, a small dataset prefix for --data)."""
    root = tmp_path_factory.mktemp("evaluate")
    train(root / "run", byte_data, "train.iters=2", "train.eval_interval=2", "train.eval_iters=2",
          f"checkpoint.save={root}/ckpt")
    logged = [json.loads(line) for line in (root / "run" / "log" / "metrics.jsonl").read_text().splitlines()]
    val_loss = next(r["val_loss"] for r in logged if r["step"] == 2 and "val_loss" in r)
    assert sorted(metrics(root / "run")) == [1, 2]
    return root / "ckpt", val_loss, _small_dataset(root)


@pytest.fixture(scope="module")
def reference(trained) -> tuple[dict, dict]:
    """The 1-rank (validation, --data) results, from in-process ranks."""
    ckpt, _, small = trained
    return run_distributed(_evaluate_layouts, 1, ckpt=ckpt, data=small, layouts={"1": []})[0]["1"]


def _small_dataset(directory: Path) -> str:
    """80 short Python functions as byte-level documents (2,974 tokens with their EODs): 46 samples of 65 tokens,
    5 whole global batches of 8 and a rest."""
    from megatron_sp.config import TokenizerConfig
    from megatron_sp.data import build_tokenizer
    from megatron_sp.data.preprocess import preprocess_jsonl

    docs = [json.dumps({"text": f"def f{i}(x):\n    return x * {i} + {i * i}\n"}) for i in range(80)]
    (directory / "small.jsonl").write_text("\n".join(docs) + "\n")
    preprocess_jsonl([directory / "small.jsonl"], str(directory / "small"), build_tokenizer(TokenizerConfig(type="byte")))
    return str(directory / "small_text_document")


def _cli(*args: str, torchrun: int = 0) -> subprocess.CompletedProcess:
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={torchrun}"] if torchrun \
        else [sys.executable]
    return subprocess.run([*launch, "tools/evaluate.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def _evaluate_layouts(rank: int, world_size: int, ckpt: Path, data: str, layouts: dict[str, list[str]]) -> dict:
    """On each rank: {layout: (the validation result, the --data result)}."""
    from tools.evaluate import evaluate_checkpoint
    from tools.inference_setup import checkpoint_config

    ckpt = checkpointing.resolve(ckpt)
    meta = checkpointing.read_meta(ckpt)
    out = {}
    for name, overrides in layouts.items():
        cfg = checkpoint_config(meta, ckpt, overrides, world_size)
        out[name] = (*evaluate_checkpoint(cfg, ckpt, meta, []), *evaluate_checkpoint(cfg, ckpt, meta, [data]))
    return out


def test_validation_loss_equals_train_py_and_every_layout(trained, reference) -> None:
    """At 1 rank the command line prints exactly the validation loss train.py logged at the checkpoint's step; tp2, pp2,
    dp2, cp2, tp2·pp2 and cp2·dp2 give the 1-rank figures to 1e-6 relative, on the validation split and on a dataset."""
    ckpt, val_loss, small = trained
    p = _cli("--load", str(ckpt), "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["step"] == 2 and out["layout"]["world_size"] == 1 and out["checkpoint"].endswith("iter_0000002")
    (valid,) = out["results"]
    assert valid["loss"] == val_loss, (valid["loss"], val_loss)                  # the same computation: bitwise
    assert valid["samples"] == 16 and valid["tokens"] == 16 * 64

    assert reference[0]["loss"] == val_loss
    assert reference[1]["samples"] == 40 and reference[1]["tokens"] == 40 * 64  # 5 whole global batches of 8
    got = {}
    for world, layouts in LAYOUTS.items():
        ranks = run_distributed(_evaluate_layouts, world, ckpt=ckpt, data=small, layouts=layouts, timeout_s=240)
        assert all(r == ranks[0] for r in ranks)                                   # every rank returns the figures
        got.update(ranks[0])
    for name, results in got.items():
        for want, have in zip(reference, results, strict=True):
            assert have["tokens"] == want["tokens"], name
            assert abs(have["loss"] - want["loss"]) <= 1e-6 * want["loss"], (name, have["loss"], want["loss"])
    print("relative to 1 rank:", {n: max(abs(h["loss"] - w["loss"]) / w["loss"] for w, h in zip(reference, r))
                                  for n, r in got.items()})


def _main_rank(rank: int, world_size: int, argv: list[str]) -> tuple[int, str]:
    """tools/evaluate.py's ``main(argv)`` on this rank, as torchrun starts it: (exit code, stdout)."""
    from tools.evaluate import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(argv)
    return code, out.getvalue()


def test_text_output_on_two_ranks_and_the_command_line_under_torchrun(trained, reference) -> None:
    """On 2 ranks (tp2) one line per dataset, printed by rank 0; under torchrun dp fills the world."""
    ckpt, val_loss, small = trained
    ranks = run_distributed(_main_rank, 2, init=False, argv=["--load", str(ckpt), "--data", small, "--data", small,
                                                             "parallel.tp=2", "train.preflight=false"])
    assert [code for code, _ in ranks] == [0, 0] and ranks[1][1] == ""
    lines = ranks[0][1].splitlines()
    assert len(lines) == 2 and lines[0] == lines[1], ranks[0][1]
    name, rest = lines[0].split(": ", 1)
    tokens, loss, ppl = rest.split(" | ")
    assert name == small and tokens == f"{40 * 64} tokens" and loss.startswith("loss ") and ppl.startswith("perplexity ")
    assert abs(float(loss.split()[1]) - reference[1]["loss"]) <= 1e-6  # printed with 6 decimals

    p = _cli("--load", str(ckpt), "--json", "parallel.pp=2", torchrun=2)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["layout"] == {"tp": 1, "pp": 2, "cp": 1, "dp": 1, "world_size": 2}
    assert abs(out["results"][0]["loss"] - val_loss) <= 1e-6 * val_loss


@pytest.mark.parametrize("args, says", [
    (["--data", "{tmp}/missing"], "{tmp}/missing.idx not found"),
    (["parallel.tp=3"], "model.num_heads 4 must be divisible by parallel.tp 3"),
    (["parallel.pp=4"], "model.num_layers = 2 is fewer than parallel.pp"),
    (["model.num_layers=4"], "the model is the checkpoint's"),
    (["data.split=100,0,0"], "the validation split of data.paths"),
    (["--data", "{small}", "train.global_batch_size=64"], "fewer than one global batch"),
    (["parallel.typo=2"], "unknown key 'parallel.typo'"),
])
def test_bad_input_is_one_line_and_exit_2(trained, tmp_path, capsys, args, says) -> None:
    """Checked before any rank starts (in this process: no process group is created)."""
    from tools.evaluate import main

    ckpt, _, small = trained
    args = [a.format(tmp=tmp_path, small=small) for a in args]
    assert main(["--load", str(ckpt), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and says.format(tmp=tmp_path) in err, err


def test_bad_checkpoint_path(tmp_path, capsys) -> None:
    from tools.evaluate import main

    assert main(["--load", str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err.startswith(f"error: --load: '{tmp_path / 'nope'}' is not a directory")
    assert main(["--load", str(tmp_path)]) == 2
    assert "no 'latest' file" in capsys.readouterr().err
