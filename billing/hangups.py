"""Hang-up tails: the tokens vLLM generated for a request after its client hung up.

When a client hangs up, the sidecar closes the stream to vLLM, and vLLM stops the request at its
next step. The tokens it generated meanwhile (a few per hang-up under load) reach no client, so
no usage record carries them, and reconciliation finds them as engine tokens beyond the
ledger's. They are the hanging-up team's only when that can be shown: in the interval between
the two engine readings around the hang-up, on that instance, the client-aborted request was
alone. Alone means that no other billable record overlaps the interval, and that the engine
itself had no other request running or waiting at the reading before it (its gauges count a
request of ``n`` choices ``n`` times), so a request that left no record does not pass for the
hang-up's tail either. Otherwise the tokens stay unattributed.

Only the intervals that hold a client-aborted record's end are examined (``usage_hangups``
keeps those records at ingest), so the work follows hang-ups, not requests: the engine's
readings are read for the hours around them, and the other records only for the spans of the
intervals that the engine's own gauges did not already rule out.

The tail of an interval is, prompt and completion apart, the engine's increase over it minus
what the hang-up's record places in it (prompt tokens at its first token, completion tokens
spread evenly to its end, as ``billing.reconciliation`` places every record), when positive.
The readings must be no further than an hour before the hang-up's hour and an hour after it.
``split_sql`` caps each instance-hour's tails at its positive difference (engine over ledger),
so no token is both a tail and accounted for by a record.

SQL built by pure functions; ``billing.reconciliation`` runs it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from billing.ingest_sql import (
    BILLABLE,
    ENGINE_PROMPT_SQL,
    FIRST_TOKEN_SQL,
    counter_delta_sql,
)
from billing.schema import HOUR_SECONDS
from infermeter.records import RequestStatus

__all__ = [
    "MAX_SPANS",
    "NO_TAILS",
    "SPAN_GAP_SECONDS",
    "bounded_sql",
    "hangup_hours_sql",
    "kept_hangups_sql",
    "others_sql",
    "raw_hangups_sql",
    "raw_readings_sql",
    "readings_sql",
    "spans",
    "split_sql",
    "tails_sql",
]

H: Final = HOUR_SECONDS
# Intervals closer than this are read as one span of records; past MAX_SPANS spans, as one.
SPAN_GAP_SECONDS: Final = 60.0
MAX_SPANS: Final = 256

_ABORTED: Final = str(RequestStatus.CLIENT_ABORTED)
# Hang-ups whose tail can fall in the hours asked for (``$lo``..``$hi``, Unix hours). The hours
# are bound as 32-bit integers: they are widened before they become seconds (past 2^31 from
# 2038-01-19 on), here and in every bound below.
_IN_RANGE: Final = (
    f"finished_at > CAST($lo AS BIGINT) * {H} - $back AND finished_at < CAST($hi AS BIGINT) * {H}"
)


def raw_hangups_sql(usage: str) -> str:
    """The client-aborted records of ``usage`` (raw rows) as ``bounded_sql`` reads hang-ups."""
    return f"""SELECT request_id, coalesce(instance, replica) AS instance, replica, team, model,
        received_at, {FIRST_TOKEN_SQL} AS tp, finished_at AS tf, {ENGINE_PROMPT_SQL} AS p,
        completion_tokens AS c, choices
    FROM {usage} WHERE status = '{_ABORTED}' AND {_IN_RANGE}"""


def kept_hangups_sql() -> str:
    """The hang-ups ``usage_hangups`` keeps, as ``raw_hangups_sql`` reads them from the raw rows."""
    return f"""SELECT request_id, instance, replica, team, model, received_at,
        first_token_at AS tp, finished_at AS tf, prompt_tokens AS p, completion_tokens AS c, choices
    FROM usage_hangups WHERE {_IN_RANGE}"""


def hangup_hours_sql() -> str:
    """SQL: the hours (Unix hours) in which a kept hang-up ended, for ``readings_sql``."""
    return f"SELECT DISTINCT CAST(floor(finished_at / {H}) AS BIGINT) FROM usage_hangups WHERE {_IN_RANGE}"


def _readings(engine: str, where: str) -> str:
    return f"""SELECT coalesce(instance, replica) AS instance, "timestamp" AS ts,
        prompt_tokens_total AS pt, generation_tokens_total AS gt,
        requests_running + requests_waiting AS busy
    FROM {engine} WHERE {where}"""


def readings_sql(runs: Sequence[tuple[int, int]], engine: str = "engine_samples") -> str:
    """The engine readings of the hour ``runs`` ([first, after-last) Unix hours), as a relation.

    Each run is read with constant bounds, so DuckDB skips every other row group of samples.
    """
    if not runs:
        return _none("instance VARCHAR, ts DOUBLE, pt DOUBLE, gt DOUBLE, busy DOUBLE")
    parts = [
        _readings(engine, f'"timestamp" >= {a * H}.0 AND "timestamp" < {b * H}.0') for a, b in runs
    ]
    return "(" + "\nUNION ALL\n".join(parts) + ")"


def raw_readings_sql(engine: str) -> str:
    """Every engine reading that a tail of the hours asked for can need, as a relation."""
    return f"""({_readings(engine, f'"timestamp" >= CAST($lo AS BIGINT) * {H} - $back AND "timestamp" < (CAST($hi AS BIGINT) + 1) * {H}')})"""


def bounded_sql(hangups: str, readings: str) -> str:
    """Per hang-up, the readings ``a`` before its end and ``b`` at or after it, on its instance.

    ``hangups``: ``raw_hangups_sql``'s columns; ``readings``: ``readings_sql``'s. Kept when
    both are within an hour of the hang-up's hour, ``b`` falls in the hours asked for
    (``hour``: its hour, the window the tail counts in), and the engine ran nothing else at
    ``a``: its running and waiting requests, less the hang-up's own choices if it had arrived.
    """
    return f"""
