"""The allocation explorer's data: a month's statement spread over hours, nodes and GPU models.

A statement says who pays what for a month, per team and model; split by instance
(``billing.statement.instance_lines``, what the FOCUS file is made of) it also says which replica
group and instance the money was spent on. The explorer needs two more things: *when* in the
month, so a window shorter than a month can be shown, and *where* (node and GPU model).

``spread`` takes the month's lines split by instance, and the month's hourly profiles read from
the rollups (``billing.queries.explorer_gpu_sql`` and ``explorer_usage_sql``), and spreads each
line's amounts over the hours, nodes and GPU models of its instance, in proportion to:

- compute and energy, GPU-hours and kWh: what the line's team and model used of the instance in
  that hour (its share of the instance's in-flight seconds, times the instance's busy cost);
- idle capacity, and the lines of unattributed tokens (which are paid out of idle capacity):
  the instance's idle cost in that hour;
- requests and tokens: the line's own requests and tokens in that hour, on the node where the
  instance spent most that hour.

When a weight is zero all month (a line of an instance that was never busy, say), the next one
is used: idle, then cost, then usage; a line with none of them (an error line, which carries no
money) lands at the month's first hour, on no node. The hourly busy and idle cost are the
allocation's rule (an instance is busy in proportion to its in-flight seconds, at most fully)
taken over the hour rather than each minute: they only decide *where* a line's money falls,
never how much there is. Every cell is a fraction of its line, in floats, so the cells of a line
add up to the line (to float precision): a whole month of them is the statement's line, and
``billing.explorer_view`` rounds a window's cells into cents that add up to the statement's
lines, to the cent, when the window is whole months.

Pure functions over frames; ``billing.explorer_cache`` reads the ledger and keeps the result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import polars as pl

from billing.reconciliation import UNATTRIBUTED_SUFFIX

__all__ = [
    "ATOM_SCHEMA",
    "CELL_SCHEMA",
    "KEYS",
    "MEASURES",
    "NONE",
    "Cells",
    "by_day",
    "empty",
    "spread",
]

# What a cell can be grouped and filtered by, in drill-down order.
KEYS: Final = ("team", "model", "replica", "instance", "node", "gpu_model")
MONEY: Final = ("compute_cents", "energy_cents", "idle_cents")
COUNTS: Final = ("requests", "prompt_tokens", "completion_tokens")
QUANTITIES: Final = ("gpu_hours", "energy_kwh")
MEASURES: Final = (*MONEY, *COUNTS, *QUANTITIES)
# A key a line does not have (an error line's instance, a cell on no node).
NONE: Final = "(none)"
ATOM_SCHEMA: Final = {"atom": pl.UInt32, **dict.fromkeys(KEYS, pl.String)}
CELL_SCHEMA: Final = {"hour": pl.Int64, "atom": pl.UInt32, **dict.fromkeys(MEASURES, pl.Float64)}

_INSTANCE = ("replica", "instance")
_LINE = ("team", "model", "replica", "instance")
_CELL = ("hour", "node", "gpu_model")
# Each measure's weights, in the order they are tried (see the module's docstring).
_BUSY = ("w_busy", "w_idle", "w_cost", "w_usage")
_IDLE = ("w_idle", "w_cost", "w_busy", "w_usage")


def _instance_cells(gpus: pl.DataFrame) -> pl.DataFrame:
    """Per instance and cell: its cost split into busy and idle, GPU-hours and kWh."""
    return gpus.select(
        *_INSTANCE,
        *_CELL,
        pl.col("cost_usd").cast(pl.Float64).fill_null(0.0).alias("w_cost"),
    )


def _occupancy(usage: pl.DataFrame) -> pl.DataFrame:
    """Per instance and hour: the share of it that was busy (in-flight seconds / 3600, at most 1)
    and the in-flight seconds, which the teams' shares of the busy part are taken over."""
    return (
        usage.group_by(*_INSTANCE, "hour")
        .agg(pl.col("inflight_seconds").sum().alias("occupied"))
        .with_columns(busy=(pl.col("occupied") / 3600.0).clip(0.0, 1.0))
    )


