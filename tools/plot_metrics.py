#!/usr/bin/env python
"""Draw loss and throughput curves from one or more ``metrics.jsonl`` files (written by train.py).

    python tools/plot_metrics.py runs/demo/metrics.jsonl --output curves.png
    python tools/plot_metrics.py runs/a/log/metrics.jsonl runs/b/log --output cmp.png --mfu

Panels against the step: training loss (validation dashed), tokens/s, the gradient norm (before clipping, log
scale) and the learning rate, with ``--mfu`` the MFU, and for a
mixture-of-experts run (records with ``moe_load_imbalance``) the expert load (max/mean tokens per expert of the
busiest layer) and the MoE aux loss; one line per input (a file, or the run directory holding one), labelled by its run directory.
An earlier run's ``metrics.jsonl.1`` compares with the latest. An existing --output is kept unless
--overwrite (the image is written under a temporary name, then renamed). Needs matplotlib.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if importlib.util.find_spec("megatron_sp") is None:  # run from a checkout without installing the package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_sp.errors import DataError, OneLineArgumentParser, UserError, refuse_existing_outputs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = OneLineArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("metrics", nargs="+", metavar="METRICS_JSONL",
                        help="metrics.jsonl files (or run directories holding one); one curve each")
    parser.add_argument("--output", "-o", default="curves.png", metavar="FILE",
                        help="image to write; the format follows the suffix (default: %(default)s)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --output (refused by default)")
    parser.add_argument("--mfu", action="store_true", help="add a panel with the MFU (%%)")
    parser.add_argument("--title", help="figure title")
    return parser.parse_args(argv)


@dataclass
class Run:
    """One metrics file: its training records (``loss``) and validation records (``val_loss``) by step."""

    path: Path
    train: dict[int, dict[str, Any]] = field(default_factory=dict)
    valid: dict[int, float] = field(default_factory=dict)

    def series(self, key: str, scale: float = 1.0) -> tuple[list[int], list[float]]:
        """Steps and values of ``key`` over the training records that have a number there."""
        steps = [s for s in sorted(self.train) if _is_number(self.train[s].get(key))]
        return steps, [float(self.train[s][key]) * scale for s in steps]


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def read_metrics(path: str | Path) -> Run:
    """Parse one metrics.jsonl; a later record for the same step replaces an earlier one."""
    p = Path(path)
    if p.is_dir():
        p = p / "metrics.jsonl"
    if not p.is_file():
        raise DataError(f"metrics file '{p}' not found; give logging.dir/metrics.jsonl of a train.py run")
    run = Run(p)
    text = p.read_text(errors="replace")
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{p}:{lineno}: not valid JSON ({exc.msg}); is it a metrics.jsonl written by "
                            "train.py?") from None
        if not isinstance(record, dict) or not _is_number(record.get("step")):
            raise DataError(f"{p}:{lineno}: expected a JSON object with a numeric 'step', got {line.strip()[:60]!r}")
        step = int(record["step"])
        if _is_number(record.get("loss")):
            run.train[step] = record
        if _is_number(record.get("val_loss")):
            run.valid[step] = float(record["val_loss"])
    if not run.train:
        raise DataError(f"metrics file '{p}' has no training records (JSON lines with 'step' and 'loss')"
                        + ("; the file is empty" if not text.strip() else ""))
    return run


def labels_for(paths: list[Path]) -> list[str]:
    """Each file's run directory (plus the file name when it is not metrics.jsonl, e.g. an earlier run's
    metrics.jsonl.1), as short as keeps the labels distinct."""
    dirs, names = [], []
    for path in paths:
        parts = list(path.resolve().parent.parts)
        if len(parts) > 1 and parts[-1] in ("log", "logs"):
            parts.pop()
        dirs.append(parts)
        names.append("" if path.name == "metrics.jsonl" else f"/{path.name}")
    for depth in range(1, max(len(d) for d in dirs) + 1):
        labels = ["/".join(d[-depth:]) + name for d, name in zip(dirs, names)]
        if len(set(labels)) == len(labels):
            return labels
    return [f"{'/'.join(d[-2:])}{name} ({i + 1})" for i, (d, name) in enumerate(zip(dirs, names))]  # a file twice


def _import_pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise UserError("tools/plot_metrics.py needs matplotlib: pip install matplotlib "
                        "(or pip install -e '.[logging]')") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    return plt


def check_output(out: Path, overwrite: bool) -> None:
    """Refuse a directory, and unless ``overwrite`` an existing file, as ``--output``."""
    if out.is_dir():
        raise UserError(f"--output '{out}' is a directory; give an image file name such as {out / 'curves.png'}")
    if not overwrite:
        refuse_existing_outputs([out], "choose another --output")


def plot(runs: list[Run], output: str | Path, mfu: bool = False, title: str | None = None, *,
         overwrite: bool = True) -> Path:
    """Draw the panels for ``runs`` into ``output`` (a temporary name, renamed when complete; unless ``overwrite``
    an existing ``output`` is refused); returns its path."""
    out = Path(output)
    check_output(out, overwrite)
    plt = _import_pyplot()
    panels = [("loss", "loss"), ("tokens_per_s", "tokens/s"), ("grad_norm", "grad norm"), ("lr", "learning rate")]
    panels += [("mfu", "MFU (%)")] if mfu else []
    if any(run.series("moe_load_imbalance")[0] for run in runs):  # a MoE run: its expert load and aux loss
        panels += [("moe_load_imbalance", "expert load max/mean"), ("moe_aux_loss", "MoE aux loss")]
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 3 * len(panels)), sharex=True, squeeze=False)
    supported = fig.canvas.get_supported_filetypes()
    if out.suffix.lstrip(".").lower() not in supported:
        plt.close(fig)
        raise UserError(f"--output '{out}': unsupported image type '{out.suffix or '(no suffix)'}'; use one of "
                        + ", ".join("." + s for s in sorted(supported)))
    for run, label in zip(runs, labels_for([r.path for r in runs])):
        color = None
        for ax, (key, _) in zip(axes[:, 0], panels):
            steps, values = run.series(key, scale=100.0 if key == "mfu" else 1.0)
            if not steps:
                continue
            (line,) = ax.plot(steps, values, label=label, color=color, linewidth=1.2,
                              marker="o" if len(steps) == 1 else None)  # one record: a dot, not nothing
            color = line.get_color()  # one colour per run across the panels
            if key == "loss" and run.valid:
                v_steps = sorted(run.valid)
                ax.plot(v_steps, [run.valid[s] for s in v_steps], "--o", color=color, markersize=3,
                        linewidth=1.2, label=f"{label} (validation)")
    for ax, (key, ylabel) in zip(axes[:, 0], panels):
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        if key == "grad_norm" and ax.has_data() and all(v > 0 for run in runs for v in run.series(key)[1]):
            ax.set_yscale("log")  # early spikes would flatten the rest of the curve
        if not ax.has_data():
            ax.text(0.5, 0.5, f"no '{key}' in the records", ha="center", va="center", transform=ax.transAxes)
    axes[0, 0].legend(fontsize="small")  # every run has a loss curve; the colours carry over below
    axes[-1, 0].set_xlabel("step")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(tmp, dpi=100, format=out.suffix.lstrip(".").lower())
        check_output(out, overwrite)  # created meanwhile: still never replaced
        os.replace(tmp, out)
    except OSError as exc:
        raise UserError(f"--output '{out}': cannot be written ({exc.strerror or exc})") from None
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        check_output(Path(args.output), args.overwrite)  # before any input is read
        runs = [read_metrics(p) for p in args.metrics]  # every input is checked before matplotlib loads
        out = plot(runs, args.output, mfu=args.mfu, title=args.title, overwrite=args.overwrite)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    last = max(max(r.train) for r in runs)
    print(f"wrote {out} ({len(runs)} run{'s' if len(runs) > 1 else ''}, up to step {last})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
