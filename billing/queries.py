"""Read-only queries behind the dashboards: SQL builders over the minute rollups.

Every query reads the rollup tables (``usage_slots``, ``gpu_slots``, ``ttft_buckets``) or the
engine samples (the reconciliation: the raw usage too, by the hour), restricted to a time range of whole slots, so its cost follows the range and the
fleet's size, never the number of requests. The builders are pure (they return SQL and its
parameters) so they can be tested against an in-memory DuckDB; ``run`` is the only function that
touches a cursor.

Times in results are Unix seconds (``t``: the start of a step). Steps are whole minutes; with no
step given, ``auto_step`` picks the smallest usual step that keeps a series under
``MAX_POINTS`` points, so a week of data is as cheap to draw as an hour.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import duckdb
import polars as pl

from billing import reconciliation
from billing.buckets import FIRST, RATIO
from billing.pricebook import compute_usd_sql, energy_usd_sql
from billing.schema import SLOT_SECONDS

__all__ = [
    "COPIES",
    "FIRST_SECOND",
    "LAST_SECOND",
    "MAX_POINTS",
    "MAX_RANGE_SECONDS",
    "PERIODS",
    "QUERIES",
    "STEPS",
    "Query",
    "QueryParams",
    "auto_step",
    "budget_overrides_sql",
    "explorer_gpu_sql",
    "explorer_usage_sql",
    "params_from",
    "reconciliation_rows",
    "rollup_setup_sql",
    "rollup_sql",
    "run",
    "trim_sql",
]

STEPS: Final = (60, 300, 900, 3600, 6 * 3600, 86400)
MAX_POINTS: Final = 200
MAX_RANGE_SECONDS: Final = 93 * 86400
# The times a range may name: from 2000 (as ingest dates records) to the end of 2999 (the last
# month served, its last hour). Past them a time is no date a calendar holds (month_of raises).
FIRST_SECOND: Final = 946_684_800.0
LAST_SECOND: Final = 32_503_676_400.0  # 2999-12-31T23:00Z
# Replicas that sent an engine sample this recently (before the range's end) count as running.
LIVE_SECONDS: Final = 120

Sql = tuple[str, dict[str, Any]]


@dataclass(frozen=True, slots=True)
class QueryParams:
    """A time range of whole slots, a step, and optional team and model filters."""

    start: int  # Unix seconds, a multiple of SLOT_SECONDS
    end: int  # exclusive
    step: int  # seconds, a multiple of SLOT_SECONDS
    team: str | None = None
    model: str | None = None
    # (rollup table, period in minutes) -> [first slot, slot after the last) the coarse copy
    # holds; empty: read the minute tables only.
    coverage: Mapping[tuple[str, int], tuple[int, int]] = field(default_factory=dict)

    @property
    def slots(self) -> tuple[int, int]:
        """The first slot of the range and the slot after its last."""
        return self.start // SLOT_SECONDS, self.end // SLOT_SECONDS


def auto_step(start: float, end: float, max_points: int = MAX_POINTS) -> int:
    """The smallest of ``STEPS`` that draws ``start``..``end`` in at most ``max_points`` points."""
    span = max(end - start, SLOT_SECONDS)
    for step in STEPS:
        if span / step <= max_points:
            return step
    return STEPS[-1]


def params_from(
    start: float,
    end: float,
    step: int | None = None,
    team: str | None = None,
    model: str | None = None,
    coverage: Mapping[tuple[str, int], tuple[int, int]] | None = None,
) -> QueryParams:
    """Checked parameters: the range widened to whole slots; ValueError naming a bad value."""
    if not (math.isfinite(start) and math.isfinite(end)) or end <= start:
        raise ValueError(f"the range must have to > from (from={start}, to={end})")
    if start < FIRST_SECOND or end > LAST_SECOND:
        raise ValueError(
            f"the range must lie within {FIRST_SECOND:.0f}..{LAST_SECOND:.0f} "
            f"(2000-01-01 to 2999-12-31T23:00Z; from={start}, to={end})"
        )
    if end - start > MAX_RANGE_SECONDS:
        raise ValueError(f"the range is {(end - start) / 86400:.0f} days; at most 93 are served")
    if step is None:
        step = auto_step(start, end)
    if step < SLOT_SECONDS or step % SLOT_SECONDS:
        raise ValueError(
            f"step={step}: must be a whole number of minutes, in seconds (60, 300, ...)"
        )
    if (end - start) / step > 10 * MAX_POINTS:
        raise ValueError(f"step={step} gives {(end - start) / step:.0f} points; use a larger step")
    lo = int(start // SLOT_SECONDS) * SLOT_SECONDS
    hi = math.ceil(end / SLOT_SECONDS) * SLOT_SECONDS
    return QueryParams(lo, hi, step, team, model, coverage or {})


def _where(p: QueryParams, team: bool = True, model: bool = True) -> Sql:
    lo, hi = p.slots
    clauses = ["slot >= $lo", "slot < $hi"]
    values: dict[str, Any] = {"lo": lo, "hi": hi}
    if team and p.team is not None:
        clauses.append("team = $team")
        values["team"] = p.team
    if model and p.model is not None:
        clauses.append("model = $model")
        values["model"] = p.model
    return " AND ".join(clauses), values


def _t(p: QueryParams, slot: str = "slot") -> str:
    """SQL for the start (Unix seconds) of the step a slot falls in."""
    return f"CAST({slot} // {p.step // SLOT_SECONDS} AS BIGINT) * {p.step}"


# -- coarse rollups -----------------------------------------------------------------------
# A month of minute rollups is tens of millions of rows; a query over days reads a coarse copy
# of them instead (5-minute and hourly sums, same columns, ``slot`` = the period's first minute)
# kept in an in-memory database attached to the ledger. The holder (the query API) rebuilds the
# copies at start and re-rolls the recent periods as minutes fill in; ``coverage`` says which
# slots each copy holds, and everything outside it is read from the minute tables.

ROLLUP_SCHEMA: Final = "dashboard_rollups.rollups"
PERIODS: Final = (60, 5)  # minutes, coarsest first


@dataclass(frozen=True, slots=True)
class Copy:
    """A coarse copy: its minute-level rows, and how a period's rows are summed.

    ``raw`` selects the copy's columns at one row per minute (or sample) for slots
    ``{lo}``..``{hi}``; ``keys`` come before ``slot`` and ``sums`` after it, in column order.
    """

    raw: str
    keys: str
    sums: str
    first: str  # SQL for the first slot with data


def _slot_table(table: str) -> str:
    return f"SELECT * FROM {table} WHERE slot >= {{lo}} AND slot < {{hi}}"


def _sums(*columns: str) -> str:
    return ", ".join(f"sum({c})" for c in columns)


_USAGE_SUMS = _sums(
    "inflight_seconds",
    "requests",
    "failed_requests",
    "prompt_tokens",
    "cached_prompt_tokens",
    "completion_tokens",
    "ttft_seconds_sum",
    "ttft_count",
    "ttft_within_sla",
    "decode_seconds_sum",
)
# The minutes are written in as literals DuckDB reads as 32-bit INTEGERs: widened before they
# become seconds, which are past 2^31 from 2038-01-19 on.
_ENGINE_RAW = (
    'SELECT replica, coalesce(instance, replica) AS instance, model, CAST(floor("timestamp" / 60) AS BIGINT) AS slot, '
    "requests_running AS running_sum, requests_waiting AS waiting_sum, "
    "requests_waiting AS waiting_max, kv_cache_usage AS kv_sum, 1 AS n FROM engine_samples "
    'WHERE "timestamp" >= CAST({lo} AS BIGINT) * 60 AND "timestamp" < CAST({hi} AS BIGINT) * 60'
)
# "_all" copies sum every team into team '*': what the admin's fleet-wide charts read.
COPIES: Final[Mapping[str, Copy]] = {
    "usage_slots": Copy(
        _slot_table("usage_slots"),
        "replica, instance, team, model",
        _USAGE_SUMS,
        "SELECT min(slot) FROM usage_slots",
    ),
    "usage_slots_all": Copy(
        _slot_table("usage_slots"),
        "replica, instance, '*' AS team, model",
        _USAGE_SUMS,
        "SELECT min(slot) FROM usage_slots",
    ),
    "ttft_buckets": Copy(
        _slot_table("ttft_buckets"),
        "model, team",
        "bucket, sum(requests)",
        "SELECT min(slot) FROM ttft_buckets",
    ),
    "ttft_buckets_all": Copy(
        _slot_table("ttft_buckets"),
        "model, '*' AS team",
        "bucket, sum(requests)",
        "SELECT min(slot) FROM ttft_buckets",
    ),
    "gpu_slots": Copy(
        _slot_table("gpu_slots"),
        "node, gpu_model, replica, instance",
        _sums(
            "gpu_seconds",
            "energy_joules",
            "unmeasured_seconds",
            "utilization_seconds",
            "power_watt_seconds",
            "samples",
            "xid_errors",
        ),
        "SELECT min(slot) FROM gpu_slots",
    ),
    "engine_samples": Copy(
        _ENGINE_RAW,
        "replica, instance, model",
        "sum(running_sum), sum(waiting_sum), max(waiting_max), sum(kv_sum), sum(n)",
        'SELECT CAST(floor(min("timestamp") / 60) AS BIGINT) FROM engine_samples',
    ),
}


def rollup_table(name: str, period: int) -> str:
    """The coarse copy ``name`` by ``period`` minutes."""
    return f"{ROLLUP_SCHEMA}.{name}_{period}m"


def rollup_setup_sql() -> list[str]:
    """Statements that attach the in-memory database and create every coarse copy (idempotent)."""
    statements = [
        "ATTACH IF NOT EXISTS ':memory:' AS dashboard_rollups",
        f"CREATE SCHEMA IF NOT EXISTS {ROLLUP_SCHEMA}",
    ]
    for name, copy in COPIES.items():
        for period in PERIODS:
            select = _coarse_select(copy, period, copy.raw.format(lo=0, hi=0))
            statements.append(
                f"CREATE TABLE IF NOT EXISTS {rollup_table(name, period)} AS {select} LIMIT 0"
            )
    return statements


def _coarse_select(copy: Copy, period: int, raw: str) -> str:
    return f"SELECT {copy.keys}, slot // {period} * {period} AS slot, {copy.sums} FROM ({raw}) GROUP BY ALL"


def rollup_sql(name: str, period: int, lo: int, hi: int) -> list[str]:
    """Statements that recompute copy ``name`` for slots ``lo``..``hi`` (period-aligned)."""
    copy, target = COPIES[name], rollup_table(name, period)
    return [
        f"DELETE FROM {target} WHERE slot >= {int(lo)} AND slot < {int(hi)}",
        f"INSERT INTO {target} {_coarse_select(copy, period, copy.raw.format(lo=int(lo), hi=int(hi)))}",
    ]


def trim_sql(name: str, period: int, before: int) -> str:
    """Drop coarse rows before slot ``before`` (a copy kept only for recent days)."""
    return f"DELETE FROM {rollup_table(name, period)} WHERE slot < {int(before)}"


_UNSET: Final = -1


def _source(name: str, p: QueryParams, step: int | None = _UNSET) -> str:
    """Copy ``name``'s rows for ``p``'s range: whole covered periods from the coarsest copy.

    ``step`` (default: ``p.step``) must be a multiple of the period so that every minute of a
    coarse row falls in the same step; None when the query has no steps. With no coverage, the
    minute rows.
    """
    lo, hi = p.slots
    copy = COPIES[name]
    step = p.step if step == _UNSET else step
    for period in PERIODS:
        span = p.coverage.get((name, period))
        if span is None or (step is not None and step % (period * SLOT_SECONDS)):
            continue
        a = -(-max(lo, span[0]) // period) * period
        b = min(hi, span[1]) // period * period
        if a >= b:
            continue
        return (
            f"({copy.raw.format(lo=lo, hi=a)} UNION ALL "
            f"SELECT * FROM {rollup_table(name, period)} WHERE slot >= {a} AND slot < {b} UNION ALL "
            f"{copy.raw.format(lo=b, hi=hi)})"
        )
    return f"({copy.raw.format(lo=lo, hi=hi)})"


def _fleet(name: str, p: QueryParams) -> str:
    """The all-teams copy when no team filter applies (the query must not group by team)."""
    return f"{name}_all" if p.team is None else name


def throughput_sql(p: QueryParams) -> Sql:
    """Requests/s, output tokens/s, error ratio and mean TTFT per model and step."""
    where, values = _where(p)
    return (
        f"""
