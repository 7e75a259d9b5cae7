"""Nothing the user did not ask us to replace is overwritten or deleted: save-directory ownership,
``checkpoint.keep`` across resumes and rollbacks, the save-directory lock, Ctrl-C, rotated metrics files.

Each data-loss path compares the user's files byte for byte before and after."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch

import train as cli  # train.py: its main() is the command line
from megatron_sp import checkpointing, config, launcher, training
from megatron_sp.checkpointing import Lineage, SaveDirLock
from megatron_sp.errors import ConfigError, TrainingError
from megatron_sp.model import GPTModel
from megatron_sp.optim import DistributedOptimizer, named_trainable

ROOT = Path(__file__).resolve().parents[2]
OVR = ["data.paths=[x]", "tokenizer.type=byte", "model.num_layers=1", "model.hidden_size=16", "model.num_heads=2",
       "model.seq_length=8"]
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def digest(root: Path) -> dict[str, str]:
    """{relative path: sha256} of every file under ``root`` (the lock file aside)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != checkpointing.LOCK_FILE}


def cfg_of(*overrides: str) -> config.Config:
    cfg = config.load(overrides=OVR + list(overrides))
    config.set_vocab(cfg, 258)
    return cfg


@pytest.fixture(scope="module")
def tiny():
    cfg = cfg_of()
    model = GPTModel(cfg.model, seed=1)
    return model, DistributedOptimizer(named_trainable(model), cfg.train, None)


def save_steps(tiny, root: Path, lineage: Lineage, steps, *extra: str) -> checkpointing.Checkpointer:
    model, opt = tiny
    saver = checkpointing.Checkpointer(cfg_of(f"checkpoint.save={root}", *extra), None, torch.device("cpu"), lineage)
    for step in steps:
        saver.save(step, 4 * step, model, opt, asynchronous=False)
        assert (root / (root / "latest").read_text().strip() / "meta.json").is_file()  # latest names a checkpoint
    return saver


def resumed(root: Path, name: str) -> Lineage:
    ckpt = root / name
    return Lineage.start(checkpointing.read_meta(ckpt), ckpt, root)


def dirs(root: Path) -> list[str]:
    return sorted(p.name for p in root.glob("iter_*"))


def main_in_process(argv: list[str], monkeypatch, capsys) -> tuple[int, list[str]]:
    """train.py's ``main`` in this process; reaching training fails the test."""
    def must_not_train(*_: object, **__: object) -> None:
        raise AssertionError("passed the checks and would train")

    with monkeypatch.context() as m:
        for var in TORCHRUN_ENV:
            m.delenv(var, raising=False)
        m.setattr(training.log, "handlers", [])
        m.setattr(training.log, "propagate", training.log.propagate)
        m.setattr(training.log, "level", training.log.level)
        m.setattr(training, "run", must_not_train)
        m.setattr(launcher, "start_local", must_not_train)
        code = cli.main(argv)
    return code, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


# ------------------------------------------------------------------------------- save directory


def test_a_fresh_run_never_writes_into_another_runs_save_dir(tmp_path, tiny, monkeypatch, capsys):
    other, mine = tmp_path / "other", tmp_path / "mine"
    save_steps(tiny, other, Lineage.start(), (2, 3))
    save_steps(tiny, mine, Lineage.start(), (1,))
    before = digest(tmp_path)
    base = [*OVR, f"logging.dir={tmp_path}/log"]
    for extra, words in (([], ["holds checkpoints of another run (iter_0000002, iter_0000003)",
                               f"checkpoint.load={other} (or checkpoint.auto_resume=true)", "checkpoint.overwrite=true"]),
                         ([f"checkpoint.load={mine}"], ["that checkpoint.load", "does not continue"])):
        code, lines = main_in_process([*base, f"checkpoint.save={other}", *extra], monkeypatch, capsys)
        assert code == 2 and len(lines) == 1 and lines[0].startswith(f"error: checkpoint.save '{other}'"), lines
        assert all(w in lines[0] for w in words), lines[0]
    assert digest(tmp_path) == before and not (tmp_path / "log").exists()

    # who may save there: a run resuming from it (load, auto_resume), or one told to overwrite
    for ok in ([f"checkpoint.load={other}"], ["checkpoint.auto_resume=true"], ["checkpoint.overwrite=true"],
               [f"checkpoint.load={other}/iter_0000003"]):
        checkpointing.check_save_dir(cfg_of(f"checkpoint.save={other}", "train.iters=9", *ok))
    checkpointing.check_save_dir(cfg_of(f"checkpoint.save={tmp_path}/new"))  # nothing there yet
    assert not (tmp_path / "new").exists()  # the check creates nothing


