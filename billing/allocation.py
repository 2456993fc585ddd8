"""Cost allocation: who pays for each GPU-minute.

The unit of allocation is the *instance*: one running engine of a replica group (a pod; a
fixed replica is the one instance of its own group). The rollups carry each record's instance
(``coalesce(instance, replica)``), so every instance's minutes are costed and shared on their
own: with three pods serving one group, sixty in-flight seconds on one pod make that pod's
minute busy, not all three.

The fleet's cost is measured, not assumed: an instance's cost in a one-minute slot is the GPU
time its GPUs were seen for, at the price book's USD per GPU-hour, plus the energy they drew, at
USD per kWh times the data centre's PUE. That cost is split among teams by one of three rules:

``in_flight`` (default)
    At each moment the instance's GPU time is shared equally by the requests in flight on it,
    so ten requests sharing a batch each pay a tenth. Resolution is the one-minute slot: a
    team's share of a slot is its in-flight seconds divided by ``max(60, all in-flight
    seconds)`` on that instance. When fewer than 60 in-flight seconds fall in a slot, the
    uncovered part of the minute is idle capacity; a request alone on an instance pays exactly
    the time it held it.
``tokens``
    The instance's busy cost in the month is split by weighted tokens
    (``prompt_weight * (prompt - cached) + cached_prompt_weight * cached
    + completion_weight * completion``).
``requests``
    The instance's busy cost in the month is split by request count.

Idle capacity (a slot, or the part of it, with nothing in flight) follows the ``idle_policy``
of the instance's replica group: ``spread`` over the teams in proportion to what they paid on
that instance that month (on its group, when nobody used the instance itself), ``platform``
to the platform account, ``owner`` to the team that owns a dedicated group. GPUs that no
instance runs on are the platform's, as model ``(unallocated)``.

Where an instance's lifetime is known (``billing.lifetimes``: it announced itself), its GPU
time counts only within the minutes of its lifetime; GPU time seen for it outside them (after
its first start) is unallocated capacity, the platform's, and usage outside them pays nothing.
An instance that never announced itself (a fixed replica) is allocated over every minute it was
seen, as before, and so is any instance's time before its first announcement.

A GPU model seen by the collector with no price in the price book cannot be costed, and guessing
a price would be wrong, but one unknown board must not stop a whole month's chargeback either.
Its time is left out of the fleet cost and shown as an error line: the platform account, zero
cost, its GPU-hours and kWh, and model ``(error) no price for GPU model <name> in
prices.usd_per_gpu_hour`` saying what to fix. Adding the price later turns the line into costs
(as adjustments once the month is closed).

The work is split the way the data is shaped. The per-slot arithmetic runs over millions of
rollup rows, so it is SQL, built here by pure functions (``allocation_sql``) and run by whoever
holds a DuckDB connection. What comes back is a few rows per instance and team, measured in
floats; ``billing.charges`` turns each instance's cost into integer micro-cents once and splits
it exactly among the teams, the unattributed tokens and the idle capacity, so the lines add up
to the fleet's cost by construction (``lines_from`` sums them per team and model).
``billing.frames.allocate`` runs the whole thing over two frames in a scratch DuckDB, for tests
and small jobs.
``docs/billing.md`` works one example by hand; ``tests/billing`` checks it, and with hypothesis
that every split adds up to the fleet cost.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

import duckdb
import polars as pl

from billing import hourly
from billing.charges import CASH, ERROR_PREFIX, UNALLOCATED, Charges, Policy, charge
from billing.hourly import HOUR_SLOTS, HourRows
from billing.pricebook import (
    Commitment,
    PriceBook,
    commitments,
    compute_usd_sql,
    energy_usd_sql,
    pool_name_sql,
    priced_sql,
)
from billing.rounding import microcents

__all__ = [
    "ERROR_PREFIX",
    "LINE_COLUMNS",
    "LINE_TYPES",
    "MONEY",
    "UNALLOCATED",
    "UNUSED_COMMITMENT",
    "Allocation",
    "AllocationSql",
    "IdleClaims",
    "Keyed",
    "Policy",
    "allocation_sql",
    "by_instance",
    "hours_sql",
    "lines_from",
    "pool_use",
    "priced_sql_of",
    "run",
    "run_all",
    "unpriced_model",
    "unused_commitment_model",
]

COUNTS: Final = ("requests", "prompt_tokens", "completion_tokens")
# The model column of a node pool's commitment paid for and not used starts with this.
UNUSED_COMMITMENT: Final = "(unused commitment)"
# A statement line before rounding: counts, quantities, and its money in integer micro-cents.
LINE_COLUMNS: Final = ("team", "model", *COUNTS, "gpu_hours", "energy_kwh", *CASH)
LINE_TYPES: Final = {
    "team": pl.String,
    "model": pl.String,
    **dict.fromkeys(COUNTS, pl.Int64),
    "gpu_hours": pl.Float64,
    "energy_kwh": pl.Float64,
    **dict.fromkeys(CASH, pl.Int64),
}
# What the SQL measures per slot, instance and team, in floats: quantities and USD.
MONEY: Final = ("gpu_hours", "energy_kwh", "compute_usd", "energy_usd")


@dataclass(frozen=True, slots=True)
class AllocationSql:
    """The queries of one allocation, each over the relations named when it was built.

    ``hours``: statements building the hourly cost rows into temp tables (``billing.hourly``)
    when they are not the ledger's own, else "". ``unpriced``: GPU models seen without a price,
    with their GPU-hours and kWh. ``prepare``: creates temp tables ``_rates`` (each node's
    price in each hour, ``billing.pricebook``) and ``_slots`` (per replica group, instance and
    hour: cost, quantities and their busy parts, idle cost, pool), which the next two read.
    ``instances``: per instance (and its group), its cost (compute, energy), GPU-hours, kWh and
    the minute of its highest cost. ``shares``: per instance, team and model, what it used of
    the instance's cost and its GPU-hours and kWh (with the in-flight split, also the counts).
    ``counts``: requests and tokens per team and model, or "" when ``shares`` carries them.
    ``instance_counts``: the same per instance too, or "". ``pools``: per node pool and the
    first minute of its rate in effect, the GPU-hours, kWh and cost measured. ``period``:
    [start, end) of the allocation in epoch seconds, when known (commitments are paid for over
    it). The fleet's cost is the instances' costs summed (``billing.charges``) plus unused
    commitments, read in the same pass as everything it is split into.
    """

    hours: str
    unpriced: str
    prepare: str
    instances: str
    shares: str
    counts: str
    instance_counts: str
    pools: str = ""
    period: tuple[float, float] | None = None


@dataclass(frozen=True, slots=True)
class Keyed:
    """Relations with allocation's integer-keyed rollups (``billing.schema``'s ``alloc_*``).

    ``slots``: key, unit, slot, inflight_seconds (``alloc_slots`` rows); ``keys``: key, unit,
    replica, instance, team, model (``alloc_keys``); ``hours``: key, hour, requests,
    prompt_tokens, completion_tokens, cached_prompt_tokens (``alloc_hours``). Relation names or
    parenthesised subqueries, limited to the slots and hours allocated.
    """

    slots: str
    keys: str
    hours: str


# What ``allocation_sql`` reads when it is given no keyed rollups: the same relations, numbered
# from the usage rows themselves by ``hours``.
_KEYED_FROM_USAGE: Final = Keyed("_alloc_slots", "_alloc_keys", "_alloc_hours")
# Where ``allocation_sql`` leaves the hourly rows it builds.
_HOURS_FROM_USAGE: Final = HourRows("_cost_hours", "_share_hours", "_alloc_keys", "_alloc_hours")


def _keyed_from(usage: str) -> str:
    """SQL making ``_KEYED_FROM_USAGE``'s temp tables from ``usage`` (usage_slots rows)."""
    k = ("replica", "instance", "team", "model")
    return f"""
CREATE OR REPLACE TEMP TABLE _alloc_keys AS
SELECT row_number() OVER (ORDER BY {", ".join(k)}) AS "key",
    dense_rank() OVER (ORDER BY replica, instance)::INTEGER AS unit, {", ".join(k)}
FROM (SELECT DISTINCT {", ".join(k)} FROM {usage});
CREATE OR REPLACE TEMP TABLE _alloc_slots AS
SELECT k."key", k.unit, u.slot, u.inflight_seconds
FROM {usage} u JOIN _alloc_keys k USING ({", ".join(k)});
CREATE OR REPLACE TEMP TABLE _alloc_hours AS
SELECT k."key", u.slot // {HOUR_SLOTS} AS hour, {_COUNT_SUMS},
    sum(u.cached_prompt_tokens)::BIGINT AS cached_prompt_tokens
FROM {usage} u JOIN _alloc_keys k USING ({", ".join(k)}) GROUP BY ALL;
"""


