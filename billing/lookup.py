"""Finding a usage record by any id its request is known by: the sidecar's, vLLM's or the caller's.

A user holds vLLM's response id (``chatcmpl-...``) or the ``x-request-id`` it sent, an operator
the sidecar's ``request_id``; each is a column of the usage table. The query is built here as a
pure function (SQL and parameters), so its scoping, a team held to its own records, is tested
without a server.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from infermeter.records import USAGE

__all__ = ["ID_FIELDS", "MAX_RECORDS", "Lookup", "lookup_sql"]

# The columns an id may be looked up in, in the order they are tried by ``by=any``.
ID_FIELDS: Final = ("request_id", "response_id", "client_request_id")
# At most this many records are answered: a caller's own x-request-id may repeat.
MAX_RECORDS: Final = 100
MAX_ID_CHARS: Final = 256


@dataclass(frozen=True, slots=True)
class Lookup:
    """One lookup: the id, the column(s) to find it in, and the team it is held to (None: all)."""

    id: str
    by: str = "any"
    team: str | None = None
    limit: int = 20

    def __post_init__(self) -> None:
        if self.by != "any" and self.by not in ID_FIELDS:
            raise ValueError(f"by={self.by!r} is not one of any, {', '.join(ID_FIELDS)}")
        if not 0 < len(self.id) <= MAX_ID_CHARS:
            raise ValueError(f"id must be 1 to {MAX_ID_CHARS} characters")
        if not 0 < self.limit <= MAX_RECORDS:
            raise ValueError(f"limit={self.limit} is not within 1..{MAX_RECORDS}")


def lookup_sql(lookup: Lookup) -> tuple[str, list[Any]]:
    """The query for ``lookup`` and its parameters: newest first, at most ``limit`` rows."""
    fields = ID_FIELDS if lookup.by == "any" else (lookup.by,)
    where = " OR ".join(f"{f} = ?" for f in fields)
    params: list[Any] = [lookup.id] * len(fields)
    if lookup.team is not None:
        where = f"({where}) AND team = ?"
        params.append(lookup.team)
    columns = ", ".join(f.name for f in USAGE.fields)
    sql = (
        f"SELECT {columns} FROM {USAGE.table} WHERE {where} "
        "ORDER BY received_at DESC, request_id LIMIT ?"
    )
    return sql, [*params, lookup.limit]