SELECT {_t(p)} AS t, model,
    sum(requests) / {p.step}.0 AS requests_per_second,
    sum(completion_tokens) / {p.step}.0 AS output_tokens_per_second,
    sum(prompt_tokens) / {p.step}.0 AS prompt_tokens_per_second,
    CASE WHEN sum(requests) > 0 THEN sum(failed_requests) / sum(requests) END AS error_ratio,
    CASE WHEN sum(ttft_count) > 0 THEN sum(ttft_seconds_sum) / sum(ttft_count) END AS ttft_mean_seconds,
    CASE WHEN sum(decode_seconds_sum) > 0 THEN sum(completion_tokens) / sum(decode_seconds_sum) END
        AS decode_tokens_per_second
FROM {_source(_fleet("usage_slots", p), p)} WHERE {where}
GROUP BY ALL ORDER BY model, t""",
        values,
    )


def _bucket_counts_sql(group: str, where: str, source: str) -> str:
    return f"""
SELECT model, {group} AS t, bucket, CAST(sum(requests) AS BIGINT) AS n
FROM {source} WHERE {where} GROUP BY ALL HAVING sum(requests) > 0 ORDER BY model, t, bucket"""


def ttft_sql(p: QueryParams) -> Sql:
    """Requests per TTFT bucket, model and step; ``ttft_quantiles`` turns them into p50/p95."""
    where, values = _where(p)
    return _bucket_counts_sql(_t(p), where, _source(_fleet("ttft_buckets", p), p)), values


def worst_hours_sql(p: QueryParams) -> Sql:
    """Requests per TTFT bucket, model and hour; ``worst_hours`` keeps the worst."""
    where, values = _where(p)
    group = "CAST(slot // 60 AS BIGINT) * 3600"
    return _bucket_counts_sql(group, where, _source(_fleet("ttft_buckets", p), p, 3600)), values


def _quantile(q: float) -> pl.Expr:
    """The q-quantile of each (model, t), as ``billing.buckets.quantile``: linear in the bucket."""
    bucket = pl.col("bucket")
    low = pl.when(bucket == 0).then(0.0).otherwise(FIRST * pl.lit(RATIO).pow(bucket - 1))
    up = FIRST * pl.lit(RATIO).pow(bucket)
    rank = q * pl.col("total")
    value = low + (up - low) * (rank - (pl.col("cum") - pl.col("n"))) / pl.col("n")
    return value.filter(pl.col("cum") >= rank).first()


def ttft_quantiles(counts: pl.DataFrame) -> pl.DataFrame:
    """p50 and p95 seconds and requests per (t, model) from bucket counts sorted by bucket."""
    keys = ["model", "t"]
    return (
        counts.with_columns(
            cum=pl.col("n").cum_sum().over(keys), total=pl.col("n").sum().over(keys)
        )
        .group_by(keys, maintain_order=True)
        .agg(
            pl.col("total").first().alias("requests"),
            _quantile(0.5).alias("p50_seconds"),
            _quantile(0.95).alias("p95_seconds"),
        )
        .select("t", "model", "requests", "p50_seconds", "p95_seconds")
        .sort("model", "t")
    )


def worst_hours(counts: pl.DataFrame, limit: int = 10) -> pl.DataFrame:
    """The ``limit`` hours with the highest p95 per model, worst first."""
    hours = ttft_quantiles(counts).drop("p50_seconds")
    return (
        hours.sort(["model", "p95_seconds", "t"], descending=[False, True, False])
        .group_by("model", maintain_order=True)
        .head(limit)
    )


def sla_sql(p: QueryParams) -> Sql:
    """Per model and team: requests with a TTFT, and the share within the model's target."""
    where, values = _where(p)
    return (
        f"""
SELECT model, team, CAST(sum(ttft_count) AS BIGINT) AS ttft_requests, CAST(sum(ttft_within_sla) AS BIGINT) AS within_sla,
    CASE WHEN sum(ttft_count) > 0 THEN sum(ttft_within_sla) / sum(ttft_count) END AS compliance,
    CAST(sum(requests) AS BIGINT) AS requests, CAST(sum(failed_requests) AS BIGINT) AS failed_requests
FROM {_source("usage_slots", p, None)} WHERE {where}
GROUP BY ALL ORDER BY model, team""",
        values,
    )


