"""Today's allocation before hourly cost rows, kept as the oracle the hourly rows must equal.

This is ``billing.allocation.allocation_sql`` and ``billing.reconciliation.unattributed_sql`` as
they were when a statement priced and split every GPU-minute each time it was asked for: the
same rollups, a per-minute ``_slots``, the in-flight join over every (key, minute). The tests
in ``test_hourly_costs.py`` hold the statement read from hourly rows to this one, cent for cent.
"""

from __future__ import annotations

from typing import Final

import duckdb
import polars as pl

from billing.allocation import MONEY, AllocationSql, IdleClaims, Keyed, Policy, _token_weight
from billing.hourly import alive_sql, dense_sql
from billing.lifetimes import slot_windows_sql
from billing.pricebook import pool_name_sql, priced_sql
from billing.reconciliation import claim_rows, hours, reconcile, tail_lines
from billing.schema import HOUR_SECONDS, SLOT_SECONDS
from infermeter.months import month_bounds

_COUNT_SUMS: Final = (
    "sum(requests)::BIGINT AS requests, sum(prompt_tokens)::BIGINT AS prompt_tokens, "
    "sum(completion_tokens)::BIGINT AS completion_tokens"
)


def minute_allocation_sql(
    policy: Policy,
    usage: str,
    gpus: str,
    occupancy: str | None = None,
    lifetimes: str | None = None,
    keyed: Keyed | None = None,
    slot_range: tuple[int, int] | None = None,
    period: tuple[float, float] | None = None,
) -> AllocationSql:
    """The queries allocating ``gpus`` (gpu_slots rows) to ``usage`` (usage_slots rows).

    ``usage``, ``gpus`` and ``occupancy`` (replica_slots rows) are relation names or
    parenthesised subqueries with the rollup tables' columns; without ``occupancy`` it is
    summed from ``usage``. ``lifetimes`` (instance, replica, first_slot, last_slot): the known
    lifetimes of instances, in whole slots; without it every instance is allocated wherever it
    was seen. ``keyed``: ``usage`` as the ledger keeps it for statements (integer keys, counts
    per hour); without it, ``prepare`` numbers ``usage`` itself. Either way the usage is read
    through the keyed relations, so both give the same lines. ``slot_range``: [first, after-last)
    slot of every row, when known; the big join then matches one integer, the instance's slot
    numbered densely, which DuckDB joins several times faster than (instance, slot).
    ``period``: the [start, end) the allocation covers, for commitments. Every GPU row is priced
    by ``policy``'s price book at its node and minute (``billing.pricebook.priced_sql``). Pure:
    nothing is run here.
    """
    assert keyed is not None
    numbering = ""
    units = f"(SELECT DISTINCT unit, replica, instance FROM {keyed.keys})"
    occupied = (
        f"SELECT replica, instance, slot, inflight_seconds AS occupied FROM {occupancy}"
        if occupancy
        else f"SELECT replica, instance, slot, sum(inflight_seconds) AS occupied FROM {usage} GROUP BY replica, instance, slot"
    )
    book = policy.prices
    prepare = f"""{numbering}
CREATE OR REPLACE TEMP TABLE _slots AS
WITH costs AS (
    SELECT g.replica, g.instance, g.slot,
        sum(g.gpu_seconds) / 3600.0 AS gpu_hours,
        sum(g.energy_joules) / 3.6e6 AS energy_kwh,
        sum(g.gpu_seconds / 3600.0 * g.usd) AS compute_usd,
        sum(g.energy_joules / 3.6e6 * g.kwh_usd) AS energy_usd,
        -- An instance's GPUs are on one node, so one pool and rate in a minute: any row's.
        any_value(g.pool) AS pool, any_value(g.category) AS category, any_value(g.sku) AS sku,
        any_value(g.gpu_model) AS gpu_model
    FROM {priced_sql(book, alive_sql(gpus, lifetimes), gpus)} g WHERE g.usd IS NOT NULL
    GROUP BY g.replica, g.instance, g.slot
),
occupancy AS ({occupied}),
slots AS (
    SELECT c.*, n.unit, coalesce(o.occupied, 0.0) AS occupied,
        least(1.0, coalesce(o.occupied, 0.0) / {SLOT_SECONDS}.0) AS busy
    FROM costs c LEFT JOIN occupancy o USING (replica, instance, slot)
    LEFT JOIN {units} n USING (replica, instance)
)
-- per_* : what one in-flight second of the slot pays, so the big join only multiplies.
SELECT *, {", ".join(f"CASE WHEN occupied > 0 THEN {c} * busy / occupied ELSE 0.0 END AS per_{c}" for c in MONEY)},
    {dense_sql("unit", "slot", slot_range)} AS i
FROM slots"""
    busy_money = ", ".join(f"sum({c} * busy) AS {c}" for c in MONEY)
    # Per key, its requests and tokens: every key with usage in the range has an hour row.
    key_counts = f'(SELECT "key", {_COUNT_SUMS} FROM {keyed.hours} GROUP BY "key")'
    if policy.allocation == "in_flight":
        share_cols = ", ".join(
            f"coalesce(sum(u.inflight_seconds * s.per_{c}), 0.0) AS {c}" for c in MONEY
        )
        # The one pass over the biggest table joins and groups on integers; names come after.
        # An inner join (several times faster than an outer one here): the keys come from the
        # counts, which have a row for every key with usage in the range.
        match = (
            f"s.i = {dense_sql('u.unit', 'u.slot', slot_range)}"
            if slot_range
            else "s.unit = u.unit AND s.slot = u.slot"
        )
        shares = f"""
SELECT k.replica, k.instance, k.team, k.model,
    {", ".join(f"coalesce(x.{c}, 0.0) AS {c}" for c in MONEY)},
    {", ".join(f"n.{c}::BIGINT AS {c}" for c in ("requests", "prompt_tokens", "completion_tokens"))}
FROM {key_counts} n JOIN {keyed.keys} k USING ("key")
LEFT JOIN (SELECT u."key", {share_cols}
      FROM {keyed.slots} u JOIN _slots s ON {match}
      GROUP BY u."key") x USING ("key")"""
    else:
        weight = _token_weight(policy) if policy.allocation == "tokens" else "sum(requests)::DOUBLE"
        share_cols = ", ".join(
            f"t.{c} * w.w / sum(w.w) OVER (PARTITION BY w.replica, w.instance) AS {c}"
            for c in MONEY
        )
        shares = f"""
WITH weights AS (SELECT replica, instance, team, model, {weight} AS w
    FROM {keyed.hours} JOIN {keyed.keys} USING ("key")
    GROUP BY replica, instance, team, model HAVING {weight} > 0),
totals AS (SELECT replica, instance, {busy_money} FROM _slots GROUP BY replica, instance)
SELECT w.replica, w.instance, w.team, w.model, {share_cols}
FROM weights w JOIN totals t USING (replica, instance)"""
    instances = f"""
SELECT replica, instance, sum(compute_usd) AS compute_usd, sum(energy_usd) AS energy_usd,
    sum(gpu_hours) AS gpu_hours, sum(energy_kwh) AS energy_kwh,
    arg_max(slot, compute_usd + energy_usd) AS peak_slot,
    {pool_name_sql("arg_max(pool, gpu_hours)", "arg_max(gpu_model, gpu_hours)")} AS pool,
    arg_max(category, gpu_hours) AS pricing_category,
    arg_max(sku, gpu_hours) AS sku
FROM _slots GROUP BY replica, instance"""
    priced = priced_sql(book, gpus)
    return AllocationSql(
        hours="",
        unpriced=f"""SELECT gpu_model, sum(gpu_seconds) / 3600.0 AS gpu_hours, sum(energy_joules) / 3.6e6 AS energy_kwh
FROM {priced} WHERE usd IS NULL GROUP BY gpu_model ORDER BY gpu_model""",
        pools=f"""SELECT {pool_name_sql("pool", "gpu_model")} AS pool, rate_slot,
    sum(gpu_seconds) / 3600.0 AS gpu_hours,
    sum(energy_joules) / 3.6e6 AS energy_kwh, sum(gpu_seconds / 3600.0 * usd) AS compute_usd,
    sum(energy_joules / 3.6e6 * kwh_usd) AS energy_usd
FROM {priced} WHERE usd IS NOT NULL GROUP BY ALL ORDER BY pool, rate_slot""",
        period=period,
        prepare=prepare,
        instances=instances,
        shares=shares,
        counts=""
        if policy.allocation == "in_flight"
        else f'SELECT team, model, {_COUNT_SUMS} FROM {keyed.hours} JOIN {keyed.keys} USING ("key") GROUP BY team, model',
        instance_counts=""
        if policy.allocation == "in_flight"
        else f'SELECT replica, instance, team, model, {_COUNT_SUMS} FROM {keyed.hours} JOIN {keyed.keys} USING ("key") GROUP BY ALL',
    )


