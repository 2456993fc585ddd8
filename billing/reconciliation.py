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
- **Ledger.** Billable records (ok, client-aborted, upstream error) in that same window: prompt
  tokens at the first token (when vLLM has finished the prefill and counted them), completion
  tokens spread evenly from the first token to the end of the request, so a stream running across
  the window's edge counts on both sides as the engine counted it. Tokens after the instance's
  last sample are not reconciled yet: the engine has not reported them.

The difference (engine - ledger) is reported signed; only a positive one, prompt and completion
apart, is *unattributed*: work the engines did that no record carries. A negative one is
reported, never billed.

Unattributed tokens are a statement line of their own (model ``<model> (unattributed)``), for
the replica group's owner when its idle policy is ``owner``, else for the platform account.
They are priced at the group's measured cost per token in that hour: the hour's GPU cost times
the unattributed share of the tokens its engines processed (weighted as ``billing.token_weights``
weighs them). That cost is taken out of the hour's idle capacity, never added: the requests
without a record held the GPUs while the ledger counted those minutes as idle, so teams still
pay exactly their measured share and the statement still adds up to the fleet's cost to the
cent. The claim is capped at the hour's idle cost; beyond it there is no idle time the lost
work could have filled.

SQL built by pure functions (``reconciliation_sql``, ``unattributed_sql``), run by the ledger;
``charge`` turns the per-hour costs into lines, plain Polars.
"""

from __future__ import annotations

from typing import Any, Final

import duckdb
import polars as pl

from billing.allocation import LINE_COLUMNS, MONEY, IdleClaims, Policy
from infermeter.records import BILLABLE_STATUSES

__all__ = [
    "HOUR_SECONDS",
    "LOOKBACK_SECONDS",
    "UNATTRIBUTED_SUFFIX",
    "charge",
    "claims",
    "hours",
    "is_unattributed",
    "reconciliation_sql",
    "unattributed_model",
    "unattributed_sql",
]

HOUR_SECONDS: Final = 3600
# How far before the first hour asked for samples and records are read, so that the first
# hour's window starts at the previous sample rather than at its own first one.
LOOKBACK_SECONDS: Final = 2 * HOUR_SECONDS
UNATTRIBUTED_SUFFIX: Final = " (unattributed)"

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


def _delta(value: str, previous: str) -> str:
    """A counter's increase since the previous sample; after a drop (a restart), its value."""
    return f"CASE WHEN {previous} IS NULL THEN 0.0 WHEN {value} < {previous} THEN {value} ELSE {value} - {previous} END"


def reconciliation_sql(first_hour: int, end_hour: int, model: str | None = None,
                       usage: str = "usage", engine: str = "engine_samples") -> Sql:  # fmt: skip
    """Per instance and hour in ``first_hour``..``end_hour`` (Unix hours): engine, ledger, difference.

    Columns: ``t`` (the hour's start, Unix seconds), ``instance``, ``replica`` (its group),
    ``model``, engine and ledger prompt and completion tokens, ``engine_tokens``,
    ``ledger_tokens``, ``difference_tokens`` (engine - ledger), ``share`` (the difference over
    the engine's tokens), ``unattributed_prompt_tokens``, ``unattributed_completion_tokens``,
    ``unattributed_tokens`` and ``unattributed_share``. Pure: nothing is run here.
    """
    statuses = ", ".join(f"'{s.value}'" for s in BILLABLE_STATUSES)
    filter_model = "AND model = $model" if model is not None else ""
    values: dict[str, Any] = {"lo": first_hour, "hi": end_hour, "back": float(LOOKBACK_SECONDS)}
    if model is not None:
        values["model"] = model
    return (
        f"""
WITH samples AS (
    SELECT coalesce(instance, replica) AS instance, replica, model, "timestamp" AS ts,
        {_delta("prompt_tokens_total", "lag(prompt_tokens_total) OVER w")} AS prompt,
        {_delta("generation_tokens_total", "lag(generation_tokens_total) OVER w")} AS completion
    FROM {engine}
    WHERE "timestamp" >= $lo * {HOUR_SECONDS} - $back AND "timestamp" < $hi * {HOUR_SECONDS}
    WINDOW w AS (PARTITION BY coalesce(instance, replica) ORDER BY "timestamp", sample_id)
),
hourly AS (
    SELECT instance, CAST(floor(ts / {HOUR_SECONDS}) AS BIGINT) AS hour,
        max(replica) AS replica, max(model) AS model,
        sum(prompt) AS engine_prompt, sum(completion) AS engine_completion,
        min(ts) AS first_ts, max(ts) AS hi
    FROM samples GROUP BY ALL
),
-- Each instance-hour's window (lo, hi]: from the previous window's last sample to its own.
windows AS (
    SELECT *, coalesce(lag(hi) OVER (PARTITION BY instance ORDER BY hour), first_ts) AS lo
    FROM hourly
),
records AS (
    SELECT coalesce(instance, replica) AS instance,
        least(coalesce(first_token_at, finished_at), finished_at) AS tp, finished_at AS tf,
        prompt_tokens AS p, completion_tokens AS c
    FROM {usage}
    WHERE status IN ({statuses}) AND finished_at > $lo * {HOUR_SECONDS} - $back
        AND least(coalesce(first_token_at, finished_at), finished_at) <= $hi * {HOUR_SECONDS}
),
-- The window each record's first token fell in; records after the last sample have none yet.
placed AS (
    SELECT r.*, w.hour, w.lo, w.hi, r.tp > w.lo AND r.tf <= w.hi AS inside
    FROM records r ASOF JOIN windows w ON r.instance = w.instance AND r.tp <= w.hi
),
ledger AS (
    SELECT instance, hour, sum(p)::DOUBLE AS prompt, sum(CASE WHEN inside THEN c ELSE 0 END)::DOUBLE AS completion
    FROM placed WHERE tp > lo GROUP BY ALL
    UNION ALL
    -- A request across windows: its completion tokens by the time it spent in each.
    SELECT x.instance, w.hour, 0.0,
        sum(x.c * (least(w.hi, x.tf) - greatest(w.lo, x.tp)) / (x.tf - x.tp))
    FROM (SELECT * FROM placed WHERE NOT inside AND tf > tp) x
    JOIN windows w ON w.instance = x.instance AND w.hi > x.tp AND w.lo < x.tf
    GROUP BY ALL
),
counted AS (
    SELECT w.hour, w.instance, w.replica, w.model,
        CAST(round(w.engine_prompt) AS BIGINT) AS engine_prompt_tokens,
        CAST(round(w.engine_completion) AS BIGINT) AS engine_completion_tokens,
        CAST(round(coalesce(sum(l.prompt), 0)) AS BIGINT) AS ledger_prompt_tokens,
        CAST(round(coalesce(sum(l.completion), 0)) AS BIGINT) AS ledger_completion_tokens
    FROM windows w LEFT JOIN ledger l USING (instance, hour)
    WHERE w.hour >= $lo AND w.hour < $hi {filter_model}
    GROUP BY ALL
)
SELECT hour * {HOUR_SECONDS} AS t, instance, replica, model,
    engine_prompt_tokens, engine_completion_tokens, ledger_prompt_tokens, ledger_completion_tokens,
    engine_prompt_tokens + engine_completion_tokens AS engine_tokens,
    ledger_prompt_tokens + ledger_completion_tokens AS ledger_tokens,
    engine_tokens - ledger_tokens AS difference_tokens,
    difference_tokens / nullif(engine_tokens, 0) AS share,
    greatest(0, engine_prompt_tokens - ledger_prompt_tokens) AS unattributed_prompt_tokens,
    greatest(0, engine_completion_tokens - ledger_completion_tokens) AS unattributed_completion_tokens,
    unattributed_prompt_tokens + unattributed_completion_tokens AS unattributed_tokens,
    unattributed_tokens / nullif(engine_tokens, 0) AS unattributed_share
FROM counted ORDER BY t, replica, instance""",
        values,
    )