def team_usage_sql(p: QueryParams) -> Sql:
    """Per team and model over the whole range: requests, tokens, in-flight hours."""
    where, values = _where(p)
    return (
        f"""
SELECT team, model, CAST(sum(requests) AS BIGINT) AS requests, CAST(sum(failed_requests) AS BIGINT) AS failed_requests,
    CAST(sum(prompt_tokens) AS BIGINT) AS prompt_tokens, CAST(sum(cached_prompt_tokens) AS BIGINT) AS cached_prompt_tokens,
    CAST(sum(completion_tokens) AS BIGINT) AS completion_tokens, sum(inflight_seconds) / 3600 AS inflight_hours
FROM {_source("usage_slots", p, None)} WHERE {where}
GROUP BY ALL ORDER BY team, model""",
        values,
    )


def gpus_sql(p: QueryParams) -> Sql:
    """Mean GPU utilization, power and busy GPUs per node, instance (by replica group) and step."""
    where, values = _where(p, team=False, model=False)
    return (
        f"""
SELECT {_t(p)} AS t, node, replica, instance, gpu_model,
    sum(utilization_seconds) / nullif(sum(gpu_seconds), 0) AS utilization,
    sum(power_watt_seconds) / nullif(sum(gpu_seconds), 0) AS power_watts,
    sum(gpu_seconds) / {p.step}.0 AS gpus,
    sum(energy_joules) / 3.6e6 AS energy_kwh,
    CAST(sum(xid_errors) AS BIGINT) AS xid_errors
FROM {_source("gpu_slots", p)} WHERE {where}
GROUP BY ALL ORDER BY node, replica, instance, t""",
        values,
    )


