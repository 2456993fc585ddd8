"""Duplicate keys in JSON: two readers of one body must never see two different records.

JSON leaves duplicate keys undefined, and the readers ingest uses disagree: orjson keeps the last
value, DuckDB the first. A record checked by one and stored by the other could pass a limit it
breaks (``{"usage": [one record], "usage": [a million]}``), so ingest refuses any body in which
the two could differ. orjson cannot report duplicates; the standard library's parser can, through
``object_pairs_hook``, at about the cost of one more parse, and only on the paths that need it
(the JSON-object route, and NDJSON lines that did not read as typed columns: Arrow's reader
refuses a duplicate itself).
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["NestedTooDeeplyError", "duplicate_key"]


class NestedTooDeeplyError(ValueError):
    """The text nests arrays or objects deeper than the standard library's parser follows.

    Its C scanner recurses once per level and stops with ``RecursionError`` near the
    interpreter's recursion limit (about a thousand levels, fewer on a deep stack). A batch's
    records are flat objects, so no batch nests anywhere near that: such a text is the caller's
    to fix, never a fault of the service.
    """


class _Duplicate(Exception):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _no_duplicates(pairs: list[tuple[str, Any]]) -> None:
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise _Duplicate(key)
        seen.add(key)


def duplicate_key(text: bytes | str) -> str | None:
    """The first key found twice in one object of ``text`` (valid JSON), or None.

    Raises ``NestedTooDeeplyError`` for a text nested too deeply to be read this way.
    """
    try:
        json.loads(text, object_pairs_hook=_no_duplicates)
    except _Duplicate as dup:
        return dup.key
    except RecursionError:
        raise NestedTooDeeplyError(
            "nested too deeply: a batch's records are flat JSON objects"
        ) from None
    except ValueError:
        return None  # not JSON at all: the caller's own parser says so
    return None
