"""Hourly cost rows: allocation's per-minute arithmetic done once per hour of data.

A statement used to share every instance's GPU minutes among the requests in flight in them at
the time it was asked for: at 20M records a month that is a join of 18.7M (key, minute) rows
against 0.7M priced minutes, every time. The split of a minute does not depend on any price: a
team's share of an instance's minute is its in-flight seconds over ``max(60, all in-flight
seconds)``, whatever the GPU-hour costs. So the ledger keeps, per hour, quantities, not money:

``cost_hours``
    per (hour, replica group, instance, node, GPU model): the GPU-seconds and joules measured
    (after an instance's lifetime bounds them: time outside it is replica and instance ''),
    the part of each that was busy (``x busy``, busy = ``min(1, in-flight seconds / 60)`` per
    minute), and the minute of the most GPU time and energy, for error messages.
``share_hours``
    per (hour, usage key, node, GPU model): the GPU-seconds and joules of the in-flight split,
    ``sum over minutes of in-flight seconds x quantity x busy / occupied``.

Pricing them is linear: a statement multiplies each row by the rate in effect in its hour
(``billing.allocation``). Prices change on whole hours (``infermeter.config``), so that is the
same money, to the float, as pricing each minute; an invoice's scaling or a price-book change
needs no recompute. Rows are in proportion to hours x instances x teams, not to minutes or
requests.

An hour's rows are a function of the rollups and lifetimes within it, so ingest marks the hours
a batch touched (``hours_dirty``) in the batch's transaction and the rows are rebuilt later for
exactly those hours (``billing.allocation_runs.refresh_hours``); a statement reads the clean hours' rows and
rebuilds the dirty ones on the fly in its own snapshot, so it is never stale. SQL built by pure
functions; the ledger runs it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

from billing.lifetimes import ended_sql
from billing.schema import HOUR_SECONDS, SLOT_SECONDS

__all__ = [
    "COST_COLUMNS",
    "DIRTY_ALL",
    "HOUR_SLOTS",
    "REBUILD_HOURS",
    "SHARE_COLUMNS",
    "HourRows",
    "alive_sql",
    "cost_rows_sql",
    "dense_sql",
    "minutes_sql",
    "runs",
    "share_rows_sql",
]

HOUR_SLOTS: Final = HOUR_SECONDS // SLOT_SECONDS
# The longest run of hours one rebuild transaction works on: a month.
REBUILD_HOURS: Final = 31 * 24
COST_COLUMNS: Final = (
    "hour",
    "replica",
    "instance",
    "node",
    "gpu_model",
    "gpu_seconds",
    "energy_joules",
    "busy_gpu_seconds",
    "busy_energy_joules",
    "peak_slot",
)
SHARE_COLUMNS: Final = ("hour", "key", "node", "gpu_model", "gpu_seconds", "energy_joules")


@dataclass(frozen=True, slots=True)
class HourRows:
    """The relations a statement prices: relation names or parenthesised subqueries.

    ``costs``: ``cost_hours`` rows; ``shares``: ``share_hours`` rows; ``keys``: key, unit,
    replica, instance, team, model (``alloc_keys``); ``counts``: key, hour, requests,
    prompt_tokens, completion_tokens, cached_prompt_tokens (``alloc_hours``). All limited to
    the hours allocated.
    """

    costs: str
    shares: str
    keys: str
    counts: str


def dense_sql(unit: str, slot: str, slot_range: tuple[int, int] | None) -> str:
    """SQL numbering (``unit``, ``slot``) densely from 0 over ``slot_range``; NULL without one."""
    if slot_range is None:
        return "NULL::BIGINT"
    first, after = slot_range
    return f"({unit} - 1)::BIGINT * {after - first} + ({slot} - {first})"


def alive_sql(gpus: str, lifetimes: str | None) -> str:
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


def minutes_sql(
    gpus: str,
    occupancy: str,
    units: str,
    lifetimes: str | None = None,
    slot_range: tuple[int, int] | None = None,
    table: str = "_minutes",
) -> str:
    """SQL creating temp ``table``: per instance, node, GPU model and minute, what was measured.

    ``gpus``: gpu_slots rows; ``occupancy``: replica, instance, slot, occupied (in-flight
    seconds); ``units``: unit, replica, instance (the keys' instance numbers). Columns: those
    keys, unit, gs (GPU-seconds), ej (joules), occupied, busy and ``i``, the instance's minute
    numbered densely over ``slot_range`` (a one-integer join key, several times faster to join
    than (unit, slot)).
    """
    return f"""
CREATE OR REPLACE TEMP TABLE {table} AS
WITH g AS (
    SELECT replica, instance, node, gpu_model, slot,
        sum(gpu_seconds) AS gs, sum(energy_joules) AS ej
    FROM {alive_sql(gpus, lifetimes)} GROUP BY ALL
)
SELECT g.*, n.unit, coalesce(o.occupied, 0.0) AS occupied,
    least(1.0, coalesce(o.occupied, 0.0) / {SLOT_SECONDS}.0) AS busy,
    {dense_sql("n.unit", "g.slot", slot_range)} AS i
FROM g LEFT JOIN {occupancy} o USING (replica, instance, slot)
LEFT JOIN {units} n USING (replica, instance)"""


def cost_rows_sql(minutes: str = "_minutes") -> str:
    """``cost_hours`` rows (``COST_COLUMNS``) from ``minutes_sql``'s table."""
    return f"""
SELECT slot // {HOUR_SLOTS} AS hour, replica, instance, node, gpu_model,
    sum(gs) AS gpu_seconds, sum(ej) AS energy_joules,
    sum(gs * busy) AS busy_gpu_seconds, sum(ej * busy) AS busy_energy_joules,
    arg_max(slot, gs + ej) AS peak_slot
FROM {minutes} GROUP BY ALL"""


def share_rows_sql(
    slots: str, slot_range: tuple[int, int] | None, minutes: str = "_minutes"
) -> str:
    """``share_hours`` rows (``SHARE_COLUMNS``): the in-flight split of each minute's quantities.

    ``slots``: key, unit, slot, inflight_seconds (``alloc_slots`` rows) within the minutes of
    ``minutes``. A key's share of a minute is its in-flight seconds x busy / occupied: with
    fewer than 60 in-flight seconds the rest of the minute stays idle. An inner join: a key's
    minute with no GPU measured has nothing to share.
    """
    match = (
        f"m.i = {dense_sql('u.unit', 'u.slot', slot_range)}"
        if slot_range
        else "m.unit = u.unit AND m.slot = u.slot"
    )
    return f"""
SELECT u.slot // {HOUR_SLOTS} AS hour, u."key", m.node, m.gpu_model,
    sum(u.inflight_seconds * m.gs * m.busy / m.occupied) AS gpu_seconds,
    sum(u.inflight_seconds * m.ej * m.busy / m.occupied) AS energy_joules
FROM {slots} u JOIN {minutes} m ON {match}
WHERE m.occupied > 0
GROUP BY ALL"""


def runs(hours: Iterable[int], longest: int | None = None) -> list[tuple[int, int]]:
    """``hours`` as [first, after-last) runs of consecutive hours, in order, none longer than
    ``longest`` when given.

    A rebuild works a run at a time (``REBUILD_HOURS`` at most), so a backlog of dirty hours (a
    ledger upgraded, a late batch for a week ago) is rebuilt in pieces of at most a month's
    minutes.
    """
    out: list[tuple[int, int]] = []
    for h in sorted(set(hours)):
        if out and out[-1][1] == h and (longest is None or h - out[-1][0] < longest):
            out[-1] = (out[-1][0], h + 1)
        else:
            out.append((h, h + 1))
    return out


# -- which hours a batch makes stale -------------------------------------------------------

# Every hour with GPU time: a ledger from before hourly rows, or one whose heartbeat changed.
DIRTY_ALL: Final = (
    f"INSERT INTO hours_dirty SELECT DISTINCT slot // {HOUR_SLOTS} FROM gpu_slots "
    "ON CONFLICT DO NOTHING"
)


def dirty_usage_sql(delta: str = "_usage_delta") -> str:
    """SQL marking dirty the hours of a usage batch's rollup (``billing.ingest_sql``'s delta)."""
    return (
        f"INSERT INTO hours_dirty SELECT DISTINCT slot // {HOUR_SLOTS} FROM {delta} "
        "ON CONFLICT DO NOTHING"
    )


def dirty_samples_sql() -> str:
    """SQL marking dirty the hours the ``fresh`` GPU samples' intervals cover."""
    first = f'CAST(floor(("timestamp" - interval_seconds) / {HOUR_SECONDS}) AS BIGINT)'
    last = f'CAST(floor("timestamp" / {HOUR_SECONDS}) AS BIGINT)'
    return f"""INSERT INTO hours_dirty
SELECT DISTINCT unnest(range({first}, greatest({first}, {last}) + 1)) FROM fresh
ON CONFLICT DO NOTHING"""


def windows_sql(heartbeat_seconds: float, events: bool, also: str | None = None) -> str:
    """The lifetimes a fold can change, as whole slots (``billing.lifetimes.slot_windows_sql``).

    Only the instances in ``fresh``: instance events (``events``) fold into any lifetime of
    their instance; samples move only the end of their instance's open lifetime. Reading those
    alone keeps the comparison to the batch's size, not the fleet's open lifetimes. ``also``:
    a relation of (instance, started_at) to include whatever their state now (those read
    before the fold, so a lifetime the fold closed is compared with itself).
    """
    first = f"CAST(floor(started_at / {SLOT_SECONDS}) AS BIGINT)"
    last = f"CAST(ceil({ended_sql(heartbeat_seconds)} / {SLOT_SECONDS}) AS BIGINT) - 1"
    if events:
        which = "instance IN (SELECT DISTINCT instance FROM fresh)"
    else:
        which = (
            "stopped_at IS NULL AND instance IN "
            "(SELECT DISTINCT coalesce(instance, replica) FROM fresh)"
        )
    if also:
        which += f" OR (instance, started_at) IN (SELECT (instance, started_at) FROM {also})"
    return f"""SELECT instance, started_at, {first} AS first_slot, greatest({first}, {last}) AS last_slot
FROM lifetimes WHERE {which}"""


def dirty_lifetimes_sql(before: str, after: str) -> str:
    """SQL marking dirty the hours whose GPU time a fold moved into or out of a lifetime.

    ``before``/``after``: ``windows_sql`` rows around the fold. An end that moved dirties the
    hours between its old and new place; a lifetime that appeared or went, its whole window;
    an instance whose first lifetime starts elsewhere, the hours between (time before an
    instance's first lifetime is not judged, ``alive_sql``).
    """
    return f"""
INSERT INTO hours_dirty
SELECT DISTINCT unnest(range(lo // {HOUR_SLOTS}, hi // {HOUR_SLOTS} + 1)) FROM (
    SELECT least(b.last_slot, a.last_slot) AS lo, greatest(b.last_slot, a.last_slot) AS hi
    FROM {before} b JOIN {after} a USING (instance, started_at) WHERE b.last_slot <> a.last_slot
    UNION ALL SELECT first_slot, last_slot FROM {after} a
        WHERE NOT EXISTS (SELECT 1 FROM {before} b
                          WHERE b.instance = a.instance AND b.started_at = a.started_at)
    UNION ALL SELECT first_slot, last_slot FROM {before} b
        WHERE NOT EXISTS (SELECT 1 FROM {after} a
                          WHERE b.instance = a.instance AND b.started_at = a.started_at)
    UNION ALL SELECT least(fb, fa), greatest(fb, fa) FROM
        (SELECT instance, min(first_slot) AS fb FROM {before} GROUP BY instance)
        JOIN (SELECT instance, min(first_slot) AS fa FROM {after} GROUP BY instance) USING (instance)
        WHERE fa <> fb
)
ON CONFLICT DO NOTHING"""
