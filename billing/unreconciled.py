"""Unreconciled: the billed records that no engine reading covers, for ``billing.reconciliation``.

A record is counted against the engine's counters between two readings of its instance. One
whose first token has no reading before it (in the range read: the hours asked for and the
``LOOKBACK_SECONDS`` before them) has nothing to be counted against: an instance the collector
first read after it started serving, or never read. Nor has one after an instance's last reading
once the instance is *stale*: no reading of it follows (within ``LOOKBACK_SECONDS`` after the
hours asked for), while the fleet's engines were read ``PENDING_SECONDS`` or more after its last
one (an instance gone, or lost by the collector). Until then, or while no engine is read at all,
such records wait: the next reading counts them, whatever the gap.

Their requests and tokens (prompt tokens once per choice, as the ledger side counts them) are
reported per instance and hour of their first token: billed as their records say, but checked by
no counter. Of a stream across the first (or a stale instance's last) reading, its completion
tokens outside the readings, by time.

SQL fragments built by pure functions, over the CTEs ``windows`` (per instance-hour: ``lo``,
``hi``, ``hour``) and ``cover`` (``cover_ctes``) of the reconciliation's query.
"""

from __future__ import annotations

from typing import Final

from billing.ingest_sql import token_hour_sql
from billing.schema import HOUR_SECONDS

__all__ = ["PENDING_SECONDS", "cover_ctes", "records_sql", "summed_sql"]

# Records after an instance's last reading wait for its next one, until the fleet's engines have
# been read this long after it without it: then they are unreconciled.
PENDING_SECONDS: Final = 600
H: Final = HOUR_SECONDS


def cover_ctes(ahead: str) -> str:
    """CTEs ``ahead``, ``newest`` and ``cover``: per instance, the span its readings cover.

    ``ahead`` (instance, ts) holds each instance's latest reading in the ``LOOKBACK_SECONDS``
    after the hours asked for. ``cover``: the first and last reading in the range read and their
    hours, and ``stale``: no reading after the last one, while the fleet's engines were read
    ``PENDING_SECONDS`` or more after it.
    """
    return f"""ahead AS ({ahead}),
newest AS (SELECT greatest((SELECT max(hi) FROM windows), (SELECT max(ts) FROM ahead)) AS ts),
cover AS (
    SELECT w.instance, min(w.lo) AS first_reading, max(w.hi) AS last_reading,
        min(w.hour) AS first_hour, max(w.hour) AS last_hour,
        NOT EXISTS (SELECT 1 FROM ahead a WHERE a.instance = w.instance)
            AND (SELECT ts FROM newest) >= max(w.hi) + {PENDING_SECONDS} AS stale
    FROM windows w GROUP BY w.instance
)"""


def records_sql(records: str) -> str:
    """What of ``records`` no reading covers: per record, its instance, hour of first token,
    group, model, and the requests, prompt and completion tokens outside ``cover``.

    A record whose first token has no reading before it (or, on a stale instance, after it) is
    unreconciled whole, request included; of one that crosses the first or (stale) last reading,
    the completion tokens outside them, in proportion to its time there.
    """
    whole = "(k.instance IS NULL OR r.tp <= k.first_reading OR (k.stale AND r.tp > k.last_reading))"
    return f"""
SELECT r.instance, {token_hour_sql("r.tp")} AS hour, r.replica, r.model,
    CASE WHEN {whole} THEN r.n ELSE 0 END AS requests,
    CASE WHEN {whole} THEN r.p ELSE 0 END::DOUBLE AS p,
    r.c * CASE WHEN k.instance IS NULL THEN 1.0
        WHEN r.tf > r.tp THEN (greatest(0.0, least(r.tf, k.first_reading) - r.tp)
            + CASE WHEN k.stale THEN greatest(0.0, r.tf - greatest(r.tp, k.last_reading)) ELSE 0.0 END)
            / (r.tf - r.tp)
        WHEN {whole} THEN 1.0 ELSE 0.0 END AS c
FROM {records} r LEFT JOIN cover k USING (instance)
WHERE r.tp >= CAST($lo AS BIGINT) * {H} AND r.tp < CAST($hi AS BIGINT) * {H}
    AND (k.instance IS NULL OR r.tp <= k.first_reading OR (k.stale AND r.tf > k.last_reading))"""


def summed_sql(hours_table: str) -> str:
    """The summed records (``usage_hours`` rows) no reading covers, as ``records_sql``'s rows.

    Each row's records lie whole inside its hour and end before its last minute, so a whole
    hour is unreconciled when it comes before the instance's first window, after its last (once
    stale), or when the instance has no window; the partial hours are its windows' first and
    last, whose records are placed one by one (``billing.reconciliation.unsummed_sql``).
    """
    return f"""
SELECT h.instance, h.hour, h.replica, h.model, h.requests, h.prompt_tokens::DOUBLE,
    h.completion_tokens::DOUBLE
FROM {hours_table} h LEFT JOIN cover k USING (instance)
WHERE h.hour >= $lo AND h.hour < $hi
    AND (k.instance IS NULL OR h.hour < k.first_hour OR (k.stale AND h.hour > k.last_hour))"""