def _token_weight(policy: Policy) -> str:
    """SQL of the ``tokens`` rule's weight over ``alloc_hours`` rows.

    A prompt token vLLM served from its prefix cache weighs ``cached_prompt_weight``, the rest
    of the prompt ``prompt_weight``: a team whose prompts hit the cache used less of the engine.
    """
    prompt = float(policy.prompt_weight)
    cached = prompt if policy.cached_prompt_weight is None else float(policy.cached_prompt_weight)
    return (
        f"sum((prompt_tokens - cached_prompt_tokens) * {prompt!r} + cached_prompt_tokens * {cached!r}"
        f" + completion_tokens * {float(policy.completion_weight)!r})"
    )


_COUNT_SUMS: Final = (
    "sum(requests)::BIGINT AS requests, sum(prompt_tokens)::BIGINT AS prompt_tokens, "
    "sum(completion_tokens)::BIGINT AS completion_tokens"
)


def hours_sql(
    usage: str,
    gpus: str,
    occupancy: str | None = None,
    lifetimes: str | None = None,
    keyed: Keyed | None = None,
    slot_range: tuple[int, int] | None = None,
    into: HourRows = _HOURS_FROM_USAGE,
) -> str:
    """SQL building the hourly cost rows of ``usage`` and ``gpus`` into ``into``'s temp tables.

    ``usage``, ``gpus`` and ``occupancy`` (replica_slots rows) are relation names or
    parenthesised subqueries with the rollup tables' columns; without ``occupancy`` it is
    summed from ``usage``. ``lifetimes`` (instance, replica, first_slot, last_slot): the known
    lifetimes of instances, in whole slots. ``keyed``: ``usage`` as the ledger keeps it (integer
    keys); without it, ``usage`` is numbered here into ``_alloc_*`` temp tables.
    """
    numbering = _keyed_from(usage) if keyed is None else ""
    keyed = _KEYED_FROM_USAGE if keyed is None else keyed
    occupied = (
        f"(SELECT replica, instance, slot, inflight_seconds AS occupied FROM {occupancy})"
        if occupancy
        else f"(SELECT replica, instance, slot, sum(inflight_seconds) AS occupied FROM {usage} GROUP BY ALL)"
    )
    units = f"(SELECT DISTINCT unit, replica, instance FROM {keyed.keys})"
    return f"""{numbering}
{hourly.minutes_sql(gpus, occupied, units, lifetimes, slot_range)};
CREATE OR REPLACE TEMP TABLE {into.costs} AS {hourly.cost_rows_sql()};
CREATE OR REPLACE TEMP TABLE {into.shares} AS {hourly.share_rows_sql(keyed.slots, slot_range)};
"""


