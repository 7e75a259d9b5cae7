"""Every shell command of README.md and docs/*.md runs verbatim, in order, on a fresh copy of the repository.

The commands come from the fenced ``bash``/``sh`` blocks (and from indented code blocks that start with a command),
backslash continuations joined, comments dropped, ``a && b`` split. Each is classified by ``RULES``: it runs (a
training run with the overrides of ``QUICK`` appended) or it is skipped for a stated reason. A command that matches
no rule fails the test, so a new command in the docs gets classified when it is written. The runs share one copy
of the tracked files (no data/, runs/, checkpoints/), so a command that needs another's output (convert_checkpoint
needs checkpoints/demo) must come after it in the docs. A command repeated word for word runs once.

Each command runs in a child forked from a server process (this file run with ``--serve`` in the copy, under the
commands' environment) that has imported torch and megatron_sp once: the child takes the command's argv, cwd and
environment and runs the script (or ``-m`` module) as ``__main__``, so no command pays the ~3 s import again; what
the command starts itself (train.py's ranks, torchrun's workers) are processes of their own, as before.
"""
from __future__ import annotations

import gc
import importlib.machinery
import json
import os
import re
import runpy
import signal
import shlex
import shutil
import subprocess
import sys
import time
import types
from dataclasses import dataclass
from pathlib import Path

import pytest

from megatron_sp import config

PRELOAD = ("torch", "torch.distributed", "numpy", "megatron_sp.training", "megatron_sp.launcher")
"""What the server imports before forking a command (from the copy: the server runs there with its PYTHONPATH)."""

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
QUICK = ("train.iters=1", "train.eval_interval=0", "logging.peak_tflops=1")
"""Appended to every training run: one step, no validation, and a given peak FLOP/s instead of the ~1 s measurement
at start-up; the commands' own settings otherwise (the sample included)."""


@dataclass(frozen=True)
class Rule:
    """A command matching ``pattern`` (re.search on the command line) runs with ``append`` added to its arguments,
    or is skipped when ``append`` is None, or only has its config checked (``config_only``); ``reason`` says why."""

    pattern: str
    reason: str
    append: tuple[str, ...] | None = ()
    config_only: bool = False  # its config is loaded and checked in this process (config.load), not trained


RULES = [  # first match wins
    Rule(r"^pip install ", "installs packages: CI's environment has them (pip install -e '.[test]')", None),
    Rule(r"^python -m pytest\b", "the test suite itself, which holds this test", None),
    Rule(r"(^| )--hostfile |--launcher (pdsh|slurm)", "multi-host launch: needs ssh/pdsh/slurm hosts", None),
    Rule(r"path/to/|corpus\.jsonl\.gz|--input packed\.jsonl", "placeholder paths for the user's own files", None),
    Rule(r"\[launcher options\]|\[script args\]", "a synopsis with placeholders", None),
    Rule(r"^python tools/bench/", "a benchmark (minutes); each has its own smoke test in tests/unit", None),
    Rule(r"train\.compile=true", "compiling takes 20-130 s on CPU; tests/e2e/test_compile.py trains compiled", None),
    Rule(r"^python train\.py --help-config$", "prints the keys"),
    Rule(r"^python train\.py --conf configs/demo\.yml logging\.name=(dp1|pp2|zero_bubble|interleaved|cp2|system_malloc|zero3|muon) ",
         "a layout or memory variant of the demo run: its keys are checked here (config.load); each layout trains in "
         "tests/e2e/test_layout_parity.py; a 1-rank train.py command line trains in tests/e2e/test_faults.py (Ctrl-C); "
         "cache_host_memory=false only skips device.cache_host_memory "
         "(tests/unit/test_host_memory.py)", config_only=True),
    Rule(r"^torchrun --standalone --nproc-per-node 2 train\.py --conf configs/demo\.yml$",
         "the demo under torchrun: the fault-tolerance section's torchrun command (the same run, with --max-restarts) "
         "runs below", config_only=True),
    Rule(r"^(python (train|deepy)\.py|torchrun) .*--conf ", "a training run: shortened", QUICK),
    Rule(r"^python tools/plan\.py --conf configs/demo\.yml --devices 2$",
         "the demo's own layout planned: the planner's command line runs in the commands beside it (the 410M config; "
         "--verify on the demo's); the breakdown of a config's own layout: tests/unit/test_plan.py", config_only=True),
    Rule(r"^python tools/plan\.py ", "the planner (meta device; --verify runs 2 steps)"),
    Rule(r"^python tools/fuzz_parity\.py ", "the parity fuzzer (--draw-only: tests/unit/test_fuzz_space.py; a seeded "
                                           "sample: tests/e2e/test_fuzz_parity.py)", None),
    Rule(r"^python tools/gpu_check\.py ", "the GPU check (minutes on a GPU); its --dry mode: tests/unit/test_gpu_check_smoke.py",
         None),
    Rule(r"^python tools/(make_demo_corpus|train_tokenizer|preprocess_data)\.py ", "data preparation"),
    Rule(r"^python tools/(convert_checkpoint|generate|plot_metrics|evaluate)\.py ", "reads what earlier commands wrote"),
    Rule(r"^torchrun .*tools/evaluate\.py ", "evaluation under torchrun: reads what earlier commands wrote"),
]