def engine_sql(p: QueryParams) -> Sql:
    """Mean running and waiting requests and KV-cache use per instance (by replica group) and step."""
    where, values = _where(p, team=False)
    return (
        f"""
SELECT {_t(p)} AS t, replica, instance, model,
    sum(running_sum) / sum(n) AS requests_running, sum(waiting_sum) / sum(n) AS requests_waiting,
    max(waiting_max) AS requests_waiting_max, sum(kv_sum) / sum(n) AS kv_cache_usage
FROM {_source("engine_samples", p)} WHERE {where}
GROUP BY ALL ORDER BY replica, instance, t""",
        values,
    )


def replicas_sql(p: QueryParams) -> Sql:
    """Replica groups and instances per model that sent an engine sample in the ``LIVE_SECONDS``
    before the end."""
    values: dict[str, Any] = {"start": float(p.end - LIVE_SECONDS), "end": float(p.end)}
    return (
        """
SELECT model, count(DISTINCT replica) AS replicas,
    count(DISTINCT coalesce(instance, replica)) AS instances, max("timestamp") AS last_sample
FROM engine_samples WHERE "timestamp" >= $start AND "timestamp" < $end
GROUP BY ALL ORDER BY model""",
        values,
    )


def reconciliation_rows(cursor: duckdb.DuckDBPyConnection, p: QueryParams) -> pl.DataFrame:
    """Engine counters against the ledger per instance and hour (``billing.reconciliation``).

    From the rollups the statement reads (``reconcile``): the rows of the raw records'
    ``reconciliation_sql``, for a month of 20M records in a tenth of a second where the raw
    query took 11 s. The temp tables it leaves are the cursor's own.
    """
    table = reconciliation.reconcile(cursor, *reconciliation.hours(p.start, p.end), model=p.model)
    frame: pl.DataFrame = cursor.sql(f"SELECT * FROM {table}").pl()
    return frame


