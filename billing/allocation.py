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
    (``prompt_weight * prompt + completion_weight * completion``).
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
holds a DuckDB connection. What comes back is a few rows per replica and team; charging idle
capacity and assembling lines is plain Polars on those (``lines_from``). ``allocate`` runs the
whole thing over two frames in an in-memory DuckDB, for tests and small jobs.
``docs/billing.md`` works one example by hand; ``tests/billing`` checks it, and with hypothesis
that every split adds up to the fleet cost.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Final, Literal

import duckdb
import polars as pl

from billing.schema import HOUR_SECONDS, SLOT_SECONDS

__all__ = [
    "ERROR_PREFIX",
    "LINE_COLUMNS",
    "UNALLOCATED",
    "AllocationSql",
    "IdleClaims",
    "Keyed",
    "Policy",
    "allocate",
    "allocation_sql",
    "by_instance",
    "lines_from",
    "unpriced_model",
]

UNALLOCATED: Final = "(unallocated)"
# The model of a line that could not be priced starts with this; the rest says why.
ERROR_PREFIX: Final = "(error) "
LINE_COLUMNS: Final = (
    "team", "model", "requests", "prompt_tokens", "completion_tokens", "gpu_hours", "energy_kwh",
    "compute_usd", "energy_usd", "idle_usd",
)  # fmt: skip
MONEY: Final = ("gpu_hours", "energy_kwh", "compute_usd", "energy_usd")

IdlePolicy = Literal["spread", "platform", "owner"]


@dataclass(frozen=True, slots=True)
class Policy:
    """Everything allocation needs besides the measurements: prices and rules."""

    usd_per_gpu_hour: Mapping[str, float]
    usd_per_kwh: float = 0.0
    pue: float = 1.0
    allocation: Literal["in_flight", "tokens", "requests"] = "in_flight"
    prompt_weight: float = 1.0
    completion_weight: float = 1.0
    platform_account: str = "platform"
    # replica group -> (idle policy, owner team); a group not listed spreads its idle capacity.
    idle: Mapping[str, tuple[IdlePolicy, str | None]] = field(default_factory=dict)
    # replica group -> model, for idle lines of instances that served nothing in the month.
    replica_model: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class AllocationSql:
    """The queries of one allocation, each over the relations named when it was built.

    ``unpriced``: GPU models seen without a price, with their GPU-hours and kWh. ``prepare``:
    creates temp table ``_slots`` (cost and occupancy per replica group, instance and slot),
    which the next two read, so the big join is done once. ``instances``: per instance (and its
    group), its busy and idle cost. ``shares``: per instance, team and model, the busy cost it
    pays and its GPU-hours and kWh (with the in-flight split, also the counts). ``counts``:
    requests and tokens per team and model, or "" when ``shares`` carries them.
    ``instance_counts``: the same per instance too, or "". ``fleet``: the fleet cost.
    """

    unpriced: str
    prepare: str
    instances: str
    shares: str
    counts: str
    instance_counts: str
    fleet: str


@dataclass(frozen=True, slots=True)
class Keyed:
    """Relations with allocation's integer-keyed rollups (``billing.schema``'s ``alloc_*``).

    ``slots``: key, unit, slot, inflight_seconds (``alloc_slots`` rows); ``keys``: key, unit,
    replica, instance, team, model (``alloc_keys``); ``hours``: key, hour, requests,
    prompt_tokens, completion_tokens (``alloc_hours``). Relation names or parenthesised
    subqueries, limited to the slots and hours allocated.
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
SELECT k."key", u.slot // {HOUR_SECONDS // SLOT_SECONDS} AS hour, {_COUNT_SUMS}
FROM {usage} u JOIN _alloc_keys k USING ({", ".join(k)}) GROUP BY ALL;
"""


def _dense(unit: str, slot: str, slot_range: tuple[int, int] | None) -> str:
    """SQL numbering (``unit``, ``slot``) densely from 0 over ``slot_range``; NULL without one."""
    if slot_range is None:
        return "NULL::BIGINT"
    first, after = slot_range
    return f"({unit} - 1)::BIGINT * {after - first} + ({slot} - {first})"


