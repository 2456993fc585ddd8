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
``allocate`` runs the whole thing over two frames in an in-memory DuckDB, for tests and small
jobs.
``docs/billing.md`` works one example by hand; ``tests/billing`` checks it, and with hypothesis
that every split adds up to the fleet cost.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

import duckdb
import polars as pl

from billing.charges import CASH, ERROR_PREFIX, UNALLOCATED, Charges, Policy, charge
from billing.pricebook import Commitment, commitments, pool_name_sql, priced_sql
from billing.rounding import microcents
from billing.schema import HOUR_SECONDS, SLOT_SECONDS

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
    "allocate",
    "allocation_sql",
    "by_instance",
    "lines_from",
    "pool_use",
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

    ``unpriced``: GPU models seen without a price, with their GPU-hours and kWh. ``prepare``:
    creates temp table ``_slots`` (cost and occupancy per replica group, instance and slot),
    which the next two read, so the big join is done once. ``instances``: per instance (and its
    group), its cost (compute, energy), GPU-hours, kWh and the slot of its highest cost.
    ``shares``: per instance, team and model, what it used of the instance's cost and its
    GPU-hours and kWh (with the in-flight split, also the counts). ``counts``: requests and
    tokens per team and model, or "" when ``shares`` carries them. ``instance_counts``: the
    same per instance too, or "". ``pools``: per node pool and the first minute of its rate in
    effect (``billing.pricebook``), the GPU-hours, kWh and cost measured. ``period``: [start,
    end) of the allocation in epoch seconds, when known (commitments are paid for over it).
    The fleet's cost is the instances' costs summed (``billing.charges``) plus unused
    commitments, read in the same pass as everything it is split into.
    """

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
# from the usage rows themselves by ``prepare``.
_KEYED_FROM_USAGE: Final = Keyed("_alloc_slots", "_alloc_keys", "_alloc_hours")


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
SELECT k."key", u.slot // {HOUR_SECONDS // SLOT_SECONDS} AS hour, {_COUNT_SUMS},
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


def _dense(unit: str, slot: str, slot_range: tuple[int, int] | None) -> str:
    """SQL numbering (``unit``, ``slot``) densely from 0 over ``slot_range``; NULL without one."""
    if slot_range is None:
        return "NULL::BIGINT"
    first, after = slot_range
    return f"({unit} - 1)::BIGINT * {after - first} + ({slot} - {first})"


_COUNT_SUMS: Final = (
    "sum(requests)::BIGINT AS requests, sum(prompt_tokens)::BIGINT AS prompt_tokens, "
    "sum(completion_tokens)::BIGINT AS completion_tokens"
)


def _alive(gpus: str, lifetimes: str | None) -> str:
    """``gpus`` with the time outside a known lifetime moved to replica and instance ''.

    ``lifetimes``: (instance, replica, first_slot, last_slot) rows. Time before an instance's
    first lifetime is not judged: a fixed replica whose sidecar starts announcing itself has
    months of GPU time from before, which stay its own. A GPU row that names no replica group
    takes its instance's group from its lifetime.
    """
    if lifetimes is None:
        return gpus
    inside = f"""EXISTS (SELECT 1 FROM {lifetimes} w
        WHERE w.instance = g.instance AND g.slot BETWEEN w.first_slot AND w.last_slot)"""
    alive = f"(k.instance IS NULL OR g.slot < k.first_slot OR {inside})"
    return f"""(SELECT g.* REPLACE (
        CASE WHEN {alive} THEN coalesce(nullif(g.replica, ''), k.replica, '') ELSE '' END AS replica,
        CASE WHEN {alive} THEN g.instance ELSE '' END AS instance)
    FROM {gpus} g LEFT JOIN (SELECT instance, min(replica) AS replica, min(first_slot) AS first_slot
        FROM {lifetimes} GROUP BY instance) k
        ON g.instance = k.instance)"""


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
    numbering = _keyed_from(usage) if keyed is None else ""
    keyed = _KEYED_FROM_USAGE if keyed is None else keyed
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
    FROM {priced_sql(book, _alive(gpus, lifetimes), gpus)} g WHERE g.usd IS NOT NULL
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
    {_dense("unit", "slot", slot_range)} AS i
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
            f"s.i = {_dense('u.unit', 'u.slot', slot_range)}"
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
    con: duckdb.DuckDBPyConnection, queries: AllocationSql, instance_counts: bool
) -> tuple[pl.DataFrame, pl.DataFrame, pl.DataFrame]:
    """Run ``prepare`` and read the instances, the shares and the counts (per instance with
    ``instance_counts``, else per team and model)."""
    con.execute(queries.prepare)
    shares: pl.DataFrame = con.sql(queries.shares).pl()
    shares = shares.with_columns(pl.col(c).cast(pl.Float64) for c in MONEY)
    keys = ["team", "model", "replica", "instance"] if instance_counts else ["team", "model"]
    query = queries.instance_counts if instance_counts else queries.counts
    if query:
        counts: pl.DataFrame = con.sql(query).pl()
    else:  # the in-flight split's shares carry them
        counts = shares.select(*keys, *COUNTS)
        shares = shares.drop(COUNTS)
    return con.sql(queries.instances).pl(), shares, counts


@dataclass(frozen=True, slots=True)
class Allocation:
    """One allocation's result: the lines, the fleet's cost, and what each pool measured.

    ``lines``: ``LINE_COLUMNS`` rows, money in micro-cents, adding up to ``fleet_microcents``
    exactly. ``pools``: the ``pools`` query's rows (per pool and rate: GPU-hours, kWh, compute
    and energy USD). ``commitments``: the committed rates in the period, with what ran.
    """

    lines: pl.DataFrame
    fleet_microcents: int
    pools: pl.DataFrame
    commitments: list[Commitment]


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


def pool_use(
    con: duckdb.DuckDBPyConnection, queries: AllocationSql, policy: Policy
) -> tuple[pl.DataFrame, list[Commitment]]:
    """The ``pools`` query's rows and the period's commitments with the GPU-hours run under them."""
    if not queries.pools:
        return pl.DataFrame(), []
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
) -> Allocation:
    """Run ``queries`` on ``con``: the lines, the fleet cost in micro-cents, and the pools.

    The lines' money adds up to the fleet cost exactly (``billing.charges``); error lines
    (unpriced GPU models, instances whose cost is out of range) carry none. ``claims``, when
    given, takes its lines out of the idle capacity before idle is charged. Commitments paid for
    and not used are the platform's lines, in the fleet's cost. Every query reads ``con`` as it
    is: on a ledger that is being written, run it in one transaction
    (``billing.ledger.Ledger.snapshot``) so that all of them read the same state.
    """
    unpriced = con.sql(queries.unpriced).pl()
    use, held = pool_use(con, queries, policy)
    instances, shares, counts = _measured(con, queries, instance_counts=False)
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
    return Allocation(lines, charges.fleet_microcents + unused_microcents, use, held)


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
    instances, shares, counts = _measured(con, queries, instance_counts=True)
    charges = charge(instances, shares, policy)
    keys = ["team", "model", "replica", "instance"]
    rows = _summed(charges.rows, counts, keys).select(*keys, *LINE_COLUMNS[2:])
    where = instances.select("replica", "instance", "pool", "pricing_category", "sku")
    return rows.join(where, on=["replica", "instance"], how="left")


def _with_instance(frame: pl.DataFrame) -> pl.DataFrame:
    if "instance" not in frame.columns:
        frame = frame.with_columns(instance=pl.col("replica"))
    if "cached_prompt_tokens" in frame.columns or "prompt_tokens" not in frame.columns:
        return frame
    return frame.with_columns(cached_prompt_tokens=pl.lit(0, pl.Int64))  # no prefix cache hits


def allocate(
    usage: pl.DataFrame,
    gpus: pl.DataFrame,
    policy: Policy,
    lifetimes: pl.DataFrame | None = None,
) -> tuple[pl.DataFrame, int]:
    """Lines and fleet cost (micro-cents) for two frames with the rollup tables' columns.

    Runs in an in-memory DuckDB. Frames without an ``instance`` column are a fixed fleet's:
    each replica is its one instance. ``lifetimes`` (instance, replica, first_slot,
    last_slot), when given, bounds the instances it names.
    """
    con = duckdb.connect()
    try:
        con.register("usage_in", _with_instance(usage))
        con.register("gpus_in", _with_instance(gpus))
        lives = None
        if lifetimes is not None:
            con.register("lifetimes_in", lifetimes)
            lives = "lifetimes_in"
        return run(con, allocation_sql(policy, "usage_in", "gpus_in", None, lives), policy)
    finally:
        con.close()
