"""tools/plot_metrics.py: metrics.jsonl files → a PNG of loss and throughput curves; bad input → one error line."""
from __future__ import annotations

import importlib.util
import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "plot_metrics.py"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def load_tool():
    spec = importlib.util.spec_from_file_location("plot_metrics_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def write_metrics(path: Path, steps: int = 6, val_every: int = 3, scale: float = 1.0) -> Path:
    """A metrics.jsonl shaped like train.py's: training records, and validation records at some steps."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for step in range(1, steps + 1):
        rows.append({"step": step, "loss": scale * 8.0 / step, "lr": 1e-3, "grad_norm": 1.5, "tokens_per_s": 900.0 + step,
                     "tflops": 0.01, "mfu": 0.05, "memory_bytes": 1 << 28, "world_size": 2,
                     "consumed_samples": 8 * step, "skipped_steps": 0})
        if val_every and step % val_every == 0:
            rows.append({"step": step, "val_loss": scale * 9.0 / step})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_cli_writes_png_of_two_runs(tmp_path):
    pytest.importorskip("matplotlib")
    a = write_metrics(tmp_path / "runs" / "a" / "log" / "metrics.jsonl")
    write_metrics(tmp_path / "runs" / "b" / "log" / "metrics.jsonl", val_every=0, scale=1.2)
    out = tmp_path / "plots" / "curves.png"
    p = subprocess.run([sys.executable, str(TOOL), str(a), str(tmp_path / "runs" / "b" / "log"), "--output", str(out)],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr
    assert out.stat().st_size > 0
    width, height = png_size(out)
    assert width > 0 and height > 0
    assert "2 runs" in p.stdout and "step 6" in p.stdout


def test_mfu_panel_adds_height(tmp_path):
    pytest.importorskip("matplotlib")
    tool = load_tool()
    runs = [tool.read_metrics(write_metrics(tmp_path / "r" / "metrics.jsonl"))]
    two = png_size(tool.plot(runs, tmp_path / "two.png"))
    three = png_size(tool.plot(runs, tmp_path / "three.png", mfu=True, title="t"))
    assert three[0] == two[0] and three[1] > two[1]


def test_moe_runs_add_the_expert_load_panels(tmp_path):
    """Records with train.py's MoE keys add two panels (expert load max/mean, aux loss); a dense run beside a MoE
    run draws them too (empty for it)."""
    pytest.importorskip("matplotlib")
    tool = load_tool()
    dense = write_metrics(tmp_path / "dense" / "metrics.jsonl")
    moe = tmp_path / "moe" / "metrics.jsonl"
    rows = [json.loads(line) for line in write_metrics(moe).read_text().splitlines()]
    for row in rows:
        if "loss" in row:
            row.update(moe_aux_loss=1.0 + 0.1 / row["step"], moe_z_loss=0.5, moe_load_imbalance=1.2 + 1 / row["step"],
                       moe_dropped_tokens=0.0, moe_tokens_per_expert=[[10, 20, 30, 40]])
    moe.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = tool.read_metrics(moe)
    assert run.series("moe_load_imbalance")[1] == pytest.approx([1.2 + 1 / s for s in range(1, 7)])
    plain = png_size(tool.plot([tool.read_metrics(dense)], tmp_path / "dense.png"))
    both = png_size(tool.plot([tool.read_metrics(dense), run], tmp_path / "both.png"))
    assert both[0] == plain[0] and both[1] * 4 == plain[1] * 6  # 6 panels instead of 4, each 3 inches


def test_grad_norm_and_learning_rate_panels(tmp_path, monkeypatch):
    """Every run gets a gradient-norm panel (log scale) and a learning-rate panel, drawn from its records."""
    pytest.importorskip("matplotlib")
    tool = load_tool()
    path = tmp_path / "r" / "metrics.jsonl"
    rows = [json.loads(line) for line in write_metrics(path).read_text().splitlines()]
    for row in rows:
        if "loss" in row:
            row.update(lr=1e-3 * row["step"], grad_norm=10.0 / row["step"])
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    plt = tool._import_pyplot()
    figures = []
    monkeypatch.setattr(tool, "_import_pyplot", lambda: plt)
    monkeypatch.setattr(plt, "close", figures.append)
    tool.plot([tool.read_metrics(path)], tmp_path / "out.png")
    axes = figures[0].axes
    assert [ax.get_ylabel() for ax in axes] == ["loss", "tokens/s", "grad norm", "learning rate"]
    assert list(axes[2].lines[0].get_ydata()) == pytest.approx([10.0 / s for s in range(1, 7)])
    assert axes[2].get_yscale() == "log"
    assert list(axes[3].lines[0].get_ydata()) == pytest.approx([1e-3 * s for s in range(1, 7)])


def test_read_metrics_splits_train_and_validation(tmp_path):
    tool = load_tool()
    run = tool.read_metrics(write_metrics(tmp_path / "metrics.jsonl", steps=6, val_every=3))
    assert sorted(run.train) == [1, 2, 3, 4, 5, 6]
    assert run.valid == pytest.approx({3: 3.0, 6: 1.5})
    steps, mfu = run.series("mfu", scale=100.0)
    assert steps == [1, 2, 3, 4, 5, 6] and mfu == pytest.approx([5.0] * 6)


def test_labels_are_run_directories(tmp_path):
    tool = load_tool()
    assert tool.labels_for([tmp_path / "runs/a/log/metrics.jsonl", tmp_path / "runs/b/metrics.jsonl"]) == ["a", "b"]
    assert tool.labels_for([tmp_path / "x/demo/metrics.jsonl", tmp_path / "y/demo/metrics.jsonl"]) == ["x/demo", "y/demo"]
    same = tmp_path / "a/metrics.jsonl"
    assert len(set(tool.labels_for([same, same]))) == 2


def _bad_inputs(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """name → (metrics file, a word the error line must contain)."""
    cases = {}
    cases["missing"] = (tmp_path / "nope" / "metrics.jsonl", "not found")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    cases["empty"] = (empty, "empty")
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss"\n')
    cases["malformed"] = (bad_json, ":2: not valid JSON")
    not_object = tmp_path / "list.jsonl"
    not_object.write_text("[1, 2, 3]\n")
    cases["not an object"] = (not_object, ":1: expected a JSON object")
    only_val = tmp_path / "val.jsonl"
    only_val.write_text('{"step": 5, "val_loss": 3.0}\n')
    cases["no training records"] = (only_val, "no training records")
    return cases


def test_bad_inputs_give_one_error_line(tmp_path, capsys):
    tool = load_tool()
    good = write_metrics(tmp_path / "good" / "metrics.jsonl")
    for name, (path, needle) in _bad_inputs(tmp_path).items():
        out = tmp_path / f"{name}.png"
        rc = tool.main([str(good), str(path), "--output", str(out)])
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.strip()]
        assert rc != 0, name
        assert len(lines) == 1 and lines[0].startswith("error: "), (name, err)
        assert needle in lines[0] and str(path) in lines[0], (name, lines[0])
        assert not out.exists(), name


def test_bad_input_through_the_cli(tmp_path):
    p = subprocess.run([sys.executable, str(TOOL), str(tmp_path / "missing.jsonl"), "--output", str(tmp_path / "c.png")],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode != 0
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "missing.jsonl" in lines[0] and "not found" in lines[0], p.stderr
    assert not (tmp_path / "c.png").exists()


def test_unsupported_output_type(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    tool = load_tool()
    rc = tool.main([str(write_metrics(tmp_path / "metrics.jsonl")), "--output", str(tmp_path / "curves.xyz")])
    err = capsys.readouterr().err.strip()
    assert rc != 0 and err.startswith("error: --output") and "'.xyz'" in err and "\n" not in err


def test_missing_matplotlib_names_the_fix(tmp_path, capsys, monkeypatch):
    tool = load_tool()
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    rc = tool.main([str(write_metrics(tmp_path / "metrics.jsonl")), "--output", str(tmp_path / "c.png")])
    err = capsys.readouterr().err.strip()
    assert rc != 0 and "\n" not in err
    assert err.startswith("error: ") and "pip install matplotlib" in err
    assert not (tmp_path / "c.png").exists()


def test_existing_output_is_kept_unless_overwrite(tmp_path, capsys, monkeypatch):
    """The default ./curves.png of an earlier plot is refused in one line naming it and --overwrite, before any
    input is read; --overwrite replaces it (renamed into place, no temporary left); a directory is refused."""
    pytest.importorskip("matplotlib")
    tool = load_tool()
    monkeypatch.chdir(tmp_path)
    metrics = str(write_metrics(tmp_path / "r" / "metrics.jsonl"))
    Path("curves.png").write_bytes(b"mine")
    assert tool.main([metrics, str(tmp_path / "missing.jsonl")]) != 0  # the output is named first
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: output 'curves.png' already exists (4 bytes)")
    assert "pass --overwrite" in err and "--output" in err and Path("curves.png").read_bytes() == b"mine"
    assert tool.main([metrics, "--overwrite"]) == 0
    assert png_size(tmp_path / "curves.png")[0] > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["curves.png", "r"]
    (tmp_path / "dir.png").mkdir()
    assert tool.main([metrics, "--output", "dir.png", "--overwrite"]) != 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: --output 'dir.png' is a directory")