@dataclass(frozen=True)
class Command:
    source: str  # FILE:LINE
    line: str  # the arguments joined by spaces (unquoted): what RULES match
    argv: tuple[str, ...]


def block_commands(text: str, source: str) -> list[Command]:
    """The commands of ``text``'s shell blocks: fenced ``bash``/``sh``/``shell`` blocks, and indented code blocks
    (outside fences, after a blank line) whose first line starts with python, torchrun or pip."""
    lines = text.splitlines()
    blocks: list[tuple[int, list[str]]] = []
    i = 0
    while i < len(lines):
        fence = re.match(r"^\s*(```+)\s*(\w*)", lines[i])
        if fence:
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip().startswith(fence.group(1))), len(lines))
            if fence.group(2) in ("bash", "sh", "shell"):
                blocks.append((i + 2, lines[i + 1:end]))
            i = end + 1
            continue
        if lines[i].startswith("    ") and (i == 0 or not lines[i - 1].strip()) \
                and re.match(r"(python|torchrun|pip) ", lines[i].strip()):
            end = next((j for j in range(i, len(lines)) if not lines[j].startswith("    ")), len(lines))
            blocks.append((i + 1, lines[i:end]))
            i = end
            continue
        i += 1
    out = []
    for first, body in blocks:
        logical, start = "", first
        for n, raw in enumerate(body):
            if not logical:
                start = first + n
            logical += raw.strip()
            if logical.endswith("\\"):
                logical = logical[:-1] + " "
                continue
            argv = shlex.split(logical, comments=True)
            segments: list[list[str]] = [[]]
            for arg in argv:
                if arg == "&&":
                    segments.append([])
                else:
                    segments[-1].append(arg)
            for seg in segments:
                if seg:
                    out.append(Command(f"{source}:{start}", " ".join(seg), tuple(seg)))
            logical = ""
    return out


def all_commands() -> list[Command]:
    return [c for path in DOCS for c in block_commands(path.read_text(encoding="utf-8"), path.relative_to(ROOT).as_posix())]


def classify(command: Command) -> Rule | None:
    return next((r for r in RULES if re.search(r.pattern, command.line)), None)


def test_every_command_is_classified() -> None:
    commands = all_commands()
    assert len(commands) > 30, "the extractor found too few commands"
    unknown = [f"{c.source}: {c.line}" for c in commands if classify(c) is None]
    assert not unknown, "commands matching no rule of RULES (say whether and how each runs):\n" + "\n".join(unknown)


def test_extractor_and_rules() -> None:
    text = ("x\n```bash\npython train.py --conf a.yml \\\n    train.iters=3   # note\n"
            "pip install -e . && python -m pytest -q tests\n```\n\n    python tools/bench/x.py --n 1\n\n"
            "```yaml\npython not.py\n```\n- item\n  ```bash\n  python tools/generate.py --load c  # c\n  ```\n")
    got = [(c.source, c.argv) for c in block_commands(text, "F")]
    assert got == [("F:3", ("python", "train.py", "--conf", "a.yml", "train.iters=3")),
                   ("F:5", ("pip", "install", "-e", ".")), ("F:5", ("python", "-m", "pytest", "-q", "tests")),
                   ("F:8", ("python", "tools/bench/x.py", "--n", "1")),
                   ("F:15", ("python", "tools/generate.py", "--load", "c"))]
    assert classify(Command("F:1", "rm -rf data", ("rm", "-rf", "data"))) is None


def fresh_copy(dest: Path) -> Path:
    """The repository's tracked (and new, unignored) files under ``dest``: what a fresh clone holds."""
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split("\0")
    for name in files:
        src = ROOT / name
        if name and src.is_file() and name.split("/")[0] not in ("data", "runs", "checkpoints", "hf"):
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


