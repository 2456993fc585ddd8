"""Replace a small file whole: the state files that must never be read half-written."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["write_atomically"]


def write_atomically(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data``: whole or not at all, and on disk when this returns.

    The bytes go to a temporary file in the same directory, which is fsynced and renamed over
    ``path``; rename(2) within one file system is atomic, so a reader sees the old file or the
    new one, never a mix, whatever moment the writer dies at. The directory's fsync makes the
    rename itself survive a power cut.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with tmp.open("wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
