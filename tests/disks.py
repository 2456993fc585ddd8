"""A disk that really fills: a small tmpfs, mounted for one test.

Full-disk behaviour that ``/dev/full`` cannot show (a shared mapping's page that the file
system has no room for, a write that fails half-way) needs a file system that runs out of
space. Mounting one needs root and the right to mount, as the CI machine has; where either is
missing the test is skipped with the reason, never failed for the machine's sake.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

__all__ = ["small_disk"]


@contextlib.contextmanager
def small_disk(where: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (``mount``'s form: ``1M``) mounted at ``where`` (made here), unmounted
    at the end."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    where.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)
