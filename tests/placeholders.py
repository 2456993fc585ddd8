"""The shipped example configurations hold placeholders; tests fill them as an operator would."""

from __future__ import annotations

import re
from pathlib import Path

from infermeter.config import hash_key

PLACEHOLDER = re.compile(r'"<sha256 of ([^">]+)>"')


def filled(text: str) -> str:
    """``text`` with every ``"<sha256 of X>"`` replaced by the SHA-256 of a key of X's own."""
    return PLACEHOLDER.sub(lambda m: hash_key(f"key of {m[1]}"), text)


def filled_copy(source: Path, directory: Path) -> Path:
    """A copy of ``source`` in ``directory`` with its placeholders filled."""
    target = directory / source.name
    target.write_text(filled(source.read_text()))
    return target