def serve() -> int:
    """The command server: per request line (JSON: argv, cwd, stdout and stderr files, timeout) fork a child that
    runs it as ``python argv...`` would, and answer with its exit code (negative: the signal that killed it). In the
    child this returns (to ``sys.exit``) only when the command exits by itself: its SystemExit, traceback and atexit
    handlers are the interpreter's own, as in a process of its own."""
    environ = dict(os.environ)  # as started (before any import could change it)
    for name in PRELOAD:
        __import__(name)
    gc.freeze()  # the preloaded objects: no collection in a child walks them (nor writes to their pages)
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            os.chdir(req["cwd"])
            for fd, path in ((0, os.devnull), (1, req["stdout"]), (2, req["stderr"])):
                opened = os.open(path, os.O_RDONLY if fd == 0 else os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                os.dup2(opened, fd)
                os.close(opened)
            os.environ.clear()
            os.environ.update(environ)
            args = req["argv"][1:]
            if args[0] == "-m":  # python -m MODULE: sys.path[0] is the working directory
                sys.path[0], sys.argv = os.getcwd(), args[1:]
                runpy.run_module(args[1], run_name="__main__", alter_sys=True)
            else:  # python SCRIPT: a __main__ of its own with the absolute __file__, argv[0] as given
                script = os.path.abspath(args[0])
                sys.path[0], sys.argv = os.path.dirname(script), args
                main = sys.modules["__main__"] = types.ModuleType("__main__")
                main.__file__, main.__cached__ = script, None
                main.__loader__ = importlib.machinery.SourceFileLoader("__main__", script)
                exec(compile(Path(script).read_bytes(), script, "exec"), main.__dict__)
            return 0
        deadline = time.monotonic() + req["timeout"]
        while not (status := os.waitpid(pid, os.WNOHANG))[0]:
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
            time.sleep(0.02)
        print(json.dumps(os.waitstatus_to_exitcode(status[1])), flush=True)
    return 0


def test_readme_commands_run_in_order(tmp_path: Path) -> None:
    if not (ROOT / ".git").exists():
        pytest.skip("needs the git checkout to know its tracked files")
    commands = all_commands()
    rules = [classify(c) for c in commands]
    assert all(rules), "unclassified commands: see test_every_command_is_classified"
    repo = fresh_copy(tmp_path / "repo")
    env = {**os.environ, "PYTHONPATH": str(repo)}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    server = subprocess.Popen([sys.executable, str(repo / Path(__file__).relative_to(ROOT)), "--serve"], cwd=repo,
                              env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    timings, ran = [], set()
    try:
        for command, rule in zip(commands, rules):
            if rule.append is None or command.argv in ran:  # type: ignore[union-attr]
                continue  # a command the docs repeat (the quick start's again in Training) ran already, the same way
            ran.add(command.argv)
            if rule.config_only:  # type: ignore[union-attr]
                confs = [str(repo / a) for flag, a in zip(command.argv, command.argv[1:]) if flag == "--conf"]
                overrides = [a for a in command.argv[2:] if "=" in a and a not in confs]
                config.load(confs, overrides)  # a key that does not exist or a layout the model refuses raises here
                continue
            argv = [*command.argv, *rule.append]  # type: ignore[union-attr]
            if argv[0] == "python":
                argv[0] = sys.executable
            elif argv[0] == "torchrun":
                argv[:1] = [sys.executable, "-m", "torch.distributed.run"]
            t0 = time.perf_counter()
            server.stdin.write(json.dumps({"argv": argv, "cwd": str(repo), "stdout": str(out), "stderr": str(err),  # type: ignore[union-attr]
                                           "timeout": 900}) + "\n")
            server.stdin.flush()  # type: ignore[union-attr]
            reply = server.stdout.readline()  # type: ignore[union-attr]
            assert reply, f"the command server died (exit code {server.wait()}) running {command.source}"
            code = json.loads(reply)
            timings.append((time.perf_counter() - t0, command.source))
            assert code == 0, (f"{command.source}: `{command.line}` (+ {' '.join(rule.append)}) exited "  # type: ignore[union-attr]
                               f"{code}:\n{out.read_text(errors='replace')[-2000:]}\n{err.read_text(errors='replace')[-3000:]}")
    finally:
        server.stdin.close()  # type: ignore[union-attr]  # the server ends at end of input
        server.wait(timeout=60)
    print("slowest:", ", ".join(f"{s} {t:.1f}s" for t, s in sorted(timings, reverse=True)))


if __name__ == "__main__" and sys.argv[1:] == ["--serve"]:
    sys.exit(serve())
