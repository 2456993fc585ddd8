"""Computing a month's statement: allocation lines in cents, adjustments for closed months.

Pure functions over frames; the ``Statement`` they fill is ``infermeter.statement``'s. A
statement reconciles when its lines add up to the fleet's cost for the month plus the
adjustments it carries for earlier, closed months, to the cent.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any, Final

import polars as pl

from billing.allocation import LINE_COLUMNS
from billing.charges import CASH, ERROR_PREFIX
from billing.rounding import largest_remainder, split
from infermeter.statement import (
    CENT_COLUMNS,
    COUNT_COLUMNS,
    LINE_SCHEMA,
    UNRECONCILED_SCHEMA,
    empty_lines,
)

__all__ = [
    "ERROR_REASONS",
    "adjustment_lines",
    "cents_lines",
    "error_counts",
    "error_lines",
    "instance_lines",
    "merged",
    "team_totals",
    "unreconciled_of",
    "unroundable_model",
]

log = logging.getLogger("infermeter.billing")


def merged(lines: pl.DataFrame) -> pl.DataFrame:
    """Allocation lines (``LINE_COLUMNS``) with the rows of one team and model summed into one.

    Reconciliation hands a team's hang-up tails over as rows of tokens only, under the team's own
    model (``billing.reconciliation.charge``); the statement shows them on the team's line.
    """
    keys = ["team", "model"]
    values = [c for c in LINE_COLUMNS if c not in keys]
    if lines.height == lines.select(keys).n_unique():
        return lines
    return lines.group_by(keys, maintain_order=True).agg(pl.col(values).sum()).sort(keys)


def unreconciled_of(reconciliation: pl.DataFrame) -> pl.DataFrame:
    """The unreconciled requests and tokens of ``reconciliation``'s instance-hours, per replica
    group and model (``infermeter.statement.UNRECONCILED_SCHEMA``), those with any."""
    columns = {
        "unreconciled_requests": "requests",
        "unreconciled_prompt_tokens": "prompt_tokens",
        "unreconciled_completion_tokens": "completion_tokens",
    }
    if reconciliation.height == 0:
        return pl.DataFrame(schema=UNRECONCILED_SCHEMA)
    return (
        reconciliation.group_by("replica", "model")
        .agg(pl.col(c).sum().alias(name) for c, name in columns.items())
        .filter(pl.sum_horizontal(*columns.values()) > 0)
        .sort("replica", "model")
        .cast(UNRECONCILED_SCHEMA)  # type: ignore[arg-type]
    )


def cents_lines(month: str, lines: pl.DataFrame) -> pl.DataFrame:
    """Allocation lines (money in micro-cents) as cents that add up to the lines' total, rounded.

    Every cell (compute, energy and idle of every line) takes part in one largest-remainder
    rounding, so both the line totals and the statement total are exact: the lines add up to
    the fleet's cost in micro-cents (``billing.charges``), and their cents to that cost
    rounded. Error lines stay out of it: a leftover cent must never land on a line that says it
    could not be priced. A line that cannot be rounded (a negative amount) becomes an error
    line naming it, and the rest of the month is rounded without it.
    """
    if lines.height == 0:
        return empty_lines()
    rows = lines.select(*CASH).rows()
    models = [m or "" for m in lines["model"]]
    bad = {
        i
        for i, cells in enumerate(rows)
        if min(cells) < 0 and not models[i].startswith(ERROR_PREFIX)
    }
    for i in sorted(bad):
        log.error(
            "statement %s: line %s / %s has a negative amount %s; shown as an error line",
            month,
            lines["team"][i],
            models[i],
            rows[i],
        )
        models[i] = unroundable_model(models[i])
    priced = [i for i, m in enumerate(models) if not m.startswith(ERROR_PREFIX)]
    rounded = largest_remainder([c for i in priced for c in rows[i]])
    cents = [0] * (3 * len(rows))
    for k, i in enumerate(priced):
        cents[3 * i : 3 * i + 3] = rounded[3 * k : 3 * k + 3]
    compute, energy, idle = cents[0::3], cents[1::3], cents[2::3]
    return lines.select(
        pl.lit(month).alias("month"),
        pl.lit(month).alias("for_month"),
        "team",
        pl.Series("model", models, dtype=pl.String),
        *COUNT_COLUMNS,
        pl.Series("compute_cents", compute, dtype=pl.Int64),
        pl.Series("energy_cents", energy, dtype=pl.Int64),
        pl.Series("idle_cents", idle, dtype=pl.Int64),
        pl.Series(
            "total_cents",
            [a + b + c for a, b, c in zip(compute, energy, idle, strict=True)],
            dtype=pl.Int64,
        ),
    ).cast(LINE_SCHEMA)  # type: ignore[arg-type]


def unroundable_model(model: str) -> str:
    """The model column of an error line for a line of ``model`` that could not be rounded."""
    return f"{ERROR_PREFIX}cannot round the line of {model}: a negative amount"


def adjustment_lines(
    month: str, for_month: str, now: pl.DataFrame, issued: pl.DataFrame
) -> pl.DataFrame:
    """What ``for_month``'s lines say now minus what its statements already charged.

    ``now`` is ``for_month`` recomputed with every record the ledger has today; ``issued`` is
    every line already issued for it (its own statement and earlier adjustments). Lines with
    nothing to adjust are left out.
    """
    keys = ["team", "model"]
    value_cols = [*COUNT_COLUMNS, *CENT_COLUMNS]
    a = now.group_by(keys).agg(pl.col(value_cols).sum())
    b = issued.group_by(keys).agg(pl.col(value_cols).sum())
    diff = a.join(b, on=keys, how="full", coalesce=True, suffix="_issued").select(
        *keys,
        *(
            (pl.col(c).fill_null(0) - pl.col(f"{c}_issued").fill_null(0)).alias(c)
            for c in value_cols
        ),
    )
    nonzero = pl.any_horizontal(
        pl.col(c) != 0 for c in (*CENT_COLUMNS, "requests", "prompt_tokens", "completion_tokens")
    )
    return (
        diff.filter(nonzero)
        .select(
            pl.lit(month).alias("month"), pl.lit(for_month).alias("for_month"), *keys, *value_cols
        )
        .cast(LINE_SCHEMA)  # type: ignore[arg-type]
        .sort(keys)
    )


def error_lines(lines: pl.DataFrame) -> pl.DataFrame:
    """The lines that could not be priced: zero cost, and the model column says why."""
    return lines.filter(pl.col("model").str.starts_with(ERROR_PREFIX))


# Why a line is an error line, by how its model column begins (after ``ERROR_PREFIX``).
ERROR_REASONS: Final = {
    "unpriced_gpu_model": "no price for GPU model",
    "cost_out_of_range": "cost out of range",
    "unroundable": "cannot round",
}


def error_counts(lines: pl.DataFrame) -> dict[str, int]:
    """The error lines of ``lines`` per reason (``ERROR_REASONS``), every reason present."""
    models = error_lines(lines)["model"].to_list()
    return {
        reason: sum(1 for m in models if m.startswith(ERROR_PREFIX + text))
        for reason, text in ERROR_REASONS.items()
    }


def team_totals(lines: pl.DataFrame, teams: Sequence[str]) -> dict[str, int]:
    """Cents per team over all lines, with 0 for teams without lines."""
    totals = dict.fromkeys(teams, 0)
    for team, cents in lines.group_by("team").agg(pl.col("total_cents").sum()).iter_rows():
        totals[team] = totals.get(team, 0) + int(cents)
    return totals


# What each cent column of a line is split by: the same money per instance.
_SPLIT_BY: Final = {
    "compute_cents": "compute_microcents",
    "energy_cents": "energy_microcents",
    "idle_cents": "idle_microcents",
    "requests": "requests",
    "prompt_tokens": "prompt_tokens",
    "completion_tokens": "completion_tokens",
}


# Where an instance's row was served: its group, itself, and its GPUs' node pool, pricing
# category and SKU (``billing.allocation.by_instance``).
_WHERE: Final = ("replica", "instance", "pool", "pricing_category", "sku")


def instance_lines(lines: pl.DataFrame, parts: pl.DataFrame) -> pl.DataFrame:
    """``lines`` split by instance: columns ``replica`` (the group), ``instance``, and the
    instance's ``pool``, ``pricing_category`` and ``sku`` added.

    ``parts`` is ``billing.allocation.by_instance`` of each month charged, with ``for_month``:
    what every instance contributed to each (team, model). Each line's cents, requests and
    tokens are split in whole units by largest remainder, in proportion to the instances'
    own amounts, so the rows of a line add up to it exactly; GPU-hours and kWh are split in
    proportion too. A line with nothing to split it by (an error line) stays whole, with
    null replica, instance and pool. An adjustment is split as its month is now made up.
    """
    keys = ["for_month", "team", "model"]
    groups = dict(parts.group_by(keys))
    rows: list[dict[str, Any]] = []
    for line in lines.iter_rows(named=True):
        mine = groups.get(tuple(line[k] for k in keys))
        money = None if mine is None else mine.select(pl.sum_horizontal(*CASH)).to_series()
        if mine is None or money is None or float(money.sum()) <= 0:
            rows.append({**line, **dict.fromkeys(_WHERE)})
            continue
        mine = mine.sort("replica", "instance")
        fallback = money.to_list()
        shares = {c: _split(line[c], mine[w].to_list(), fallback) for c, w in _SPLIT_BY.items()}
        for name in ("gpu_hours", "energy_kwh"):
            weights = _weights(mine[name].to_list(), fallback)
            shares[name] = [line[name] * w for w in weights]
        where = mine.select(*(c if c in mine.columns else pl.lit(None).alias(c) for c in _WHERE))
        for i, place in enumerate(where.iter_rows(named=True)):
            row = {**line, **{c: v[i] for c, v in shares.items()}}
            row["total_cents"] = row["compute_cents"] + row["energy_cents"] + row["idle_cents"]
            if any(row[c] for c in (*_SPLIT_BY, "gpu_hours", "energy_kwh")):
                rows.append({**row, **place})
    schema = {**LINE_SCHEMA, **dict.fromkeys(_WHERE, pl.String)}
    return pl.DataFrame(rows, schema=schema)


def _weights(amounts: Sequence[float], fallback: Sequence[float]) -> list[float]:
    """Shares of ``amounts`` (of ``fallback`` when they are all zero), adding up to 1."""
    total = math.fsum(amounts)
    if total <= 0:
        amounts, total = fallback, math.fsum(fallback)
    return [a / total for a in amounts]


def _split(whole: int, amounts: Sequence[float], fallback: Sequence[float]) -> list[int]:
    """``whole`` in whole units over ``amounts`` (``fallback`` when they are all zero) by largest
    remainder, exactly (``billing.rounding.split``); the parts add up to it, sign and all."""
    if whole == 0:
        return [0] * len(amounts)
    weights = amounts if math.fsum(amounts) > 0 else fallback
    parts = split(abs(whole), [max(0.0, w) for w in weights])
    return parts if whole > 0 else [-p for p in parts]
