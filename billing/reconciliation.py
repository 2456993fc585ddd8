"""Reconciliation: the ledger's tokens against the engines' own counters, per instance and hour.

vLLM counts every prompt and generated token it processes (``vllm:prompt_tokens_total``,
``vllm:generation_tokens_total``); the collector stores those counters in ``engine_samples``.
The ledger holds one record per request the sidecar saw. When the two disagree, tokens were
spent that no team's record carries (a request cut off with no record, a record lost), or the
ledger holds tokens the engine never reported (a counter lost in a crash). Auditing a bill means
showing that difference every hour, and charging it to someone instead of letting it vanish.

How an hour is measured, per instance (``coalesce(instance, replica)``: a fixed replica is its
own only instance):

- **Engine.** Each sample's delta from the previous one; a counter that dropped means the engine
  restarted, and the delta is the new value. The first sample seen only sets the baseline. An
  instance-hour is the *window* from the last sample of the instance's previous hour with samples
  to the last sample of this hour, so the counters are read where they were actually read, not
  guessed at the hour's edge.
- **Ledger.** Billable records (ok, client-aborted, upstream error, interrupted) in that same
  window: prompt tokens at the first token (when vLLM has finished the prefill and counted them),
  once per choice as vLLM counts them (``prompt_tokens x choices``: the usage object counts a
  prompt once whatever ``n``), completion tokens spread evenly from the first token to the end of
  the request, so a stream running across the window's edge counts on both sides as the engine
  counted it.

The difference (engine - ledger) is reported signed; its positive part, prompt and completion
apart, is split in two:

- **Hang-up tails** (``billing.hangups``): tokens vLLM generated for a request after its client
  hung up, when the interval between the readings around the hang-up held that request alone.
  They are the hanging-up team's: its statement line carries them (no money: the in-flight split
  already charged the team the GPU time its request held).
- **Unattributed**: the rest, work the engines did that no record carries.

The negative part (``ledger_excess_tokens``) is reported, never billed.

**Unreconciled** (``billing.unreconciled``). A record with no engine reading before its first
token (an instance read for the first time after it started serving, or never read) has nothing
to be counted against, and neither has one after an instance's last reading once the instance
has gone unread for ``PENDING_SECONDS`` while the fleet's engines were read (an instance gone,
or lost by the collector; until then its records wait for its next reading). Their requests and
tokens are reported as unreconciled, per instance and hour of their first token: billed (the
team's record says what vLLM's usage reported), but not checked by any engine counter.

Unattributed tokens are a statement line of their own (model ``<model> (unattributed)``), for
the replica group's owner when its idle policy is ``owner``, else for the platform account.
They are priced at the group's measured cost per token in that hour: the hour's GPU cost times
the unattributed share of the tokens its engines processed (weighted as ``billing.token_weights``
weighs them). That cost is taken out of the hour's idle capacity, never added: the requests
without a record held the GPUs while the ledger counted those minutes as idle, so teams still
pay exactly their measured share and the statement still adds up to the fleet's cost to the
cent. The claim is capped at the hour's idle cost; beyond it there is no idle time the lost
work could have filled.

SQL built by pure functions, run by the ledger; ``claim_rows`` says who carries the per-hour
costs, plain Polars, and ``billing.charges`` takes them out of the idle capacity in integer
micro-cents, never beyond it. ``reconciliation_sql`` reads the raw records and samples (any range, for the
query route); ``reconcile`` gives the same rows from the rollups ingest keeps (``engine_hours``,
``usage_hours``, ``usage_edges``, ``usage_hangups``: see ``billing.schema``), for statements and
metrics, so their cost follows instance-hours and hang-ups, not requests.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import duckdb
import polars as pl

from billing import hangups, unreconciled
from billing.allocation import LINE_COLUMNS, MONEY, Policy
from billing.charges import CASH
from billing.hourly import runs
from billing.ingest_sql import (
    BILLABLE,
    ENGINE_PROMPT_SQL,
    FIRST_TOKEN_SQL,
    counter_delta_sql,
    summed_sql,
    token_hour_sql,
)
from billing.schema import EDGE_SECONDS, HOUR_SECONDS
from billing.unreconciled import PENDING_SECONDS

__all__ = [
    "HOUR_SECONDS",
    "LOOKBACK_SECONDS",
    "PENDING_SECONDS",
    "UNATTRIBUTED_SUFFIX",
    "claim_rows",
    "first_windows_sql",
    "hour_runs",
    "hours",
    "is_unattributed",
    "reconcile",
    "reconciliation_sql",
    "rollup_reconciliation_sql",
    "tail_lines",
    "unattributed_model",
    "unattributed_sql",
    "unsummed_sql",
    "windows_sql",
]

# How far before the first hour asked for samples and records are read, so that the first
# hour's window starts at the previous sample rather than at its own first one; and how far
# after the last hour an instance's next reading is looked for.
LOOKBACK_SECONDS: Final = 2 * HOUR_SECONDS
UNATTRIBUTED_SUFFIX: Final = " (unattributed)"
H: Final = HOUR_SECONDS

Sql = tuple[str, dict[str, Any]]


def unattributed_model(model: str) -> str:
    """The model column of ``model``'s unattributed line."""
    return f"{model}{UNATTRIBUTED_SUFFIX}"


