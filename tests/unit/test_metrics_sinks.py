"""MetricsLogger's sinks: metrics.jsonl always; wandb (offline) and TensorBoard read back equal to the records;
a missing package is one ConfigError naming the key and the fix."""
from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest

from megatron_sp import config
from megatron_sp.errors import ConfigError
from megatron_sp.metrics import MetricsLogger, check_sinks

BASE = ["data.paths=[d/x]", "tokenizer.type=byte"]

# Shaped like the training loop's records: training steps, then a validation record at step 3.
RECORDS = [
    {"step": step, "loss": 8.0 / step, "lr": 1e-3 * step, "grad_norm": 0.5 + step, "tokens_per_s": 1000.0 * step,
     "tflops": 0.25, "mfu": 0.125, "memory_bytes": 1 << 20, "world_size": 2, "consumed_samples": 8 * step,
     "skipped_steps": 0}
    for step in (1, 2, 3)
] + [{"step": 3, "val_loss": 2.75}]


def make_cfg(tmp_path: Path, *overrides: str) -> config.Config:
    return config.load(overrides=BASE + [f"logging.dir={tmp_path / 'run'}", *overrides])


def expected_scalars() -> dict[str, list[tuple[int, float]]]:
    """key → [(step, value)] as a sink should hold them (``step`` is the x axis, not a scalar)."""
    out: dict[str, list[tuple[int, float]]] = {}
    for r in RECORDS:
        for k, v in r.items():
            if k != "step":
                out.setdefault(k, []).append((r["step"], float(v)))
    return out


def log_all(cfg: config.Config) -> Path:
    logger = MetricsLogger(cfg, enabled=True)
    for r in RECORDS:
        logger.write(dict(r))
    logger.close()
    lines = logger.path.read_text().splitlines()
    assert [json.loads(line) for line in lines] == RECORDS  # the file sink, whatever else is on
    return logger.path.parent


def test_disabled_logger_writes_nothing(tmp_path):
    logger = MetricsLogger(make_cfg(tmp_path, "logging.tensorboard=true", "logging.wandb=true"), enabled=False)
    logger.write(dict(RECORDS[0]))
    logger.close()
    assert not (tmp_path / "run").exists()