def _prices(policy: Policy) -> str:
    rows = ", ".join(
        f"({_lit(m)}, {float(p)!r})" for m, p in sorted(policy.usd_per_gpu_hour.items())
    )
    return (
        f"(VALUES {rows}) AS p(gpu_model, usd)"
        if rows
        else "(SELECT NULL::VARCHAR AS gpu_model, NULL::DOUBLE AS usd WHERE false) AS p"
    )


_COUNT_SUMS: Final = (
    "sum(requests)::BIGINT AS requests, sum(prompt_tokens)::BIGINT AS prompt_tokens, "
    "sum(completion_tokens)::BIGINT AS completion_tokens"
)


def _lit(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


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
    numbered densely, which DuckDB joins several times faster than (instance, slot). Pure:
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
    energy_price = float(policy.usd_per_kwh) * float(policy.pue)
    prepare = f"""{numbering}
CREATE OR REPLACE TEMP TABLE _slots AS
WITH costs AS (
    SELECT g.replica, g.instance, g.slot,
        sum(g.gpu_seconds) / 3600.0 AS gpu_hours,
        sum(g.energy_joules) / 3.6e6 AS energy_kwh,
        sum(g.gpu_seconds / 3600.0 * p.usd) AS compute_usd,
        sum(g.energy_joules) / 3.6e6 * {energy_price!r} AS energy_usd
    FROM {_alive(gpus, lifetimes)} g JOIN {_prices(policy)} USING (gpu_model)
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
        weight = (
            f"sum(prompt_tokens * {float(policy.prompt_weight)!r} + completion_tokens * {float(policy.completion_weight)!r})"
            if policy.allocation == "tokens"
            else "sum(requests)::DOUBLE"
        )
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
    instances = """
SELECT replica, instance,
    sum((compute_usd + energy_usd) * busy) AS busy_usd,
    sum((compute_usd + energy_usd) * (1.0 - busy)) AS idle_usd
FROM _slots GROUP BY replica, instance"""
    priced = ", ".join(_lit(m) for m in sorted(policy.usd_per_gpu_hour))
    # (NOT IN () is not SQL, and NOT IN (NULL) matches nothing: with no prices, every model.)
    unpriced_where = f"WHERE gpu_model NOT IN ({priced})" if priced else ""
    return AllocationSql(
        unpriced=f"""SELECT gpu_model, sum(gpu_seconds) / 3600.0 AS gpu_hours, sum(energy_joules) / 3.6e6 AS energy_kwh
FROM {gpus} {unpriced_where} GROUP BY gpu_model ORDER BY gpu_model""",
        prepare=prepare,
        instances=instances,
        shares=shares,
        counts=""
        if policy.allocation == "in_flight"
        else f'SELECT team, model, {_COUNT_SUMS} FROM {keyed.hours} JOIN {keyed.keys} USING ("key") GROUP BY team, model',
        instance_counts=""
        if policy.allocation == "in_flight"
        else f'SELECT replica, instance, team, model, {_COUNT_SUMS} FROM {keyed.hours} JOIN {keyed.keys} USING ("key") GROUP BY ALL',
        fleet=f"""SELECT coalesce(sum(g.gpu_seconds / 3600.0 * p.usd), 0) + coalesce(sum(g.energy_joules), 0) / 3.6e6 * {energy_price!r}
FROM {gpus} g JOIN {_prices(policy)} USING (gpu_model)""",
    )


def lines_from(
    instances: pl.DataFrame, shares: pl.DataFrame, counts: pl.DataFrame, policy: Policy
) -> pl.DataFrame:
    """The statement's lines from the small query results: idle charged, one row per team and model.

    Costs are unrounded; ``billing.statement.cents_lines`` turns them into cents.
    """
    shares = shares.with_columns(pl.col(c).cast(pl.Float64) for c in MONEY)
    idle = _idle_lines(instances, shares, policy)
    money = pl.concat(
        [shares.drop("replica", "instance"), idle.drop("replica", "instance")],
        how="diagonal_relaxed",
    )
    lines = (
        money.group_by("team", "model")
        .agg(pl.col(*MONEY, "idle_usd").fill_null(0.0).sum())
        .join(counts, on=["team", "model"], how="full", coalesce=True)
        .with_columns(
            pl.col("requests", "prompt_tokens", "completion_tokens").fill_null(0).cast(pl.Int64),
            pl.col(*MONEY, "idle_usd").fill_null(0.0),
        )
    )
    # Float sums may differ in their last bits with the order rows arrive in; rounding far
    # below a cent makes the same usage give the same lines.
    return (
        lines.select(LINE_COLUMNS)
        .with_columns(pl.col(*MONEY, "idle_usd").round(10))
        .sort("team", "model")
    )


def unpriced_model(gpu_model: str) -> str:
    """The model column of the error line for ``gpu_model``'s unpriced time: the reason."""
    return f"{ERROR_PREFIX}no price for GPU model {gpu_model} in prices.usd_per_gpu_hour"


def unpriced_lines(unpriced: pl.DataFrame, policy: Policy) -> pl.DataFrame:
    """Error lines for ``unpriced`` (gpu_model, gpu_hours, energy_kwh): the platform's, at zero cost."""
    return unpriced.select(
        pl.lit(policy.platform_account).alias("team"),
        pl.format(unpriced_model("{}"), "gpu_model").alias("model"),
        *(pl.lit(0, dtype=pl.Int64).alias(c) for c in ("requests", "prompt_tokens", "completion_tokens")),
        *(pl.col(c).cast(pl.Float64).round(10) for c in ("gpu_hours", "energy_kwh")),
        *(pl.lit(0.0).alias(c) for c in ("compute_usd", "energy_usd", "idle_usd")),
    )  # fmt: skip


_IDLE_SCHEMA: Final = {
    "team": pl.String, "model": pl.String, "idle_usd": pl.Float64, "replica": pl.String,
    "instance": pl.String,
}  # fmt: skip


def _idle_lines(instances: pl.DataFrame, shares: pl.DataFrame, policy: Policy) -> pl.DataFrame:
    """Idle capacity per instance, charged by its replica group's policy: team, model, idle_usd."""
    # Sums in one fixed order: float addition is not associative, and the statement must not
    # change (by a rounding tie) with the order the rows arrived in.
    keys = ["replica", "instance"]
    shares = shares.sort(*keys, "team", "model", "compute_usd", "energy_usd")
    paid = shares.group_by(keys).agg(paid=(pl.col("compute_usd") + pl.col("energy_usd")).sum())
    # Busy cost with no team to carry it (tokens/requests split with zero weight) is idle too.
    idle = instances.join(paid, on=keys, how="left").with_columns(
        idle_usd=pl.col("idle_usd")
        + (pl.col("busy_usd") - pl.col("paid").fill_null(0.0)).clip(lower_bound=0.0)
    )
    payers = shares.with_columns(paid=pl.col("compute_usd") + pl.col("energy_usd"))
    by_instance = dict(payers.group_by(keys))
    by_group = {k[0]: g for k, g in payers.group_by("replica")}
    empty = payers.clear()
    rows: list[dict[str, object]] = []
    for replica, instance, amount in idle.select(*keys, "idle_usd").sort(keys).iter_rows():
        if not amount:
            continue
        at = {"replica": replica, "instance": instance}
        rule, owner = policy.idle.get(replica, ("spread", None))
        model = policy.replica_model.get(replica, UNALLOCATED)
        # Nobody used this instance (one the autoscaler just added, say): its idle follows what
        # the teams paid on its group.
        mine = by_instance.get((replica, instance), empty)
        if float(mine["paid"].sum()) <= 0:
            mine = by_group.get(replica, empty)
        mine = mine.group_by("team", "model").agg(pl.col("paid").sum()).sort("team", "model")
        total = float(mine["paid"].sum())
        if replica == "":
            rows.append(
                {"team": policy.platform_account, "model": UNALLOCATED, "idle_usd": amount, **at}
            )
        elif rule == "owner" and owner:
            rows.append({"team": owner, "model": model, "idle_usd": amount, **at})
        elif rule == "spread" and total > 0:
            # The share first: amount * p can underflow when p is tiny (a request in flight for
            # a subnormal number of seconds), and the shares would no longer add up to amount.
            rows.extend(
                {"team": t, "model": m, "idle_usd": amount * (p / total), **at}
                for t, m, p in mine.select("team", "model", "paid").iter_rows()
            )
        else:
            rows.append({"team": policy.platform_account, "model": model, "idle_usd": amount, **at})
    return pl.DataFrame(rows, schema=_IDLE_SCHEMA)


# Called by ``run`` once ``_slots`` exists, with the per-replica busy and idle cost: returns them
# with part of the idle claimed by other lines (``billing.reconciliation``), and those lines.
IdleClaims = Callable[[duckdb.DuckDBPyConnection, pl.DataFrame], tuple[pl.DataFrame, pl.DataFrame]]


def run(
    con: duckdb.DuckDBPyConnection,
    queries: AllocationSql,
    policy: Policy,
    claims: IdleClaims | None = None,
) -> tuple[pl.DataFrame, float]:
    """Run ``queries`` on ``con``: the lines (error lines for unpriced GPUs) and the fleet cost.

    ``claims``, when given, takes its lines out of the idle capacity before idle is charged.
    """
    unpriced = con.sql(queries.unpriced).pl()
    fleet_rows = con.execute(queries.fleet).fetchall()
    fleet = float(fleet_rows[0][0]) if fleet_rows and fleet_rows[0][0] is not None else 0.0
    con.execute(queries.prepare)
    shares = con.sql(queries.shares).pl()
    if queries.counts:
        counts = con.sql(queries.counts).pl()
    else:
        counts = shares.group_by("team", "model").agg(
            pl.col("requests", "prompt_tokens", "completion_tokens").sum()
        )
        shares = shares.drop("requests", "prompt_tokens", "completion_tokens")
    instances = con.sql(queries.instances).pl()
    claimed = None
    if claims is not None:
        instances, claimed = claims(con, instances)
    lines = lines_from(instances, shares, counts, policy)
    if claimed is not None and claimed.height:
        lines = pl.concat([lines, claimed]).sort("team", "model")
    if unpriced.height:
        lines = pl.concat([lines, unpriced_lines(unpriced, policy)]).sort("team", "model")
    return lines, fleet


def by_instance(
    con: duckdb.DuckDBPyConnection, queries: AllocationSql, policy: Policy
) -> pl.DataFrame:
    """What each line is made of: its unrounded money and quantities per instance.

    Columns: team, model, replica (group), instance, then ``LINE_COLUMNS``' numbers; the rows
    of one (team, model) add up to its line (but for error lines, which have none). The
    exports split lines by these (``billing.statement.instance_lines``).
    """
    con.execute(queries.prepare)
    shares: pl.DataFrame = con.sql(queries.shares).pl()
    shares = shares.with_columns(pl.col(c).cast(pl.Float64) for c in MONEY)
    count_cols = ["requests", "prompt_tokens", "completion_tokens"]
    keys = ["team", "model", "replica", "instance"]
    counts: pl.DataFrame
    if queries.instance_counts:
        counts = con.sql(queries.instance_counts).pl()
    else:
        counts = shares.select(*keys, *count_cols)
        shares = shares.drop(count_cols)
    idle = _idle_lines(con.sql(queries.instances).pl(), shares, policy)
    money = pl.concat([shares, idle], how="diagonal_relaxed")
    return (
        money.group_by(keys)
        .agg(pl.col(*MONEY, "idle_usd").fill_null(0.0).sum())
        .join(
            counts.group_by(keys).agg(pl.col(count_cols).sum()), on=keys, how="full", coalesce=True
        )
        .with_columns(
            pl.col(count_cols).fill_null(0).cast(pl.Int64),
            pl.col(*MONEY, "idle_usd").fill_null(0.0),
        )
        .sort(keys)
    )


def _with_instance(frame: pl.DataFrame) -> pl.DataFrame:
    if "instance" in frame.columns:
        return frame
    return frame.with_columns(instance=pl.col("replica"))


def allocate(
    usage: pl.DataFrame,
    gpus: pl.DataFrame,
    policy: Policy,
    lifetimes: pl.DataFrame | None = None,
) -> tuple[pl.DataFrame, float]:
    """Lines and fleet cost for two frames with the rollup tables' columns (an in-memory DuckDB).

    Frames without an ``instance`` column are a fixed fleet's: each replica is its one instance.
    ``lifetimes`` (instance, replica, first_slot, last_slot), when given, bounds the instances
    it names.
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