def unattributed_sql(policy: Policy, reconciliation: str, slots: str = "_slots") -> str:
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


def charge(replicas: pl.DataFrame, hourly: pl.DataFrame, policy: Policy) -> tuple[pl.DataFrame, pl.DataFrame]:  # fmt: skip
    """``replicas`` (busy and idle cost per instance) with ``hourly``'s claims taken out of each
    instance's idle, and the lines.

    ``hourly`` holds ``unattributed_sql``'s rows. One line per team and model, in
    ``LINE_COLUMNS`` (costs unrounded, no idle of their own: the money is compute and energy
    that was counted idle).
    """
    hourly = hourly.with_columns(pl.col(*MONEY).cast(pl.Float64)).sort(
        "replica", "instance", "hour"
    )
    taken = hourly.group_by("replica", "instance").agg(
        claimed=(pl.col("compute_usd") + pl.col("energy_usd")).sum()
    )
    replicas = (
        replicas.join(taken, on=["replica", "instance"], how="left")
        .with_columns((pl.col("idle_usd") - pl.col("claimed").fill_null(0.0)).clip(lower_bound=0.0))
        .drop("claimed")
    )  # fmt: skip
    teams = {r: (owner if rule == "owner" and owner else policy.platform_account)
             for r, (rule, owner) in policy.idle.items()}  # fmt: skip
    lines = (
        hourly.with_columns(
            team=pl.col("replica").replace_strict(teams, default=policy.platform_account),
            model=pl.col("replica").replace_strict(dict(policy.replica_model), default=pl.col("model")),
        )
        .group_by("team", "model")
        .agg(pl.col("prompt_tokens", "completion_tokens").sum(), pl.col(*MONEY).sum())
        .with_columns(
            pl.col("model") + UNATTRIBUTED_SUFFIX,
            pl.lit(0, dtype=pl.Int64).alias("requests"),
            pl.col("prompt_tokens", "completion_tokens").cast(pl.Int64),
            pl.col(*MONEY).round(10),
            pl.lit(0.0).alias("idle_usd"),
        )
    )  # fmt: skip
    return replicas, lines.select(LINE_COLUMNS).sort("team", "model")


def claims(policy: Policy, start: float, end: float, usage: str = "usage",
           engine: str = "engine_samples") -> IdleClaims:  # fmt: skip
    """The claims of the hours in ``start``..``end``, for ``allocation.run``.

    Reconciles the range on the connection ``allocation.run`` gives, into temp table
    ``_reconciliation``, then prices it against that allocation's ``_slots``.
    """

    def run(con: duckdb.DuckDBPyConnection, replicas: pl.DataFrame) -> tuple[pl.DataFrame, pl.DataFrame]:  # fmt: skip
        first, after = hours(start, end)
        # No engine sample in the range: no instance-hour to reconcile, and the scan of the
        # month's usage (most of the statement's time on a large ledger) is skipped.
        sampled = con.execute(
            f'SELECT 1 FROM {engine} WHERE "timestamp" >= ? AND "timestamp" < ? LIMIT 1',
            [float(first * HOUR_SECONDS), float(after * HOUR_SECONDS)],
        ).fetchone()
        if sampled is None:
            return replicas, pl.DataFrame()
        sql, values = reconciliation_sql(first, after, usage=usage, engine=engine)
        con.execute(f"CREATE OR REPLACE TEMP TABLE _reconciliation AS {sql}", values)
        hourly = con.sql(unattributed_sql(policy, "_reconciliation")).pl()
        return charge(replicas, hourly, policy)

    return run
