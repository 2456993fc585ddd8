"""Cost allocation: who pays for each GPU-minute.

The fleet's cost is measured, not assumed: a replica's cost in a one-minute slot is the GPU time
its GPUs were seen for, at the price book's USD per GPU-hour, plus the energy they drew, at USD
per kWh times the data centre's PUE. That cost is split among teams by one of three rules:

``in_flight`` (default)
    At each moment the replica's GPU time is shared equally by the requests in flight on it, so
    ten requests sharing a batch each pay a tenth. Resolution is the one-minute slot: a team's
    share of a slot is its in-flight seconds divided by ``max(60, all in-flight seconds)``.
    When fewer than 60 in-flight seconds fall in a slot, the uncovered part of the minute is
    idle capacity; a request alone on a replica pays exactly the time it held it.
``tokens``
    The replica's busy cost in the month is split by weighted tokens
    (``prompt_weight * prompt + completion_weight * completion``).
``requests``
    The replica's busy cost in the month is split by request count.

Idle capacity (a slot, or the part of it, with nothing in flight) follows the replica's
``idle_policy``: ``spread`` over the teams in proportion to what they paid on that replica
that month, ``platform`` to the platform account, ``owner`` to the team that owns a dedicated
replica. GPUs that no replica runs on are the platform's, as model ``(unallocated)``.

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

from billing.schema import SLOT_SECONDS

__all__ = [
    "ERROR_PREFIX",
    "LINE_COLUMNS",
    "UNALLOCATED",
    "AllocationSql",
    "IdleClaims",
    "Policy",
    "allocate",
    "allocation_sql",
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
    # replica -> (idle policy, owner team); a replica not listed spreads its idle capacity.
    idle: Mapping[str, tuple[IdlePolicy, str | None]] = field(default_factory=dict)
    # replica -> model, for idle lines of replicas that served nothing in the month.
    replica_model: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class AllocationSql:
    """The queries of one allocation, each over the relations named when it was built.

    ``unpriced``: GPU models seen without a price, with their GPU-hours and kWh. ``prepare``: creates temp
    table ``_slots`` (cost and occupancy per replica and slot), which the next two read, so the
    big join is done once. ``replicas``: per replica,
    its busy and idle cost. ``shares``: per replica, team and model, the busy cost it pays and
    its GPU-hours and kWh (with the in-flight split, also the counts). ``counts``: requests and
    tokens per team and model, or "" when ``shares`` carries them. ``fleet``: the fleet cost.
    """

    unpriced: str
    prepare: str
    replicas: str
    shares: str
    counts: str
    fleet: str


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


def allocation_sql(
    policy: Policy, usage: str, gpus: str, occupancy: str | None = None
) -> AllocationSql:
    """The queries allocating ``gpus`` (gpu_slots rows) to ``usage`` (usage_slots rows).

    ``usage``, ``gpus`` and ``occupancy`` (replica_slots rows) are relation names or
    parenthesised subqueries with the rollup tables' columns; without ``occupancy`` it is
    summed from ``usage``. Pure: nothing is run here.
    """
    occupied = (
        f"SELECT replica, slot, inflight_seconds AS occupied FROM {occupancy}"
        if occupancy
        else f"SELECT replica, slot, sum(inflight_seconds) AS occupied FROM {usage} GROUP BY replica, slot"
    )
    energy_price = float(policy.usd_per_kwh) * float(policy.pue)
    prepare = f"""
CREATE OR REPLACE TEMP TABLE _slots AS
WITH costs AS (
    SELECT g.replica, g.slot,
        sum(g.gpu_seconds) / 3600.0 AS gpu_hours,
        sum(g.energy_joules) / 3.6e6 AS energy_kwh,
        sum(g.gpu_seconds / 3600.0 * p.usd) AS compute_usd,
        sum(g.energy_joules) / 3.6e6 * {energy_price!r} AS energy_usd
    FROM {gpus} g JOIN {_prices(policy)} USING (gpu_model)
    GROUP BY g.replica, g.slot
),
occupancy AS ({occupied}),
slots AS (
    SELECT c.*, coalesce(o.occupied, 0.0) AS occupied,
        least(1.0, coalesce(o.occupied, 0.0) / {SLOT_SECONDS}.0) AS busy
    FROM costs c LEFT JOIN occupancy o USING (replica, slot)
)
-- per_* : what one in-flight second of the slot pays, so the big join only multiplies.
SELECT *, {", ".join(f"CASE WHEN occupied > 0 THEN {c} * busy / occupied ELSE 0.0 END AS per_{c}" for c in MONEY)}
FROM slots"""
    busy_money = ", ".join(f"sum({c} * busy) AS {c}" for c in MONEY)
    if policy.allocation == "in_flight":
        share_cols = ", ".join(
            f"coalesce(sum(u.inflight_seconds * s.per_{c}), 0.0) AS {c}" for c in MONEY
        )
        # One pass over the biggest table gives the shares and the counts together.
        shares = f"""
SELECT u.replica, u.team, u.model, {share_cols}, {_COUNT_SUMS}
FROM {usage} u LEFT JOIN _slots s USING (replica, slot)
GROUP BY u.replica, u.team, u.model"""
    else:
        weight = (
            f"sum(prompt_tokens * {float(policy.prompt_weight)!r} + completion_tokens * {float(policy.completion_weight)!r})"
            if policy.allocation == "tokens"
            else "sum(requests)::DOUBLE"
        )
        share_cols = ", ".join(
            f"t.{c} * w.w / sum(w.w) OVER (PARTITION BY w.replica) AS {c}" for c in MONEY
        )
        shares = f"""