def _rates_sql(book: PriceBook, costs: str) -> str:
    """Each (node, GPU model, hour) of ``costs`` priced by ``book`` (``billing.pricebook``).

    Priced at the hour's first minute: rates change on whole hours, so that is every minute's.
    """
    distinct = f"(SELECT DISTINCT node, gpu_model, hour * {HOUR_SLOTS} AS slot FROM {costs})"
    return f"(SELECT p.* EXCLUDE (slot), p.slot // {HOUR_SLOTS} AS hour FROM {priced_sql(book, distinct)} p)"


def _priced_sums(alias: str, prefix: str = "") -> str:
    """``MONEY`` sums of ``alias``'s GPU-seconds and joules (named ``prefix``-ed) at ``r``'s rates."""
    gs, ej = f"{alias}.{prefix}gpu_seconds", f"{alias}.{prefix}energy_joules"
    return (
        f"sum({gs}) / 3600.0 AS {prefix}gpu_hours, sum({ej}) / 3.6e6 AS {prefix}energy_kwh, "
        f"sum({compute_usd_sql(gs, 'r.usd')}) AS {prefix}compute_usd, "
        f"sum({energy_usd_sql(ej, 'r.kwh_usd')}) AS {prefix}energy_usd"
    )


def priced_sql_of(
    policy: Policy, rows: HourRows, hours: str = "", period: tuple[float, float] | None = None
) -> AllocationSql:
    """The queries pricing and splitting ``rows`` (hourly cost rows) by ``policy``.

    ``hours``: statements that build ``rows`` first, or "" when they exist. ``period``: the
    [start, end) the allocation covers, for commitments. Pure: nothing is run here.
    """
    book = policy.prices
    rates = _rates_sql(book, rows.costs)
    minute_usd = (
        f"{compute_usd_sql('c.gpu_seconds', 'r.usd')} + "
        f"{energy_usd_sql('c.energy_joules', 'r.kwh_usd')}"
    )
    prepare = f"""
CREATE OR REPLACE TEMP TABLE _rates AS SELECT * FROM {rates};
CREATE OR REPLACE TEMP TABLE _slots AS
SELECT c.replica, c.instance, c.hour, {_priced_sums("c")}, {_priced_sums("c", "busy_")},
    arg_max(c.peak_slot, {minute_usd}) AS peak_slot,
    -- An instance's GPUs are on one node, so one pool and rate in an hour: any row's.
    any_value(r.pool) AS pool, any_value(r.category) AS category, any_value(r.sku) AS sku,
    any_value(c.gpu_model) AS gpu_model
FROM {rows.costs} c JOIN _rates r USING (hour, node, gpu_model) WHERE r.usd IS NOT NULL
GROUP BY c.replica, c.instance, c.hour"""
    busy_money = ", ".join(f"sum(busy_{c}) AS {c}" for c in MONEY)
    # Per key, its requests and tokens: every key with usage in the range has an hour row.
    key_counts = f'(SELECT "key", {_COUNT_SUMS} FROM {rows.counts} GROUP BY "key")'
    if policy.allocation == "in_flight":
        shares = f"""
SELECT k.replica, k.instance, k.team, k.model,
    {", ".join(f"coalesce(x.{c}, 0.0) AS {c}" for c in MONEY)},
    {", ".join(f"n.{c}::BIGINT AS {c}" for c in COUNTS)}
FROM {key_counts} n JOIN {rows.keys} k USING ("key")
LEFT JOIN (SELECT s."key", {_priced_sums("s")}
      FROM {rows.shares} s JOIN _rates r USING (hour, node, gpu_model)
      WHERE r.usd IS NOT NULL GROUP BY s."key") x USING ("key")"""
    else:
        weight = _token_weight(policy) if policy.allocation == "tokens" else "sum(requests)::DOUBLE"
        share_cols = ", ".join(
            f"t.{c} * w.w / sum(w.w) OVER (PARTITION BY w.replica, w.instance) AS {c}"
            for c in MONEY
        )
        shares = f"""
WITH weights AS (SELECT replica, instance, team, model, {weight} AS w
    FROM {rows.counts} JOIN {rows.keys} USING ("key")
    GROUP BY replica, instance, team, model HAVING {weight} > 0),
totals AS (SELECT replica, instance, {busy_money} FROM _slots GROUP BY replica, instance)
SELECT w.replica, w.instance, w.team, w.model, {share_cols}
FROM weights w JOIN totals t USING (replica, instance)"""
    instances = f"""
SELECT replica, instance, sum(compute_usd) AS compute_usd, sum(energy_usd) AS energy_usd,
    sum(gpu_hours) AS gpu_hours, sum(energy_kwh) AS energy_kwh,
    arg_max(peak_slot, compute_usd + energy_usd) AS peak_slot,
    {pool_name_sql("arg_max(pool, gpu_hours)", "arg_max(gpu_model, gpu_hours)")} AS pool,
    arg_max(category, gpu_hours) AS pricing_category,
    arg_max(sku, gpu_hours) AS sku
FROM _slots GROUP BY replica, instance"""
    priced = f"{rows.costs} c JOIN {rates} r USING (hour, node, gpu_model)"
    counts_by = f'FROM {rows.counts} JOIN {rows.keys} USING ("key")'
    return AllocationSql(
        hours=hours,
        unpriced=f"""SELECT c.gpu_model, sum(c.gpu_seconds) / 3600.0 AS gpu_hours, sum(c.energy_joules) / 3.6e6 AS energy_kwh
FROM {priced} WHERE r.usd IS NULL GROUP BY c.gpu_model ORDER BY c.gpu_model""",
        pools=f"""SELECT {pool_name_sql("r.pool", "c.gpu_model")} AS pool, r.rate_slot, {_priced_sums("c")}
FROM {priced} WHERE r.usd IS NOT NULL GROUP BY ALL ORDER BY pool, rate_slot""",
        period=period,
        prepare=prepare,
        instances=instances,
        shares=shares,
        counts=""
        if policy.allocation == "in_flight"
        else f"SELECT team, model, {_COUNT_SUMS} {counts_by} GROUP BY team, model",
        instance_counts=""
        if policy.allocation == "in_flight"
        else f"SELECT replica, instance, team, model, {_COUNT_SUMS} {counts_by} GROUP BY ALL",
    )


