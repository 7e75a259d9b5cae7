"""The registry of config checks: each part marks ``fn(cfg)`` with ``@check`` (one ``ConfigError`` per broken
rule; it may fill derived values of its own keys) and ``finalize`` runs them. The package root hands
``discover`` their imports, so config imports nothing above ``errors`` and they load on the first run."""
from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import ConfigError

Check = Callable[[Any], None]
_checks: dict[str, Check] = {}
_importers: list[Callable[[], None]] = []


def check(fn: Check) -> Check:
    """Register ``fn(cfg)`` (decorator); registering the same function again replaces it."""
    _checks[f"{fn.__module__}.{fn.__qualname__}"] = fn
    return fn


def discover(importer: Callable[[], None]) -> None:
    """Run ``importer`` (which imports modules holding ``@check`` functions) before the next checks."""
    _importers.append(importer)


def registered() -> list[str]:
    """The qualified names of the registered checks, in the order they run."""
    _import_pending()
    return list(_checks)


def run_checks(cfg: Any) -> None:
    """Run every registered check on ``cfg``, in registration order."""
    _import_pending()
    for fn in list(_checks.values()):
        fn(cfg)


def _import_pending() -> None:
    while _importers:
        _importers[0]()  # a failed import stays pending and is retried
        _importers.pop(0)


def show(value: Any, limit: int = 80) -> str:
    """``value`` for an error line: its text, cut to ``limit`` characters."""
    text = str(value)
    return text if len(text) <= limit else text[:limit] + f"… ({len(text)} characters)"


def did_you_mean(value: str, options: Sequence[str]) -> str:
    """"; did you mean 'x'?" for the option closest to ``value``, or "" when none is close."""
    close = difflib.get_close_matches(value, list(options), n=1, cutoff=0.5)
    return f"; did you mean '{close[0]}'?" if close else ""


def choice(key: str, value: str, options: Sequence[str]) -> None:
    """A ``ConfigError`` unless ``value`` is one of ``options`` (with a "did you mean")."""
    if value not in options:
        raise ConfigError(f"{key}: '{show(value)}' is not one of {', '.join(options)}{did_you_mean(value, options)}")
