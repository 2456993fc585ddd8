"""Record ids that begin with their time, so that billing can find a resent id cheaply, forever.

Billing keeps the first record with a given id and drops every resend (the pipeline is
idempotent by id). To find a resend whatever time it claims, without an index of every id in
memory, it looks ids up between the batch's least and greatest id: exact for any ids, and cheap
when ids sort by time, because the ledger is appended in time order and DuckDB skips every row
group whose min/max id lies outside the range. Both formats here sort by time as plain strings.

Because the first record of an id is kept from whichever writer sends it, billing holds a
credential's record to the ``sample_id`` its own fields give (``billing.trust_sql``): a
predictable id is then one only its own writer can send. ``request_id`` is not predictable.
"""

from __future__ import annotations

import os

__all__ = ["request_id", "sample_id"]


def request_id(received_at: float) -> str:
    """32 hex digits: milliseconds since the epoch (12 digits), then 80 random bits."""
    return f"{int(received_at * 1000):012x}{os.urandom(10).hex()}"


def sample_id(timestamp: float, *source: str) -> str:
    """``<milliseconds, 13 digits>/<source parts>``: unique per source and reading time."""
    return "/".join((f"{round(timestamp * 1000):013d}", *source))