def is_unattributed(model: str) -> bool:
    """Whether a statement line's model marks unattributed tokens."""
    return model.endswith(UNATTRIBUTED_SUFFIX)


def hours(start: float, end: float) -> tuple[int, int]:
    """The first hour (Unix hour) that ``start``..``end`` touches and the hour after its last."""
    return int(start // HOUR_SECONDS), int(-(-end // HOUR_SECONDS))


_delta = counter_delta_sql
_BACK_HOURS: Final = LOOKBACK_SECONDS // HOUR_SECONDS


def _rollup_windows_ctes() -> str:
    """``_windows_ctes`` from ``engine_hours``: an hour's increases, plus the step from the last
    reading of the hour with samples before it (in the range read) to its first."""
    prompt = _delta("first_prompt_total", "lag(last_prompt_total) OVER w")
    completion = _delta("first_generation_total", "lag(last_generation_total) OVER w")
    return f"""hourly AS (
    SELECT instance, hour, replica, model,
        prompt_tokens + {prompt} AS engine_prompt,
        generation_tokens + {completion} AS engine_completion,
        first_ts, last_ts AS hi
    FROM engine_hours WHERE hour >= $lo - {_BACK_HOURS} AND hour < $hi
    WINDOW w AS (PARTITION BY instance ORDER BY hour)
),
windows AS (
    SELECT *, coalesce(lag(hi) OVER (PARTITION BY instance ORDER BY hour), first_ts) AS lo
    FROM hourly
)"""


def _windows_ctes(engine: str) -> str:
    """CTEs ``samples``, ``hourly`` and ``windows``: each instance-hour's engine tokens and window."""
    return f"""samples AS (
    SELECT coalesce(instance, replica) AS instance, replica, model, "timestamp" AS ts,
        {_delta("prompt_tokens_total", "lag(prompt_tokens_total) OVER w")} AS prompt,
        {_delta("generation_tokens_total", "lag(generation_tokens_total) OVER w")} AS completion
    FROM {engine}
    WHERE "timestamp" >= CAST($lo AS BIGINT) * {H} - $back AND "timestamp" < CAST($hi AS BIGINT) * {H}
    WINDOW w AS (PARTITION BY coalesce(instance, replica) ORDER BY "timestamp", sample_id)
),
hourly AS (
    SELECT instance, CAST(floor(ts / {H}) AS BIGINT) AS hour,
        max(replica) AS replica, max(model) AS model,
        sum(prompt) AS engine_prompt, sum(completion) AS engine_completion,
        min(ts) AS first_ts, max(ts) AS hi
    FROM samples GROUP BY ALL
),
-- Each instance-hour's window (lo, hi]: from the previous window's last sample to its own.
windows AS (
    SELECT *, coalesce(lag(hi) OVER (PARTITION BY instance ORDER BY hour), first_ts) AS lo
    FROM hourly
)"""


# The records a window counts, placed one by one: ``records`` (instance, replica, model, tp, tf,
# p, c, n) in, CTEs ``placed`` and ``ledger`` (instance, hour, prompt, completion) out.
_PLACED = """
-- The window each record's first token fell in; records after the last sample have none yet.
placed AS ({placed}),
ledger AS (
    SELECT instance, hour, sum(p)::DOUBLE AS prompt, sum(CASE WHEN inside THEN c ELSE 0 END)::DOUBLE AS completion
    FROM placed WHERE tp > lo GROUP BY instance, hour
    UNION ALL
    -- A request across windows: its completion tokens by the time it spent in each.
    SELECT x.instance, w.hour, 0.0,
        sum(x.c * (least(w.hi, x.tf) - greatest(w.lo, x.tp)) / (x.tf - x.tp))
    FROM {across} w ON w.instance = x.instance AND w.hi > x.tp AND w.lo < x.tf{meets}
    GROUP BY x.instance, w.hour{more}
)"""

# Each record's window: the first whose end is at or after its first token.
_PLACED_ASOF = """
    SELECT r.*, w.hour, w.lo, w.hi, r.tp > w.lo AND r.tf <= w.hi AS inside
    FROM records r ASOF JOIN windows w ON r.instance = w.instance AND r.tp <= w.hi"""

# The same window by equality joins on ``_first_windows`` (``first_windows_sql``): the first
# window at or after the hour of the first token (or the instance's first window), or the one
# after it when the token came after that window's end. Twice as fast as the ASOF join on a
# 20M-record month (0.14 s against 0.25-0.28 s), the same rows.
_PLACED_BY_HOUR = f"""
    SELECT r.* EXCLUDE (wh), w.hour, w.lo, w.hi, r.tp > w.lo AND r.tf <= w.hi AS inside
    FROM (
        SELECT r.* EXCLUDE (fh), CASE WHEN r.tp <= f.hi THEN f.first_hour ELSE f.next_hour END AS wh
        FROM (
            SELECT r.*, greatest(CAST(floor(r.tp / {HOUR_SECONDS}) AS BIGINT), s.span_first) AS fh
            FROM records r JOIN (SELECT DISTINCT instance, span_first FROM _first_windows) s
                USING (instance)
        ) r
        JOIN _first_windows f ON f.instance = r.instance AND f.hour = r.fh
    ) r
    JOIN windows w ON w.instance = r.instance AND w.hour = r.wh"""

# The requests across windows and every window of their instance: simple, and quadratic.
_EVERY_WINDOW = "(SELECT * FROM placed WHERE NOT inside AND tf > tp) x JOIN windows"

# The same pairs, found without trying every window: a request meets the windows from the one
# its first token fell in to the first that ends at or after its end (or the last there is), so
# those hours are listed and joined on (instance, hour). The window of its end is looked up in
# ``_first_windows`` as its first token's is (``_PLACED_BY_HOUR``).
_ITS_WINDOWS = f"""(
    SELECT r.* EXCLUDE (fh), unnest(range(r.hour, coalesce(
        CASE WHEN r.tf <= f.hi THEN f.first_hour ELSE f.next_hour END, $hi) + 1)) AS meets
    FROM (
        SELECT r.*, greatest(CAST(floor(r.tf / {HOUR_SECONDS}) AS BIGINT), s.span_first) AS fh
        FROM (SELECT * FROM placed WHERE NOT inside AND tf > tp) r
        JOIN (SELECT DISTINCT instance, span_first FROM _first_windows) s USING (instance)
    ) r
    LEFT JOIN _first_windows f ON f.instance = r.instance AND f.hour = r.fh
) x JOIN windows"""


def _rows(filter_model: str) -> str:
    """CTEs ``counted``, ``missed``, ``split`` and ``joined``, then the final select.

    Over ``windows``, ``ledger``, ``unreconciled`` (``_unreconciled``'s rows) and ``tails``
    (``billing.hangups.tails_sql``'s): the windows asked for against the ledger, and the
    instance-hours with unreconciled records, with or without a window.
    """
    return f"""counted AS (
    SELECT w.hour, w.instance, w.replica, w.model,
        CAST(round(w.engine_prompt) AS BIGINT) AS engine_prompt_tokens,
        CAST(round(w.engine_completion) AS BIGINT) AS engine_completion_tokens,
        CAST(round(coalesce(sum(l.prompt), 0)) AS BIGINT) AS ledger_prompt_tokens,
        CAST(round(coalesce(sum(l.completion), 0)) AS BIGINT) AS ledger_completion_tokens
    FROM windows w LEFT JOIN ledger l USING (instance, hour)
    WHERE w.hour >= $lo AND w.hour < $hi
    GROUP BY ALL
),
missed AS (
    SELECT instance, hour, max(replica) AS replica, max(model) AS model,
        sum(requests)::BIGINT AS requests,
        CAST(round(sum(p)) AS BIGINT) AS prompt, CAST(round(sum(c)) AS BIGINT) AS completion
    FROM unreconciled GROUP BY instance, hour
),
split AS ({hangups.split_sql("tails", "counted")}),
joined AS (
    SELECT hour, instance, coalesce(c.replica, m.replica) AS replica,
        coalesce(c.model, m.model) AS model,
        coalesce(c.engine_prompt_tokens, 0) AS engine_prompt_tokens,
        coalesce(c.engine_completion_tokens, 0) AS engine_completion_tokens,
        coalesce(c.ledger_prompt_tokens, 0) AS ledger_prompt_tokens,
        coalesce(c.ledger_completion_tokens, 0) AS ledger_completion_tokens,
        coalesce(s.prompt, 0)::BIGINT AS hangup_prompt_tokens,
        coalesce(s.completion, 0)::BIGINT AS hangup_completion_tokens,
        coalesce(m.requests, 0) AS unreconciled_requests,
        coalesce(m.prompt, 0) AS unreconciled_prompt_tokens,
        coalesce(m.completion, 0) AS unreconciled_completion_tokens
    FROM counted c FULL JOIN missed m USING (instance, hour)
    LEFT JOIN (SELECT instance, hour, sum(prompt_tokens) AS prompt,
                      sum(completion_tokens) AS completion
               FROM split GROUP BY instance, hour) s USING (instance, hour)
)
SELECT hour * {H} AS t, instance, replica, model,
    engine_prompt_tokens, engine_completion_tokens, ledger_prompt_tokens, ledger_completion_tokens,
    engine_prompt_tokens + engine_completion_tokens AS engine_tokens,
    ledger_prompt_tokens + ledger_completion_tokens AS ledger_tokens,
    engine_tokens - ledger_tokens AS difference_tokens,
    difference_tokens / nullif(engine_tokens, 0) AS share,
    hangup_prompt_tokens, hangup_completion_tokens,
    hangup_prompt_tokens + hangup_completion_tokens AS hangup_tokens,
    greatest(0, engine_prompt_tokens - ledger_prompt_tokens) - hangup_prompt_tokens
        AS unattributed_prompt_tokens,
    greatest(0, engine_completion_tokens - ledger_completion_tokens) - hangup_completion_tokens
        AS unattributed_completion_tokens,
    unattributed_prompt_tokens + unattributed_completion_tokens AS unattributed_tokens,
    unattributed_tokens / nullif(engine_tokens, 0) AS unattributed_share,
    greatest(0, ledger_prompt_tokens - engine_prompt_tokens)
        + greatest(0, ledger_completion_tokens - engine_completion_tokens) AS ledger_excess_tokens,
    unreconciled_requests, unreconciled_prompt_tokens, unreconciled_completion_tokens,
    unreconciled_prompt_tokens + unreconciled_completion_tokens AS unreconciled_tokens
FROM joined {filter_model} ORDER BY t, replica, instance"""


def _values(first_hour: int, end_hour: int, model: str | None) -> tuple[dict[str, Any], str]:
    values: dict[str, Any] = {"lo": first_hour, "hi": end_hour, "back": float(LOOKBACK_SECONDS)}
    if model is not None:
        values["model"] = model
    return values, ("WHERE model = $model" if model is not None else "")


# Which records a window reads: billable, and able to meet the hours asked for. DuckDB binds a
# Python int that fits as a 32-bit INTEGER, and an hour's number times 3600 is past 2^31 from
# 2038-01-19 on: the hours are widened first, so a month of 2038 or later is no overflow (a 500).
_RECORDS_IN_RANGE = f"finished_at > CAST($lo AS BIGINT) * {HOUR_SECONDS} - $back AND {FIRST_TOKEN_SQL} <= CAST($hi AS BIGINT) * {HOUR_SECONDS}"


def reconciliation_sql(
    first_hour: int,
    end_hour: int,
    model: str | None = None,
    usage: str = "usage",
    engine: str = "engine_samples",
) -> Sql:
    """Per instance and hour in ``first_hour``..``end_hour`` (Unix hours): engine, ledger, difference.

    Columns: ``t`` (the hour's start, Unix seconds), ``instance``, ``replica`` (its group),
    ``model``, engine and ledger prompt and completion tokens (the ledger's prompt tokens once
    per choice), ``engine_tokens``, ``ledger_tokens``, ``difference_tokens`` (engine - ledger),
    ``share`` (the difference over the engine's tokens), ``hangup_prompt_tokens``,
    ``hangup_completion_tokens``, ``hangup_tokens`` (the hanging-up teams'),
    ``unattributed_prompt_tokens``, ``unattributed_completion_tokens``, ``unattributed_tokens``,
    ``unattributed_share``, ``ledger_excess_tokens`` (the ledger's tokens beyond the engine's),
    ``unreconciled_requests``, ``unreconciled_prompt_tokens``,
    ``unreconciled_completion_tokens`` and ``unreconciled_tokens``. So ``difference_tokens`` =
    ``hangup_tokens`` + ``unattributed_tokens`` - ``ledger_excess_tokens``. An instance-hour
    with unreconciled records and no reading has zero engine and ledger tokens. Reads every raw
    record in the range (``reconcile`` gives the same rows from the rollups). Pure: nothing is
    run here.
    """
    values, filter_model = _values(first_hour, end_hour, model)
    ahead = f"""SELECT coalesce(instance, replica) AS instance, max("timestamp") AS ts FROM {engine}
    WHERE "timestamp" >= CAST($hi AS BIGINT) * {H} AND "timestamp" < CAST($hi AS BIGINT) * {H} + $back GROUP BY ALL"""
    bounded = hangups.bounded_sql(hangups.raw_hangups_sql(usage), hangups.raw_readings_sql(engine))
    return (
        f"""
WITH {_windows_ctes(engine)},
records AS (
    SELECT coalesce(instance, replica) AS instance, replica, model,
        {FIRST_TOKEN_SQL} AS tp, finished_at AS tf,
        {ENGINE_PROMPT_SQL} AS p, completion_tokens AS c, 1 AS n
    FROM {usage}
    WHERE status IN {BILLABLE} AND {_RECORDS_IN_RANGE}
),{_PLACED.format(placed=_PLACED_ASOF, across=_EVERY_WINDOW, meets="", more="")},
{unreconciled.cover_ctes(ahead)},
unreconciled AS ({unreconciled.records_sql("records")}),
bounded AS ({bounded}),
tails AS ({hangups.tails_sql("bounded", hangups.others_sql(None, usage))}),
{_rows(filter_model)}""",
        values,
    )


def windows_sql(first_hour: int, end_hour: int) -> Sql:
    """SQL creating temp table ``_windows``: ``reconciliation_sql``'s windows, with neighbours.

    Per instance and hour with samples: the engine's tokens, the window (lo, hi], and the hours
    of the instance's windows before (``prev_hour``, null for its first) and after it. Read
    from ``engine_hours``, a row per instance-hour.
    """
    values, _ = _values(first_hour, end_hour, None)
    values.pop("back")
    return (
        f"""
CREATE OR REPLACE TEMP TABLE _windows AS
WITH {_rollup_windows_ctes()}
SELECT *, lag(hour) OVER (PARTITION BY instance ORDER BY hour) AS prev_hour,
    lead(hour) OVER (PARTITION BY instance ORDER BY hour) AS next_hour
FROM windows""",
        values,
    )


def first_windows_sql() -> list[str]:
    """SQL creating temp table ``_first_windows`` over ``_windows`` (``windows_sql``).

    Per instance and hour from its first window's to its last's: the first window at or after
    that hour (``first_hour``, its end ``hi`` and the hour of the window after it) and the
    instance's first window's hour (``span_first``), for placing records by equality joins.
    """
    return [
        """
CREATE OR REPLACE TEMP TABLE _first_windows AS
WITH spans AS (SELECT instance, min(hour) AS span_first, max(hour) AS span_last
               FROM _windows GROUP BY instance),
grid AS (SELECT instance, span_first, unnest(range(span_first, span_last + 1)) AS hour FROM spans)
SELECT g.instance, g.hour, g.span_first,
    min(w.hour) OVER (PARTITION BY g.instance ORDER BY g.hour DESC
                      ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS first_hour
FROM grid g LEFT JOIN _windows w USING (instance, hour)""",
        """
CREATE OR REPLACE TEMP TABLE _first_windows AS
SELECT f.instance, f.hour, f.span_first, w.hour AS first_hour, w.hi, w.next_hour
FROM _first_windows f JOIN _windows w ON w.instance = f.instance AND w.hour = f.first_hour""",
    ]


def unsummed_sql() -> str:
    """SQL: the instance-hours whose summed records must be placed one by one (over ``_windows``).

    A window's summed records (``usage_hours``: they end ``EDGE_SECONDS`` or more before their
    hour does) all fall whole inside it when its last sample is at most ``EDGE_SECONDS``
    before the hour's end and it has a window before it. Otherwise (an instance's first window,
    whose records before its first sample count for nothing; an hour read early) its hour's
    records are read raw, when it can meet the hours asked for (``$lo``). Columns: instance,
    hour.
    """
    return f"""
SELECT instance, hour FROM _windows
WHERE (prev_hour IS NULL OR hi < (hour + 1) * {HOUR_SECONDS}.0 - {EDGE_SECONDS})
    AND (hour >= $lo OR next_hour >= $lo)
ORDER BY hour, instance"""


def hour_runs(hours: Sequence[int]) -> list[tuple[int, int]]:
    """Consecutive ``hours`` as [first, after-last) runs, in order."""
    return runs(hours)


def rollup_reconciliation_sql(
    first_hour: int,
    end_hour: int,
    unsummed: Sequence[int],
    model: str | None = None,
    usage: str = "usage",
    hours_table: str = "usage_hours",
    edges: str = "usage_edges",
    tails: str = "_tails",
) -> Sql:
    """``reconciliation_sql``'s rows from the rollups, over ``_windows`` (``windows_sql``).

    Tokens of summed records come from ``hours_table`` per instance-hour, each added to the
    window its hour falls in; ``edges``' records are placed one by one. ``unsummed``: the hours
    of ``_unsummed`` (``unsummed_sql``, a temp table), whose summed records are read from
    ``usage`` and placed one by one instead; only the row groups of those hours are read
    (``finished_at`` within them), so a ledger ordered by time skips the rest. ``tails``: the
    hang-up tails (``billing.hangups.tails_sql``'s rows). Pure.
    """
    values, filter_model = _values(first_hour, end_hour, model)
    raw = " UNION ALL ".join(
        f"""
    SELECT coalesce(u.instance, u.replica) AS instance, u.replica, u.model, {FIRST_TOKEN_SQL} AS tp,
        u.finished_at AS tf, u.prompt_tokens * u.choices AS p, u.completion_tokens AS c, 1 AS n
    FROM {usage} u SEMI JOIN _unsummed x
        ON x.instance = coalesce(u.instance, u.replica) AND x.hour = {token_hour_sql()}
    WHERE u.finished_at >= {a * HOUR_SECONDS}.0 AND u.finished_at < {b * HOUR_SECONDS}.0
        AND u.status IN {BILLABLE} AND {summed_sql()} AND {_RECORDS_IN_RANGE}"""
        for a, b in hour_runs(unsummed)
    )
    summed = f"""
    UNION ALL
    -- Summed records: whole inside the window of the first hour with samples at or after theirs.
    SELECT w.instance, w.hour, sum(h.prompt_tokens)::DOUBLE, sum(h.completion_tokens)::DOUBLE
    FROM (SELECT * FROM {hours_table} WHERE hour >= $lo - {_BACK_HOURS} AND hour < $hi) h
    ASOF JOIN windows w ON h.instance = w.instance AND h.hour <= w.hour
    ANTI JOIN _unsummed x ON x.instance = h.instance AND x.hour = h.hour
    WHERE NOT (w.prev_hour IS NULL AND h.hour < w.hour)  -- before the first sample: not counted
    GROUP BY ALL"""
    ahead = f"""SELECT instance, max(last_ts) AS ts FROM engine_hours
    WHERE hour >= $hi AND hour < $hi + {_BACK_HOURS} GROUP BY ALL"""
    edge_range = _RECORDS_IN_RANGE.replace(FIRST_TOKEN_SQL, "first_token_at")
    return (
        f"""
WITH windows AS (SELECT * FROM _windows),
-- Read where it is used rather than copied first: 15 % less time on a 20M-record month.
records AS NOT MATERIALIZED (
    SELECT instance, replica, model, first_token_at AS tp, finished_at AS tf, prompt_tokens AS p,
        completion_tokens AS c, 1 AS n
    FROM {edges} WHERE {edge_range}{" UNION ALL " + raw if raw else ""}
),{_PLACED.format(placed=_PLACED_BY_HOUR, across=_ITS_WINDOWS, meets=" AND w.hour = x.meets", more=summed)},
{unreconciled.cover_ctes(ahead)},
unreconciled AS ({unreconciled.records_sql("records")}
    UNION ALL {unreconciled.summed_sql(hours_table)}),
tails AS (SELECT * FROM {tails}),
{_rows(filter_model)}""",
        values,
    )


def _tails(con: duckdb.DuckDBPyConnection, values: dict[str, Any]) -> None:
    """Leave the range's hang-up tails in temp table ``_tails`` (``billing.hangups``).

    The engine's readings are read for the hours around the hang-ups only, and the other records
    for the spans of the intervals its gauges leave open only.
    """
    found = con.execute(hangups.hangup_hours_sql(), values).fetchall()
    around = [h + d for (h,) in found for d in (-1, 0, 1)]
    readings = hangups.readings_sql(hour_runs(around))
    bounded = hangups.bounded_sql(hangups.kept_hangups_sql(), readings)
    con.execute(f"CREATE OR REPLACE TEMP TABLE _bounded AS {bounded}", values)
    intervals = con.execute("SELECT a_ts, b_ts FROM _bounded").fetchall()
    others = hangups.others_sql(hangups.spans([(float(a), float(b)) for a, b in intervals]))
    con.execute(f"CREATE OR REPLACE TEMP TABLE _tails AS {hangups.tails_sql('_bounded', others)}")


def reconcile(
    con: duckdb.DuckDBPyConnection,
    first_hour: int,
    end_hour: int,
    model: str | None = None,
    tails: bool = True,
) -> str:
    """Reconcile the ledger's hours ``first_hour``..``end_hour`` on ``con`` from its rollups.

    Leaves ``reconciliation_sql``'s rows in temp table ``_reconciliation`` and returns its name;
    each team's share of the hang-up tails is left in ``_hangups`` (instance, hour, team, model,
    replica, prompt_tokens, completion_tokens). Without ``tails``, no hang-up is examined (their
    tails count as unattributed): for what does not depend on them, the unreconciled requests.
    """
    sql, values = windows_sql(first_hour, end_hour)
    con.execute(sql, values)
    for statement in first_windows_sql():
        con.execute(statement)
    con.execute(f"CREATE OR REPLACE TEMP TABLE _unsummed AS {unsummed_sql()}", {"lo": first_hour})
    unsummed = [int(r[0]) for r in con.execute("SELECT DISTINCT hour FROM _unsummed").fetchall()]
    if tails:
        _tails(con, _values(first_hour, end_hour, None)[0])
    else:
        con.execute(f"CREATE OR REPLACE TEMP TABLE _tails AS {hangups.NO_TAILS}")
    sql, values = rollup_reconciliation_sql(first_hour, end_hour, unsummed, model)
    con.execute(f"CREATE OR REPLACE TEMP TABLE _reconciliation AS {sql}", values)
    counted = f"(SELECT *, CAST(t // {H} AS BIGINT) AS hour FROM _reconciliation)"
    con.execute(f"CREATE OR REPLACE TEMP TABLE _hangups AS {hangups.split_sql('_tails', counted)}")
    return "_reconciliation"


def unattributed_sql(policy: Policy, reconciliation: str, slots: str = "_slots") -> str:
    """Per instance and hour: the unattributed tokens and what they cost, taken from its idle.

    ``reconciliation`` holds ``reconciliation_sql``'s rows; ``slots`` is allocation's per-instance,
    per-hour cost and its busy part (``AllocationSql.prepare``). ``claimed`` is the part of the
    instance-hour's cost the unattributed tokens stand for: their share of the engine's weighted
    tokens, at most the hour's idle share of that instance. Pure: nothing is run here.
    """
    wp, wc = float(policy.prompt_weight), float(policy.completion_weight)
    return f"""
WITH tokens AS (
    SELECT instance, max(replica) AS replica, CAST(floor(t / {HOUR_SECONDS}) AS BIGINT) AS hour,
        arg_max(model, t) AS model,
        sum(unattributed_prompt_tokens)::BIGINT AS prompt_tokens,
        sum(unattributed_completion_tokens)::BIGINT AS completion_tokens,
        sum(unattributed_prompt_tokens * {wp!r} + unattributed_completion_tokens * {wc!r}) AS weighted,
        sum(engine_prompt_tokens * {wp!r} + engine_completion_tokens * {wc!r}) AS engine_weighted
    FROM {reconciliation} GROUP BY instance, hour
    HAVING sum(unattributed_prompt_tokens) + sum(unattributed_completion_tokens) > 0
),
costs AS (
    SELECT instance, hour,
        {", ".join(f"sum({c}) AS {c}" for c in MONEY)},
        sum(compute_usd + energy_usd - busy_compute_usd - busy_energy_usd) AS idle_usd
    FROM {slots} GROUP BY ALL
),
claimed AS (
    SELECT t.*,
        CASE WHEN coalesce(c.compute_usd + c.energy_usd, 0.0) > 0 AND t.engine_weighted > 0
            THEN greatest(0.0, least(t.weighted / t.engine_weighted,
                                     c.idle_usd / (c.compute_usd + c.energy_usd)))
            ELSE 0.0 END AS claimed,
        {", ".join(f"coalesce(c.{m}, 0.0) AS hour_{m}" for m in MONEY)}
    FROM tokens t LEFT JOIN costs c USING (instance, hour)
)
SELECT replica, instance, hour, model, prompt_tokens, completion_tokens,
    {", ".join(f"claimed * hour_{m} AS {m}" for m in MONEY)}
FROM claimed ORDER BY replica, instance, hour"""


def claim_rows(hourly: pl.DataFrame, policy: Policy) -> pl.DataFrame:
    """Who carries ``hourly``'s unattributed tokens, and what they claim of each instance's idle.

    ``hourly`` holds ``unattributed_sql``'s rows. One row per instance and line (team, model
    ``<model> (unattributed)``): the group's owner under ``idle_policy: owner``, else the
    platform account. Columns replica, instance, team, model, prompt_tokens,
    completion_tokens, then ``MONEY`` (floats): the claim, which ``billing.charges.charge``
    takes out of the instance's idle capacity in micro-cents, never beyond it.
    """
    teams = {
        r: (owner if rule == "owner" and owner else policy.platform_account)
        for r, (rule, owner) in policy.idle.items()
    }
    keys = ["replica", "instance", "team", "model"]
    return (
        hourly.with_columns(
            pl.col(*MONEY).cast(pl.Float64),
            team=pl.col("replica").replace_strict(teams, default=policy.platform_account),
            model=pl.col("replica").replace_strict(
                dict(policy.replica_model), default=pl.col("model")
            )
            + UNATTRIBUTED_SUFFIX,
        )
        .group_by(keys)
        .agg(
            pl.col("prompt_tokens", "completion_tokens").sum().cast(pl.Int64), pl.col(*MONEY).sum()
        )
        .sort(keys)
    )


def tail_lines(tails: pl.DataFrame) -> pl.DataFrame:
    """The hang-up tails each team is charged (team, model, prompt_tokens, completion_tokens), as
    lines of tokens only (``LINE_COLUMNS``), under the team's own model.

    No money: the in-flight split already charged the team the GPU time its request held. The
    statement adds them to the team's line of that model (``billing.statement.merged``).
    """
    tokens = ("prompt_tokens", "completion_tokens")
    return (
        tails.group_by("team", "model")
        .agg(pl.col(*tokens).sum().cast(pl.Int64))
        .filter(pl.col("prompt_tokens") + pl.col("completion_tokens") > 0)
        .with_columns(
            pl.lit(0, dtype=pl.Int64).alias("requests"),
            pl.lit(0.0).alias("gpu_hours"),
            pl.lit(0.0).alias("energy_kwh"),
            *(pl.lit(0, dtype=pl.Int64).alias(c) for c in CASH),
        )
        .select(LINE_COLUMNS)
        .sort("team", "model")
    )