def minute_unattributed_sql(policy: Policy, reconciliation: str, slots: str = "_slots") -> str:
    """Per instance and hour: the unattributed tokens and what they cost, taken from its idle.

    ``reconciliation`` holds ``reconciliation_sql``'s rows; ``slots`` is allocation's per-instance,
    per-minute cost and occupancy (``AllocationSql.prepare``). ``claimed`` is the part of the
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
    SELECT instance, CAST(slot // 60 AS BIGINT) AS hour,
        {", ".join(f"sum({c}) AS {c}" for c in MONEY)},
        sum((compute_usd + energy_usd) * (1.0 - busy)) AS idle_usd
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


def minute_month_sql(
    cur: duckdb.DuckDBPyConnection, policy: Policy, month: str, heartbeat_seconds: float
) -> AllocationSql:
    """``month``'s minute-level allocation queries over a ledger's rollups, as the ledger built them."""
    lo, hi = month_bounds(month)
    lo, hi = int(lo // SLOT_SECONDS), int(hi // SLOT_SECONDS)
    usage = f"(SELECT * FROM usage_slots WHERE slot >= {lo} AND slot < {hi})"
    gpus = f"(SELECT * FROM gpu_slots WHERE slot >= {lo} AND slot < {hi})"
    occupancy = f"(SELECT * FROM replica_slots WHERE slot >= {lo} AND slot < {hi})"
    windows = slot_windows_sql(lo, hi, heartbeat_seconds)
    cur.execute(f"CREATE OR REPLACE TEMP TABLE _lifetimes AS SELECT * FROM {windows}")
    per_hour = HOUR_SECONDS // SLOT_SECONDS
    keyed = Keyed(
        f"(SELECT * FROM alloc_slots WHERE slot >= {lo} AND slot < {hi})",
        "alloc_keys",
        f"(SELECT * FROM alloc_hours WHERE hour >= {lo // per_hour} AND hour < {hi // per_hour})",
    )
    known = bool(cur.execute("SELECT 1 FROM _lifetimes LIMIT 1").fetchall())
    return minute_allocation_sql(
        policy,
        usage,
        gpus,
        occupancy,
        "_lifetimes" if known else None,
        keyed,
        (lo, hi),
        month_bounds(month),
    )


def minute_claims(policy: Policy, month: str) -> IdleClaims:
    """The idle claims of ``month`` priced against the per-minute ``_slots``, as they were."""

    def run(con: duckdb.DuckDBPyConnection) -> tuple[pl.DataFrame, pl.DataFrame]:
        reconcile(con, *hours(*month_bounds(month)))
        hourly = con.sql(minute_unattributed_sql(policy, "_reconciliation")).pl()
        tails = con.sql(
            "SELECT team, model, sum(prompt_tokens) AS prompt_tokens, "
            "sum(completion_tokens) AS completion_tokens FROM _hangups GROUP BY ALL"
        ).pl()
        return claim_rows(hourly, policy), tail_lines(tails)

    return run
