"""A window of the allocation explorer: its cells grouped, rounded to the cent, and charted.

``view`` takes the cells of the months a window touches (``billing.explorer.spread``) and
answers what the explorer page shows: one row per group (one or two keys), a total, the cost of
each group over time, and the values each key takes (for the filter).

Rounding keeps the statement's promise. Per month, the window's cells are summed per team and
model (the statement's lines) and rounded together, by largest remainder, so that they add up to
the window's total rounded; each line's cents are then split over the line's finest parts
(group, instance, node, GPU model) by largest remainder again, and the rows are sums of those
parts. So for a window of whole months, every team's, model's and line's cents are the
statement's, and every total is the statement's total, to the cent, whatever the grouping, the
filter or the caller; a shorter window's rows add up to its total exactly too. Rounding is done
before any filter, so the admin and a team see the same cents for that team.

Pure functions over frames; the route (``billing.routes.allocation``) reads the cells.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import polars as pl

from billing.explorer import COUNTS, KEYS, MEASURES, MONEY, QUANTITIES, Cells
from billing.rounding import split
from exporters.chargeback_csv import defuse, write_csv
from infermeter.months import month_bounds, month_of

__all__ = [
    "COLUMNS",
    "HOUR",
    "MAX_SERIES",
    "MAX_WINDOW_HOURS",
    "ExplorerQuery",
    "View",
    "csv_text",
    "months_of",
    "view",
]

HOUR: Final = 3600
# At most 93 days, as the other queries: three months of cells.
MAX_WINDOW_HOURS: Final = 93 * 24
# Charts stack at most this many groups; the rest is one series, "other".
MAX_SERIES: Final = 12
# Beyond this many hours the chart is drawn by the day (UTC).
HOURLY_UP_TO: Final = 72
OTHER: Final = "other"
# The table's and the file's columns after the group keys.
COLUMNS: Final = (
    "requests",
    "tokens",
    "gpu_hours",
    "compute_usd",
    "energy_usd",
    "idle_usd",
    "total_usd",
    "efficiency_pct",
    "usd_per_million_tokens",
)
_ATOM: Final = ("month", *KEYS)
_LINE: Final = ("month", "team", "model")
_INTEGERS: Final = (*MONEY, *COUNTS)


@dataclass(frozen=True, slots=True)
class ExplorerQuery:
    """A window of whole hours [``first_hour``, ``end_hour``) (Unix hours), grouped ``by`` one or
    two keys, keeping only the cells whose key values are in ``filters``; ``team``: the caller's
    own team (a team key), or None for the admin."""

    first_hour: int
    end_hour: int
    by: tuple[str, ...]
    filters: Mapping[str, frozenset[str]] = field(default_factory=dict)
    team: str | None = None

    @classmethod
    def checked(
        cls,
        start: float,
        end: float,
        by: Sequence[str],
        filters: Mapping[str, Sequence[str]],
        team: str | None,
    ) -> ExplorerQuery:
        """The query for ``start``..``end`` (Unix seconds, widened to whole hours); ValueError
        naming a bad range, key or filter."""
        if not (math.isfinite(start) and math.isfinite(end)) or end <= start:
            raise ValueError(f"the window must have to > from (from={start}, to={end})")
        first, last = math.floor(start / HOUR), math.ceil(end / HOUR)
        if last - first > MAX_WINDOW_HOURS:
            raise ValueError(f"the window is {(last - first) / 24:.0f} days; at most 93 are served")
        keys = tuple(dict.fromkeys(by))
        if not 1 <= len(keys) <= 2:
            raise ValueError(f"by={','.join(by)}: group by one or two of {', '.join(KEYS)}")
        unknown = [k for k in (*keys, *filters) if k not in KEYS]
        if unknown:
            raise ValueError(f"unknown key {unknown[0]!r}; the keys are {', '.join(KEYS)}")
        kept = {k: frozenset(v) for k, v in filters.items() if v}
        return cls(first, last, keys, kept, team)

    @property
    def step(self) -> int:
        """The chart's step: hours for a window of up to three days, else days."""
        return HOUR if self.end_hour - self.first_hour <= HOURLY_UP_TO else 24 * HOUR


@dataclass(frozen=True, slots=True)
class View:
    """What the explorer shows for a query: ``rows`` (the group keys, then ``COLUMNS``) with
    their ``total``; ``series`` (t, group, cost_usd) for the chart; ``values`` each key takes in
    the window (the caller's own cells), for the filter."""

    rows: pl.DataFrame
    total: dict[str, Any]
    series: pl.DataFrame
    values: dict[str, list[str]]


