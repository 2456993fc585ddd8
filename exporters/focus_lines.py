"""A statement's lines made ready to be FOCUS rows: every optional column, both bases, the cache.

Billing hands the exporters lines in three shapes: a line per team and model, the same split by
instance (``replica``, ``instance`` and, with node pools, ``pool``, ``pricing_category`` and
``sku``), and lines split by the requests' tags (``project``, ``user``). ``with_optional`` gives
every shape the same columns, null where the statement does not say, so one set of FOCUS
expressions serves them all; a line with no pricing category is priced as on-demand.

Figures the statement carries at another grain than its lines are split onto the rows in whole
units by largest remainder (``apportion``), so the rows add up to the statement's figure exactly:

- ``list_cents``: the usage basis (the price book's prices) of each row. On the ``list`` basis it
  is the row's own cents. On the ``allocation`` basis it is ``statement.usage_lines``' cents,
  matched on every key both sets of lines have (month charged, team, model, and the instance,
  pool or tags when the usage lines carry them) and split among the rows of a key in proportion
  to their allocation-basis cents.
- ``cached_prompt_tokens`` and ``cache_savings_cents``: ``statement.cache`` (per team and model,
  the statement's own month) split among that team and model's rows of the month in proportion
  to their prompt tokens. Rows of adjustments carry none.

A committed node pool's commitment left unused is a row of its own (``kind`` = ``unused``) on
the platform's account: the platform's line billing puts it on (model ``(unused commitment)
<pool>``, ``billing.allocation.unused_commitment_model``), or, for a pool whose commitment the
lines do not carry, one made from ``statement.pools``. Either way its GPU-hours are the
committed GPU-hours the pool left unused, when ``statement.pools`` says.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Final

import polars as pl

from infermeter.config import NodePool
from infermeter.months import month_bounds
from infermeter.statement import LINE_SCHEMA, Statement

__all__ = [
    "OPTIONAL_COLUMNS",
    "PRICING_CATEGORIES",
    "UNUSED_COMMITMENT",
    "apportion",
    "focus_lines",
    "pool_skus",
    "unused_commitments",
    "with_cache",
    "with_commitments",
    "with_list_cents",
    "with_optional",
]

# Columns some statements' lines carry and others do not; null where absent.
OPTIONAL_COLUMNS: Final = (
    "replica",
    "instance",
    "pool",
    "pricing_category",
    "sku",
    "project",
    "user",
)
# The keys a row of lines can be told apart by, in the order they narrow a line down.
_KEYS: Final = ("for_month", "team", "model", "replica", "instance", "pool", "project", "user")
# How billing names the platform's line of a pool's unused commitment (the pool follows).
UNUSED_COMMITMENT: Final = "(unused commitment) "
# FOCUS's PricingCategory of each of the price book's categories: on-demand is the agreed rate
# (Standard), a commitment's GPUs are Committed, spot is priced by the provider as it goes
# (Dynamic), and owned hardware's depreciation is none of those (Other).
PRICING_CATEGORIES: Final = {
    "on_demand": "Standard",
    "committed": "Committed",
    "spot": "Dynamic",
    "owned": "Other",
}


def with_optional(lines: pl.DataFrame) -> pl.DataFrame:
    """``lines`` with every ``OPTIONAL_COLUMNS`` column as text, null where the lines lack it."""
    missing = [c for c in OPTIONAL_COLUMNS if c not in lines.columns]
    return lines.with_columns(pl.lit(None, dtype=pl.String).alias(c) for c in missing).with_columns(
        pl.col(c).cast(pl.String) for c in OPTIONAL_COLUMNS
    )


def apportion(
    rows: pl.DataFrame,
    totals: pl.DataFrame,
    keys: Sequence[str],
    values: Iterable[str],
    weight: pl.Expr,
) -> pl.DataFrame:
    """``rows`` with each ``values`` column of ``totals`` split among the rows of its key.

    Each key's total is split in whole units by largest remainder, in proportion to ``weight``
    (negative weights count as 0; equally when a key's weights add up to 0), so the rows of a
    key add up to its total exactly, negative totals included. Rows of a key ``totals`` does not
    have get 0. Null keys match null keys.
    """
    values = list(values)
    keys = list(keys)
    right = totals.select(
        *(pl.col(k).cast(rows.schema[k]) for k in keys),
        *(pl.col(v).alias(f"_total_{v}") for v in values),
    )
    joined = rows.join(right, on=keys, how="left", nulls_equal=True, maintain_order="left")
    w = pl.max_horizontal(weight.cast(pl.Float64).fill_null(0.0), pl.lit(0.0))
    weights = w.sum().over(keys)
    for v in values:
        total = pl.col(f"_total_{v}").fill_null(0).cast(pl.Float64)
        share = (
            pl.when(weights > 0).then(total * (w / weights)).otherwise(total / pl.len().over(keys))
        )
        base = share.floor()
        short = total - base.sum().over(keys)  # whole units the floors left out (or took over)
        fraction = share - base
        up = fraction.rank("ordinal", descending=True).over(keys) <= short
        down = fraction.rank("ordinal").over(keys) <= -short
        step = pl.when(up).then(1.0).when(down).then(-1.0).otherwise(0.0)
        joined = joined.with_columns((base + step).cast(pl.Int64).alias(v))
    return joined.drop(f"_total_{v}" for v in values)


def with_list_cents(lines: pl.DataFrame, usage_lines: pl.DataFrame | None) -> pl.DataFrame:
    """``lines`` with ``list_cents``: each row's cents on the usage basis (see above)."""
    if usage_lines is None:
        return lines.with_columns(list_cents=pl.col("total_cents"))
    keys = [k for k in _KEYS if k in usage_lines.columns and k in lines.columns]
    totals = usage_lines.group_by(keys).agg(list_cents=pl.col("total_cents").sum())
    return apportion(lines, totals, keys, ["list_cents"], pl.col("total_cents"))


def with_cache(lines: pl.DataFrame, cache: pl.DataFrame, month: str) -> pl.DataFrame:
    """``lines`` with the month's prompt-cache hits and savings split onto their rows."""
    totals = cache.group_by("team", "model").agg(
        pl.col("cached_prompt_tokens").sum(), pl.col("cache_savings_cents").sum()
    )
    totals = totals.with_columns(for_month=pl.lit(month))
    values = ["cached_prompt_tokens", "cache_savings_cents"]
    return apportion(lines, totals, ["for_month", "team", "model"], values, pl.col("prompt_tokens"))


def pool_skus(pools: Sequence[NodePool], month: str) -> dict[str, str | None]:
    """The SKU of each pool's price entry in effect at the end of ``month`` (None: none named)."""
    end = month_bounds(month)[1]
    skus: dict[str, str | None] = {}
    for pool in pools:
        entries = [p for p in pool.prices if p.from_ < end]
        skus[pool.name] = entries[-1].sku if entries else None
    return skus


def _unused_hours() -> pl.Expr:
    """The committed GPU-hours a ``statement.pools`` row left unused."""
    return (pl.col("committed_gpu_hours") - pl.col("gpu_hours")).clip(lower_bound=0)


def with_commitments(
    lines: pl.DataFrame, pools: pl.DataFrame, skus: Mapping[str, str | None] | None = None
) -> pl.DataFrame:
    """``lines`` (with ``OPTIONAL_COLUMNS``) with ``kind``: ``unused`` on the lines of unused
    commitments (their pool, category and the pool's SKU in ``skus`` filled in, their GPU-hours
    the unused ones), else ``usage``."""
    unused = pl.col("model").str.starts_with(UNUSED_COMMITMENT)
    hours = dict(pools.select("pool", _unused_hours().alias("h")).iter_rows())
    pool = pl.coalesce("pool", pl.col("model").str.strip_prefix(UNUSED_COMMITMENT))
    return lines.with_columns(
        pl.when(unused).then(pool).otherwise(pl.col("pool")).alias("pool"),
        pl.when(unused)
        .then(pl.coalesce("pricing_category", pl.lit("committed")))
        .otherwise(pl.col("pricing_category"))
        .alias("pricing_category"),
        pl.when(unused).then(pl.lit("unused")).otherwise(pl.lit("usage")).alias("kind"),
    ).with_columns(
        pl.when(pl.col("kind") == "unused")
        .then(
            pl.coalesce(
                "sku",
                pl.col("pool").replace_strict(
                    dict(skus or {}), default=None, return_dtype=pl.String
                ),
            )
        )
        .otherwise(pl.col("sku"))
        .alias("sku"),
        pl.when(pl.col("kind") == "unused")
        .then(
            pl.coalesce(
                pl.col("pool").replace_strict(hours, default=None, return_dtype=pl.Float64),
                pl.col("gpu_hours"),
            )
        )
        .otherwise(pl.col("gpu_hours"))
        .alias("gpu_hours"),
    )


def unused_commitments(
    statement: Statement, platform_account: str, skus: Mapping[str, str | None]
) -> pl.DataFrame:
    """A row per committed pool with commitment left unused in the month whose unused commitment
    is on no line, on the platform's account.

    Its cents are the pool's ``unused_commitment_cents`` on both bases; its GPU-hours are the
    committed GPU-hours the pool did not use.
    """
    carried = [
        m.removeprefix(UNUSED_COMMITMENT)
        for m in statement.lines["model"].to_list()
        if m.startswith(UNUSED_COMMITMENT)
    ]
    pools = statement.pools.filter(
        (pl.col("committed_gpu_hours") > 0)
        & (pl.col("unused_commitment_cents") > 0)
        & ~pl.col("pool").is_in(carried)
    )
    unused = pl.col("unused_commitment_cents")
    zero = pl.lit(0, dtype=pl.Int64)
    return pools.select(
        pl.lit(statement.month).alias("month"),
        pl.lit(statement.month).alias("for_month"),
        pl.lit(platform_account).alias("team"),
        (UNUSED_COMMITMENT + pl.col("pool")).alias("model"),
        *(zero.alias(c) for c in ("requests", "prompt_tokens", "completion_tokens")),
        _unused_hours().alias("gpu_hours"),
        pl.lit(0.0).alias("energy_kwh"),
        zero.alias("compute_cents"),
        zero.alias("energy_cents"),
        unused.alias("idle_cents"),
        unused.alias("total_cents"),
        pl.lit(None, dtype=pl.String).alias("replica"),
        pl.lit(None, dtype=pl.String).alias("instance"),
        pl.col("pool"),
        pl.lit("committed").alias("pricing_category"),
        pl.col("pool")
        .replace_strict(dict(skus), default=None, return_dtype=pl.String)
        .alias("sku"),
        pl.lit(None, dtype=pl.String).alias("project"),
        pl.lit(None, dtype=pl.String).alias("user"),
        unused.alias("list_cents"),
        zero.alias("cached_prompt_tokens"),
        zero.alias("cache_savings_cents"),
        pl.lit("unused").alias("kind"),
    )


def focus_lines(
    statement: Statement, platform_account: str, skus: Mapping[str, str | None]
) -> pl.DataFrame:
    """Every row a FOCUS file has: the lines (``kind`` = ``usage``, or ``unused`` on a line of an
    unused commitment), then the unused commitments no line carries."""
    lines = with_optional(statement.lines).with_columns(
        pl.col(c).cast(t) for c, t in LINE_SCHEMA.items()
    )
    lines = with_list_cents(lines, statement.usage_lines)
    lines = with_cache(lines, statement.cache, statement.month)
    lines = with_commitments(lines, statement.pools, skus)
    unused = unused_commitments(statement, platform_account, skus)
    columns = [
        *LINE_SCHEMA,
        *OPTIONAL_COLUMNS,
        "list_cents",
        "cached_prompt_tokens",
        "cache_savings_cents",
        "kind",
    ]
    return pl.concat([lines.select(columns), unused.select(columns)], how="vertical_relaxed")