def allocation_sql(
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

    Builds the hourly cost rows of the relations given (``hours_sql``, same arguments) and
    prices them (``priced_sql_of``): the path of frames and tests, the same arithmetic the
    ledger keeps per hour. ``period``: the [start, end) the allocation covers, for commitments.
    Pure: nothing is run here.
    """
    hours = hours_sql(usage, gpus, occupancy, lifetimes, keyed, slot_range)
    rows = _HOURS_FROM_USAGE
    if keyed is not None:
        rows = HourRows(rows.costs, rows.shares, keyed.keys, keyed.hours)
    return priced_sql_of(policy, rows, hours, period)


def lines_from(charges: Charges, counts: pl.DataFrame) -> pl.DataFrame:
    """The statement's lines from ``charges``: one row per team and model, in ``LINE_COLUMNS``.

    ``counts``: requests and tokens per team and model. Money stays in micro-cents;
    ``billing.statement.cents_lines`` turns it into cents.
    """
    return _summed(charges.rows, counts, ["team", "model"]).select(LINE_COLUMNS)


def _summed(rows: pl.DataFrame, counts: pl.DataFrame, keys: list[str]) -> pl.DataFrame:
    """``rows`` (``billing.charges.CHARGE_SCHEMA``) summed per ``keys``, with ``counts`` joined.

    A charge row's tokens are an unattributed line's, added to the counts of its key.
    """
    quantities = ("gpu_hours", "energy_kwh")
    money = rows.group_by(keys).agg(
        pl.col("prompt_tokens", "completion_tokens").sum().name.suffix("_charged"),
        pl.col(*quantities, *CASH).sum(),
    )
    counted = counts.group_by(keys).agg(pl.col(*COUNTS).sum())
    lines = money.join(counted, on=keys, how="full", coalesce=True).with_columns(
        pl.col("requests").fill_null(0).cast(pl.Int64),
        *(
            (pl.col(c).fill_null(0) + pl.col(f"{c}_charged").fill_null(0)).cast(pl.Int64).alias(c)
            for c in ("prompt_tokens", "completion_tokens")
        ),
        # Float sums may differ in their last bits with the order rows arrive in; rounding far
        # below anything shown makes the same usage give the same lines.
        pl.col(*quantities).fill_null(0.0).round(10),
        pl.col(*CASH).fill_null(0).cast(pl.Int64),
    )
    return lines.sort(keys)


def unpriced_model(gpu_model: str) -> str:
    """The model column of the error line for ``gpu_model``'s unpriced time: the reason."""
    return f"{ERROR_PREFIX}no price for GPU model {gpu_model} in prices.usd_per_gpu_hour"


def unpriced_lines(unpriced: pl.DataFrame, policy: Policy) -> pl.DataFrame:
    """Error lines for ``unpriced`` (gpu_model, gpu_hours, energy_kwh): the platform's, at zero cost."""
    return unpriced.select(
        pl.lit(policy.platform_account).alias("team"),
        pl.format(unpriced_model("{}"), "gpu_model").alias("model"),
        *(pl.lit(0, dtype=pl.Int64).alias(c) for c in COUNTS),
        *(pl.col(c).cast(pl.Float64).round(10) for c in ("gpu_hours", "energy_kwh")),
        *(pl.lit(0, dtype=pl.Int64).alias(c) for c in CASH),
    )


# Called by ``run`` once ``_slots`` exists: the lines that take their money out of instances'
# idle capacity (``billing.charges.charge``'s claims, from ``billing.reconciliation``), and
# lines of tokens only (no money) that the statement adds to the teams' own lines.
IdleClaims = Callable[[duckdb.DuckDBPyConnection], tuple[pl.DataFrame, pl.DataFrame]]


def _measured(
    con: duckdb.DuckDBPyConnection, queries: AllocationSql
) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Run ``prepare`` and read the instances and the shares (with the in-flight split, the
    shares carry the counts too: ``_counted`` takes them off)."""
    con.execute(queries.prepare)
    shares: pl.DataFrame = con.sql(queries.shares).pl()
    shares = shares.with_columns(pl.col(c).cast(pl.Float64) for c in MONEY)
    return con.sql(queries.instances).pl(), shares


def _counted(
    con: duckdb.DuckDBPyConnection,
    queries: AllocationSql,
    shares: pl.DataFrame,
    instance_counts: bool,
) -> tuple[pl.DataFrame, pl.DataFrame]:
    """``shares`` without counts, and the counts: per instance with ``instance_counts``, else
    per team and model. Read after ``_measured``, from the tables its ``prepare`` made."""
    keys = ["team", "model", "replica", "instance"] if instance_counts else ["team", "model"]
    query = queries.instance_counts if instance_counts else queries.counts
    if query:
        counts: pl.DataFrame = con.sql(query).pl()
        return shares, counts
    # The in-flight split's shares carry them.
    return shares.drop(COUNTS, strict=False), shares.select(*keys, *COUNTS)


@dataclass(frozen=True, slots=True)
class Allocation:
    """One allocation's result: the lines, the fleet's cost, and what each pool measured.

    ``lines``: ``LINE_COLUMNS`` rows, money in micro-cents, adding up to ``fleet_microcents``
    exactly. ``pools``: the ``pools`` query's rows (per pool and rate: GPU-hours, kWh, compute
    and energy USD). ``commitments``: the committed rates in the period, with what ran.
    ``reconciled``: the reconciliation its claims were priced from, when it had any
    (``billing.reconciliation_hours.Claims``). ``instances``: the lines per instance
    (``by_instance``'s rows), when asked for with the lines: read from the same run, so the
    exports split the lines by the very allocation that made them.
    """

    lines: pl.DataFrame
    fleet_microcents: int
    pools: pl.DataFrame
    commitments: list[Commitment]
    reconciled: pl.DataFrame | None = None
    instances: pl.DataFrame | None = None


def unused_commitment_model(pool: str) -> str:
    """The model column of the line of ``pool``'s commitment paid for and not used."""
    return f"{UNUSED_COMMITMENT} {pool}"


def _commitment_lines(held: Sequence[Commitment], policy: Policy) -> tuple[pl.DataFrame, int]:
    """The unused commitments as the platform's lines (idle money, no GPU-hours), and their sum."""
    rows = [
        {
            "team": policy.platform_account,
            "model": unused_commitment_model(c.pool),
            **dict.fromkeys(COUNTS, 0),
            "gpu_hours": 0.0,
            "energy_kwh": 0.0,
            "compute_microcents": 0,
            "energy_microcents": 0,
            "idle_microcents": microcents(c.unused_usd),
        }
        for c in held
        if microcents(c.unused_usd) > 0
    ]
    merged = pl.DataFrame(rows, schema=LINE_TYPES) if rows else pl.DataFrame(schema=LINE_TYPES)
    if merged.height:
        merged = merged.group_by("team", "model").agg(pl.col(c).sum() for c in LINE_COLUMNS[2:])
    return merged.select(LINE_COLUMNS), int(merged["idle_microcents"].sum()) if merged.height else 0


def _built(con: duckdb.DuckDBPyConnection, queries: AllocationSql) -> None:
    """Build ``queries``' hourly rows on ``con`` when they are its own (not the ledger's)."""
    if queries.hours:
        con.execute(queries.hours)


def pool_use(
    con: duckdb.DuckDBPyConnection, queries: AllocationSql, policy: Policy
) -> tuple[pl.DataFrame, list[Commitment]]:
    """The ``pools`` query's rows and the period's commitments with the GPU-hours run under them."""
    if not queries.pools:
        return pl.DataFrame(), []
    _built(con, queries)
    use: pl.DataFrame = con.sql(queries.pools).pl()
    if queries.period is None:
        return use, []
    ran = {
        (str(pool), int(slot)): float(hours)
        for pool, slot, hours in use.select("pool", "rate_slot", "gpu_hours").iter_rows()
        if slot is not None
    }
    return use, commitments(policy.prices, *queries.period, ran)


def run_all(
    con: duckdb.DuckDBPyConnection,
    queries: AllocationSql,
    policy: Policy,
    claims: IdleClaims | None = None,
    split_by_instance: bool = False,
) -> Allocation:
    """Run ``queries`` on ``con``: the lines, the fleet cost in micro-cents, and the pools.

    The lines' money adds up to the fleet cost exactly (``billing.charges``); error lines
    (unpriced GPU models, instances whose cost is out of range) carry none. ``claims``, when
    given, takes its lines out of the idle capacity before idle is charged. Commitments paid for
    and not used are the platform's lines, in the fleet's cost. With ``split_by_instance``, the
    result carries ``by_instance``'s rows too, from the same run (the exports need both, and a
    second run would cost the month's queries again). Every query reads ``con`` as it is: on a
    ledger that is being written, run it in one transaction (``billing.ledger.Ledger.snapshot``)
    so that all of them read the same state.
    """
    _built(con, queries)
    unpriced = con.sql(queries.unpriced).pl()
    use, held = pool_use(con, queries, policy)
    instances, measured = _measured(con, queries)
    shares, counts = _counted(con, queries, measured, instance_counts=False)
    split = None
    if split_by_instance:
        split = _split(instances, *_counted(con, queries, measured, instance_counts=True), policy)
    claimed = tails = None
    if claims is not None:
        claimed, tails = claims(con)
    charges = charge(instances, shares, policy, claimed)
    parts = [lines_from(charges, counts)]
    if tails is not None and tails.height:
        parts.append(tails.select(LINE_COLUMNS))
    if charges.errors:
        parts.append(pl.DataFrame(charges.errors).select(LINE_COLUMNS))
    if unpriced.height:
        parts.append(unpriced_lines(unpriced, policy))
    unused, unused_microcents = _commitment_lines(held, policy)
    if unused.height:
        parts.append(unused)
    lines = pl.concat([p.cast(LINE_TYPES) for p in parts]).sort("team", "model")  # type: ignore[arg-type]
    fleet = charges.fleet_microcents + unused_microcents
    return Allocation(lines, fleet, use, held, instances=split)


def run(
    con: duckdb.DuckDBPyConnection,
    queries: AllocationSql,
    policy: Policy,
    claims: IdleClaims | None = None,
) -> tuple[pl.DataFrame, int]:
    """``run_all``'s lines and fleet cost (micro-cents)."""
    result = run_all(con, queries, policy, claims)
    return result.lines, result.fleet_microcents


def by_instance(
    con: duckdb.DuckDBPyConnection, queries: AllocationSql, policy: Policy
) -> pl.DataFrame:
    """What each line is made of: its money (micro-cents) and quantities per instance.

    Columns: team, model, replica (group), instance, then ``LINE_COLUMNS``' numbers, then the
    instance's node pool, pricing category and SKU (those of most of its GPU-hours); the rows
    of one (team, model) add up to its line (but for error lines, which have none). The
    exports split lines by these (``billing.statement.instance_lines``).
    """
    _built(con, queries)
    instances, measured = _measured(con, queries)
    return _split(instances, *_counted(con, queries, measured, instance_counts=True), policy)


def _split(
    instances: pl.DataFrame, shares: pl.DataFrame, counts: pl.DataFrame, policy: Policy
) -> pl.DataFrame:
    """``by_instance``'s rows from what one run measured (counts per instance).

    Charged without the idle claims of reconciliation: the rows are the weights the exports
    split each team's line by, as the instances' own use made it.
    """
    charges = charge(instances, shares, policy)
    keys = ["team", "model", "replica", "instance"]
    rows = _summed(charges.rows, counts, keys).select(*keys, *LINE_COLUMNS[2:])
    where = instances.select("replica", "instance", "pool", "pricing_category", "sku")
    return rows.join(where, on=["replica", "instance"], how="left")