SELECT x.*, b.ts AS b_ts, b.pt AS b_pt, b.gt AS b_gt, CAST(floor(b.ts / {H}) AS BIGINT) AS hour
FROM (
    SELECT h.*, a.ts AS a_ts, a.pt AS a_pt, a.gt AS a_gt,
        a.busy - CASE WHEN h.received_at < a.ts THEN h.choices ELSE 0 END AS others_busy
    FROM ({hangups}) h ASOF JOIN {readings} a ON h.instance = a.instance AND h.tf > a.ts
) x ASOF JOIN {readings} b ON x.instance = b.instance AND x.tf <= b.ts
WHERE x.a_ts >= (floor(x.tf / {H}) - 1) * {H} AND b.ts < (floor(x.tf / {H}) + 2) * {H}
    AND b.ts >= CAST($lo AS BIGINT) * {H} AND b.ts < CAST($hi AS BIGINT) * {H} AND x.others_busy < 0.5"""


def spans(
    intervals: Sequence[tuple[float, float]], gap: float = SPAN_GAP_SECONDS, most: int = MAX_SPANS
) -> list[tuple[float, float]]:
    """``intervals`` merged where they overlap or lie within ``gap`` of each other, in order.

    More than ``most`` spans become one, from the first start to the last end: past that many
    reads, one scan costs less.
    """
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a - out[-1][1] <= gap:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    if len(out) > most:
        return [(out[0][0], max(b for _, b in out))]
    return out


def others_sql(within: Sequence[tuple[float, float]] | None, usage: str = "usage") -> str:
    """The billable records of ``usage`` that overlap a span of ``within`` (None: the range read).

    Columns: request_id, instance, received_at, finished_at. Each span is read with constant
    bounds, so DuckDB skips the row groups of records that ended before it or began after it.
    """
    columns = "request_id, coalesce(instance, replica) AS instance, received_at, finished_at"
    if within is None:
        return f"""(SELECT {columns} FROM {usage} WHERE status IN {BILLABLE}
        AND finished_at > CAST($lo AS BIGINT) * {H} - $back AND received_at < (CAST($hi AS BIGINT) + 1) * {H})"""
    if not within:
        return _none("request_id VARCHAR, instance VARCHAR, received_at DOUBLE, finished_at DOUBLE")
    parts = [
        f"SELECT {columns} FROM {usage} WHERE status IN {BILLABLE} "
        f"AND finished_at > {a!r} AND received_at < {b!r}"
        for a, b in within
    ]
    # UNION, not UNION ALL: a record across two spans is one record.
    return "(" + "\nUNION\n".join(parts) + ")"


def tails_sql(bounded: str, others: str) -> str:
    """Per instance, hour, team and model: the tails of the hang-ups of ``bounded`` that were alone.

    ``bounded``: ``bounded_sql``'s rows; ``others``: ``others_sql``'s. Columns: instance,
    hour, team, model, replica, prompt, completion (whole tokens, before ``split_sql``'s cap).

    The records overlapping an interval (a, b] are counted, not searched for: those that began
    before b, less those that ended by a (a record that ended by a began before b). Both counts
    are read from the records' starts and ends in order, so the work is a sort of the records
    read, whatever the number of hang-ups; the hang-up's own record is one of them.
    """
    prompt_delta = counter_delta_sql("x.b_pt", "x.a_pt")
    completion_delta = counter_delta_sql("x.b_gt", "x.a_gt")
    placed = """CASE WHEN x.tf > x.tp
            THEN greatest(0.0, least(x.b_ts, x.tf) - greatest(x.a_ts, x.tp)) / (x.tf - x.tp)
            ELSE 1.0 END"""
    itself = "CASE WHEN x.received_at < x.b_ts AND x.tf > x.a_ts THEN 1 ELSE 0 END"
    return f"""
WITH overlapping AS (SELECT DISTINCT * FROM {others}),
starts_by AS (SELECT instance, received_at AS t, count(*) OVER (PARTITION BY instance ORDER BY received_at) AS n FROM overlapping),
ends_by AS (SELECT instance, finished_at AS t, count(*) OVER (PARTITION BY instance ORDER BY finished_at) AS n FROM overlapping),
alone AS (
    SELECT x.*, coalesce(s.n, 0) - coalesce(e.n, 0) - {itself} AS others
    FROM {bounded} x
    ASOF LEFT JOIN starts_by s ON s.instance = x.instance AND x.b_ts > s.t
    ASOF LEFT JOIN ends_by e ON e.instance = x.instance AND x.a_ts >= e.t
)
SELECT instance, hour, team, model, replica, sum(prompt)::BIGINT AS prompt,
    sum(completion)::BIGINT AS completion
FROM (
    SELECT x.instance, x.hour, x.team, x.model, x.replica,
        greatest(0.0, round({prompt_delta}
            - CASE WHEN x.tp > x.a_ts AND x.tp <= x.b_ts THEN x.p ELSE 0 END)) AS prompt,
        greatest(0.0, round({completion_delta} - x.c * {placed})) AS completion
    FROM alone x WHERE x.others = 0
)
GROUP BY instance, hour, team, model, replica
HAVING sum(prompt) + sum(completion) > 0"""


# ``tails_sql``'s columns, and no row.
NO_TAILS: Final = (
    "SELECT NULL::VARCHAR AS instance, NULL::BIGINT AS hour, NULL::VARCHAR AS team, "
    "NULL::VARCHAR AS model, NULL::VARCHAR AS replica, NULL::BIGINT AS prompt, "
    "NULL::BIGINT AS completion WHERE false"
)


def _capped(column: str, difference: str) -> str:
    """Whole tokens of ``column``, scaled down (rounding down) when the hour's tails exceed
    ``difference``."""
    total = f"sum(t.{column}) OVER w"
    room = f"greatest(0, {difference})"
    return f"""CAST(CASE WHEN {total} <= {room} THEN t.{column}
        ELSE (t.{column} * {room}) // {total} END AS BIGINT)"""


def split_sql(tails: str, counted: str) -> str:
    """The tails of ``tails`` (``tails_sql``) that each team is charged, per instance and hour.

    ``counted``: per instance and hour, the engine and ledger prompt and completion tokens
    (``engine_prompt_tokens``, ``ledger_prompt_tokens``, ...). Where an hour's tails add up to
    more than its positive difference, each is scaled down to fit, rounding down; what is left
    of the difference stays unattributed. Columns: instance, hour, team, model, replica,
    prompt_tokens, completion_tokens.
    """
    return f"""
SELECT t.instance, t.hour, t.team, t.model, t.replica,
    {_capped("prompt", "c.engine_prompt_tokens - c.ledger_prompt_tokens")} AS prompt_tokens,
    {_capped("completion", "c.engine_completion_tokens - c.ledger_completion_tokens")} AS completion_tokens
FROM {tails} t JOIN {counted} c USING (instance, hour)
WINDOW w AS (PARTITION BY t.instance, t.hour)"""


def _none(columns: str) -> str:
    """An empty relation with ``columns`` (``name TYPE, ...``)."""
    cols = ", ".join(f"NULL::{c.split()[1]} AS {c.split()[0]}" for c in columns.split(", "))
    return f"(SELECT {cols} WHERE false)"