def _main_nodes(cells: pl.DataFrame) -> pl.DataFrame:
    """Per instance and hour, the node and GPU model it spent most on (its requests go there)."""
    return (
        cells.sort("w_cost", "node", "gpu_model", descending=[True, False, False])
        .group_by(*_INSTANCE, "hour", maintain_order=True)
        .first()
        .select(*_INSTANCE, "hour", "node", "gpu_model")
    )


def _weights(lines: pl.DataFrame, gpus: pl.DataFrame, usage: pl.DataFrame) -> pl.DataFrame:
    """Every (line, cell) a line may fall in, with its busy, idle, cost and usage weights."""
    cells = _instance_cells(gpus)
    occupancy = _occupancy(usage)
    # Money cells: the hours and nodes the line's instance had a cost in.
    money = (
        lines.select("line", *_LINE)
        .join(cells, on=_INSTANCE)
        .join(occupancy, on=[*_INSTANCE, "hour"], how="left")
        .join(
            usage.select(*_LINE, "hour", "inflight_seconds"),
            on=[*_LINE, "hour"],
            how="left",
        )
        .with_columns(pl.col("busy", "occupied", "inflight_seconds").fill_null(0.0))
        .with_columns(
            w_idle=pl.col("w_cost") * (1.0 - pl.col("busy")),
            w_busy=pl.when(pl.col("occupied") > 0)
            .then(
                pl.col("w_cost") * pl.col("busy") * pl.col("inflight_seconds") / pl.col("occupied")
            )
            .otherwise(0.0),
        )
        .select("line", *_CELL, "w_busy", "w_idle", "w_cost")
    )
    # Usage cells: the hours the line had requests in, on its instance's main node that hour.
    mains = _main_nodes(cells)
    used = (
        lines.select("line", *_LINE)
        .join(usage.select(*_LINE, "hour", *COUNTS), on=_LINE)
        .join(mains, on=[*_INSTANCE, "hour"], how="left")
        .with_columns(pl.col("node", "gpu_model").fill_null(NONE))
        .with_columns(pl.col(c).cast(pl.Float64).alias(f"u_{c}") for c in COUNTS)
        .with_columns(w_usage=pl.sum_horizontal(*(f"u_{c}" for c in COUNTS)))
        .select("line", *_CELL, "w_usage", *(f"u_{c}" for c in COUNTS))
    )
    both = money.join(used, on=["line", *_CELL], how="full", coalesce=True)
    weights = ("w_busy", "w_idle", "w_cost", "w_usage", *(f"u_{c}" for c in COUNTS))
    return both.with_columns(pl.col(weights).fill_null(0.0))


def _share(order: tuple[str, ...]) -> pl.Expr:
    """A cell's share of its line by the first weight of ``order`` that is not zero all month;
    with none, an equal share of each of the line's cells."""
    chain: Any = pl
    for w in order:
        total = pl.col(w).sum().over("line")
        chain = chain.when(total > 0).then(pl.col(w) / total)
    share: pl.Expr = chain.otherwise(1.0 / pl.len().over("line"))
    return share


@dataclass(frozen=True, slots=True)
class Cells:
    """A month's cells, kept small: ``atoms`` (``ATOM_SCHEMA``: an id per combination of the
    keys), ``cells`` (``CELL_SCHEMA``: per hour and atom, the measures) and ``days`` (the same
    per UTC day, ``hour`` being the day's first), which a long window reads for its whole days."""

    month: str
    atoms: pl.DataFrame
    cells: pl.DataFrame
    days: pl.DataFrame


def empty(month: str) -> Cells:
    """A month without a line."""
    none = pl.DataFrame(schema=CELL_SCHEMA)
    return Cells(month, pl.DataFrame(schema=ATOM_SCHEMA), none, none)