def budget_overrides_sql(p: QueryParams) -> Sql:
    """The budget overrides admins granted in the range, newest first: who, why, until when."""
    where = "issued_at >= $start AND issued_at < $end"
    values: dict[str, Any] = {"start": p.start, "end": p.end}
    if p.team is not None:
        where, values["team"] = f"{where} AND team = $team", p.team
    return (
        f"""
SELECT DISTINCT ON (override_id) override_id, team, admin_reason, until, issued_at, issued_by
FROM budget_overrides WHERE {where}
ORDER BY override_id""",
        values,
    )


def span_sql(p: QueryParams) -> Sql:
    """The first and the end (Unix seconds, whole minutes) of the data the caller may see.

    Usage for a team; usage and GPU time for the admin (spare GPUs are data before any
    request). The range is ignored: this is what a page's default range is fitted to.
    """
    if p.team is not None:
        return (
            "SELECT min(slot) * 60 AS first, (max(slot) + 1) * 60 AS last FROM usage_slots "
            "WHERE team = $team",
            {"team": p.team},
        )
    return (
        """
SELECT min(first) AS first, max(last) AS last FROM (
    SELECT min(slot) * 60 AS first, (max(slot) + 1) * 60 AS last FROM usage_slots
    UNION ALL SELECT min(slot) * 60, (max(slot) + 1) * 60 FROM gpu_slots)""",
        {},
    )


