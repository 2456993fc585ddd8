"""Computing a month's statement: allocation lines in cents, adjustments for closed months.

Pure functions over frames; the ``Statement`` they fill is ``infermeter.statement``'s. A
statement reconciles when its lines add up to the fleet's cost for the month plus the
adjustments it carries for earlier, closed months, to the cent.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Final

import polars as pl

from billing.allocation import ERROR_PREFIX, LINE_COLUMNS
from billing.rounding import largest_remainder
from infermeter.statement import (
    CENT_COLUMNS,
    COUNT_COLUMNS,
    LINE_SCHEMA,
    UNRECONCILED_SCHEMA,
    empty_lines,
)

__all__ = [
    "adjustment_lines",
    "cents_lines",
    "error_lines",
    "instance_lines",
    "merged",
    "team_totals",
    "unreconciled_of",
]


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
    columns = {"unreconciled_requests": "requests", "unreconciled_prompt_tokens": "prompt_tokens",
               "unreconciled_completion_tokens": "completion_tokens"}  # fmt: skip
    if reconciliation.height == 0:
        return pl.DataFrame(schema=UNRECONCILED_SCHEMA)
    return (
        reconciliation.group_by("replica", "model")
        .agg(pl.col(c).sum().alias(name) for c, name in columns.items())
        .filter(pl.sum_horizontal(*columns.values()) > 0)
        .sort("replica", "model")
        .cast(UNRECONCILED_SCHEMA)  # type: ignore[arg-type]
    )


def cents_lines(month: str, lines: pl.DataFrame, fleet_usd: float) -> pl.DataFrame:
    """Allocation lines (USD floats) as cents that add up to ``fleet_usd`` rounded.

    Every cell (compute, energy and idle of every line) takes part in one largest-remainder
    rounding, so both the line totals and the statement total are exact. Error lines stay out
    of it: a leftover cent must never land on a line that says it could not be priced.
    """
    if lines.height == 0:
        return empty_lines()
    rows = lines.select("compute_usd", "energy_usd", "idle_usd").rows()
    priced = [i for i, m in enumerate(lines["model"]) if not (m or "").startswith(ERROR_PREFIX)]
    rounded = largest_remainder([max(0.0, c) for i in priced for c in rows[i]], fleet_usd)
    cents = [0] * (3 * len(rows))
    for k, i in enumerate(priced):
        cents[3 * i : 3 * i + 3] = rounded[3 * k : 3 * k + 3]
    compute, energy, idle = cents[0::3], cents[1::3], cents[2::3]
    return lines.select(
        pl.lit(month).alias("month"),
        pl.lit(month).alias("for_month"),
        "team", "model", *COUNT_COLUMNS,
        pl.Series("compute_cents", compute, dtype=pl.Int64),
        pl.Series("energy_cents", energy, dtype=pl.Int64),
        pl.Series("idle_cents", idle, dtype=pl.Int64),
        pl.Series("total_cents", [a + b + c for a, b, c in zip(compute, energy, idle, strict=True)], dtype=pl.Int64),
    ).cast(LINE_SCHEMA)  # type: ignore[arg-type]  # fmt: skip


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
    return diff.filter(nonzero).select(
        pl.lit(month).alias("month"), pl.lit(for_month).alias("for_month"), *keys, *value_cols
    ).cast(LINE_SCHEMA).sort(keys)  # type: ignore[arg-type]  # fmt: skip


def error_lines(lines: pl.DataFrame) -> pl.DataFrame:
    """The lines that could not be priced: zero cost, and the model column says why."""
    return lines.filter(pl.col("model").str.starts_with(ERROR_PREFIX))


def team_totals(lines: pl.DataFrame, teams: Sequence[str]) -> dict[str, int]:
    """Cents per team over all lines, with 0 for teams without lines."""
    totals = dict.fromkeys(teams, 0)
    for team, cents in lines.group_by("team").agg(pl.col("total_cents").sum()).iter_rows():
        totals[team] = totals.get(team, 0) + int(cents)
    return totals


# What each cent column of a line is split by: the same money per instance.
_SPLIT_BY: Final = {
    "compute_cents": "compute_usd", "energy_cents": "energy_usd", "idle_cents": "idle_usd",
    "requests": "requests", "prompt_tokens": "prompt_tokens",
    "completion_tokens": "completion_tokens",
}  # fmt: skip


def instance_lines(lines: pl.DataFrame, parts: pl.DataFrame) -> pl.DataFrame:
    """``lines`` split by instance: columns ``replica`` (the group) and ``instance`` added.

    ``parts`` is ``billing.allocation.by_instance`` of each month charged, with ``for_month``:
    what every instance contributed to each (team, model). Each line's cents, requests and
    tokens are split in whole units by largest remainder, in proportion to the instances'
    own amounts, so the rows of a line add up to it exactly; GPU-hours and kWh are split in
    proportion too. A line with nothing to split it by (an error line) stays whole, with
    null replica and instance. An adjustment is split as its month is now made up.
    """
    keys = ["for_month", "team", "model"]
    groups = dict(parts.group_by(keys))
    rows: list[dict[str, Any]] = []
    for line in lines.iter_rows(named=True):
        mine = groups.get(tuple(line[k] for k in keys))
        money = (
            None if mine is None else mine["compute_usd"] + mine["energy_usd"] + mine["idle_usd"]
        )
        if mine is None or money is None or float(money.sum()) <= 0:
            rows.append({**line, "replica": None, "instance": None})
            continue
        mine = mine.sort("replica", "instance")
        fallback = money.to_list()
        split = {c: _split(line[c], mine[w].to_list(), fallback) for c, w in _SPLIT_BY.items()}
        for name in ("gpu_hours", "energy_kwh"):
            weights = _weights(mine[name].to_list(), fallback)
            split[name] = [line[name] * w for w in weights]
        for i, (replica, instance) in enumerate(mine.select("replica", "instance").iter_rows()):
            row = {**line, **{c: v[i] for c, v in split.items()}}
            row["total_cents"] = row["compute_cents"] + row["energy_cents"] + row["idle_cents"]
            if any(row[c] for c in (*_SPLIT_BY, "gpu_hours", "energy_kwh")):
                rows.append({**row, "replica": replica, "instance": instance})
    schema = {**LINE_SCHEMA, "replica": pl.String, "instance": pl.String}
    return pl.DataFrame(rows, schema=schema)


def _weights(amounts: Sequence[float], fallback: Sequence[float]) -> list[float]:
    """Shares of ``amounts`` (of ``fallback`` when they are all zero), adding up to 1."""
    total = math.fsum(amounts)
    if total <= 0:
        amounts, total = fallback, math.fsum(fallback)
    return [a / total for a in amounts]


def _split(whole: int, amounts: Sequence[float], fallback: Sequence[float]) -> list[int]:
    """``whole`` in whole units over ``amounts`` by largest remainder; the parts add up to it."""
    if whole == 0:
        return [0] * len(amounts)
    sign, size = (1 if whole > 0 else -1), abs(whole)
    exact = [size * w for w in _weights(amounts, fallback)]
    floors = [math.floor(e) for e in exact]
    missing = min(size - sum(floors), len(floors))
    for i in sorted(range(len(exact)), key=lambda i: (floors[i] - exact[i], i))[:missing]:
        floors[i] += 1
    return [sign * f for f in floors]