def by_day(cells: pl.DataFrame) -> pl.DataFrame:
    """``cells`` summed per UTC day and atom (``hour``: the day's first hour)."""
    day = (pl.col("hour") // 24 * 24).alias("hour")
    return cells.group_by(day, "atom").agg(pl.col(MEASURES).sum()).sort("hour", "atom")


def spread(
    month: str, lines: pl.DataFrame, gpus: pl.DataFrame, usage: pl.DataFrame, first_hour: int
) -> Cells:
    """The month's lines as cells: each line's amounts over its hours, nodes and GPU models.

    ``lines``: the month's own lines split by instance (team, model, replica, instance, the
    counts, GPU-hours, kWh and cents; an error line has no replica or instance). ``gpus``:
    ``explorer_gpu_sql``'s rows; ``usage``: ``explorer_usage_sql``'s. ``first_hour``: the
    month's first hour (Unix hours), for lines that fall nowhere else.
    """
    if lines.height == 0:
        return empty(month)
    lines = lines.with_columns(
        pl.col("replica", "instance").fill_null(NONE), line=pl.int_range(pl.len())
    )
    weights = _weights(lines, gpus, usage)
    # A line with no cell at all (an error line; an instance with no GPU time and no usage).
    lost = lines.join(weights.select("line").unique(), on="line", how="anti").select(
        "line",
        pl.lit(first_hour, pl.Int64).alias("hour"),
        pl.lit(NONE).alias("node"),
        pl.lit(NONE).alias("gpu_model"),
    )
    cells = pl.concat([weights, lost], how="diagonal_relaxed").with_columns(
        pl.col("^w_.*$", "^u_.*$").fill_null(0.0)
    )
    unattributed = pl.col("model").str.ends_with(UNATTRIBUTED_SUFFIX)
    counts_order = ("u_{}", "w_usage", "w_cost")
    shares = (
        cells.join(lines.select("line", "model"), on="line")
        .with_columns(
            s_busy=pl.when(unattributed).then(_share(_IDLE)).otherwise(_share(_BUSY)),
            s_idle=_share(_IDLE),
            **{
                f"s_{c}": pl.when(unattributed)
                .then(_share(_IDLE))
                .otherwise(_share(tuple(o.format(c) for o in counts_order)))
                for c in COUNTS
            },
        )
        .select("line", *_CELL, "s_busy", "s_idle", *(f"s_{c}" for c in COUNTS))
    )
    by = {
        "compute_cents": "s_busy",
        "energy_cents": "s_busy",
        "idle_cents": "s_idle",
        "gpu_hours": "s_busy",
        "energy_kwh": "s_busy",
        **{c: f"s_{c}" for c in COUNTS},
    }
    out = shares.join(lines.select("line", *KEYS[:4], *MEASURES), on="line").select(
        "hour",
        *KEYS[:4],
        "node",
        "gpu_model",
        *((pl.col(c).cast(pl.Float64) * pl.col(s)).alias(c) for c, s in by.items()),
    )
    # Spare GPUs are nobody's group or instance: named so, not left blank.
    out = out.filter(pl.any_horizontal(pl.col(c) != 0 for c in MEASURES)).with_columns(
        pl.when(pl.col(k) == "").then(pl.lit(NONE)).otherwise(pl.col(k)).alias(k) for k in KEYS
    )
    atoms = (
        out.select(KEYS)
        .unique()
        .sort(KEYS)
        .with_columns(atom=pl.int_range(pl.len(), dtype=pl.UInt32))
    )
    keyed = out.join(atoms, on=list(KEYS)).group_by("hour", "atom").agg(pl.col(MEASURES).sum())
    hourly = keyed.sort("hour", "atom").select(*CELL_SCHEMA).cast(CELL_SCHEMA)  # type: ignore[arg-type]
    return Cells(
        month,
        atoms.select(*ATOM_SCHEMA).cast(ATOM_SCHEMA),  # type: ignore[arg-type]
        hourly,
        by_day(hourly),
    )