def test_a_rollback_keeps_the_source_the_abandoned_branch_and_latest(tmp_path, tiny):
    """Run X saved 1-5 (keep 0); run Z resumes from iter_3 with keep=2. Z's planned saves may not land on
    X's later steps (refused before training); a save that would (a preemption at step 4) fails before
    writing; keep deletes only Z's history (X's 1 and 2), never the source or X's abandoned 4 and 5."""
    root = tmp_path / "ckpt"
    save_steps(tiny, root, Lineage.start(), range(1, 6))
    branch = {n: digest(root / n) for n in ("iter_0000003", "iter_0000004", "iter_0000005")}
    load = [f"checkpoint.save={root}", f"checkpoint.load={root}/iter_0000003", "checkpoint.keep=2"]
    with pytest.raises(ConfigError, match=r"resumes from iter_0000003 and would save iter_0000004, iter_0000005 again"):
        checkpointing.check_save_dir(cfg_of(*load, "train.iters=7", "checkpoint.interval=1"))
    with pytest.raises(ConfigError, match=r"would save iter_0000005 again"):
        checkpointing.check_save_dir(cfg_of(*load, "train.iters=5"))  # the end-of-training save
    checkpointing.check_save_dir(cfg_of(*load, "train.iters=7", "checkpoint.interval=3"))  # saves 6, 7: fine

    z = resumed(root, "iter_0000003")
    assert z.runs[:-1] == checkpointing.lineage_of(checkpointing.read_meta(root / "iter_0000005")) and z.runs[-1][1] == 3
    saver = save_steps(tiny, root, z, (6,), *load[::2])
    with pytest.raises(TrainingError, match=r"checkpoint of step 4 not saved: .*iter_0000004' holds a checkpoint of "
                                            r"another run.*checkpoint.overwrite=true"):
        saver.save(4, 16, *tiny, asynchronous=False)
    assert not list(root.glob(".tmp*"))
    saver.save(7, 28, *tiny, asynchronous=False)
    assert dirs(root) == ["iter_0000003", "iter_0000004", "iter_0000005", "iter_0000006", "iter_0000007"]
    assert {n: digest(root / n) for n in branch} == branch and (root / "latest").read_text() == "iter_0000007\n"
    meta = checkpointing.read_meta(root / "iter_0000007")
    assert meta["run_id"] == z.run_id and [tuple(r) for r in meta["lineage"]] == list(z.runs)

    # checkpoint.overwrite=true: this run replaces the step directories it saves, nothing else
    saver = save_steps(tiny, root, z, (4,), *load[::2], "checkpoint.overwrite=true")
    assert checkpointing.read_meta(root / "iter_0000004")["run_id"] == z.run_id
    assert dirs(root) == ["iter_0000003", "iter_0000004", "iter_0000005", "iter_0000006", "iter_0000007"]
    assert digest(root / "iter_0000005") == branch["iter_0000005"]
    assert (root / "latest").read_text() == "iter_0000004\n"  # the newest save is latest, even at a lower step


