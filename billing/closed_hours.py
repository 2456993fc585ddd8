"""A closed month's hours: the evidence frozen beside its statement, for a central to audit.

A statement line says what a team owes for a month; a central billing across clusters
(``billing.federation``) also wants to see *when* the money was spent and whether the engines
agree with the ledger, without reading any cluster's raw rows. So closing a month
(``billing.closing.freeze``) also freezes, in the same transaction, four small tables whose
rows are in proportion to hours x groups x teams, not to requests:

``closed_cost_hours``
    per (hour, replica group, GPU model): GPU-hours, kWh and cents. The cents are the month's
    own lines (``for_month`` = the month; adjustments charge earlier months, whose hours were
    frozen with them) split over the hours in proportion to each hour's measured cost at the
    price book's rates (``billing.allocation``'s ``_rates``), by ``billing.rounding.split``:
    they add up to the statement's total for the month to the cent, by construction. Under the
    allocation basis an invoice scales a pool's month as a whole, so the hours keep list-price
    proportions of it.
``closed_usage_hours``
    per (hour, team, model): requests and tokens (``alloc_hours``), the GPU-hours of the
    in-flight split (``share_hours``), and cents: each statement line's total split over its
    hours by their priced share (by requests where nothing was priced).
``closed_reconciled_hours``
    per (hour, replica group, model): the engines' counted tokens against the ledger's, the
    signed difference and how it was explained (``billing.reconciliation``'s instance-hours
    summed per group).
``closed_lifetime_hours``
    per (hour, replica group, model, GPU model): the instance lifetimes (``billing.lifetimes``)
    alive in it, started, stopped, and ended without a stop (``kill -9``, a lost node: at the
    last evidence of the pod, ``billing.lifetimes.ended_sql``), and their instance-hours and
    GPU-hours within it. A lifetime has no team, so these are per group: how a dynamic fleet
    was shaped hour by hour, beside what it cost. (A lifetime's effect on the money, GPU time
    outside it being the '' group's, is in the cost rows already.)

SQL and the cents split are built here by pure functions; ``hour_frames`` runs them on a
cursor and ``write_hours`` keeps the result on the closing transaction's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

import duckdb
import polars as pl

from billing import reconciliation_hours
from billing.allocation import Policy, priced_sql_of
from billing.hourly import HourRows
from billing.lifetimes import ended_sql
from billing.pricebook import compute_usd_sql, energy_usd_sql
from billing.rounding import microcents, split
from billing.schema import HOUR_SECONDS
from infermeter.months import month_bounds

__all__ = [
    "COST_HOUR_SCHEMA",
    "KINDS",
    "LIFETIME_HOUR_SCHEMA",
    "RECONCILED_HOUR_SCHEMA",
    "USAGE_HOUR_SCHEMA",
    "cost_cents",
    "hour_frames",
    "lifetimes_sql",
    "month_hours",
    "usage_cents",
    "write_hours",
]

COST_HOUR_SCHEMA: Final = {
    "month": pl.String,
    "hour": pl.Int64,  # Unix hour: hours since 1970-01-01T00:00Z
    "replica": pl.String,
    "gpu_model": pl.String,
    "gpu_hours": pl.Float64,
    "energy_kwh": pl.Float64,
    "total_cents": pl.Int64,
}
USAGE_HOUR_SCHEMA: Final = {
    "month": pl.String,
    "hour": pl.Int64,
    "team": pl.String,
    "model": pl.String,
    "requests": pl.Int64,
    "prompt_tokens": pl.Int64,
    "completion_tokens": pl.Int64,
    "gpu_hours": pl.Float64,
    "total_cents": pl.Int64,
}
RECONCILED_HOUR_SCHEMA: Final = {
    "month": pl.String,
    "hour": pl.Int64,
    "replica": pl.String,
    "model": pl.String,
    "engine_tokens": pl.Int64,
    "ledger_tokens": pl.Int64,
    "difference_tokens": pl.Int64,
    "hangup_tokens": pl.Int64,
    "unattributed_tokens": pl.Int64,
    "ledger_excess_tokens": pl.Int64,
    "unreconciled_requests": pl.Int64,
    "unreconciled_tokens": pl.Int64,
}
LIFETIME_HOUR_SCHEMA: Final = {
    "month": pl.String,
    "hour": pl.Int64,
    "replica": pl.String,
    "model": pl.String,
    "gpu_model": pl.String,
    "instances": pl.Int64,
    "started": pl.Int64,
    "stopped": pl.Int64,
    "ended_without_stop": pl.Int64,
    "instance_hours": pl.Float64,
    "gpu_hours": pl.Float64,
}
# Each kind of hourly row: its name on the wire, its schema, the cluster's table of it.
KINDS: Final[Mapping[str, tuple[Mapping[str, type[pl.DataType]], str]]] = {
    "cost": (COST_HOUR_SCHEMA, "closed_cost_hours"),
    "usage": (USAGE_HOUR_SCHEMA, "closed_usage_hours"),
    "reconciliation": (RECONCILED_HOUR_SCHEMA, "closed_reconciled_hours"),
    "lifetimes": (LIFETIME_HOUR_SCHEMA, "closed_lifetime_hours"),
}
# Floats are frozen rounded, so the digest of a month does not depend on a sum's order.
_DIGITS: Final = 10


def month_hours(month: str) -> tuple[int, int]:
    """``month``'s first Unix hour and the first hour after it."""
    start, end = month_bounds(month)
    return int(start // HOUR_SECONDS), int(end // HOUR_SECONDS)


def _priced_usd(alias: str) -> str:
    """SQL of ``alias``'s GPU-seconds and joules at ``r``'s rates in USD (0 where unpriced)."""
    return (
        f"coalesce({compute_usd_sql(f'{alias}.gpu_seconds', 'r.usd')}, 0) + "
        f"coalesce({energy_usd_sql(f'{alias}.energy_joules', 'r.kwh_usd')}, 0)"
    )


def _cost_sql(costs: str) -> str:
    """The measured cost per hour, group and GPU model of ``costs`` (``cost_hours`` rows) at
    ``_rates``; a GPU model without a price keeps its GPU-hours at no cost."""
    return f"""
SELECT c.hour, c.replica, c.gpu_model, sum(c.gpu_seconds) / 3600.0 AS gpu_hours,
    sum(c.energy_joules) / 3.6e6 AS energy_kwh, sum({_priced_usd("c")}) AS usd
FROM {costs} c LEFT JOIN _rates r USING (hour, node, gpu_model)
GROUP BY ALL ORDER BY hour, replica, gpu_model"""


def _usage_sql(first: int, after: int) -> str:
    """Requests, tokens and the priced in-flight share per hour, team and model (``_rates``)."""
    span = f"hour >= {first} AND hour < {after}"
    usd = _priced_usd("s")
    return f"""
WITH counted AS (
    SELECT h.hour, k.team, k.model, sum(h.requests)::BIGINT AS requests,
        sum(h.prompt_tokens)::BIGINT AS prompt_tokens,
        sum(h.completion_tokens)::BIGINT AS completion_tokens
    FROM (SELECT * FROM alloc_hours WHERE {span}) h JOIN alloc_keys k USING ("key") GROUP BY ALL
), shared AS (
    SELECT s.hour, k.team, k.model, sum(s.gpu_seconds) / 3600.0 AS gpu_hours, sum({usd}) AS usd
    FROM (SELECT * FROM share_hours WHERE {span}) s JOIN alloc_keys k USING ("key")
    LEFT JOIN _rates r USING (hour, node, gpu_model) GROUP BY ALL
)
SELECT hour, team, model, coalesce(c.requests, 0) AS requests,
    coalesce(c.prompt_tokens, 0) AS prompt_tokens,
    coalesce(c.completion_tokens, 0) AS completion_tokens,
    coalesce(x.gpu_hours, 0.0) AS gpu_hours, coalesce(x.usd, 0.0) AS usd
FROM counted c FULL JOIN shared x USING (hour, team, model)
ORDER BY hour, team, model"""


_RECONCILED_SQL: Final = f"""
SELECT CAST(t // {HOUR_SECONDS} AS BIGINT) AS hour, coalesce(replica, '') AS replica,
    coalesce(model, '') AS model,
    {", ".join(f"sum({c})::BIGINT AS {c}" for c in list(RECONCILED_HOUR_SCHEMA)[4:])}
FROM _reconciliation GROUP BY ALL ORDER BY hour, replica, model"""


def lifetimes_sql(first: int, after: int, heartbeat_seconds: float) -> str:
    """The lifetimes alive in hours ``first``..``after``, summed per hour, group, model and GPU
    model (``LIFETIME_HOUR_SCHEMA`` but the month), each ending where ``ended_sql`` says."""
    lo, hi, h = first * HOUR_SECONDS, after * HOUR_SECONDS, HOUR_SECONDS
    ended = ended_sql(heartbeat_seconds)
    within = f"least(ended_at, (hour + 1) * {h}) - greatest(started_at, hour * {h})"
    start_hour = f"CAST(floor(greatest(started_at, {lo}) / {h}) AS BIGINT)"
    return f"""
WITH alive AS (
    SELECT replica, model, gpu_model, gpu_count, started_at, stopped_at, {ended} AS ended_at
    FROM lifetimes WHERE started_at < {hi} AND {ended} >= {lo}
), hours AS (
    SELECT *, unnest(range({start_hour},
        greatest({start_hour} + 1, CAST(ceil(least(ended_at, {hi}) / {h}) AS BIGINT)))) AS hour
    FROM alive
)
SELECT hour, replica, model, gpu_model, count(*) AS instances,
    count(*) FILTER (WHERE started_at >= hour * {h} AND started_at < (hour + 1) * {h}) AS started,
    count(*) FILTER (WHERE stopped_at >= hour * {h} AND stopped_at < (hour + 1) * {h}) AS stopped,
    count(*) FILTER (WHERE stopped_at IS NULL AND ended_at >= hour * {h}
                     AND ended_at < (hour + 1) * {h}) AS ended_without_stop,
    sum(greatest(0, {within})) / 3600.0 AS instance_hours,
    sum(gpu_count * greatest(0, {within})) / 3600.0 AS gpu_hours
FROM hours GROUP BY ALL ORDER BY hour, replica, model, gpu_model"""


def _weights(usd: pl.Series) -> list[int]:
    return [microcents(float(u)) if u and u > 0 else 0 for u in usd.to_list()]


def cost_cents(rows: pl.DataFrame, total_cents: int, first_hour: int) -> pl.DataFrame:
    """``rows`` (hour, replica, gpu_model, gpu_hours, energy_kwh, usd) with ``total_cents`` split
    over them in proportion to ``usd``: they add up to it exactly.

    A total with nothing priced to carry it (a month of unused commitments only) is one row of
    its own: the month's ``first_hour``, group and GPU model ''.
    """
    weights = _weights(rows["usd"]) if rows.height else []
    priced = total_cents > 0 and any(weights)
    parts = split(total_cents, weights) if priced else [0] * rows.height
    out = rows.drop("usd").with_columns(pl.Series("total_cents", parts, pl.Int64))
    if sum(parts) != total_cents:
        row = [(first_hour, "", "", 0.0, 0.0, total_cents)]
        out = pl.concat([out, pl.DataFrame(row, schema=out.schema, orient="row")])
    return out


def usage_cents(rows: pl.DataFrame, lines: pl.DataFrame) -> pl.DataFrame:
    """``rows`` (hour, team, model, counts, gpu_hours, usd) with each of ``lines``' total (per
    team and model) split over its hours: by ``usd``, by requests where nothing was priced,
    else all in its first hour. A line with no hour of usage (idle, unallocated GPUs) has no
    rows; its cents are in ``closed_cost_hours`` only."""
    owed = {
        (t, m): int(c)
        for t, m, c in lines.group_by("team", "model").agg(pl.col("total_cents").sum()).iter_rows()
    }
    parts: list[pl.DataFrame] = []
    for (team, model), group in rows.group_by("team", "model", maintain_order=True):
        total = owed.get((str(team), str(model)), 0)
        weights = _weights(group["usd"])
        if not any(weights):
            weights = [int(r) for r in group["requests"].to_list()]
        if total > 0 and any(weights):
            cents = split(total, weights)
        else:
            cents = [total] + [0] * (group.height - 1)
        parts.append(group.drop("usd").with_columns(pl.Series("total_cents", cents, pl.Int64)))
    if not parts:
        return rows.drop("usd").with_columns(pl.lit(0, pl.Int64).alias("total_cents"))
    return pl.concat(parts).sort("hour", "team", "model")


def _framed(
    frame: pl.DataFrame, month: str, schema: Mapping[str, type[pl.DataType]]
) -> pl.DataFrame:
    """``frame`` with its month, in ``schema``'s columns and types, floats rounded."""
    out = frame.with_columns(pl.lit(month).alias("month")).select(
        pl.col(c).cast(t) for c, t in schema.items()
    )
    return out.with_columns(pl.col(pl.Float64).round(_DIGITS))


def hour_frames(
    cur: duckdb.DuckDBPyConnection,
    policy: Policy,
    month: str,
    lines: pl.DataFrame,
    heartbeat_seconds: float,
) -> dict[str, pl.DataFrame]:
    """``month``'s hourly rows (each of ``KINDS``, in its schema), read on ``cur``.

    ``lines``: the statement being frozen; its lines for ``month`` itself give the cents. The
    hourly cost rows are read as the ledger keeps them (a close rebuilds the dirty hours first).
    ``heartbeat_seconds``: the sidecars' heartbeat, where a lifetime without a stop ends.
    """
    first, after = month_hours(month)
    span = f"hour >= {first} AND hour < {after}"
    rows = HourRows(
        f"(SELECT * FROM cost_hours WHERE {span})",
        f"(SELECT * FROM share_hours WHERE {span})",
        "alloc_keys",
        f"(SELECT * FROM alloc_hours WHERE {span})",
    )
    cur.execute(priced_sql_of(policy, rows, period=month_bounds(month)).prepare)
    own = lines.filter(pl.col("for_month") == month)
    total = int(own["total_cents"].sum()) if own.height else 0
    cost = cost_cents(cur.sql(_cost_sql(rows.costs)).pl(), total, first)
    usage = usage_cents(cur.sql(_usage_sql(first, after)).pl(), own)
    # The month's reconciliation as its statement read it: the kept hours and any stale ones.
    reconciliation_hours.month_reconciliation(cur, first, after)
    reconciled = cur.sql(_RECONCILED_SQL).pl()
    lived = cur.sql(lifetimes_sql(first, after, heartbeat_seconds)).pl()
    frames = (cost, usage, reconciled, lived)
    return {
        kind: _framed(frame, month, schema)
        for frame, (kind, (schema, _)) in zip(frames, KINDS.items(), strict=True)
    }


def write_hours(
    cur: duckdb.DuckDBPyConnection, month: str, frames: Mapping[str, pl.DataFrame]
) -> None:
    """Keep ``frames`` (``hour_frames``) as ``month``'s hours, on ``cur``: the closing
    transaction, so a month is never closed without them."""
    for kind, (_, table) in KINDS.items():
        cur.register("_hour_rows", frames[kind].to_arrow())
        try:
            cur.execute(f"INSERT INTO {table} BY NAME SELECT * FROM _hour_rows")
        finally:
            cur.unregister("_hour_rows")
    cur.execute("INSERT INTO closed_hour_months VALUES (?)", [month])