def months_of(query: ExplorerQuery) -> list[str]:
    """The months (UTC) the query's window touches, in order."""
    months, t = [], query.first_hour * HOUR
    while t < query.end_hour * HOUR:
        month = month_of(t)
        months.append(month)
        t = int(month_bounds(month)[1])
    return months


def _rounded(values: Sequence[float]) -> list[int]:
    """Whole units for ``values`` that add up to their sum rounded half up, by largest remainder.

    Values are first rounded to a millionth, so a sum of float parts that is a whole number
    (a month's line) comes back as that number.
    """
    snapped = [round(v, 6) for v in values]
    target = math.floor(math.fsum(snapped) + 0.5)
    floors = [math.floor(v) for v in snapped]
    missing = target - sum(floors)
    order = sorted(range(len(snapped)), key=lambda i: (-(snapped[i] - floors[i]), i))
    for i in order[:missing]:
        floors[i] += 1
    return floors


def _split(whole: int, weights: Sequence[float]) -> list[int]:
    """``whole`` over ``weights`` exactly (``billing.rounding.split``), any sign; equal parts
    when the weights give none."""
    clean = [w if math.isfinite(w) and w > 0 else 0.0 for w in weights]
    if whole == 0:
        return [0] * len(weights)
    if math.fsum(clean) <= 0:
        clean = [1.0] * len(weights)
    parts = split(abs(whole), clean)
    return parts if whole > 0 else [-p for p in parts]


def _lines(atoms: pl.DataFrame) -> pl.DataFrame:
    """The window's atoms per month, team and model, each integer measure rounded per month."""
    lines = atoms.group_by(_LINE).agg(pl.col(MEASURES).sum()).sort(_LINE)
    parts = []
    for _, part in lines.group_by("month", maintain_order=True):
        # The money of every line in one rounding, as the statement does; counts column by column.
        money = _rounded([v for row in part.select(MONEY).rows() for v in row])
        cents = {c: money[i :: len(MONEY)] for i, c in enumerate(MONEY)}
        counts = {c: _rounded(part[c].to_list()) for c in COUNTS}
        parts.append(
            part.with_columns(pl.Series(c, v, pl.Int64) for c, v in (cents | counts).items())
        )
    return pl.concat(parts) if parts else lines.cast(dict.fromkeys(_INTEGERS, pl.Int64))


def _whole(atoms: pl.DataFrame) -> pl.DataFrame:
    """The window's atoms (per month and every key) with whole cents and counts that add up
    to the rounded lines (``_lines``) exactly."""
    atoms = atoms.sort(_ATOM)
    lines = _lines(atoms)
    whole = {tuple(r[:3]): r[3:] for r in lines.select(*_LINE, *_INTEGERS).iter_rows()}
    out: dict[str, list[int]] = {c: [] for c in _INTEGERS}
    for key, part in atoms.group_by(_LINE, maintain_order=True):
        totals = whole[tuple(str(k) for k in key)]
        for c, amount in zip(_INTEGERS, totals, strict=True):
            out[c].extend(_split(int(amount), part[c].to_list()))
    # Sorted by the line first, so the groups come in order and the parts line up with the atoms.
    return atoms.with_columns(pl.Series(c, v, pl.Int64) for c, v in out.items())