def test_tensorboard_scalars_read_back(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = log_all(make_cfg(tmp_path, "logging.tensorboard=true"))
    events = list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1
    acc = EventAccumulator(str(events[0]))
    acc.Reload()
    expected = expected_scalars()
    assert set(acc.Tags()["scalars"]) == set(expected)
    for key, points in expected.items():
        got = [(e.step, e.value) for e in acc.Scalars(key)]
        assert [s for s, _ in got] == [s for s, _ in points], key
        assert [v for _, v in got] == pytest.approx([v for _, v in points], rel=1e-6), key  # stored as float32


def test_resume_drops_steps_past_the_checkpoint_in_both_files(tmp_path):
    """A run logged steps 1-4, crashed, and resumed from its step-2 checkpoint: metrics.jsonl and TensorBoard
    both read 1, 2 from the first run and 3, 4, 5 from the second (no step twice)."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = make_cfg(tmp_path, "logging.tensorboard=true")
    for resume_step, steps, offset in ((0, (1, 2, 3, 4), 0.0), (2, (3, 4, 5), 10.0)):
        logger = MetricsLogger(cfg, enabled=True, resume_step=resume_step)
        for step in steps:
            logger.write({"step": step, "loss": offset + step})
        logger.close()
    expected = [(1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0), (5, 15.0)]
    rows = [json.loads(line) for line in logger.path.read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in rows] == expected
    acc = EventAccumulator(str(tmp_path / "run" / "tensorboard"))  # the folder: both runs' event files
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == expected


def _wandb_records(path: Path):
    """The protobuf records of a ``.wandb`` file: a ':W&B' header, then LevelDB-log-style 32 KiB blocks of
    chunks (crc32 u32, length u16, type u8: 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", "not a wandb transaction log"
    block, pos, chunks = 32768, 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # too little room for a chunk header: the block is padded
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        chunks += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            chunks = b""
            yield record


def test_wandb_offline_run_holds_the_records(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    for var in ("WANDB_API_KEY", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(var, raising=False)
    wandb_dir = tmp_path / "wandb_dir"
    wandb_dir.mkdir()
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(wandb_dir))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb_cache"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb_data"))
    monkeypatch.setenv("WANDB_CONSOLE", "off")  # leave pytest's stdout capture alone
    monkeypatch.setenv("WANDB_SILENT", "true")
    try:
        log_all(make_cfg(tmp_path, "logging.wandb=true", "logging.wandb_project=sinks_test"))
    finally:
        wandb.teardown()  # stop the wandb service process now rather than at interpreter exit
    runs = list((wandb_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list(wandb_dir.rglob("*"))
    logs = list(runs[0].glob("run-*.wandb"))
    assert len(logs) == 1

    history: dict[int, dict[str, float]] = {}
    config_keys: set[str] = set()
    for record in _wandb_records(logs[0]):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history.setdefault(record.history.step.num, {}).update(
                {k: v for k, v in items.items() if not k.startswith("_")})  # wandb's own _step, _runtime, ...
        elif kind == "run":
            config_keys |= {item.key for item in record.run.config.update}
    expected: dict[int, dict[str, float]] = {}
    for key, points in expected_scalars().items():
        for step, value in points:
            expected.setdefault(step, {})[key] = value  # wandb merges the records of one step
    assert history.keys() == expected.keys()
    for step, values in expected.items():
        assert history[step] == pytest.approx(values), step
    assert {"model", "parallel", "train", "logging"} <= config_keys  # the resolved config rides along


def test_wandb_init_failure_is_one_config_error(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")

    def refuse(**_: object) -> None:
        raise wandb.errors.UsageError("No API key configured. Use `wandb login` to log in.")

    monkeypatch.setattr(wandb, "init", refuse)
    with pytest.raises(ConfigError) as exc:
        MetricsLogger(make_cfg(tmp_path, "logging.wandb=true"), enabled=True)
    message = str(exc.value)
    assert "logging.wandb" in message and "No API key" in message and "WANDB_MODE=offline" in message
    assert "\n" not in message


@pytest.mark.parametrize("key, package", [("wandb", "wandb"), ("tensorboard", "tensorboard")])
def test_missing_package_is_a_config_error(tmp_path, monkeypatch, key, package):
    monkeypatch.setitem(sys.modules, package, None)  # `import package` raises ImportError, find_spec gives None
    cfg = make_cfg(tmp_path, f"logging.{key}=true")
    for check in (lambda: check_sinks(cfg), lambda: MetricsLogger(cfg, enabled=True)):
        with pytest.raises(ConfigError) as exc:
            check()
        message = str(exc.value)
        assert f"logging.{key}=true needs {package}" in message and "pip install" in message
        assert "\n" not in message
    check_sinks(make_cfg(tmp_path))  # off: nothing is required


def test_earlier_runs_metrics_are_never_lost(tmp_path):
    """A fresh run in a used logging.dir moves the earlier run's metrics.jsonl (and tensorboard/) to .N, in
    run order; a resume that drops records past its checkpoint keeps the whole earlier file as .N first."""
    cfg = make_cfg(tmp_path)
    run = tmp_path / "run"

    def log(resume_step: int, steps, offset: float) -> str:
        logger = MetricsLogger(cfg, enabled=True, resume_step=resume_step)
        for step in steps:
            logger.write({"step": step, "loss": offset + step})
        logger.close()
        return logger.path.read_text()

    first = log(0, (1, 2, 3, 4), 0.0)
    (run / "tensorboard").mkdir()
    (run / "tensorboard" / "events.out.tfevents.1").write_bytes(b"first run")
    second = log(0, (1, 2), 10.0)
    assert (run / "metrics.jsonl.1").read_text() == first and (run / "metrics.jsonl").read_text() == second
    assert (run / "tensorboard.1" / "events.out.tfevents.1").read_bytes() == b"first run"
    assert not (run / "tensorboard").exists()

    # resumed from a step-1 checkpoint: the record of step 2 (logged after it) leaves metrics.jsonl, kept in .2
    (run / "metrics.jsonl").write_text(second + '{"step": 3, "lo')  # and a line cut short by a crash
    resumed = log(1, (2, 3), 20.0)
    assert (run / "metrics.jsonl.2").read_text() == second + '{"step": 3, "lo'
    assert [(r["step"], r["loss"]) for r in map(json.loads, resumed.splitlines())] == [(1, 11.0), (2, 22.0), (3, 23.0)]
    log(3, (4,), 30.0)  # nothing past step 3: appended, nothing rotated
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl", "metrics.jsonl.1", "metrics.jsonl.2",
                                                     "tensorboard.1"]
    third = (run / "metrics.jsonl").read_text()
    log(0, (1,), 40.0)
    assert (run / "metrics.jsonl.3").read_text() == third and (run / "metrics.jsonl.1").read_text() == first


def test_earlier_runs_config_is_kept_with_its_metrics(tmp_path):
    """config.yml of an earlier run (a different config) is kept as config.yml.N, N the number its
    metrics.jsonl gets; the same config written again is not duplicated."""
    from megatron_sp.metrics import keep_earlier_config

    cfg = make_cfg(tmp_path)
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    (run / "config.yml").write_text("train: {iters: 5}\n")
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    keep_earlier_config(run / "config.yml", "train: {iters: 5}\n")  # the same config (a resume): nothing to keep
    assert not (run / "config.yml.1").exists()
    keep_earlier_config(run / "config.yml", "train: {iters: 100}\n")  # a fresh run with another config
    MetricsLogger(cfg, enabled=True).close()
    assert (run / "config.yml.1").read_text() == "train: {iters: 5}\n"
    assert (run / "metrics.jsonl.1").read_text() == '{"step": 1, "loss": 1.0}\n'
