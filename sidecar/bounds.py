"""Bounds on what a client's strings may cost: stored record fields, metric labels, echoed names.

Anything a team key sends can be megabytes long. Stored fields are capped (a usage record line
stays a few hundred bytes, whatever the request), metric labels only ever take names from the
configuration (so no request can create a time series), and names echoed in error messages are
shortened.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Final

__all__ = ["MAX_FIELD_CHARS", "MAX_SHOWN_CHARS", "TRUNCATED", "UNKNOWN", "capped", "label", "shown"]

# A stored string field of a usage record never exceeds this many characters.
MAX_FIELD_CHARS: Final = 256
# A client's string echoed in an error message is cut to this many characters.
MAX_SHOWN_CHARS: Final = 64
TRUNCATED: Final = "...[truncated]"
UNKNOWN: Final = "unknown"


def capped(value: str, limit: int = MAX_FIELD_CHARS) -> str:
    """``value`` itself when short enough, else its head and the ``TRUNCATED`` marker, ``limit`` chars in all."""
    if len(value) <= limit:
        return value
    return value[: limit - len(TRUNCATED)] + TRUNCATED


def shown(value: object) -> str:
    """A client's value as an error message may quote it: its text, capped."""
    return capped(str(value), MAX_SHOWN_CHARS)


def label(value: str, known: Collection[str]) -> str:
    """``value`` as a metric label: itself when the configuration names it, else "unknown"."""
    return value if value in known else UNKNOWN
