"""Atomic file writes: a temporary name beside the target (this process, a random tag), renamed onto it when the
block succeeds and deleted when it raises. Below every other part: the data files, caches and the device's
peak-FLOP/s record all write this way."""
from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO


def temp_path(path: Path) -> Path:
    """A unique temporary name beside ``path`` (this process, a random tag)."""
    return path.with_name(f"{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[IO[bytes]]:
    """A temporary file renamed onto ``path`` when the block succeeds, deleted when it raises."""
    tmp = temp_path(path)
    try:
        with open(tmp, "wb") as f:
            yield f
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