def test_keep_follows_the_lineage_across_resumes_and_spares_other_runs(tmp_path, tiny):
    root = tmp_path / "ckpt"
    keep = ("checkpoint.keep=2",)
    legacy = root / "iter_0000000"  # written before run ids: never pruned
    save_steps(tiny, root, Lineage.start(), (0,))
    meta = json.loads((legacy / "meta.json").read_text())
    (legacy / "meta.json").write_text(json.dumps({k: v for k, v in meta.items() if k not in ("run_id", "lineage")}))
    old = digest(legacy)

    save_steps(tiny, root, Lineage.start(), (1, 2, 3), *keep, "checkpoint.overwrite=true")
    assert dirs(root) == ["iter_0000000", "iter_0000002", "iter_0000003"]
    save_steps(tiny, root, resumed(root, "iter_0000003"), (4, 5), *keep)  # an auto-resume: its source stays
    assert dirs(root) == ["iter_0000000", "iter_0000003", "iter_0000004", "iter_0000005"]
    save_steps(tiny, root, resumed(root, "iter_0000005"), (6, 7), *keep)  # the next one prunes the ancestors
    assert dirs(root) == ["iter_0000000", "iter_0000005", "iter_0000006", "iter_0000007"]
    assert digest(legacy) == old

    # a fresh run told to overwrite: another lineage's checkpoints stay, whatever keep says
    save_steps(tiny, root, Lineage.start(), (8, 9, 10), "checkpoint.keep=1", "checkpoint.overwrite=true")
    assert dirs(root) == ["iter_0000000", "iter_0000005", "iter_0000006", "iter_0000007", "iter_0000010"]


def test_a_second_run_is_refused_while_the_first_holds_the_lock(tmp_path, monkeypatch, capsys):
    root = tmp_path / "ckpt"
    cfg = cfg_of(f"checkpoint.save={root}")
    with checkpointing.claim_save_dir(cfg):  # what global rank 0 of the first run holds
        holder = f"pid {os.getpid()} on "
        assert (root / checkpointing.LOCK_FILE).read_text().startswith(holder)
        for attempt in (lambda: SaveDirLock(root).acquire(), lambda: SaveDirLock.check(root),
                        lambda: checkpointing.check_save_dir(cfg)):
            with pytest.raises(ConfigError, match=f"checkpoint.save '{root}' is in use by another run \\({holder}"):
                attempt()
        code, lines = main_in_process([*OVR, f"checkpoint.save={root}", f"logging.dir={tmp_path}/log"],
                                      monkeypatch, capsys)
        assert code == 2 and len(lines) == 1 and "is in use by another run" in lines[0], lines
    SaveDirLock.check(root)  # released
    with SaveDirLock(root):
        pass
    with pytest.raises(RuntimeError), checkpointing.claim_save_dir(cfg):
        raise RuntimeError("a run that fails")
    SaveDirLock.check(root)  # released on error too


def test_outputs_that_are_files_are_refused_before_training(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("mine")
    for path, where in ((a_file, "is a file"), (a_file / "sub", f"lies under the file '{a_file}'")):
        for key in ("checkpoint.save", "logging.dir"):
            with pytest.raises(ConfigError, match=f"{key} '{path}' {where}"):
                checkpointing.check_output_dir(path, key)
    assert a_file.read_text() == "mine"


# ------------------------------------------------------------------------------- plot_metrics


def test_plot_metrics_labels_rotated_files_of_earlier_runs(tmp_path):
    spec = importlib.util.spec_from_file_location("plot_metrics_safety", ROOT / "tools" / "plot_metrics.py")
    tool = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = tool
    spec.loader.exec_module(tool)
    run = tmp_path / "runs" / "a"
    assert tool.labels_for([run / "metrics.jsonl.1", run / "metrics.jsonl"]) == ["a/metrics.jsonl.1", "a"]
    run.mkdir(parents=True)
    (run / "metrics.jsonl.1").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n')
    assert sorted(tool.read_metrics(run / "metrics.jsonl.1").train) == [1, 2]