# -- the allocation explorer's profiles (``billing.explorer``) -----------------------------
# Where in a month each statement line's money and counts fall, hour by hour: read from the
# hourly copies (and the minutes they do not cover yet), so a month is a few hundred thousand
# rows whatever the number of requests.


def _quoted(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def explorer_gpu_sql(
    p: QueryParams, usd_per_gpu_hour: Mapping[str, float], usd_per_kwh: float
) -> Sql:
    """Per instance (and group), hour, node and GPU model: cost at the price book, GPU-hours, kWh.

    ``usd_per_kwh`` includes the PUE. GPU models without a price are left out, as the
    allocation leaves them out of the fleet's cost. ``p.step`` must be 3600.
    """
    rows = ", ".join(f"({_quoted(m)}, {float(u)!r})" for m, u in sorted(usd_per_gpu_hour.items()))
    if not rows:
        return "SELECT NULL::VARCHAR AS replica WHERE false", {}
    where, values = _where(p, team=False, model=False)
    compute = compute_usd_sql("sum(gpu_seconds)", "any_value(p.usd)")
    energy = energy_usd_sql("sum(energy_joules)", repr(float(usd_per_kwh)))
    return (
        f"""
SELECT replica, instance, CAST(slot // 60 AS BIGINT) AS hour, node, gpu_model,
    {compute} + {energy} AS cost_usd,
    sum(gpu_seconds) / 3600.0 AS gpu_hours, sum(energy_joules) / 3.6e6 AS energy_kwh
FROM {_source("gpu_slots", p)} JOIN (VALUES {rows}) AS p(gpu_model, usd) USING (gpu_model)
WHERE {where} GROUP BY ALL""",
        values,
    )


def explorer_usage_sql(p: QueryParams) -> Sql:
    """Per instance (and group), team, model and hour: in-flight seconds, requests and tokens.

    ``p.step`` must be 3600.
    """
    where, values = _where(p)
    return (
        f"""
SELECT replica, instance, team, model, CAST(slot // 60 AS BIGINT) AS hour,
    sum(inflight_seconds) AS inflight_seconds, sum(requests)::DOUBLE AS requests,
    sum(prompt_tokens)::DOUBLE AS prompt_tokens, sum(completion_tokens)::DOUBLE AS completion_tokens
FROM {_source("usage_slots", p)} WHERE {where} GROUP BY ALL""",
        values,
    )


def newest_first(frame: pl.DataFrame) -> pl.DataFrame:
    """Rows by ``issued_at``, newest first."""
    return frame.sort("issued_at", descending=True)


@dataclass(frozen=True, slots=True)
class Query:
    """A named query: its SQL, whether a team key may run it (for its own team), and a
    final step over the SQL's rows.

    ``scrapers``: the metrics credential may run it too (what monitoring watches, such as the
    reconciliation, which holds no team's data).
    """

    build: Callable[[QueryParams], Sql] | None
    per_team: bool
    doc: str
    finish: Callable[[pl.DataFrame], pl.DataFrame] | None = None
    scrapers: bool = False
    # A query of several statements (temp tables on the cursor) reads its rows itself.
    read: Callable[[duckdb.DuckDBPyConnection, QueryParams], pl.DataFrame] | None = None


QUERIES: Final[Mapping[str, Query]] = {
    "throughput": Query(throughput_sql, True, "requests/s, tokens/s, errors per model and step"),
    "ttft": Query(ttft_sql, True, "TTFT p50/p95 per model and step", ttft_quantiles),
    "worst_hours": Query(
        worst_hours_sql, True, "hours with the highest TTFT p95 per model", worst_hours
    ),
    "sla": Query(sla_sql, True, "share of requests within the TTFT target per model and team"),
    "team_usage": Query(team_usage_sql, True, "requests and tokens per team and model"),
    "gpus": Query(gpus_sql, False, "GPU utilization and power per instance and step"),
    "engine": Query(engine_sql, False, "queue depth and KV-cache use per instance and step"),
    "replicas": Query(replicas_sql, False, "replica groups and instances reporting now, per model"),
    "reconciliation": Query(
        None,
        False,
        "engine tokens against the ledger's per instance and hour",
        scrapers=True,
        read=reconciliation_rows,
    ),
    "span": Query(span_sql, True, "the first and last minute of the data the caller may see"),
    "budget_overrides": Query(
        budget_overrides_sql,
        False,
        "budget overrides granted by admins: team, reason, until, issuing instance",
        newest_first,
    ),
}


def run(cursor: duckdb.DuckDBPyConnection, name: str, params: QueryParams) -> pl.DataFrame:
    """Run query ``name`` on ``cursor``; KeyError for an unknown name."""
    query = QUERIES[name]
    if query.read is not None:
        frame = query.read(cursor, params)
    else:
        assert query.build is not None
        sql, values = query.build(params)
        frame = cursor.sql(sql, params=values).pl()
    # Percentiles are a cumulative sum per series: cheaper in Polars than as SQL windows.
    return query.finish(frame) if query.finish is not None else frame