def _hours(m: Cells, query: ExplorerQuery) -> pl.DataFrame:
    """The month's cells of the window: its whole UTC days from ``days``, the rest by the hour.

    With hourly steps (a window of three days at most), every hour from ``cells``.
    """
    lo, hi = query.first_hour, query.end_hour
    if query.step == HOUR:
        return m.cells.filter(pl.col("hour").is_between(lo, hi - 1))
    first_day, end_day = -(-lo // 24) * 24, hi // 24 * 24
    if first_day >= end_day:
        return m.cells.filter(pl.col("hour").is_between(lo, hi - 1))
    hour = pl.col("hour")
    edges = m.cells.filter(hour.is_between(lo, first_day - 1) | hour.is_between(end_day, hi - 1))
    days = m.days.filter(hour.is_between(first_day, end_day - 1))
    return pl.concat([days, edges])


def _in_window(months: Sequence[Cells], query: ExplorerQuery) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(per month and atom: the window's sums, with the atom's keys; per step and atom: its cost,
    with the keys), read from each month's integer-keyed cells."""
    sums, steps = [], []
    for m in months:
        cells = _hours(m, query)
        keys = m.atoms.with_columns(month=pl.lit(m.month))
        sums.append(cells.group_by("atom").agg(pl.col(MEASURES).sum()).join(keys, on="atom"))
        per_step = cells.group_by(
            (pl.col("hour") * HOUR // query.step * query.step).alias("t"), "atom"
        ).agg(pl.sum_horizontal(*MONEY).sum().alias("cents"))
        steps.append(per_step.join(keys, on="atom"))
    schema = {"month": pl.String, **dict.fromkeys(KEYS, pl.String)}
    if not sums:
        empty_sums = pl.DataFrame(schema=schema | dict.fromkeys(MEASURES, pl.Float64))
        return empty_sums, pl.DataFrame(schema=schema | {"t": pl.Int64, "cents": pl.Float64})
    return pl.concat(sums, how="diagonal_relaxed"), pl.concat(steps, how="diagonal_relaxed")


def _derived(frame: pl.DataFrame) -> pl.DataFrame:
    """Money in USD (from whole cents), tokens, efficiency and the cost of a million tokens."""
    total = pl.sum_horizontal(*MONEY)
    tokens = pl.col("prompt_tokens") + pl.col("completion_tokens")
    return frame.with_columns(
        tokens=tokens,
        **{c.replace("_cents", "_usd"): (pl.col(c) / 100).round(2) for c in MONEY},
        total_usd=(total / 100).round(2),
        gpu_hours=pl.col("gpu_hours").round(6),
        total_cents=total,
        efficiency_pct=pl.when(total > 0)
        .then((100 * (pl.col("compute_cents") + pl.col("energy_cents")) / total).round(2))
        .otherwise(None),
        usd_per_million_tokens=pl.when(tokens > 0)
        .then((total / 100 * 1e6 / tokens).round(4))
        .otherwise(None),
    )


def _kept(frame: pl.DataFrame, query: ExplorerQuery) -> pl.DataFrame:
    """Rows the caller may see (its own team) that pass the query's filters."""
    if query.team is not None:
        frame = frame.filter(pl.col("team") == query.team)
    for key, allowed in sorted(query.filters.items()):
        frame = frame.filter(pl.col(key).is_in(sorted(allowed)))
    return frame


def _series(steps: pl.DataFrame, query: ExplorerQuery, order: Sequence[str]) -> pl.DataFrame:
    """Cost per step and group (the top ``MAX_SERIES`` - 1 groups by cost, the rest as one)."""
    top = order[: MAX_SERIES - 1] if len(order) > MAX_SERIES else order
    label = _label(query.by)
    return (
        steps.with_columns(
            group=pl.when(label.is_in(list(top))).then(label).otherwise(pl.lit(OTHER)),
        )
        .group_by("t", "group")
        .agg((pl.col("cents").sum() / 100).alias("cost_usd"))
        .sort("t", "group")
    )


def _label(by: Sequence[str]) -> pl.Expr:
    """A group's name: its key values joined by " / "."""
    return pl.concat_str([pl.col(k) for k in by], separator=" / ")


def view(months: Sequence[Cells], query: ExplorerQuery) -> View:
    """The explorer's answer for ``query`` over the cells of the months its window touches."""
    sums, steps = _in_window(months, query)
    atoms = _kept(_whole(sums), query)
    rows = _derived(atoms.group_by(query.by).agg(pl.col(*_INTEGERS, *QUANTITIES).sum())).sort(
        "total_cents", *query.by, descending=[True, *([False] * len(query.by))]
    )
    columns = [*query.by, *COLUMNS]
    summed = atoms.select(pl.col(*_INTEGERS, *QUANTITIES).sum())
    total = _derived(summed).select(*COLUMNS, "total_cents").row(0, named=True)
    order = rows.select(_label(query.by)).to_series().to_list()
    own = sums if query.team is None else sums.filter(pl.col("team") == query.team)
    values = {k: sorted(own[k].unique().to_list()) for k in KEYS}
    series = _series(_kept(steps, query), query, order)
    return View(rows.select(columns), total, series, values)


def csv_text(shown: View, start: float, end: float) -> str:
    """The rows and their total as a CSV file: what the table shows, spreadsheet-safe.

    Money in USD with two decimals (from whole cents); text cells that a spreadsheet would run
    as formulas are defused as in the chargeback CSV; the first two columns say the window.
    """
    keys = [c for c in shown.rows.columns if c not in COLUMNS]
    window = [pl.lit(_iso(start)).alias("from"), pl.lit(_iso(end)).alias("to")]
    total = {k: ("total" if i == 0 else None) for i, k in enumerate(keys)} | {
        c: shown.total[c] for c in COLUMNS
    }
    frame = pl.concat(
        [shown.rows, pl.DataFrame([total], schema=shown.rows.schema)], how="vertical_relaxed"
    )
    frame = frame.select(*window, *keys, *COLUMNS).with_columns(defuse(k) for k in keys)
    return write_csv(frame)


def _iso(t: float) -> str:
    import datetime as dt

    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
