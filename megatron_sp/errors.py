"""User-facing error types: what a user can fix is printed as one line, without a traceback (train.py, the
tools); programming errors stay ordinary exceptions."""
from __future__ import annotations

import argparse
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import NoReturn


MAX_LINE = 480  # characters of an error message: a 200 kB value in a config must not become a 200 kB line


def one_line(text: str, limit: int = MAX_LINE) -> str:
    """``text`` on one line and at most about ``limit`` characters: its start and its end (the fix) kept."""
    text = text.replace("\r", " ").replace("\n", " ")
    if len(text) <= limit:
        return text
    head, tail = (2 * limit) // 3, limit // 3
    return f"{text[:head]} … ({len(text)} characters) … {text[-tail:]}"


class UserError(Exception):
    """Base class: an error in the user's input, printed as one line (``str()`` is that line)."""

    exit_code = 1

    def __str__(self) -> str:
        return one_line(super().__str__())


def read_utf8(path: Path, what: str, hint: str, error: type[UserError] | None = None) -> str:
    """The text of a UTF-8 file; else one ``error`` (default ``DataError``) naming ``what``, the file, the line of
    the first bad byte and ``hint``."""
    error = error or DataError
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise error(f"{what} {path}: cannot be read ({exc.strerror})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise error(f"{what} {path}:{line}: not UTF-8 text (byte {exc.start}); {hint}") from None


class ConfigError(UserError):
    """A config key, value or combination is invalid. Exit code 2."""

    exit_code = 2


class DataError(UserError):
    """A data, tokenizer or checkpoint file is missing or malformed."""


class TrainingError(UserError):
    """Training cannot go on (a non-finite loss or gradient norm): the message names the step."""


class LaunchError(UserError):
    """A launcher option, hostfile, environment or layout problem (deepy.py). Exit code 2."""

    exit_code = 2


def refuse_existing_outputs(paths: Iterable[str | Path], instead: str) -> None:
    """The tools' rule for outputs: one ``DataError`` naming the first of ``paths`` that exists (and how many more
    do), the opt-in ``--overwrite`` and ``instead``, the other way out (e.g. ``choose another --output``)."""
    existing = [Path(p) for p in paths if Path(p).exists()]
    if existing:
        first = existing[0]
        what = f"{first.stat().st_size} bytes" if first.is_file() else "not a file"
        more = f"; {len(existing) - 1} more output file(s) too" if len(existing) > 1 else ""
        raise DataError(f"output '{first}' already exists ({what}{more}); pass --overwrite to replace it, or {instead}")


def write_failure(path: str | Path, exc: BaseException, need: int | None) -> str:
    """One line for a write that failed with ``exc`` (``OSError``, ``shutil.Error``, ...; a full disk, typically): the
    file (``exc``'s own, else ``path``), the reason, about ``need`` bytes needed (if known) and the bytes free there."""
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, shutil.Error) and exc.args and isinstance(exc.args[0], list) and exc.args[0]:
        _, path, reason = (str(x) for x in exc.args[0][0])  # copytree's [(src, dst, why), ...]
    elif isinstance(exc, OSError):
        path, reason = exc.filename or path, exc.strerror or reason
    probe = Path(path)
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    try:
        free = f"{shutil.disk_usage(probe).free:,} bytes free there"
    except OSError:
        free = "free space unknown"
    return f"cannot write '{path}' ({reason}); {f'about {need:,} bytes are needed, ' if need else ''}{free}"


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are one ``error:`` line (exit code 2), like every other user error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {one_line(message)} (see {self.prog} --help)\n")