WITH weights AS (SELECT replica, team, model, {weight} AS w FROM {usage} GROUP BY replica, team, model HAVING {weight} > 0),
totals AS (SELECT replica, {busy_money} FROM _slots GROUP BY replica)
SELECT w.replica, w.team, w.model, {share_cols}
FROM weights w JOIN totals t USING (replica)"""
    replicas = """
SELECT replica,
    sum((compute_usd + energy_usd) * busy) AS busy_usd,
    sum((compute_usd + energy_usd) * (1.0 - busy)) AS idle_usd
FROM _slots GROUP BY replica"""
    priced = ", ".join(_lit(m) for m in sorted(policy.usd_per_gpu_hour))
    # (NOT IN () is not SQL, and NOT IN (NULL) matches nothing: with no prices, every model.)
    unpriced_where = f"WHERE gpu_model NOT IN ({priced})" if priced else ""
    return AllocationSql(
        unpriced=f"""SELECT gpu_model, sum(gpu_seconds) / 3600.0 AS gpu_hours, sum(energy_joules) / 3.6e6 AS energy_kwh
FROM {gpus} {unpriced_where} GROUP BY gpu_model ORDER BY gpu_model""",
        prepare=prepare,
        replicas=replicas,
        shares=shares,
        counts=""
        if policy.allocation == "in_flight"
        else f"SELECT team, model, {_COUNT_SUMS} FROM {usage} GROUP BY team, model",
        fleet=f"""SELECT coalesce(sum(g.gpu_seconds / 3600.0 * p.usd), 0) + coalesce(sum(g.energy_joules), 0) / 3.6e6 * {energy_price!r}
FROM {gpus} g JOIN {_prices(policy)} USING (gpu_model)""",
    )


def lines_from(
    replicas: pl.DataFrame, shares: pl.DataFrame, counts: pl.DataFrame, policy: Policy
) -> pl.DataFrame:
    """The statement's lines from the small query results: idle charged, one row per team and model.

    Costs are unrounded; ``billing.statement.cents_lines`` turns them into cents.
    """
    shares = shares.with_columns(pl.col(c).cast(pl.Float64) for c in MONEY)
    idle = _idle_lines(replicas, shares, policy)
    money = pl.concat([shares.drop("replica"), idle], how="diagonal_relaxed")
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


def _idle_lines(replicas: pl.DataFrame, shares: pl.DataFrame, policy: Policy) -> pl.DataFrame:
    """Idle capacity per replica, charged by its policy: team, model, idle_usd."""
    # Sums in one fixed order: float addition is not associative, and the statement must not
    # change (by a rounding tie) with the order the rows arrived in.
    shares = shares.sort("replica", "team", "model", "compute_usd", "energy_usd")
    paid = shares.group_by("replica").agg(paid=(pl.col("compute_usd") + pl.col("energy_usd")).sum())
    # Busy cost with no team to carry it (tokens/requests split with zero weight) is idle too.
    idle = replicas.join(paid, on="replica", how="left").with_columns(
        idle_usd=pl.col("idle_usd")
        + (pl.col("busy_usd") - pl.col("paid").fill_null(0.0)).clip(lower_bound=0.0)
    )
    payers = shares.with_columns(paid=pl.col("compute_usd") + pl.col("energy_usd"))
    rows: list[dict[str, object]] = []
    for replica, amount in idle.select("replica", "idle_usd").sort("replica").iter_rows():
        if not amount:
            continue
        rule, owner = policy.idle.get(replica, ("spread", None))
        model = policy.replica_model.get(replica, UNALLOCATED)
        mine = payers.filter(pl.col("replica") == replica).sort("team", "model")
        total = float(mine["paid"].sum())
        if replica == "":
            rows.append({"team": policy.platform_account, "model": UNALLOCATED, "idle_usd": amount})
        elif rule == "owner" and owner:
            rows.append({"team": owner, "model": model, "idle_usd": amount})
        elif rule == "spread" and total > 0:
            # The share first: amount * p can underflow when p is tiny (a request in flight for
            # a subnormal number of seconds), and the shares would no longer add up to amount.
            rows.extend(
                {"team": t, "model": m, "idle_usd": amount * (p / total)}
                for t, m, p in mine.select("team", "model", "paid").iter_rows()
            )
        else:
            rows.append({"team": policy.platform_account, "model": model, "idle_usd": amount})
    return pl.DataFrame(
        rows, schema={"team": pl.String, "model": pl.String, "idle_usd": pl.Float64}
    )


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
    replicas = con.sql(queries.replicas).pl()
    claimed = None
    if claims is not None:
        replicas, claimed = claims(con, replicas)
    lines = lines_from(replicas, shares, counts, policy)
    if claimed is not None and claimed.height:
        lines = pl.concat([lines, claimed]).sort("team", "model")
    if unpriced.height:
        lines = pl.concat([lines, unpriced_lines(unpriced, policy)]).sort("team", "model")
    return lines, fleet


def allocate(usage: pl.DataFrame, gpus: pl.DataFrame, policy: Policy) -> tuple[pl.DataFrame, float]:
    """Lines and fleet cost for two frames with the rollup tables' columns (an in-memory DuckDB)."""
    con = duckdb.connect()
    try:
        con.register("usage_in", usage)
        con.register("gpus_in", gpus)
        return run(con, allocation_sql(policy, "usage_in", "gpus_in"), policy)
    finally:
        con.close()
