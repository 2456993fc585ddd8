"""Prompt caching on the statement: each team's prefix-cache hits and what they saved it.

vLLM's prefix cache serves the KV blocks of a prompt it has seen before, so a cached prompt
token costs the engine a fraction of an uncached one (``billing.token_weights.cached_prompt``,
measured by ``bench/prefix_cache_cost.py``). The saving is an estimate, made per statement
line (team and model):

    savings = cached * (prompt_weight - cached_prompt_weight) * cents per weighted token

where the line's cents per weighted token is its total over its weighted tokens,
``prompt_weight * (prompt - cached) + cached_prompt_weight * cached
+ completion_weight * completion``: what the line would have cost more had its cached tokens
been uncached, at the line's own price of a unit of work. It values the engine work the cache
took off the line; it is not the difference between two splits of the same month (the fleet's
cost does not fall when one team's prompts hit the cache: the other teams' shares grow).
Under ``in_flight`` the line's measured time already shrank with the cache, and the figure
says by about how much. Rounded to whole cents, half up; never added to any total.

``cache_rows`` is pure; ``cached_tokens_sql`` builds the ledger read and ``month_cached_tokens``
runs it through the ledger.
"""

from __future__ import annotations

from typing import Any, Final

import polars as pl

from billing.charges import Policy
from billing.ledger import Ledger
from billing.schema import HOUR_SECONDS
from infermeter.months import month_bounds
from infermeter.statement import CACHE_SCHEMA

__all__ = ["CACHED_SCHEMA", "cache_rows", "cached_tokens_sql", "month_cached_tokens"]

# The month's prompt tokens and cached prompt tokens per team and model, as the ledger kept them.
CACHED_SCHEMA: Final = {
    "team": pl.String,
    "model": pl.String,
    "prompt_tokens": pl.Int64,
    "cached_prompt_tokens": pl.Int64,
}


def cached_tokens_sql(month: str) -> tuple[str, list[Any]]:
    """SQL and parameters reading ``month``'s cached prompt tokens per team and model.

    From ``alloc_hours`` (a row per key and hour), as the ``tokens`` split reads them: every
    team and model with usage in the month has a row, with 0 when nothing was cached.
    """
    start, end = month_bounds(month)
    sql = """
SELECT k.team, k.model, sum(h.prompt_tokens)::BIGINT AS prompt_tokens,
    sum(h.cached_prompt_tokens)::BIGINT AS cached_prompt_tokens
FROM alloc_hours h JOIN alloc_keys k USING ("key")
WHERE h.hour >= ? AND h.hour < ?
GROUP BY k.team, k.model ORDER BY k.team, k.model"""
    return sql, [int(start) // HOUR_SECONDS, int(end) // HOUR_SECONDS]


def month_cached_tokens(ledger: Ledger, month: str) -> pl.DataFrame:
    """``month``'s cached prompt tokens per team and model (``CACHED_SCHEMA``), from ``ledger``."""
    sql, params = cached_tokens_sql(month)
    with ledger.reader() as cur:
        rows = cur.execute(sql, params).fetchall()
    return pl.DataFrame(rows, schema=CACHED_SCHEMA, orient="row")


def cache_rows(lines: pl.DataFrame, cached_by_line: pl.DataFrame, policy: Policy) -> pl.DataFrame:
    """The statement's ``cache`` rows (``CACHE_SCHEMA``) for ``lines`` and their cached tokens.

    ``lines``: the statement's lines (``LINE_SCHEMA``); only the month's own count, not the
    adjustments of earlier months it carries. ``cached_by_line``: team, model and
    cached_prompt_tokens (``month_cached_tokens``). A team and model with usage but no hits
    has a row of 0; a line the read has no row for
    (idle capacity, an error line) is left out.
    """
    wp = float(policy.prompt_weight)
    wc = wp if policy.cached_prompt_weight is None else float(policy.cached_prompt_weight)
    wo = float(policy.completion_weight)
    own = (
        lines.filter(pl.col("for_month") == pl.col("month"))
        if "for_month" in lines.columns
        else lines
    )
    summed = own.group_by("team", "model").agg(
        pl.col("prompt_tokens", "completion_tokens", "total_cents").sum()
    )
    cached = cached_by_line.group_by("team", "model").agg(pl.col("cached_prompt_tokens").sum())
    joined = summed.join(cached, on=["team", "model"], how="inner").with_columns(
        pl.min_horizontal("cached_prompt_tokens", "prompt_tokens").clip(0).alias("cached")
    )
    weighted = (
        (pl.col("prompt_tokens") - pl.col("cached")) * wp
        + pl.col("cached") * wc
        + pl.col("completion_tokens") * wo
    )
    saving = pl.col("cached") * (wp - wc) * pl.col("total_cents") / weighted
    return (
        joined.with_columns(
            cache_savings_cents=pl.when(weighted > 0)
            .then((saving + 0.5).floor())
            .otherwise(0.0)
            .cast(pl.Int64),
            cached_prompt_tokens=pl.col("cached").cast(pl.Int64),
        )
        .select(list(CACHE_SCHEMA))
        .cast(CACHE_SCHEMA)  # type: ignore[arg-type]
        .sort("team", "model")
    )
